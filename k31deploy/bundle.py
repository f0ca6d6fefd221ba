"""A reproducible tarball of the k31deploy package, for nodes that run the stand-in.

Same sources -> same bytes (sorted entries, fixed mtimes and owners, no bytecode), so the
playbooks' copy of it reports "changed" only when the code really changed.

    python -m k31deploy.bundle DEST.tar
"""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def _files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo"))


def write_bundle(dest: Path) -> bool:
    """Write the bundle; return True when its content changed."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _files():
            info = tarfile.TarInfo(f"k31deploy/{path.relative_to(PACKAGE).as_posix()}")
            data = path.read_bytes()
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    content = buf.getvalue()
    if dest.exists() and dest.read_bytes() == content:
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(content)
    return True


if __name__ == "__main__":
    changed = write_bundle(Path(sys.argv[1]))
    print("changed" if changed else "unchanged")
