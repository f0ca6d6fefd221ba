"""A reproducible tarball of the k31deploy package, for nodes that run the stand-in.

Same sources -> same bytes (sorted entries, fixed mtimes and owners, no bytecode), so the
playbooks' copy of it reports "changed" only when the code really changed. Written by k31_engine's lookup
k31_bundle (in the controller's process) and by the sandbox image build (sandbox/serving.py).
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
# What nodes run: the stand-in engine (and its Dynamo variant), the tiny model writer, and what the
# stand-in parses with (the engine CLI dumps and flags.yaml's branch values; not the lane's records).
# Nothing else of the package goes to a node.
NODE_PARTS = ("__init__.py", "standin", "tinymodel.py", "data/flags.yaml", "data/engine")


def _files() -> list[Path]:
    found = []
    for part in NODE_PARTS:
        path = PACKAGE / part
        found += [p for p in (path.rglob("*") if path.is_dir() else [path])
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")
                  and not p.name.endswith(".lane.json")]
    return sorted(found)


def write_bundle(dest: Path) -> tuple[bool, str]:
    """Write the bundle; return whether its content changed, and its digest."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _files():
            info = tarfile.TarInfo(f"k31deploy/{path.relative_to(PACKAGE).as_posix()}")
            data = path.read_bytes()
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    content = buf.getvalue()
    digest = hashlib.sha256(content).hexdigest()[:16]
    if dest.exists() and dest.read_bytes() == content:
        return False, digest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Whole or not at all: a deploy running beside this one may be copying the bundle to its hosts.
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    tmp.write_bytes(content)
    os.replace(tmp, dest)
    return True, digest
