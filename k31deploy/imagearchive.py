"""What a `docker save` / `podman save` archive holds, read on the controller before a host is touched.

k31_image_source=tarball loads such an archive on each engine host. The archive's manifest.json names each
image's config blob -- whose digest IS the image ID a load gives (`docker|podman image inspect --format
'{{.Id}}'`) -- and the names it was saved under (RepoTags). k31 refuses an archive without the plan's image
before any copy, and after a load checks that the plan's name points at exactly that ID: the verification a
registry pull gets from its manifest digest. Only the tar headers and manifest.json are read (a tarball is
seekable), so a serving image of tens of GB costs milliseconds.

With k31_image_fanout=tree a host's copy of the archive serves the next hosts once it matches the controller's
sha256 (a SHA256SUMS line, checked on the host with `sha256sum --check`). The controller hashes the archive once and
remembers the digest per path, size and mtime (`sha256`), so a later run does not read tens of GB again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from k31deploy.errors import K31Error

HEX = re.compile(r"^[0-9a-f]{64}$")
# How Ansible reaches a host that the controller's archive goes to by rsync over the host's SSH settings
# (roles/k31_image/tasks/from_controller.yml; '' is unset, Ansible's default ssh). A host reached another way
# (local, a container connection) takes ansible.builtin.copy, and needs no rsync on the controller.
SSH_CONNECTIONS = ("", "ssh", "smart")


def copies_over_ssh(connection: str | None) -> bool:
    """Whether the controller's archive goes to a host with this ansible_connection by rsync over SSH."""
    return (connection or "") in SSH_CONNECTIONS


@dataclass(frozen=True)
class ArchivedImage:
    id: str                   # sha256:<64 hex>, the image ID a load gives
    tags: tuple[str, ...]     # the names it was saved under, normalized (normal_name)


def normal_name(name: str) -> str:
    """A reference as docker and podman list it: Docker Hub's implicit prefixes dropped, `:latest` added.
    `docker save lmsysorg/sglang` records `lmsysorg/sglang:latest`; podman records `docker.io/lmsysorg/...`."""
    name = name.strip()
    for prefix in ("docker.io/library/", "docker.io/", "index.docker.io/library/", "index.docker.io/"):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if "@" not in name and ":" not in name.rsplit("/", 1)[-1]:
        name += ":latest"
    return name


def _config_id(config: str) -> str:
    # docker < 25 and podman: "<hex>.json"; docker >= 25 (OCI layout inside): "blobs/sha256/<hex>"
    hexpart = Path(config).name.removesuffix(".json")
    if not HEX.match(hexpart):
        raise ValueError(f"config {config!r} names no sha256 blob")
    return f"sha256:{hexpart}"


def read(path: str | Path) -> list[ArchivedImage]:
    """The images a docker-archive holds; a K31Error naming the file when it is not one."""
    path = Path(path)
    try:
        with tarfile.open(path, "r:") as archive:
            member = archive.getmember("manifest.json")
            handle = archive.extractfile(member)
            if handle is None:
                raise ValueError("manifest.json is not a file")
            manifest = json.loads(handle.read())
        images = [ArchivedImage(id=_config_id(entry["Config"]),
                                tags=tuple(normal_name(t) for t in entry.get("RepoTags") or []))
                  for entry in manifest]
    except (OSError, KeyError, TypeError, ValueError, tarfile.TarError) as exc:
        raise K31Error(f"k31_image_tarball={path} is not a `docker save` / `podman save` archive (docker-archive "
                       f"format, manifest.json): {exc}") from exc
    if not images:
        raise K31Error(f"k31_image_tarball={path} holds no image")
    return images


def find(path: str | Path, image: str) -> ArchivedImage:
    """The archive's image saved under the plan's name `image`; refused, naming what it holds, otherwise."""
    if "@" in image:
        raise K31Error(f"k31_image={image} names a registry digest, which a `docker save` archive does not keep; "
                       f"with k31_image_source=tarball name the image REPO:TAG (k31 checks the loaded image's ID "
                       f"against the archive's)")
    want = normal_name(image)
    images = read(path)
    for archived in images:
        if want in archived.tags:
            return archived
    held = ", ".join(t for a in images for t in a.tags) or "only untagged images"
    raise K31Error(f"k31_image_tarball={path} does not hold {image} (it holds {held}); save the image under "
                   f"the plan's name: docker save -o FILE {image}")


def sha256(path: str | Path, cache: str | Path | None = None) -> str:
    """The archive's sha256 (64 hex). With `cache` (a JSON file), a digest recorded for the same real path, size
    and mtime is reused instead of reading the file again, and a new one is recorded."""
    path = Path(path)
    try:
        st = path.stat()
        real = str(path.resolve())
    except OSError as exc:
        raise K31Error(f"k31_image_tarball={path} cannot be read: {exc.strerror}") from None
    key = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    known: dict = {}
    if cache is not None:
        try:
            known = json.loads(Path(cache).read_text())
        except (OSError, ValueError):
            known = {}
        entry = known.get(real) if isinstance(known, dict) else None
        if isinstance(entry, dict) and {k: entry.get(k) for k in key} == key and HEX.match(str(entry.get("sha256"))):
            return entry["sha256"]
    digest = hashlib.sha256()
    try:
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    except OSError as exc:
        raise K31Error(f"k31_image_tarball={path} cannot be read: {exc.strerror}") from None
    hexdigest = digest.hexdigest()
    if cache is not None:
        known = known if isinstance(known, dict) else {}
        known[real] = {**key, "sha256": hexdigest}
        cache = Path(cache)
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1, sort_keys=True) + "\n")
        tmp.replace(cache)
    return hexdigest

