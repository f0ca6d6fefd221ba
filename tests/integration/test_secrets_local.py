"""Secrets in a real `k31 deploy -vvv` on localhost (ansible_connection=local), no sandbox: a vaulted HF token
reaches the hub download (a recording stand-in for the `hf` CLI) through its environment, from a 0600 file, and is
in no process's /proc/<pid>/cmdline while the run lasts, in no file of the run record and in no async job result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cmdline_watch import CmdlineWatch
from site_secrets import write_site_vars

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TOKEN = "hf_k31LocalHubToken7c1e"
FAKE_HF = """#!/bin/sh
# Records what it was started with, then "downloads" (writes config.json into --local-dir).
dest=""; prev=""
for arg in "$@"; do [ "$prev" = "--local-dir" ] && dest="$arg"; prev="$arg"; done
printf '%s\\n' "$HF_TOKEN" > "$K31_FAKE_HF_RECORD.token"
printf '%s\\n' "$@" > "$K31_FAKE_HF_RECORD.argv"
sleep 1
mkdir -p "$dest" && echo '{}' > "$dest/config.json"
"""


def files_holding(root: Path, secret: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_a_vaulted_hf_token_reaches_the_hub_cli_and_no_command_line_or_run_record(tmp_path):
    state, models = tmp_path / "state", tmp_path / "models" / "Kimi-K3.1-Pro"
    hf = tmp_path / "hf"
    hf.write_text(FAKE_HF)
    hf.chmod(0o755)
    (tmp_path / "vault-pass").write_text("vault-pw-Lh3")
    env = {**os.environ, "K31_STATE_DIR": str(state), "ANSIBLE_NOCOLOR": "1",
           "K31_FAKE_HF_RECORD": str(tmp_path / "hf-record"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    vaulted = subprocess.run([str(BIN / "ansible-vault"), "encrypt_string", "--vault-password-file", "vault-pass",
                              TOKEN, "--name", "k31_engine_hf_token"], cwd=tmp_path, env=env, capture_output=True,
                             text=True, check=True).stdout
    (tmp_path / "secrets.yml").write_text("---\n" + vaulted)
    write_site_vars(tmp_path)
    # The hub step reads the token through k31_model_hf_token's default, k31_engine_hf_token.
    (tmp_path / "hosts.ini").write_text(
        "[k31_unified]\n"
        f"localhost ansible_connection=local ansible_python_interpreter={sys.executable} ansible_become=false\n\n"
        "[all:vars]\nk31_platform=mi355x\nk31_agents=32\nk31_image=rocm/sglang:kimi-k31\n"
        f"k31_model_path={models}\nk31_model_source=hub\nk31_model_hub_allowed=true\nk31_model_hub_cli={hf}\n"
        f"k31_model_verify=none\nk31_model_etc_dir={tmp_path / 'etc'}\n")
    with CmdlineWatch(TOKEN) as watch:
        done = subprocess.run([sys.executable, "-m", "k31deploy.cli", "deploy", "-vvv", "-i", "hosts.ini",
                               "--tags", "k31_model", "-e", "@secrets.yml", "--vault-password-file", "vault-pass"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert (models / "config.json").is_file()
    assert (tmp_path / "hf-record.token").read_text().strip() == TOKEN   # delivered
    assert TOKEN not in (tmp_path / "hf-record.argv").read_text()
    # read from a 0600 file, not handed over on stdin: the async download's result (~/.ansible_async) holds no token
    assert (tmp_path / "etc" / "hf-token").stat().st_mode & 0o777 == 0o600
    async_dir = Path.home() / ".ansible_async"
    assert files_holding(async_dir, TOKEN) == [] if async_dir.is_dir() else True
    assert watch.scans > 10 and watch.hits == set()
    [run_dir] = list((state / "runs").iterdir())
    assert "ESTABLISH LOCAL CONNECTION" in (run_dir / "artifacts" / run_dir.name / "stdout").read_text()  # -vvv
    assert files_holding(run_dir, TOKEN) == []
    assert TOKEN not in done.stdout + done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "successful"
