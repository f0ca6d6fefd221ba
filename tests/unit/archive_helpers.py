"""A `docker save` archive made by hand, for the tarball image source's tests."""

from __future__ import annotations

import io
import json
import tarfile


def write_archive(path, entries, extra=()):
    """A docker-archive with manifest.json `entries` (Config, RepoTags), plus `extra` (name, bytes) members."""
    with tarfile.open(path, "w") as tar:
        for name, data in [*extra, ("manifest.json", json.dumps(entries).encode())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
