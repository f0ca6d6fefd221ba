"""k31_image_source=tarball: what a `docker save` / `podman save` archive holds, read on the controller."""

from __future__ import annotations

import io
import tarfile

import pytest
from archive_helpers import write_archive

from k31deploy import imagearchive
from k31deploy.errors import K31Error

HEX_A = "a" * 64
HEX_B = "b" * 64


def test_the_archive_names_each_image_by_its_config_digest_and_saved_names(tmp_path):
    path = write_archive(tmp_path / "k31.tar", [
        {"Config": f"{HEX_A}.json", "RepoTags": ["reg.example:5000/k31/serving:r1"], "Layers": []},
        # docker >= 25 writes an OCI layout inside the archive: the config is a blob path
        {"Config": f"blobs/sha256/{HEX_B}", "RepoTags": ["lmsysorg/sglang"], "Layers": []},
    ], extra=[("layer.tar", b"x" * 4096)])
    assert imagearchive.read(path) == [
        imagearchive.ArchivedImage(id=f"sha256:{HEX_A}", tags=("reg.example:5000/k31/serving:r1",)),
        imagearchive.ArchivedImage(id=f"sha256:{HEX_B}", tags=("lmsysorg/sglang:latest",))]
    assert imagearchive.find(path, "reg.example:5000/k31/serving:r1").id == f"sha256:{HEX_A}"
    # Docker Hub's implicit prefixes: podman lists docker.io/..., docker does not
    assert imagearchive.find(path, "docker.io/lmsysorg/sglang:latest").id == f"sha256:{HEX_B}"


def test_an_archive_without_the_plans_image_is_refused_naming_what_it_holds(tmp_path):
    path = write_archive(tmp_path / "k31.tar", [{"Config": f"{HEX_A}.json", "RepoTags": ["reg/k31:r1"]}])
    with pytest.raises(K31Error, match=r"k31_image_tarball=.*k31.tar does not hold reg/k31:r2 \(it holds "
                                       r"reg/k31:r1\); save the image under the plan's name: docker save -o FILE"):
        imagearchive.find(path, "reg/k31:r2")
    with pytest.raises(K31Error, match=r"k31_image=reg/k31@sha256:.* names a registry digest, which a `docker "
                                       r"save` archive does not keep"):
        imagearchive.find(path, f"reg/k31@sha256:{HEX_A}")


@pytest.mark.parametrize("content", [b"not a tar", None, [{"Config": "config.json", "RepoTags": []}], []])
def test_what_is_no_docker_archive_is_refused_in_one_sentence(tmp_path, content):
    path = tmp_path / "k31.tar"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is None:
        write_archive(path, [], extra=[("index.json", b"{}")])
        with tarfile.open(path, "w") as tar:          # an OCI archive: index.json, no manifest.json
            info = tarfile.TarInfo("index.json")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
    else:
        write_archive(path, content)
    with pytest.raises(K31Error, match=r"^k31_image_tarball=.*k31.tar (is not a `docker save` / `podman save` "
                                       r"archive|holds no image)"):
        imagearchive.read(path)


def test_the_archives_sha256_is_hashed_once_per_path_size_and_mtime(tmp_path):
    """k31_image_fanout=tree checks each host's copy against this digest (a SHA256SUMS line, sha256sum --check)."""
    import hashlib
    import json
    import os

    path, cache = tmp_path / "k31.tar", tmp_path / "state/image-archives.json"
    path.write_bytes(b"layer" * 300_000)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert imagearchive.sha256(path) == digest    # no cache: read every time
    assert imagearchive.sha256(path, cache) == digest
    assert json.loads(cache.read_text())[str(path.resolve())]["sha256"] == digest
    # the same path, size and mtime: the recorded digest, without reading the file
    stat = path.stat()
    entry = json.loads(cache.read_text())
    entry[str(path.resolve())]["sha256"] = HEX_A
    cache.write_text(json.dumps(entry))
    assert imagearchive.sha256(path, cache) == HEX_A
    # a new archive under the same path (another mtime): hashed again and recorded
    path.write_bytes(b"other" * 300_000)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    again = imagearchive.sha256(path, cache)
    assert again == hashlib.sha256(b"other" * 300_000).hexdigest()
    assert json.loads(cache.read_text())[str(path.resolve())]["sha256"] == again
    # a cache that is no JSON is ignored and rewritten
    cache.write_text("{not json")
    assert imagearchive.sha256(path, cache) == again and json.loads(cache.read_text())


def test_an_unreadable_archive_is_refused_in_one_sentence(tmp_path):
    with pytest.raises(K31Error, match=r"^k31_image_tarball=.*missing.tar cannot be read: No such file"):
        imagearchive.sha256(tmp_path / "missing.tar", tmp_path / "cache.json")
