"""Interrupted redeploys recover, on one sandbox of shape mi355x-2p2d (two prefill and two decode stand-in
servers behind the real sglang-router, the k31-pd-follow watchers on the prefill hosts; monitoring=none to keep
the deploy short). Each test interrupts a real `k31 redeploy decode1` once decode1 has restarted -- drained out
of the router, the prefills' watchers held, the PD rule's prefill restarts still owed -- then brings it back:

(a) a lost controller (kill -9 of the whole k31 process group): `k31 status` exits 1 naming the drained
    decode and the held watchers; `k31 status --repair` refuses while a live redeploy holds the lock, then
    restarts both prefills (drained) and re-adds decode1; `k31 status` is clean; a second repair changes nothing;
(b) Ctrl-C (SIGINT to k31): the CLI repairs at once and says so;
(c) a lost controller again, and the next `k31 redeploy` (of a prefill) repairs before its own rollout.

Needs root, podman, runc, debootstrap and the router wheels (built into .k31/wheelhouse when missing).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import sandbox_cli
import yaml
from recaps import changed
from sandbox_cli import REPO, cli_env, k31, node, node_sh, playbook, unit_state

from k31deploy import pki, wheelhouse

pytestmark = pytest.mark.integration

NAME = f"rec-{os.getpid()}"
SHAPE = "mi355x-2p2d"
ENGINES = ("prefill0", "prefill1", "decode0", "decode1")
# The restarted decode loads for a few seconds: the window the interruption lands in.
SLOW_LOAD = ("-e", "k31_engine_standin_load_seconds=3")


def ctr(host):
    return node(NAME, host)


def sh(host, command, check=True):
    return node_sh(NAME, host, command, check)


def write(host, path, text):
    proc = subprocess.run(["podman", "exec", "-i", ctr(host), "sh", "-c", f"cat > {path}"], input=text,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def started(host):
    """When the host's rank-0 unit's main process started (us, on the monotonic clock the sandbox shares)."""
    return unit_state(NAME, host, f"k31-{host}-r0")["started"]


def wait_for(what, check, timeout=90.0, interval=0.3):
    """sandbox_cli.wait_for, polling faster: the interruption must land while decode1 restarts."""
    return sandbox_cli.wait_for(what, check, timeout, interval)


def kill_tree(pid):
    """SIGKILL a process this test started and everything under it (ansible-playbook runs in a session of
    its own, so a process group is not enough), all at once, as a controller that vanished."""
    tree, todo = [], [pid]
    while todo:
        parent = todo.pop()
        tree.append(parent)
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(parent)], capture_output=True, text=True).stdout
        todo += [int(p) for p in out.split()]
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


class Cluster:
    def __init__(self, env, inventory):
        self.env = env
        self.inventory = inventory
        data = yaml.safe_load(inventory.read_text())["all"]["children"]
        self.address = {h: v["ansible_host"] for g in data.values() for h, v in (g or {}).get("hosts", {}).items()}
        self.router = f"http://{self.address['router0']}:8000"
        secrets = yaml.safe_load((inventory.parent / "secrets.yml").read_text())
        self.admin_headers = {"Authorization": "Bearer " + pki.derived_secret(secrets["k31_pki_ca_key"],
                                                                              "router-control-plane")}

    def url(self, host):
        return f"http://{self.address[host]}:{30100 if host.startswith('decode') else 30000}"

    def workers(self):
        listed = httpx.get(f"{self.router}/workers", headers=self.admin_headers, timeout=10).json()["workers"]
        return {w["url"]: w["is_healthy"] for w in listed}

    def all_in_router(self):
        workers = self.workers()
        return set(workers) == {self.url(h) for h in ENGINES} and all(workers.values())

    def holds(self):
        return [h for h in ("prefill0", "prefill1")
                if subprocess.run(["podman", "exec", ctr(h), "test", "-e", "/run/k31/pd-follow.hold"]).returncode == 0]

    def healthy(self, host):
        return httpx.get(self.url(host) + "/health", timeout=3).status_code == 200

    def interrupt_redeploy(self, sig):
        """Start `k31 redeploy decode1` and send `sig` once decode1 restarted (drained, prefills owed a restart,
        watchers held): to k31 alone for SIGINT (Ctrl-C); SIGKILL to k31 and every process under it for a lost
        controller (it takes ansible-playbook and its SSH sessions with it). Returns (process, its output file)."""
        before = started("decode1")
        out = self.inventory.parent / f"redeploy-{sig.name}-{time.monotonic_ns()}.log"
        with out.open("w") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "k31deploy.cli", "redeploy", "decode1",
                                     "-i", str(self.inventory), *SLOW_LOAD], env=self.env, cwd=REPO,
                                    stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for("the redeploy to restart decode1", lambda: started("decode1") > before, timeout=180)
            assert self.url("decode1") not in self.workers()
            assert self.holds() == ["prefill0", "prefill1"]
            if sig == signal.SIGKILL:
                kill_tree(proc.pid)
            else:
                os.kill(proc.pid, sig)
        except BaseException:
            kill_tree(proc.pid)
            raise
        return proc, out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    env = cli_env(state)
    wheelhouse.build("router", REPO / ".k31" / "wheelhouse", wheelhouse.host_arch())
    t0 = time.monotonic()
    proc = k31(env, "sandbox", "up", "--shape", SHAPE, "--name", NAME)
    try:
        assert proc.returncode == 0, proc.stderr
        inventory = Path(proc.stdout.strip().splitlines()[-1])
        # No monitoring here (test_oncall covers it): every command reads the knob from the inventory.
        data = yaml.safe_load(inventory.read_text())
        data["all"]["vars"]["k31_monitoring"] = "none"
        inventory.write_text(yaml.safe_dump(data, sort_keys=False))
        nodes = data["all"]["children"]["k31_router"]["hosts"]
        subnet = ipaddress.ip_network(f"{next(iter(nodes.values()))['ansible_host']}/24", strict=False)
        proc = playbook(env, inventory, "deploy.yml", "-e", json.dumps({"k31_firewall_cluster_sources": [str(subnet)]}))
        assert proc.returncode == 0, proc.stdout[-4000:]
        print(f"sandbox {NAME} deployed in {time.monotonic() - t0:.0f} s")
        cluster = Cluster(env, inventory)
        assert cluster.all_in_router()
        yield cluster
    finally:
        k31(env, "sandbox", "down", "--name", NAME)


def assert_whole_and_pd_rule_kept(cluster):
    assert cluster.all_in_router()
    assert cluster.holds() == []
    decode1 = started("decode1")
    for host in ("prefill0", "prefill1"):
        assert started(host) > decode1, f"{host} did not restart after decode1 (the PD rule)"


def test_a_lost_controller_is_reported_and_repaired(cluster):
    t0 = time.monotonic()
    proc, _ = cluster.interrupt_redeploy(signal.SIGKILL)
    proc.wait(10)
    killed_s = time.monotonic() - t0
    # What the lost run left: decode1 (once loaded) healthy but out of the router, both watchers held.
    wait_for("decode1 to finish loading", lambda: cluster.healthy("decode1"), timeout=60)
    status = k31(cluster.env, "status", "-i", str(cluster.inventory), "--json")
    assert status.returncode == 1
    problems = json.loads(status.stdout)["problems"]
    assert any(p.startswith("decode1: healthy but out of the router (no redeploy is running: k31 status --repair")
               for p in problems), problems
    assert sum("k31-pd-follow held until" in p and "k31 status --repair releases it" in p for p in problems) == 2
    assert json.loads(status.stdout)["redeploy"]["lock"] == "stale"   # its ansible-playbook is gone

    # A redeploy that still runs (here: another controller's lock, not expired) is never fought.
    lock = sh("router0", "cat /run/k31/redeploy.lock")
    other = {**json.loads(lock), "id": "0" * 16, "controller": "elsewhere", "expires": time.time() + 600}
    write("router0", "/run/k31/redeploy.lock", json.dumps(other))
    refused = k31(cluster.env, "status", "--repair", "-i", str(cluster.inventory))
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0
    assert refused.stderr.startswith("error: k31 status --repair refused: k31 redeploy of decode1") and \
        "from elsewhere" in refused.stderr and "ends by itself" in refused.stderr, refused.stderr
    assert cluster.url("decode1") not in cluster.workers() and cluster.holds() == ["prefill0", "prefill1"]
    write("router0", "/run/k31/redeploy.lock", lock)

    t1 = time.monotonic()
    repaired = k31(cluster.env, "status", "--repair", "-i", str(cluster.inventory))
    repair_s = time.monotonic() - t1
    assert repaired.returncode == 0, repaired.stdout[-3000:]
    out = repaired.stdout
    assert "repair: restart prefill0, drained: it started before decode1 last started" in out
    assert "repair: re-add decode1 to the router" in out and "no problems found" in out
    assert "taking over the redeploy lock" in out and "its process is gone" in out
    assert_whole_and_pd_rule_kept(cluster)
    assert sh("router0", "test -e /run/k31/redeploy.lock || echo gone").strip() == "gone"
    # The released watchers find their prefill restarted after decode1 came back: no second restart.
    after = {h: started(h) for h in ENGINES}
    time.sleep(3)
    assert {h: started(h) for h in ENGINES} == after
    assert k31(cluster.env, "status", "-i", str(cluster.inventory)).returncode == 0

    # Nothing left to do: the repair says so and changes nothing (the CLI, and its playbook run directly).
    again = k31(cluster.env, "status", "--repair", "-i", str(cluster.inventory))
    assert again.returncode == 0 and "repair: nothing to repair" in again.stdout
    run = playbook(cluster.env, cluster.inventory, "playbooks/repair.yml")
    assert run.returncode == 0 and changed(run.stdout) and not any(changed(run.stdout).values()), run.stdout[-3000:]
    assert {h: started(h) for h in ENGINES} == after
    print(f"(a) redeploy killed {killed_s:.1f} s in; k31 status --repair brought it back in {repair_s:.1f} s")


def test_b_ctrl_c_repairs_at_once(cluster):
    t0 = time.monotonic()
    proc, out = cluster.interrupt_redeploy(signal.SIGINT)
    assert proc.wait(300) == 130
    took = time.monotonic() - t0
    text = out.read_text()
    print(text[-4000:])
    assert "k31 redeploy: interrupted; bringing back what it left (k31 status --repair -i" in text
    assert "k31 redeploy: repaired: every healthy server is back in the router" in text
    assert_whole_and_pd_rule_kept(cluster)
    assert k31(cluster.env, "status", "-i", str(cluster.inventory)).returncode == 0
    print(f"(b) Ctrl-C'd redeploy and its repair took {took:.1f} s")


def test_c_the_next_redeploy_repairs_first(cluster):
    proc, _ = cluster.interrupt_redeploy(signal.SIGKILL)
    proc.wait(10)
    t0 = time.monotonic()
    before = started("prefill1")
    # A prefill: its rollout has no PD cascade of its own, so what brings decode1 back is the repair.
    nxt = k31(cluster.env, "redeploy", "prefill1", "-i", str(cluster.inventory))
    took = time.monotonic() - t0
    assert nxt.returncode == 0, nxt.stdout[-3000:]
    out = nxt.stdout
    assert "taking over the redeploy lock" in out and "its process is gone" in out
    assert out.index("re-add decode1 to the router") < out.index("prefill1: ok in")
    assert started("prefill1") > before
    assert_whole_and_pd_rule_kept(cluster)
    assert k31(cluster.env, "status", "-i", str(cluster.inventory)).returncode == 0
    print(f"(c) the next redeploy (prefill1) repaired first and rolled in {took:.1f} s")
