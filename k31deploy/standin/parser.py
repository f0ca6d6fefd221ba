"""The stand-in's command line: real SGLang's, from the machine dumps of its parser.

Every flag, alias, value type, choice list, nargs and default comes from k31deploy/data/engine/*.cli.json
(scripts/upstream-cli's dump of `ServerArgs.add_cli_args`), plus the values only the recipe's kimi-k31-pro
branch has (`branch_choices` in data/flags.yaml). So a flag or value real SGLang refuses fails here with
argparse's exit 2, as `sglang.launch_server` would fail on a real node.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from typing import Any

_TYPES = {"int": int, "float": float}


def load_engine_flags() -> dict[str, dict[str, Any]]:
    """Long flag -> the dump's spec (kind, choices, nargs, aliases, default), every known build merged,
    with the branch-only values of flags.yaml added to their flag's choices."""
    try:
        import yaml
    except ImportError as exc:  # nodes get it from Debian's python3-yaml, not from a wheel
        raise SystemExit("k31 stand-in: PyYAML is required (Debian package python3-yaml)") from exc
    data = resources.files("k31deploy").joinpath("data")
    flags: dict[str, dict[str, Any]] = {}
    for dump in sorted(data.joinpath("engine").iterdir(), key=lambda p: p.name):
        if dump.name.endswith(".cli.json"):
            for flag, spec in json.loads(dump.read_text(encoding="utf-8"))["flags"].items():
                flags.setdefault(flag, dict(spec))
    branch = yaml.safe_load(data.joinpath("flags.yaml").read_text(encoding="utf-8"))["engine"]
    for flag, entry in branch.items():
        extra = list(entry.get("branch_choices", {}))
        if extra:
            flags[flag] = dict(flags[flag], choices=[*flags[flag]["choices"], *extra])
    return flags


def build_parser(flags: dict[str, dict[str, Any]] | None = None) -> argparse.ArgumentParser:
    flags = load_engine_flags() if flags is None else flags
    # allow_abbrev=False: a truncated flag k31 emits by mistake must fail here, not be guessed.
    parser = argparse.ArgumentParser(
        prog="python -m k31deploy.standin",
        description="CPU stand-in for sglang.launch_server (k31 sandbox and tests).",
        allow_abbrev=False,
    )
    for flag, spec in flags.items():
        kwargs: dict[str, Any] = {"dest": spec["dest"]}
        if spec["kind"] == "bool":
            kwargs.update(action="store_true")
        else:
            # SGLang's own value parsers (json lists, backend specs ...) take strings; choices still apply.
            kwargs.update(type=_TYPES.get(spec["kind"], str), default=spec["default"])
            if spec["nargs"] is not None:
                kwargs["nargs"] = spec["nargs"]
            if spec["choices"] is not None:
                kwargs["choices"] = spec["choices"] if spec["kind"] in _TYPES else [str(c) for c in spec["choices"]]
        if flag == "--model-path":
            kwargs["required"] = True
        parser.add_argument(flag, *spec["aliases"], **kwargs)
    return parser


def merge_config(argv: list[str]) -> list[str]:
    """`--config FILE` as SGLang's ConfigArgumentMerger reads it: the YAML's keys (flag names without
    dashes, `-` or `_`) become flags placed before the command line's, which win."""
    if "--config" not in argv:
        return argv
    import yaml

    i = argv.index("--config")
    if i + 1 >= len(argv):
        raise SystemExit("error: No config file specified after --config flag!")
    with open(argv[i + 1], encoding="utf-8") as fh:
        data = yaml.safe_load(fh) or {}
    merged: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            merged.append(flag)
        elif value not in (False, None):
            merged += [flag, *(map(str, value) if isinstance(value, list) else [str(value)])]
    return merged + argv[:i] + argv[i + 2:]


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(merge_config(argv))
    if args.served_model_name is None:
        args.served_model_name = args.model_path
    # SGLang 0.5.23 resolves the deprecated `--dp-size N --enable-dp-attention` to `--attn-dp-size N`.
    if args.enable_dp_attention and args.attn_dp_size == 1:
        args.attn_dp_size, args.dp_size = args.dp_size, 1
    return args
