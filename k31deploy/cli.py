"""`k31` command line: each subcommand lives in its own module and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

from k31deploy.errors import K31Error

# module -> registers one or more subcommands via register(subparsers)
COMMAND_MODULES = (
    "k31deploy.commands.recipe",
    "k31deploy.commands.calc",
    "k31deploy.commands.sandbox",
    "k31deploy.commands.wheelhouse",
    "k31deploy.commands.smoke",
    "k31deploy.commands.ops",
    "k31deploy.commands.status",
    "k31deploy.commands.pki",
)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one `error:` line naming the command's --help, like every other refusal."""

    def error(self, message: str) -> None:
        self.exit(K31Error.exit_code, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="k31", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except K31Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return K31Error.exit_code
    except BrokenPipeError:    # `k31 plan | head`
        return 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
