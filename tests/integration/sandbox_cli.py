"""What the sandbox fault tests share (test_oncall, test_dynamo_redeploy): the real `k31` CLI and ansible-playbook
run against a sandbox with the test's own state directory, commands inside a sandbox node (`podman exec`), systemd's
view of a unit, and polling that treats a restarting server as "not yet"."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"


def cli_env(state: Path) -> dict[str, str]:
    """The environment the CLI and playbooks run in: this repo, its ansible.cfg, the test's state directory."""
    return {**os.environ, "K31_STATE_DIR": str(state), "PYTHONPATH": str(REPO),
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_SSH_CONTROL_PATH_DIR": str(state / "cp"),
            "ANSIBLE_DEPRECATION_WARNINGS": "False"}


def k31(env, *args, timeout=600):
    """The real `k31` CLI; its output's tail goes to the test log."""
    proc = subprocess.run([sys.executable, "-m", "k31deploy.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    print(f"$ k31 {' '.join(args)} -> rc {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    return proc


# What `k31 deploy` prints when the converge stamp ends every host play at once, and when the smoke checks pass.
SHORT = "every host is as its last whole deploy left it"
SMOKE = "localhost | Run the smoke checks (models, chat, stream, reasoning, tool call) | ok"


@contextlib.contextmanager
def sandbox_up(env, name, *args):
    """`k31 sandbox up --name NAME ARGS...`: yields the inventory's path; the sandbox is removed afterwards."""
    proc = k31(env, "sandbox", "up", *args, "--name", name)
    try:
        assert proc.returncode == 0, proc.stderr
        yield Path(proc.stdout.strip().splitlines()[-1])
    finally:
        k31(env, "sandbox", "down", "--name", name)


def deploy(env, inventory, *args, rc=0):
    """The real `k31 deploy -i INVENTORY ARGS...`, its exit status checked: (the process, seconds it took)."""
    began = time.monotonic()
    proc = k31(env, "deploy", "-i", str(inventory), *args, timeout=900)
    assert proc.returncode == rc, (proc.stdout + proc.stderr)[-4000:]
    return proc, time.monotonic() - began


def playbook(env, inventory, path, *args, timeout=600):
    proc = subprocess.run([str(PLAYBOOK), "-i", str(inventory), str(REPO / path), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL)
    assert "Traceback" not in proc.stderr
    return proc


def host_addresses(inventory: Path) -> dict[str, str]:
    """Each node's address in a sandbox inventory (ansible_host, by host name)."""
    groups = yaml.safe_load(inventory.read_text())["all"]["children"]
    return {h: v["ansible_host"] for g in groups.values() for h, v in (g or {}).get("hosts", {}).items()}


def node(sandbox: str, host: str) -> str:
    """The container of a sandbox node (k31deploy.sandbox names them k31-<sandbox>-<host>)."""
    return f"k31-{sandbox}-{host}"


def node_sh(sandbox: str, host: str, command: str, check: bool = True) -> str:
    proc = subprocess.run(["podman", "exec", node(sandbox, host), "sh", "-c", command], capture_output=True,
                          text=True, timeout=60)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc.stdout


def unit_state(sandbox: str, host: str, unit: str) -> dict[str, object]:
    """systemd's view of a unit: active state, restart count, and when its main process started (us, on the
    kernel's monotonic clock, which every container of the sandbox shares). `systemctl show` prints the
    properties in its own order, hence key=value."""
    out = node_sh(sandbox, host, f"systemctl show -p ActiveState,NRestarts,ExecMainStartTimestampMonotonic {unit}")
    props = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return {"active": props["ActiveState"], "restarts": int(props["NRestarts"]),
            "started": int(props["ExecMainStartTimestampMonotonic"])}


def wait_for(what, check, timeout=90.0, interval=0.5):
    """Poll until check() is truthy; a server that is not listening yet is "not yet", not a failure."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except httpx.TransportError as exc:  # restarting: the port is closed for a moment
            value, last_error = None, exc
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what} (last error: {last_error})")
