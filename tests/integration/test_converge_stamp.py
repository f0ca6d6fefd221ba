"""A deploy that would change nothing skips the host plays, and one that would change something runs whole
(roles/k31_stamp, k31deploy/stamp.py), on the sandbox 1P1D with the real `k31 deploy`.

Asserted: the first deploy records a stamp on every host (0600); the next one takes the short path (no host task
beyond the stamp read, smoke still passes, changed=0) and is several times faster; a hand edit on one host and a
stopped unit on another make the next deploy whole (run under `--mitogen`), name both hosts, and repair both;
`--check` on a settled fleet predicts nothing; `k31 deploy --full` runs every play anyway and changes nothing.
A host certificate reissued by a run that stopped before the router's play restarts the router at the next deploy.
`k31 redeploy decode0 --mitogen` takes over a lost run's expired lock and restarts decode0, then prefill0 (the PD
rule): under Mitogen a raw command's output comes back through a tty, CR LF line ends included. On the settled
fleet that plain restart renders nothing (the stamp says the live files are what it would render), and leaves the
fleet settled: the next deploy takes the short path.

Needs root, podman, runc and debootstrap.
"""

from __future__ import annotations

import json
import os

import pytest
from recaps import changed, recap
from sandbox_cli import SHORT, SMOKE, cli_env, k31, node_sh, playbook, sandbox_up, unit_state
from sandbox_cli import deploy as sandbox_deploy

pytestmark = pytest.mark.integration

NAME = f"stamp-{os.getpid()}"
HOSTS = ("prefill0", "decode0", "router0")
ENGINE_GATE = "Wait for rank 0 to answer /health"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    env = cli_env(tmp_path_factory.mktemp("state"))
    with sandbox_up(env, NAME, "--shape", "mi355x-1p1d") as inventory:
        yield env, inventory


def deploy(env, inventory, *args):
    proc, seconds = sandbox_deploy(env, inventory, *args)
    return proc.stdout, seconds


def test_a_deploy_that_would_change_nothing_skips_the_host_plays_and_drift_makes_it_whole(cluster):
    env, inventory = cluster
    out, fresh_s = deploy(env, inventory)
    assert SHORT not in out and "no record of a whole deploy" in out
    for host in HOSTS:
        stamp = json.loads(node_sh(NAME, host, "cat /var/lib/k31/converged.json"))
        assert set(stamp) == {"inputs", "state"}, stamp
        assert node_sh(NAME, host, "stat -c %a /var/lib/k31/converged.json").strip() == "600"

    out, short_s = deploy(env, inventory)
    assert SHORT in out, out[-3000:]
    assert set(HOSTS) <= set(changed(out)) and not any(changed(out).values()), changed(out)
    assert SMOKE in out                           # the smoke checks still run through the router
    assert ENGINE_GATE not in out
    assert all(recap(out)[h]["ok"] <= 5 for h in HOSTS), recap(out)
    print(f"fresh deploy {fresh_s:.1f} s, short no-op {short_s:.1f} s ({short_s / fresh_s:.2f})")
    assert short_s < fresh_s / 3

    out = deploy(env, inventory, "--check")[0]
    assert SHORT in out and set(HOSTS) <= set(changed(out)) and not any(changed(out).values())

    # Drift on two hosts: a hand edit of an env file, a stopped router. The next deploy is whole and repairs both.
    env_file = "/etc/k31/k31-prefill0-r0.env"
    node_sh(NAME, "prefill0", f"echo '# hand edit' >> {env_file}")
    node_sh(NAME, "router0", "systemctl stop k31-router")
    out = deploy(env, inventory, "--mitogen")[0]      # the whole deploy under Mitogen's strategy, through k31
    assert SHORT not in out
    for host in ("prefill0", "router0"):
        assert f"{host}: its files, units, firewall or images changed since its last whole deploy" in out
    assert "decode0: its files" not in out
    assert "hand edit" not in node_sh(NAME, "prefill0", f"cat {env_file}")
    assert node_sh(NAME, "router0", "systemctl is-active k31-router").strip() == "active"

    assert SHORT in deploy(env, inventory)[0]
    out = deploy(env, inventory, "--full")[0]
    assert SHORT not in out and "k31_stamp_check is false" in out and ENGINE_GATE in out
    assert set(HOSTS) <= set(changed(out)) and not any(changed(out).values()), changed(out)


def test_a_certificate_reissued_by_a_run_that_stopped_early_restarts_the_router_at_the_next_deploy(cluster):
    """k31_pki issues the host certificate in the prepare play; the router serves with it from a later play. A run
    that stops in between (here: only k31_pki's tasks run, as a Ctrl-C there leaves the hosts) must not leave the
    router on the old certificate: the next deploy restarts it, and the one after restarts nothing."""
    env, inventory = cluster
    cert = "/etc/k31/pki/host.crt"
    node_sh(NAME, "router0", f"rm {cert}")
    before = unit_state(NAME, "router0", "k31-router")
    proc = playbook(env, inventory, "deploy.yml", "--tags", "k31_pki")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "router0: host certificate issued" in proc.stdout
    assert unit_state(NAME, "router0", "k31-router")["started"] == before["started"]

    out = deploy(env, inventory)[0]
    assert SHORT not in out and SMOKE in out
    after = unit_state(NAME, "router0", "k31-router")
    assert after["active"] == "active" and after["started"] > before["started"], (before, after)
    digest = node_sh(NAME, "router0", f"sha256sum {cert}").split()[0]
    assert f"# Serves with (a change restarts it): {digest}  {cert}" in node_sh(
        NAME, "router0", "cat /etc/systemd/system/k31-router.service")

    out = deploy(env, inventory)[0]
    assert SHORT in out
    assert unit_state(NAME, "router0", "k31-router")["started"] == after["started"]


def test_a_redeploy_under_mitogen_reads_the_lock_and_restarts_decode_then_prefill(cluster):
    env, inventory = cluster
    # A lost run's lock, long expired: the redeploy judges it stale from what it read and takes it over only if
    # the lock host still holds exactly that (a byte-for-byte comparison a CR would break).
    lost = {"id": "lost-run", "controller": "elsewhere", "pid": 1, "started": 0, "expires": 1,
            "what": "k31 redeploy of decode0"}
    node_sh(NAME, "router0", f"mkdir -p /run/k31 && echo {json.dumps(json.dumps(lost))} > /run/k31/redeploy.lock")
    before = {h: unit_state(NAME, h, f"k31-{h}-r0")["started"] for h in ("decode0", "prefill0")}
    proc = k31(env, "redeploy", "decode0", "-i", str(inventory), "--mitogen")
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert "its lock on router0 expired" in proc.stdout and "unreadable" not in proc.stdout
    for host in ("decode0", "prefill0"):
        assert f"{host} is as its last whole deploy left it, with this run's inputs: nothing to render" in proc.stdout
    after = {h: unit_state(NAME, h, f"k31-{h}-r0")["started"] for h in ("decode0", "prefill0")}
    assert before["decode0"] < after["decode0"] < after["prefill0"], (before, after)
    assert node_sh(NAME, "router0", "test -e /run/k31/redeploy.lock && echo held || echo released").strip() == \
        "released"
    assert SHORT in deploy(env, inventory)[0]    # the restart left every host as the last whole deploy did
