"""`k31 wheelhouse build|install`: the offline wheel folder nodes install the router and Dynamo from."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k31deploy import wheelhouse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "wheelhouse",
        help="download pinned wheels once; install them with no package index",
        description=wheelhouse.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="wheelhouse_command", metavar="ACTION", required=True)

    build = sub.add_parser("build", help="download every pinned wheel of a set (skips what is present)")
    build.add_argument("--dest", type=Path, help="wheelhouse folder (default: STATE_DIR/wheelhouse)")
    build.add_argument("--set", dest="set_name", default="all", help="router, dynamo or all (default: all)")
    build.add_argument("--arch", help=f"node CPU: {' or '.join(wheelhouse.ARCHES)} (default: this machine's)")
    build.set_defaults(func=_build)

    install = sub.add_parser("install", help="install a set into a venv from a wheelhouse, offline")
    install.add_argument("--set", dest="set_name", required=True, help="router or dynamo")
    install.add_argument("--venv", type=Path, required=True, help="venv to create or update")
    install.add_argument("--from", dest="source", type=Path, help="wheelhouse folder (default: STATE_DIR/wheelhouse)")
    install.add_argument(
        "--python", default=sys.executable, help="CPython 3.11 that creates the venv (default: this one)"
    )
    install.set_defaults(func=_install)

    pack = sub.add_parser("pack", help="one reproducible tar of a set, for the playbooks to copy to nodes")
    pack.add_argument("--set", dest="set_name", required=True, help="router or dynamo")
    pack.add_argument("--from", dest="source", type=Path, help="wheelhouse folder (default: STATE_DIR/wheelhouse)")
    pack.add_argument("--arch", help=f"node CPU: {' or '.join(wheelhouse.ARCHES)} (default: this machine's)")
    pack.set_defaults(func=_pack)


def _build(args: argparse.Namespace) -> int:
    dest = wheelhouse.build(
        args.set_name, args.dest or wheelhouse.default_wheelhouse(), wheelhouse.host_arch(args.arch)
    )
    print(dest.resolve())
    return 0


def _pack(args: argparse.Namespace) -> int:
    source = (args.source or wheelhouse.default_wheelhouse()).resolve()
    path, digest, changed = wheelhouse.pack(args.set_name, source, wheelhouse.host_arch(args.arch))
    print(json.dumps({"path": str(path), "digest": digest, "changed": changed}))
    return 0


def _install(args: argparse.Namespace) -> int:
    source = (args.source or wheelhouse.default_wheelhouse()).resolve()
    venv = wheelhouse.install(args.set_name, args.venv.resolve(), source, python=args.python)
    print(venv)
    return 0
