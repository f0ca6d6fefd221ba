"""An engine build's command line, from the machine dump of its own parser (data/engine/<build>.cli.json).

`check()` reads an argv the way argparse would and returns what that build's parser refuses, in
argparse's words, so k31 refuses a command before a host is touched rather than after an hour of image
pull and model load. The dump is what `scripts/upstream-cli` printed from real SGLang's ServerArgs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

ENGINE_DIR = Path(__file__).resolve().parent.parent / "data" / "engine"
_NUMBERS = {"int": int, "float": float}


@dataclass(frozen=True)
class Refusal:
    flag: str
    value: str | None
    message: str    # argparse's own wording


@cache
def load(build: str) -> dict[str, Any]:
    """The dump document of `build` (engine, version, flags)."""
    with (ENGINE_DIR / f"{build}.cli.json").open(encoding="utf-8") as fh:
        return json.load(fh)


@cache
def _by_option(build: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every option string (long name and aliases) -> (long name, spec)."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for flag, spec in load(build)["flags"].items():
        for option in (flag, *spec["aliases"]):
            out[option] = (flag, spec)
    return out


def spec(build: str, flag: str) -> dict[str, Any] | None:
    found = _by_option(build).get(flag)
    return found[1] if found else None


def value_refusal(flag: str, spec_: dict[str, Any], value: str) -> str | None:
    """argparse's message for a value the flag does not take, or None."""
    kind = spec_["kind"]
    if kind in _NUMBERS:
        try:
            _NUMBERS[kind](value)
        except ValueError:
            return f"argument {flag}: invalid {kind} value: {value!r}"
    choices = spec_["choices"]
    if choices is not None and value not in [str(c) for c in choices]:
        return f"argument {flag}: invalid choice: {value!r} (choose from {', '.join(map(str, choices))})"
    return None


def _takes(spec_: dict[str, Any]) -> tuple[int, int | None]:
    """How many value tokens the flag takes: (least, most or None for any)."""
    nargs = spec_["nargs"]
    if spec_["kind"] == "bool" or nargs == 0:
        return 0, 0
    if nargs is None:
        return 1, 1
    if nargs == "?":
        return 0, 1
    if nargs == "*":
        return 0, None
    if nargs == "+":
        return 1, None
    return int(nargs), int(nargs)


def split(build: str, argv: list[str]) -> list[tuple[str, list[str]]] | Refusal:
    """argv -> [(option as written, its value tokens)], or the first refusal argparse would print."""
    options = _by_option(build)
    out: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        if not token.startswith("--") or name not in options:
            return Refusal(token, None, f"unrecognized arguments: {token}")
        least, most = _takes(options[name][1])
        if eq:
            values, i = [inline], i + 1
        else:
            values, i = [], i + 1
            while i < len(argv) and not argv[i].startswith("--") and (most is None or len(values) < most):
                values.append(argv[i])
                i += 1
        if len(values) < least or (most is not None and len(values) > most):
            want = "expected one argument" if (least, most) == (1, 1) else f"expected {least}..{most} argument(s)"
            return Refusal(name, None, f"argument {name}: {want}")
        out.append((name, values))
    return out


def check(build: str, argv: list[str], extra_choices: dict[str, set[str]] | None = None) -> list[Refusal]:
    """What `build`'s parser refuses in argv (flags after the launcher). `extra_choices` lets values
    that another build has (the branch's) through, so a caller can warn about them instead."""
    parsed = split(build, argv)
    if isinstance(parsed, Refusal):
        return [parsed]
    refusals = []
    for option, values in parsed:
        flag, spec_ = _by_option(build)[option]
        for value in values:
            if value in (extra_choices or {}).get(flag, set()):
                continue
            message = value_refusal(option, spec_, value)
            if message:
                refusals.append(Refusal(flag, value, message))
    return refusals


def deprecations(build: str, argv: list[str]) -> list[str]:
    """Flags in argv that `build` marks deprecated, each with what replaces it."""
    out = []
    for token in argv:
        found = _by_option(build).get(token)
        if found and found[1].get("deprecated"):
            new = found[1]["deprecated"]
            out.append(f"{token} (deprecated in {build}" + (f"; use {new})" if isinstance(new, str) else ")"))
    return out
