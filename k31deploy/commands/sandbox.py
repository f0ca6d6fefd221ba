"""`k31 sandbox up|down|status|image`: a local multi-host test bed of podman containers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k31deploy.sandbox import cluster, serving
from k31deploy.sandbox.shapes import DEFAULT_SHAPE, load_shapes, resolve_shape

DEFAULT_NAME = "default"


def _log(message: str) -> None:
    print(f"k31 sandbox: {message}", file=sys.stderr, flush=True)


def _up(args: argparse.Namespace) -> int:
    shape = resolve_shape(args.shape, args.nodes)
    inventory = cluster.up(shape, args.name, _log)
    # The last line of stdout is the inventory's path: scripts run `inv=$(k31 sandbox up | tail -1)`.
    print(inventory)
    return 0


def _down(args: argparse.Namespace) -> int:
    cluster.down(args.name, args.purge_images, _log)
    return 0


def _status(args: argparse.Namespace) -> int:
    rows = cluster.status(args.name)
    if args.json:
        print(json.dumps({"name": args.name, "nodes": rows}, indent=2))
    elif rows:
        header = ("HOST", "CONTAINER", "STATE", "IP", "SSH", "MEMORY")
        table = [header] + [
            (
                row["host"],
                row["container"],
                row["state"],
                row["ip"] or "-",
                "ok" if row["ssh"] else "no",
                f"{row['memory_mib']:.0f} MiB" if row["memory_mib"] is not None else "-",
            )
            for row in rows
        ]
        widths = [max(len(str(line[i])) for line in table) for i in range(len(header))]
        for line in table:
            cells = (str(cell).ljust(width) for cell, width in zip(line, widths, strict=True))
            print("  ".join(cells).rstrip())
    else:
        _log(f"no sandbox named {args.name}")
    # 0 only when the sandbox exists and every node runs and answers ssh.
    return 0 if rows and all(row["state"] == "running" and row["ssh"] for row in rows) else 1


def _image(args: argparse.Namespace) -> int:
    pushed = cluster.push_image(args.name, args.revision, args.broken, _log)
    if args.save:
        pushed.update(serving.save(pushed["local"], Path(args.save), pushed["tag"]))
    print(json.dumps(pushed))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sandbox",
        help="local multi-host sandbox cluster (podman, systemd, sshd) with a generated inventory",
        description=__doc__,
    )
    actions = parser.add_subparsers(dest="sandbox_action", metavar="ACTION", required=True)

    def named(action: str, help_text: str) -> argparse.ArgumentParser:
        sub = actions.add_parser(action, help=help_text, description=help_text)
        sub.add_argument(
            "--name", default=DEFAULT_NAME, help=f"sandbox name, several may coexist (default {DEFAULT_NAME})"
        )
        return sub

    up = named("up", "start the sandbox (or reuse it) and print its inventory path as the last line")
    up.add_argument(
        "--shape",
        help=f"hosts and recipe knobs from shapes.yaml: {', '.join(load_shapes())} (default {DEFAULT_SHAPE})",
    )
    up.add_argument("--nodes", type=int, help="host count of the `fanout` shape (implies --shape fanout)")
    up.set_defaults(func=_up)

    down = named("down", "remove the sandbox's containers, network and state; cached images stay")
    down.add_argument("--purge-images", action="store_true", help="also remove the cached sandbox images")
    down.set_defaults(func=_down)

    img = named("image", "build a revision of the stand-in serving image and push it to the sandbox's registry; "
                         "prints what was pushed as JSON (ref: repo@sha256:...)")
    img.add_argument("--revision", type=int, default=2, help="revision to build and push (1 is what `up` pushed)")
    img.add_argument("--broken", action="store_true", help="an image whose entry point exits at once")
    img.add_argument("--save", metavar="PATH", help="also write a `podman save` archive of it (k31_image_tarball)")
    img.set_defaults(func=_image)

    status = named("status", "each node's container state, IP, memory and whether ssh answers")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.set_defaults(func=_status)
