"""One GB300 NVL72 server (two trays) on the production path, its image loaded from a `podman save` archive.

The sandbox shape gb300-nvl72-container: privileged nodes running podman, stand-in /dev/nvidia* and IMEX channel
nodes, a stand-in nvidia-ctk that writes CDI specs over them, and the stand-in serving image saved as a tarball on
the controller (k31_image_source=tarball). Asserted through the real `k31 deploy`:
- each tray runs its rank as a podman container whose recorded command asks for the GPUs and the IMEX channel
  as CDI devices (podman 4 ignores --gpus), keeps NVIDIA_IMEX_CHANNELS, and sees the device nodes inside;
- the running image is the archive's (its ID), the CDI specs exist, the smoke checks pass against rank 0;
- a re-run changes nothing; an image swapped under the plan's name on one tray is drift: the next deploy is
  whole, loads the archive there only and the name points at the archive's image again;
- an archive without the plan's image is refused before any host is touched (exit 2, one sentence).

Needs root, podman, runc and debootstrap.
"""

from __future__ import annotations

import json
import os

import pytest
from recaps import changed
from sandbox_cli import SHORT, SMOKE, cli_env, node_sh, sandbox_up
from sandbox_cli import deploy as sandbox_deploy

from k31deploy import imagearchive

pytestmark = pytest.mark.integration

NAME = f"gbctr-{os.getpid()}"
TRAYS = ("unified0-t0", "unified0-t1")
LOAD = "Load the image | changed"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    env = cli_env(tmp_path_factory.mktemp("state"))
    with sandbox_up(env, NAME, "--shape", "gb300-nvl72-container") as inventory:
        yield env, inventory, inventory.parent / "serving-r1.tar"


def deploy(env, inventory, *args, rc=0):
    proc, seconds = sandbox_deploy(env, inventory, *args, rc=rc)
    return proc.stdout + proc.stderr, seconds


def engine(host: str) -> str:
    return f"k31-unified0-r{TRAYS.index(host)}"


def podman_in(host: str, *args: str) -> str:
    return node_sh(NAME, host, "podman " + " ".join(args))


def test_both_trays_run_the_archives_image_with_cdi_gpus_and_the_imex_channel(cluster):
    env, inventory, tarball = cluster
    [archived] = imagearchive.read(tarball)
    out, fresh_s = deploy(env, inventory)
    assert SMOKE in out
    assert all(f"{host} | {LOAD}" in out for host in TRAYS)
    for host in TRAYS:
        ctr = engine(host)
        record = json.loads(podman_in(host, "inspect", ctr))[0]
        command = record["Config"]["CreateCommand"]
        devices = [command[i + 1] for i, flag in enumerate(command) if flag == "--device"]
        assert devices == ["nvidia.com/gpu=all", "nvidia.com/imex-channel=0"], command
        assert "--gpus" not in command and command[command.index("NVIDIA_IMEX_CHANNELS=0") - 1] == "--env"
        assert f"--node-rank {TRAYS.index(host)}" in " ".join(command)
        assert record["Image"].removeprefix("sha256:") == archived.id.removeprefix("sha256:")
        inside = podman_in(host, "exec", ctr, "ls", "/dev", "/dev/nvidia-caps-imex-channels").split()
        assert {"nvidia0", "nvidia3", "nvidiactl", "nvidia-uvm", "channel0"} <= set(inside), inside
        specs = node_sh(NAME, host, "nvidia-ctk cdi list 2>/dev/null").split()
        assert {"nvidia.com/gpu=all", "nvidia.com/imex-channel=0"} <= set(specs), specs
        assert not node_sh(NAME, host, "ls /var/tmp/k31-image.tar 2>/dev/null", check=False).strip()
    print(f"fresh deploy of the two trays from the archive: {fresh_s:.1f} s")

    out = deploy(env, inventory)[0]
    assert SHORT in out and not any(changed(out).values()), changed(out)


def test_an_image_swapped_under_the_plans_name_is_loaded_again_on_that_tray_only(cluster):
    env, inventory, tarball = cluster
    [archived] = imagearchive.read(tarball)
    name = "sandbox.k31.internal/standin/sglang-serving:r1"
    podman_in("unified0-t1", "commit", "--quiet", engine("unified0-t1"), name)
    swapped = podman_in("unified0-t1", "image", "inspect", "--format", "'{{.Id}}'", name).strip()
    assert swapped.removeprefix("sha256:") != archived.id.removeprefix("sha256:")
    out = deploy(env, inventory)[0]
    assert SHORT not in out
    assert "unified0-t1: its files, units, firewall or images changed since its last whole deploy" in out
    assert f"unified0-t1 | {LOAD}" in out and f"unified0-t0 | {LOAD}" not in out
    for host in TRAYS:
        now = podman_in(host, "image", "inspect", "--format", "'{{.Id}}'", name).strip()
        assert now.removeprefix("sha256:") == archived.id.removeprefix("sha256:"), host
    out = deploy(env, inventory, "--full")[0]
    assert not any(changed(out).values()), changed(out)


def test_an_archive_without_the_plans_image_is_refused_before_any_host(cluster, tmp_path):
    env, inventory, _ = cluster
    stamps = {h: node_sh(NAME, h, "stat -c %Y /var/lib/k31/converged.json") for h in TRAYS}
    other = tmp_path / "other.tar"
    other.write_bytes(b"not an archive")
    out, _ = deploy(env, inventory, "-e", f"k31_image_tarball={other}", rc=2)
    assert f"k31_image_tarball={other} is not a `docker save` / `podman save` archive" in out
    assert "(for unified0-t0, unified0-t1)" in out
    assert not any(h in changed(out) for h in TRAYS)
    assert {h: node_sh(NAME, h, "stat -c %Y /var/lib/k31/converged.json") for h in TRAYS} == stamps
