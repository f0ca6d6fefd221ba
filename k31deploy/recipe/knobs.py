"""Knob values: parsing `--set knob=VALUE` strings and checking inventory values against data/knobs.yaml."""

from __future__ import annotations

from typing import Any

from k31deploy.errors import K31Error
from k31deploy.recipe.catalog import knob_specs

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def _choices_text(values) -> str:
    return ", ".join(str(v) for v in values)


def check_name(name: str, where: str) -> dict[str, Any]:
    specs = knob_specs()
    if name not in specs:
        raise K31Error(f"unknown knob '{name}' ({where}); valid knobs: {_choices_text(sorted(specs))}")
    return specs[name]


def coerce(name: str, value: Any, where: str) -> Any:
    """Return `value` as the knob's type, or raise K31Error naming the knob and what it accepts."""
    spec = check_name(name, where)
    kind = spec["type"]
    if value is None:
        return None
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE | _FALSE:
                return text in _TRUE
            raise ValueError
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            value = int(str(value).strip()) if not isinstance(value, (int, float)) else int(value)
        elif kind == "float":
            if isinstance(value, bool):
                raise ValueError
            value = float(value)
        else:
            value = str(value).strip()
    except ValueError:
        expected = {"bool": "true or false", "int": "a whole number", "float": "a number"}[kind]
        raise K31Error(f"{name}={value!r} ({where}) is not valid; expected {expected}") from None
    if kind == "choice" and value not in spec["choices"]:
        raise K31Error(f"{name}={value} ({where}) is not valid; valid choices: {_choices_text(spec['choices'])}")
    _check_range(name, spec, value, where)
    return value


def _check_range(name: str, spec: dict[str, Any], value: Any, where: str) -> None:
    lo, lo_x, hi = spec.get("min"), spec.get("min_exclusive"), spec.get("max")
    if (lo is None or value >= lo) and (lo_x is None or value > lo_x) and (hi is None or value <= hi):
        return
    want = [f">= {lo}" if lo is not None else "", f"> {lo_x}" if lo_x is not None else "",
            f"<= {hi}" if hi is not None else ""]
    raise K31Error(f"{name}={value} ({where}) is out of range; it must be {' and '.join(w for w in want if w)}")


def parse_sets(items: list[str]) -> dict[str, Any]:
    """`["knob=value", ...]` from the CLI -> typed knob values."""
    knobs: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            raise K31Error(f"--set {item!r} is not knob=value; e.g. --set max_running_requests=64")
        knobs[name] = coerce(name, raw, "--set")
    return knobs


def normalise(knobs: dict[str, Any], where: str) -> dict[str, Any]:
    """Check names and types of already-structured knob values (inventory, filter plugin)."""
    return {name: coerce(name, value, where) for name, value in knobs.items() if value is not None}
