"""The stand-in's command line, built from the `engine` section of k31deploy/data/flags.yaml.

The same list bounds what the resolver may emit, so a flag k31 emits but the list lacks (or a bad
value) fails here with argparse's exit 2, as `sglang.launch_server` would fail on a real node.
"""

from __future__ import annotations

import argparse
from importlib import resources
from typing import Any

# Defaults of upstream server_args.py for the flags the stand-in reads; flags.yaml holds no defaults.
DEFAULTS: dict[str, Any] = {
    "--host": "127.0.0.1",
    "--port": 30000,
    "--tp-size": 1,
    "--dp-size": 1,
    "--pp-size": 1,
    "--ep-size": 1,
    "--dcp-size": 1,
    "--attn-cp-size": 1,
    "--nnodes": 1,
    "--node-rank": 0,
    "--disaggregation-mode": "null",
    "--disaggregation-transfer-backend": "mooncake",
    "--disaggregation-bootstrap-port": 8998,
}

_TYPES = {"int": int, "float": float, "str": str}


def load_engine_flags() -> dict[str, dict[str, Any]]:
    """The `engine` section of flags.yaml: flag -> {type, choices?, source, ...}."""
    try:
        import yaml
    except ImportError as exc:  # nodes get it from Debian's python3-yaml, not from a wheel
        raise SystemExit("k31 stand-in: PyYAML is required (Debian package python3-yaml)") from exc
    text = resources.files("k31deploy").joinpath("data/flags.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)["engine"]


def build_parser(flags: dict[str, dict[str, Any]] | None = None) -> argparse.ArgumentParser:
    flags = load_engine_flags() if flags is None else flags
    # allow_abbrev=False: a truncated flag k31 emits by mistake must fail here, not be guessed.
    parser = argparse.ArgumentParser(
        prog="python -m k31deploy.standin",
        description="CPU stand-in for sglang.launch_server (k31 sandbox and tests).",
        allow_abbrev=False,
    )
    for flag, spec in flags.items():
        kind = spec["type"]
        kwargs: dict[str, Any] = {"default": DEFAULTS.get(flag)}
        if kind == "bool":
            kwargs = {"action": "store_true"}
        elif kind == "choice":
            kwargs["choices"] = list(spec["choices"])
        elif kind in _TYPES:
            kwargs["type"] = _TYPES[kind]
        else:
            raise ValueError(f"flags.yaml engine flag {flag} has type {kind!r}; the stand-in knows "
                             f"bool, choice, {', '.join(_TYPES)}")
        if flag == "--model-path":
            kwargs["required"] = True
        parser.add_argument(flag, **kwargs)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.served_model_name is None:
        args.served_model_name = args.model_path
    return args
