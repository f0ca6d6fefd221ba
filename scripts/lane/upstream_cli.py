"""Dump every argument of a real SGLang's launch_server parser to JSON (k31's engine CLI reference).

Run with a Python that can import `sglang.srt.server_args` (it needs torch): the lane machine, or any
venv with torch and the SGLang wheel. `scripts/upstream-cli` is the entry point; the output is committed
as k31deploy/data/engine/<build>.cli.json and read by k31deploy.engine.

    python3 upstream_cli.py OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple | set | frozenset):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=str) if isinstance(value, set | frozenset) else items
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def _kind(action: argparse.Action) -> str:
    """How the flag takes its value: bool (a bare switch), const, or the value's type name."""
    if action.nargs == 0:
        return "bool"
    if action.type is None:
        return "str"
    return getattr(action.type, "__name__", repr(action.type))


def dump(parser: argparse.ArgumentParser) -> dict[str, dict[str, Any]]:
    flags: dict[str, dict[str, Any]] = {}
    for action in parser._actions:
        long = [o for o in action.option_strings if o.startswith("--")]
        if not long or isinstance(action, argparse._HelpAction):
            continue
        entry = {
            "dest": action.dest,
            "aliases": [o for o in action.option_strings if o != long[0]],
            "kind": _kind(action),
            # a set of choices (SGLang builds some at add_cli_args time) is sorted: stable across runs
            "choices": _jsonable(action.choices if isinstance(action.choices, set | frozenset)
                                 else list(action.choices)) if action.choices is not None else None,
            "nargs": _jsonable(action.nargs),
            "default": _jsonable(action.default),
            "action": type(action).__name__,
        }
        # SGLang's Deprecated*Action classes carry the flag that replaces them.
        if type(action).__name__.startswith("Deprecated"):
            entry["deprecated"] = getattr(action, "new_flag", None) or True
        flags[long[0]] = entry
    return dict(sorted(flags.items()))


def main() -> int:
    import importlib.metadata as metadata

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    doc = {
        "engine": "sglang",
        "version": metadata.version("sglang"),
        "source": "sglang.srt.server_args.ServerArgs.add_cli_args (what `sglang serve` and "
                  "`python -m sglang.launch_server` parse)",
        "python": sys.version.split()[0],
        "flags": dump(parser),
    }
    text = json.dumps(doc, indent=1, sort_keys=False) + "\n"
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    print(f"upstream-cli: sglang {doc['version']}: {len(doc['flags'])} flags", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
