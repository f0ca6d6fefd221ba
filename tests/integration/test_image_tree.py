"""k31_image with k31_image_fanout=tree on a 4-node sandbox of nested podman nodes (shape fanout-container): the
stand-in serving image, saved on the controller as a `podman save` archive, goes from the controller to unified0
only (rsync --partial over its SSH: the half copy a stopped run left there is resumed, not sent again), then host to
host (unified0 -> unified1, then unified0 -> unified2 and unified1 -> unified3), each copy checked against the
controller's sha256 before it loads or serves; every host ends with the archive's image ID, a re-run
changes nothing, and a host that lost its image and its copy of the archive is reported by --check (nothing moves)
and restored from a peer by the next run. A host whose copy fails fails, and so does the host it was to serve,
naming it; the next run restores both from the hosts that verified.

Needs root, podman, runc and debootstrap.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time

import pytest
from recaps import changed
from sandbox_cli import REPO, cli_env, node_sh, playbook, sandbox_up

from k31deploy import imagearchive

pytestmark = pytest.mark.integration

NAME = f"imgtree{os.getpid()}"
HOSTS = [f"unified{i}" for i in range(4)]
IMAGE = "sandbox.k31.internal/standin/sglang-serving:r1"
COPY = "/var/tmp/k31-image.tar"
FROM_CONTROLLER = "Copy the archive from the controller (rsync"
SAY = "Say where this host's archive comes from"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    env = cli_env(tmp_path_factory.mktemp("state"))
    with sandbox_up(env, NAME, "--shape", "fanout-container", "--nodes", str(len(HOSTS))) as inventory:
        helper = "import sys; from k31deploy import staging_sandbox as s; s.peer_ssh(sys.argv[1])"
        peers = subprocess.run([sys.executable, "-c", helper, NAME], env=env, cwd=REPO, capture_output=True,
                               text=True, timeout=120)
        assert peers.returncode == 0, peers.stderr
        yield env, inventory, inventory.parent / "serving-r1.tar"


def stage(env, inventory, *args, rc=0):
    extra = {"k31_image_fanout": "tree", "k31_image_tree_poll": 1, "k31_image_check_engine": False}
    began = time.monotonic()
    proc = playbook(env, inventory, "playbooks/prepare.yml", "--tags", "k31_image", "-e", json.dumps(extra), *args)
    print(f"k31_image {' '.join(args)}: {time.monotonic() - began:.1f} s")
    assert (proc.returncode == 0) == (rc == 0), proc.stdout[-5000:] + proc.stderr[-2000:]
    return proc.stdout


def task(out: str, name: str) -> dict[str, str]:
    """{host: its result text} of the last task whose name holds `name` (ansible-playbook's default callback)."""
    header = r"^TASK \[[^\]]*?" + re.escape(name) + r"[^\]]*\] \*+\n"
    blocks = re.findall(header + r"(.*?)(?=^TASK |^PLAY |\Z)", out, re.M | re.S)
    assert blocks, f"no task {name!r} in the output"
    results = re.findall(r"^(\w+): \[([^\]]+)\](.*?)(?=^\w+: \[|\Z)", blocks[-1], re.M | re.S)
    # the yaml result format folds long strings: whitespace runs become one space; a delegated task's host reads
    # "host -> localhost"
    return {host.split(" -> ")[0]: f"{status}:{' '.join(text.split())}" for status, host, text in results}


def image_id(host: str) -> str:
    return node_sh(NAME, host, f"podman image inspect --format '{{{{.Id}}}}' {IMAGE}").strip().removeprefix("sha256:")


def test_the_archive_fans_out_from_one_controller_copy_and_a_lost_copy_comes_back_from_a_peer(cluster):
    env, inventory, tarball = cluster
    [archived] = imagearchive.read(tarball)
    want = archived.id.removeprefix("sha256:")
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()

    # A copy from the controller that a dropped link stopped halfway: rsync --partial kept what had arrived.
    size = tarball.stat().st_size
    with tarball.open("rb") as fh:
        half = fh.read(size // 2)
    subprocess.run(["podman", "exec", "-i", f"k31-{NAME}-unified0", "sh", "-c", f"cat > {COPY}"], input=half,
                   check=True, timeout=120)
    out = stage(env, inventory, "-v")
    copied = task(out, FROM_CONTROLLER)
    assert set(copied) == {"unified0"} and copied["unified0"].startswith("changed"), copied
    # ... and the next copy resumed it: about half the archive matched what was there, the rest was sent
    stats = {k: int(v.replace(",", "")) for k, v in re.findall(r"(Literal|Matched) data: ([\d,]+) bytes",
                                                                copied["unified0"])}
    print(f"the seed's copy from the controller resumed: {stats['Matched']} of {size} bytes matched the half copy, "
          f"{stats['Literal']} sent")
    assert stats["Matched"] >= size // 2 - 256 * 1024 and stats["Literal"] < size * 0.6, (size, stats)
    said = task(out, SAY)
    assert "round 1 of 3: from the controller" in said["unified0"]
    assert "round 2 of 3: from unified0" in said["unified1"]
    assert "round 3 of 3: from unified0" in said["unified2"]
    assert "round 3 of 3: from unified1" in said["unified3"]    # unified1 serves as soon as its copy verified
    for host in HOSTS:
        assert image_id(host) == want, host
        assert node_sh(NAME, host, f"sha256sum {COPY}").split()[0] == digest, host    # kept: it serves others

    again = stage(env, inventory)
    assert changed(again) == {"localhost": 0, **dict.fromkeys(HOSTS, 0)}, changed(again)

    # unified3 loses its image and its copy of the archive: --check reports it and moves nothing
    node_sh(NAME, "unified3", f"podman rmi --force {IMAGE} >/dev/null && rm {COPY}")
    check = stage(env, inventory, "--check")
    assert changed(check) == {"localhost": 0, **dict.fromkeys(HOSTS[:3], 0), "unified3": 1}, changed(check)
    assert "round 1 of 1: from unified0" in task(check, SAY)["unified3"]
    assert not node_sh(NAME, "unified3", f"ls {COPY} 2>/dev/null; podman images -q {IMAGE}", check=False).strip()

    fixed = stage(env, inventory)
    assert "round 1 of 1: from unified0" in task(fixed, SAY)["unified3"]
    assert FROM_CONTROLLER not in fixed    # nothing from the controller
    assert {h for h, n in changed(fixed).items() if n} == {"unified3"}, changed(fixed)
    assert image_id("unified3") == want
    assert node_sh(NAME, "unified3", f"sha256sum {COPY}").split()[0] == digest


def test_a_host_whose_source_failed_fails_naming_it_and_the_next_run_recovers(cluster):
    env, inventory, tarball = cluster
    want = imagearchive.read(tarball)[0].id.removeprefix("sha256:")
    # only unified0 keeps its copy: unified0 -> unified1, then unified0 -> unified2 and unified1 -> unified3; the
    # copy to unified1 fails (a directory stands where the archive goes), so unified3's source has no verified copy
    for host in HOSTS[1:]:
        node_sh(NAME, host, f"podman rmi --force {IMAGE} >/dev/null && rm -f {COPY}")
    node_sh(NAME, "unified1", f"mkdir -p {COPY}/in-the-way")
    address = node_sh(NAME, "unified1", "hostname -I").split()[0]
    out = stage(env, inventory, rc=2)
    failed = task(out, "Copy from this host's source once that source's copy verified")
    assert failed["unified1"].startswith("fatal") and f"{COPY} is a directory" in failed["unified1"]
    assert failed["unified3"].startswith("fatal"), failed["unified3"]
    assert f"its source {address} has no verified copy (failed: {COPY} is a directory" in failed["unified3"], \
        failed["unified3"][-1200:]
    assert failed["unified2"].startswith("changed") and image_id("unified2") == want

    node_sh(NAME, "unified1", f"rm -r {COPY}")
    out = stage(env, inventory)
    said = task(out, SAY)
    assert "round 1 of 1: from unified0" in said["unified1"] and "round 1 of 1: from unified2" in said["unified3"]
    assert all(image_id(h) == want for h in HOSTS)
