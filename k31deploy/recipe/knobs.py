"""Knob values: parsing `--set knob=VALUE` strings and checking inventory values against data/knobs.yaml.

Every value goes through k31deploy.validate: control characters are refused for every kind, strings
are checked against their `format` (image reference, model path, RDMA devices, layer partition), numbers
must be finite and within the knob's range (a C int when knobs.yaml gives no bound).
"""

from __future__ import annotations

import difflib
from typing import Any

from k31deploy import validate
from k31deploy.catalog import catalog, knob_specs
from k31deploy.errors import K31Error

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_EXPECTED = {"bool": "true or false", "int": "a whole number", "float": "a finite number", "str": "a string"}


def _choices_text(values) -> str:
    return ", ".join(str(v) for v in values)


def closest(name: Any, valid) -> str:
    """'did you mean X?' for a typo, or nothing."""
    found = difflib.get_close_matches(str(name), list(valid), n=3, cutoff=0.75)
    return f"did you mean {' or '.join(found)}? " if found else ""


def check_name(name: str, where: str) -> dict[str, Any]:
    specs = knob_specs()
    if name not in specs:
        raise K31Error(f"unknown knob '{validate.shown(name)}' ({where}); {closest(name, specs)}"
                       f"valid knobs: {_choices_text(sorted(specs))}")
    return specs[name]


def image_placeholders() -> tuple[str, ...]:
    """The catalog's image placeholders (<K31_IMAGE>, ...): a plan may show them, a deploy refuses them."""
    return tuple(f["image"] for f in catalog()["families"].values() if str(f.get("image") or "").startswith("<"))


def coerce(name: str, value: Any, where: str) -> Any:
    """Return `value` as the knob's type, or raise K31Error naming the knob and what it accepts."""
    spec = check_name(name, where)
    kind = spec["type"]
    if value is None:
        return None
    if isinstance(value, str):
        valid = (_choices_text(spec["choices"]) if kind == "choice" else
                 validate.FORMATS[spec["format"]][1] if kind == "str" else _EXPECTED[kind])
        validate.refuse_control(name, value, valid, where)
    try:
        if kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE | _FALSE:
                return text in _TRUE
            raise ValueError
        if kind == "int":
            value = validate.whole_number(value)
        elif kind == "float":
            value = validate.finite_float(value)
        elif kind == "choice" or (kind == "str" and isinstance(value, str)):
            value = str(value).strip()
        elif not (kind == "str" and spec.get("format") == "ib_device" and isinstance(value, dict)):
            raise ValueError
    except ValueError:
        shown = f"'{validate.shown(value)}'" if isinstance(value, str) else validate.shown(value)
        raise K31Error(f"{name}={shown} ({where}) is not valid; expected {_EXPECTED[kind]}") from None
    if kind == "choice" and value not in spec["choices"]:
        raise K31Error(f"{name}={validate.shown(value)} ({where}) is not valid; valid choices: "
                       f"{_choices_text(spec['choices'])}")
    if kind == "str":
        fmt = spec["format"]
        args = (image_placeholders(),) if fmt == "image" else ()
        value = validate.FORMATS[fmt][0](name, value, where, *args)
    _check_range(name, spec, value, where)
    return value


def _check_range(name: str, spec: dict[str, Any], value: Any, where: str) -> None:
    lo, lo_x, hi = spec.get("min"), spec.get("min_exclusive"), spec.get("max")
    if spec["type"] == "int":    # no bound in knobs.yaml: still a C int for the engine's parser
        lo = validate.INT_MIN if lo is None and lo_x is None else lo
        hi = validate.INT_MAX if hi is None else hi
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
            raise K31Error(f"--set '{validate.shown(item)}' is not knob=value; e.g. --set max_running_requests=64")
        knobs[name] = coerce(name, raw, "--set")
    return knobs


def normalise(knobs: dict[str, Any], where: str) -> dict[str, Any]:
    """Check names and types of already-structured knob values (inventory, filter plugin)."""
    return {name: coerce(name, value, where) for name, value in knobs.items() if value is not None}
