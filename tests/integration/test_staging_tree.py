"""k31_model with k31_model_fanout=tree on a 4-node sandbox: a small synthetic model (random shards, SHA256SUMS) on the
seed node reaches every node round by round (seed -> 1, then 2 sources -> 2), each copy verifies against the
manifest, a re-run changes nothing, and --check on a host that lost a shard reports it would move."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import recaps
from sandbox_cli import cli_env

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NAME = f"stage{os.getpid()}"
BIN = Path(sys.executable).parent
K31 = [sys.executable, "-m", "k31deploy.cli"]
SRC, DEST = "/srv/k31-src/synth", "/opt/k31/models/synth"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    env = {**cli_env(state), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "ANSIBLE_NOCOLOR": "1"}
    up = subprocess.run([*K31, "sandbox", "up", "--nodes", "4", "--name", NAME], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
    try:
        assert up.returncode == 0, up.stderr
        inventory = Path(up.stdout.strip().splitlines()[-1])
        helper = ("import sys; from k31deploy import staging_sandbox as s; s.peer_ssh(sys.argv[1]); "
                  "s.make_model(s.nodes(sys.argv[1])[0], sys.argv[2], 48, files=3)")
        made = subprocess.run([sys.executable, "-c", helper, NAME, SRC], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert made.returncode == 0, made.stderr
        yield env, inventory
    finally:
        subprocess.run([*K31, "sandbox", "down", "--name", NAME], env=env, cwd=ROOT, capture_output=True, timeout=300)


def stage(env, inventory, *args):
    extra = {"k31_model_path": DEST, "k31_model_source": "rsync", "k31_model_source_dir": SRC,
             "k31_model_seed_host": "unified0", "k31_model_verify": "sha256", "k31_model_poll": 1,
             "k31_model_fanout": "tree"}
    began = time.monotonic()
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(inventory), "playbooks/prepare.yml",
                           "--tags", "k31_model", "-e", json.dumps(extra), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    print(f"stage {' '.join(args)}: {time.monotonic() - began:.1f} s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return proc


def node_sh(host: str, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", "exec", f"k31-{NAME}-{host}", "sh", "-c", command], capture_output=True,
                          text=True, timeout=120)


def test_tree_staging_verifies_every_host_and_a_rerun_changes_nothing(sandbox):
    env, inventory = sandbox
    hosts = [f"unified{i}" for i in range(4)]
    first = stage(env, inventory)
    assert "round 1 of 2: from unified0" in first.stdout    # unified1 from the seed
    assert "round 2 of 2: from unified1" in first.stdout    # unified3 from unified1, the first host it served
    for host in hosts:
        checked = node_sh(host, f"cd {DEST} && sha256sum --quiet -c SHA256SUMS && ls /var/lib/k31/verified")
        assert checked.returncode == 0, (host, checked.stdout, checked.stderr)
    again = stage(env, inventory)
    assert recaps.changed(again.stdout) == {"localhost": 0, **dict.fromkeys(hosts, 0)}

    # a lost shard on one host: --check reports it and changes nothing; the next run restores it from a peer
    assert node_sh("unified2", f"rm {DEST}/model-00002-of-00003.safetensors").returncode == 0
    check = stage(env, inventory, "--check")
    assert recaps.changed(check.stdout)["unified2"] == 1
    assert node_sh("unified2", f"test ! -e {DEST}/model-00002-of-00003.safetensors").returncode == 0
    fixed = stage(env, inventory)
    assert "round 1 of 1: from unified0" in fixed.stdout
    assert node_sh("unified2", f"cd {DEST} && sha256sum --quiet -c SHA256SUMS").returncode == 0
