"""`k31 sandbox up --shape mi355x-1p1d` gives three systemd hosts that Ansible reaches with checked
host keys, and `down` leaves nothing behind. Needs root, podman, runc and debootstrap; the first
run builds the image (about a minute), later runs reuse it."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from k31deploy.sandbox import podman
from k31deploy.sandbox.image import node_tag

pytestmark = pytest.mark.integration

HOSTS = ["prefill0", "decode0", "router0"]
NAME = f"it{os.getpid()}"
ANSIBLE = Path(sys.executable).parent / "ansible"
# The `k31 sandbox` command through its own register(); the same handlers `k31` dispatches to.
RUNNER = ["-m", "k31deploy.cli"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {**os.environ, "K31_STATE_DIR": str(tmp_path_factory.mktemp("state"))}


def k31(env, *args, timeout=600):
    return subprocess.run(
        [sys.executable, *RUNNER, "sandbox", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def labelled(kind):
    listing = ["network", "ls"] if kind == "network" else ["ps", "-a"]
    return podman.json_out(*listing, "--filter", f"label=k31.sandbox={NAME}", "--format", "json")


@pytest.fixture(scope="module")
def sandbox(env):
    proc = k31(env, "up", "--shape", "mi355x-1p1d", "--name", NAME)
    try:
        assert proc.returncode == 0, proc.stderr
        yield Path(proc.stdout.strip().splitlines()[-1]), proc
    finally:
        k31(env, "down", "--name", NAME)


def ansible(inventory, tmp_path, module, arg=None):
    """An ad-hoc run, each host's result read from the tree callback. A fresh control path dir, so
    no earlier connection is reused and every run makes its own host key check."""
    work = Path(tempfile.mkdtemp(dir=tmp_path))
    run_env = {
        **os.environ,
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "ANSIBLE_SSH_CONTROL_PATH_DIR": str(work / "cp"),
        "ANSIBLE_DEPRECATION_WARNINGS": "False",
    }
    argv = [str(ANSIBLE), "all", "-i", str(inventory), "-m", module, *(["-a", arg] if arg else [])]
    argv += ["--tree", str(work / "tree")]
    proc = subprocess.run(argv, env=run_env, capture_output=True, text=True, timeout=120, cwd=work)
    results = {path.name: json.loads(path.read_text()) for path in (work / "tree").iterdir()}
    return proc.returncode, results


def test_up_prints_inventory_of_three_hosts(sandbox):
    inventory, proc = sandbox
    assert inventory.is_file() and inventory.name == "inventory.yml"
    data = yaml.safe_load(inventory.read_text())
    children = data["all"]["children"]
    assert [list(children[g]["hosts"]) for g in ("k31_prefill", "k31_decode", "k31_router")] == [[h] for h in HOSTS]
    assert data["all"]["vars"]["k31_engine_runtime"] == "standin"
    assert "up in" in proc.stderr and "memory per node" in proc.stderr
    ctrs = labelled("container")
    assert sorted(c["Names"][0] for c in ctrs) == sorted(f"k31-{NAME}-{h}" for h in HOSTS)
    assert all(c["State"] == "running" and c["Image"] == node_tag() for c in ctrs)


def test_ansible_ping_with_host_key_checking(sandbox, tmp_path):
    rc, results = ansible(sandbox[0], tmp_path, "ping")
    assert rc == 0
    assert {host: result.get("ping") for host, result in results.items()} == dict.fromkeys(HOSTS, "pong")


def test_wrong_host_keys_are_refused(sandbox, tmp_path):
    """The same inventory with the known_hosts keys rotated one host along must fail every host."""
    inventory = sandbox[0]
    lines = (inventory.parent / "known_hosts").read_text().splitlines()
    addresses, keys = [line.split(" ", 1)[0] for line in lines], [line.split(" ", 1)[1] for line in lines]
    wrong = tmp_path / "wrong_known_hosts"
    wrong.write_text("".join(f"{a} {k}\n" for a, k in zip(addresses, keys[1:] + keys[:1], strict=True)))
    tampered = tmp_path / "inventory.yml"
    tampered.write_text(inventory.read_text().replace(str(inventory.parent / "known_hosts"), str(wrong)))
    rc, results = ansible(tampered, tmp_path, "ping")
    assert rc != 0
    assert all(result.get("unreachable") for result in results.values()), results
    assert all("host key" in result["msg"].lower() for result in results.values()), results


def test_systemd_is_pid_1_and_the_system_is_up(sandbox, tmp_path):
    rc, results = ansible(sandbox[0], tmp_path, "shell", "cat /proc/1/comm; systemctl is-system-running --wait || true")
    assert rc == 0, results
    for host, result in results.items():
        comm, state = result["stdout_lines"]
        assert comm == "systemd", host
        assert state in ("running", "degraded"), (host, state)


def test_every_host_has_its_own_host_key_and_the_image_has_none(sandbox, tmp_path):
    rc, results = ansible(sandbox[0], tmp_path, "command", "cat /etc/ssh/ssh_host_ed25519_key.pub")
    assert rc == 0
    served = {host: result["stdout"].split()[1] for host, result in results.items()}
    assert len(set(served.values())) == len(HOSTS)
    known = {line.split()[2] for line in (sandbox[0].parent / "known_hosts").read_text().splitlines()}
    assert known == set(served.values())
    listing = podman.run("run", "--rm", "--network", "none", node_tag(), "ls", "/etc/ssh").stdout.split()
    assert not [name for name in listing if name.startswith("ssh_host_")]


def test_up_again_reuses_the_running_sandbox(sandbox, env):
    before = {c["Names"][0]: c["Id"] for c in labelled("container")}
    text = sandbox[0].read_text()
    proc = k31(env, "up", "--shape", "mi355x-1p1d", "--name", NAME, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(sandbox[0])
    assert {c["Names"][0]: c["Id"] for c in labelled("container")} == before
    assert sandbox[0].read_text() == text
    # Another shape on the same name is refused, not half-applied.
    proc = k31(env, "up", "--shape", "mi355x-single", "--name", NAME, timeout=120)
    assert proc.returncode == 2 and "lacks" in proc.stderr


def test_status_reports_each_node(sandbox, env):
    proc = k31(env, "status", "--name", NAME, "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    nodes = json.loads(proc.stdout)["nodes"]
    assert [n["host"] for n in nodes] == HOSTS
    assert all(n["state"] == "running" and n["ssh"] and n["ip"] and n["memory_mib"] > 0 for n in nodes)


def test_down_leaves_nothing_behind(sandbox, env):
    state = sandbox[0].parent
    proc = k31(env, "down", "--name", NAME, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert labelled("container") == []
    assert labelled("network") == []
    assert not state.exists()
    # The cached image stays for the next `up`.
    assert podman.run("image", "exists", node_tag(), check=False).returncode == 0
    proc = k31(env, "status", "--name", NAME, timeout=120)
    assert proc.returncode == 1
