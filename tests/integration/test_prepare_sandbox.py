"""playbooks/prepare.yml on a gb300-pd sandbox (podman hosts with systemd, no GPU, no RDMA): it converges
with the hardware steps skipped and the reasons printed, a second run changes nothing, --check runs and
changes nothing, the IMEX nodes config is identical on every tray, the model is staged and verified; and
`k31 preflight` refuses GPU-less hosts with every failure of every host in one message."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import recaps
import yaml

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NAME = f"prep{os.getpid()}"
TRAYS = ["prefill0-t0", "prefill0-t1", "decode0-t0", "decode0-t1"]
BIN = Path(sys.executable).parent
# The sandbox has no GPUs; the lead's sandbox inventory will carry k31_preflight_require_gpu=false itself.
EXTRA = {
    "k31_preflight_require_gpu": False,
    "k31_model_path": "/opt/k31/models/tiny",
    "k31_model_source": "path",
    "k31_model_source_dir": "/srv/k31-src/tiny",
    "k31_model_verify": "sha256",
    "k31_model_poll": 1,
}
K31 = [sys.executable, "-m", "k31deploy.cli"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    return {**os.environ, "K31_STATE_DIR": str(state), "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
            "PYTHONPATH": str(ROOT), "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "ANSIBLE_DEPRECATION_WARNINGS": "False", "ANSIBLE_NOCOLOR": "1"}


@pytest.fixture(scope="module")
def inventory(env):
    up = subprocess.run([*K31, "sandbox", "up", "--shape", "gb300-pd", "--name", NAME], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
    try:
        assert up.returncode == 0, up.stderr
        inv = Path(up.stdout.strip().splitlines()[-1])
        seed = ("mkdir -p /srv/k31-src/tiny/sub && cd /srv/k31-src/tiny && head -c 200000 /dev/urandom > "
                "model-00001-of-00001.safetensors && echo '{}' > config.json && echo tok > sub/tokenizer.json && "
                "sha256sum model-00001-of-00001.safetensors config.json sub/tokenizer.json > SHA256SUMS")
        made = adhoc(env, inv, "k31_prefill:k31_decode", "shell", seed)
        assert made.returncode == 0, made.stdout
        yield inv
    finally:
        subprocess.run([*K31, "sandbox", "down", "--name", NAME], env=env, cwd=ROOT, capture_output=True,
                       timeout=300)


def adhoc(env, inv, pattern, module, arg):
    return subprocess.run([str(BIN / "ansible"), pattern, "-i", str(inv), "-m", module, "-a", arg], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def playbook(env, inv, name, *args):
    t0 = time.monotonic()
    proc = subprocess.run([str(BIN / "ansible-playbook"), "-i", str(inv), f"playbooks/{name}",
                           "-e", json.dumps(EXTRA), *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    print(f"{name} {' '.join(args)}: {time.monotonic() - t0:.1f} s")
    return proc, recaps.recap(proc.stdout)


def files(env, inv, path):
    """The file's content on each tray."""
    proc = adhoc(env, inv, "k31_prefill:k31_decode", "command", f"cat {path}")
    out = {}
    for block in re.split(r"^(?=[\w.-]+ \| )", proc.stdout, flags=re.M):
        head, _, body = block.partition("\n")
        if " | " in head:
            out[head.split(" | ")[0]] = body.strip()
    return out


def test_prepare_converges_idempotent_and_check_mode(env, inventory):
    first, recap = playbook(env, inventory, "prepare.yml")
    assert first.returncode == 0, first.stdout[-4000:]
    assert set(recap) >= {*TRAYS, "router0"}
    assert all(r["failed"] == 0 and r["unreachable"] == 0 for r in recap.values())
    assert all(recap[h]["changed"] > 0 for h in TRAYS)                  # model, env and IMEX files written
    out = " ".join(first.stdout.replace("''", "'").split())          # the YAML callback folds long messages
    # Hardware steps skipped, each with its reason.
    assert "SKIP prefill0-t0 | gpu_count, gpu_model, gpu_memory, gpu_driver, cuda_version" in out
    assert "k31_preflight_require_gpu is false" in out
    assert "skipped: nothing on this host runs from the serving image" in out
    assert "no container runtime needed" in out
    assert "skipped: no RDMA devices on this host" in out
    assert "skipped: this host cannot raise resource limits (no CAP_SYS_RESOURCE" in out
    assert "skipped: no NVIDIA IMEX support on this host" in out
    assert "skipped: draft: its path in the plan is not a local directory" in out

    second, recap2 = playbook(env, inventory, "prepare.yml")
    assert second.returncode == 0, second.stdout[-4000:]
    assert {h: r["changed"] for h, r in recap2.items()} == dict.fromkeys(recap2, 0)

    check, recap3 = playbook(env, inventory, "prepare.yml", "--check")
    assert check.returncode == 0, check.stdout[-4000:]
    assert {h: r["changed"] for h, r in recap3.items()} == dict.fromkeys(recap3, 0)

    hosts = yaml.safe_load(Path(inventory).read_text())["all"]["children"]
    ips = [hosts[group]["hosts"][h]["ansible_host"] for group in ("k31_prefill", "k31_decode")
           for h in hosts[group]["hosts"]]
    nodes = files(env, inventory, "/etc/nvidia-imex/nodes_config.cfg")
    assert set(nodes) == set(TRAYS)
    assert {text for text in nodes.values()} == {"\n".join(ips)}        # identical on every tray, plan order
    config = files(env, inventory, "/etc/nvidia-imex/config.cfg")
    assert all("IMEX_NODE_CONFIG_FILE=/etc/nvidia-imex/nodes_config.cfg" in c and "SERVER_PORT=50000" in c
               for c in config.values())
    mnnvl = files(env, inventory, "/etc/k31/mnnvl.env")
    assert all("NCCL_MNNVL_ENABLE=1" in e and "MC_FORCE_MNNVL=True" in e for e in mnnvl.values())
    rdma = files(env, inventory, "/etc/k31/rdma.env")
    advertised = {h: re.search(r"^SGLANG_HOST_IP=(\S+)$", e, re.M)[1] for h, e in rdma.items()}
    assert advertised == dict(zip(TRAYS, ips, strict=True))
    staged = adhoc(env, inventory, "k31_prefill:k31_decode", "shell",
                   "cd /opt/k31/models/tiny && sha256sum --quiet -c SHA256SUMS && cat /etc/k31/model.env")
    assert staged.returncode == 0 and staged.stdout.count("HF_HUB_OFFLINE=1") == len(TRAYS), staged.stdout

    report = json.loads((Path(env["K31_STATE_DIR"]) / "preflight.json").read_text())
    assert report["ok"] and set(report["hosts"]) == {*TRAYS, "router0"}
    assert report["hosts"]["prefill0-t0"]["facts"]["os"].startswith("Debian GNU/Linux 12")


def test_preflight_refuses_gpu_less_hosts_with_every_failure(env, inventory):
    """`k31 preflight --json` with GPUs required: every tray fails, all named in one refusal."""
    proc = subprocess.run([*K31, "preflight", "-i", str(inventory), "--json",
                           "-e", "k31_preflight_require_gpu=true"], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode != 0
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["type"] == "summary" and summary["status"] == "failed"
    (refusal,) = [f["message"] for f in summary["failed_tasks"] if f["task"].startswith("Refuse hosts")]
    for tray in TRAYS:
        assert (f"FAIL {tray} | gpu_count: found nvidia-query: not installed; expected 4 GPUs per GB300 NVL72 tray"
                in refusal)
    assert "router0" not in refusal                                     # no engine there: nothing to refuse
    report = json.loads((Path(env["K31_STATE_DIR"]) / "preflight.json").read_text())
    assert not report["ok"] and {f["host"] for f in report["failures"]} == set(TRAYS)
