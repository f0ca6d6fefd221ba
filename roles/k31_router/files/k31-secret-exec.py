#!/usr/bin/env python3
"""k31-secret-exec: run a Python program that takes a secret only as a flag, without the secret in argv.

sglang-router takes its API key only as `--api-key KEY`. A flag on a command line is in
/proc/<pid>/cmdline, which every local user (and, for a container, the host) can read. This launcher
reads the secret from its environment (the unit's 0600 env file, which systemd reads), removes it from
the environment the program and its children inherit, adds the flag to `sys.argv` and runs the module
in this same process. The kernel's copy of argv, the one /proc/<pid>/cmdline shows, stays the
launcher's own command line, which names the variable, never its value.

    k31-secret-exec.py --flag-from-env FLAG VAR [--flag-from-env FLAG VAR ...] -m MODULE [ARG ...]

A VAR that is unset or empty is an error (exit 2, one line on stderr): the program never starts
without the secret it was meant to have. Standard library only: it runs in the router's venv or image.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import MutableMapping

USAGE = "usage: k31-secret-exec.py --flag-from-env FLAG VAR [--flag-from-env FLAG VAR ...] -m MODULE [ARG ...]"


def parse(argv: list[str]) -> tuple[list[tuple[str, str]], str, list[str]]:
    """(flag, variable) pairs, the module, and the module's own arguments."""
    pairs = []
    i = 0
    while i < len(argv) and argv[i] == "--flag-from-env":
        if i + 2 >= len(argv) or not argv[i + 1].startswith("--") or not argv[i + 2]:
            raise ValueError("--flag-from-env needs a flag (--name) and an environment variable")
        pairs.append((argv[i + 1], argv[i + 2]))
        i += 3
    if not pairs:
        raise ValueError("no --flag-from-env given; a program without secrets needs no k31-secret-exec")
    if i + 1 >= len(argv) or argv[i] != "-m":
        raise ValueError("-m MODULE must follow the --flag-from-env pairs")
    return pairs, argv[i + 1], argv[i + 2:]


def secret_flags(pairs: list[tuple[str, str]], environ: MutableMapping[str, str]) -> list[str]:
    """`FLAG=VALUE` tokens, each variable removed from `environ`. The `=` form keeps a value that starts
    with '-' the flag's value."""
    flags = []
    for flag, var in pairs:
        value = environ.pop(var, "")
        if not value.strip():
            raise ValueError(f"{var} is unset or empty, so {flag} has no value; the unit's env file must set it")
        flags.append(f"{flag}={value}")
    return flags


def main() -> int:
    try:
        pairs, module, args = parse(sys.argv[1:])
        flags = secret_flags(pairs, os.environ)  # os.environ.pop unsets it for child processes too
    except ValueError as exc:
        print(f"k31-secret-exec: error: {exc}; {USAGE}", file=sys.stderr)
        return 2
    sys.argv = [module, *args, *flags]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
