"""A run record whose driver was killed with SIGKILL mid-run (no finally runs) still holds the whole
environment ansible-runner recorded; the next k31 run scrubs it before doing anything else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cmdline_watch import running
from site_secrets import write_site_vars

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SLOW = REPO / "tests" / "integration" / "playbooks" / "slow.yml"
TOKEN = "hf_KilledDriverToken2b7d"
SLEEP = [b"sleep", b"31.5"]  # slow.yml's task
DRIVER = """
import sys
from pathlib import Path
from k31deploy.runner import PlainView, RunRequest, run
request = RunRequest(command="deploy", playbook=Path(sys.argv[1]), inventories=[sys.argv[2]])
sys.exit(run(request, PlainView()).exit_code)
"""


def test_the_next_run_scrubs_the_record_of_a_killed_driver(tmp_path):
    state = tmp_path / "state"
    env = {**os.environ, "K31_STATE_DIR": str(state), "ANSIBLE_NOCOLOR": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    (tmp_path / "two.ini").write_text("".join(f"host-{h} ansible_connection=local ansible_python_interpreter="
                                              f"{sys.executable}\n" for h in "ab"))
    before = running(SLEEP)
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(SLOW), "two.ini"], cwd=tmp_path,
                            env={**env, "HF_TOKEN": TOKEN}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    try:
        for line in proc.stdout:  # the first task done: the sleep is under way
            if "| Gate before the slow step | ok" in line:
                break
        [killed] = list((state / "runs").iterdir())
        command = killed / "artifacts" / killed.name / "command"
        assert TOKEN in command.read_text()  # what the runner records before the playbook starts
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        time.sleep(1)
        for pid in running(SLEEP) - before:  # orphaned by the kill; stopped by PID
            os.kill(pid, signal.SIGTERM)
    assert not (killed / ".scrubbed").exists()

    # Any later k31 run, here one that only validates (the token is no longer in its environment).
    (tmp_path / "hosts.ini").write_text(
        f"[k31_unified]\nlocalhost ansible_connection=local ansible_python_interpreter={sys.executable}\n\n"
        "[all:vars]\nk31_platform=mi355x\nk31_agents=32\nk31_model_path=/models/Kimi-K3.1-Pro\n"
        "k31_image=rocm/sglang:kimi-k31\n")
    write_site_vars(tmp_path)
    later = subprocess.run([sys.executable, "-m", "k31deploy.cli", "deploy", "-i", "hosts.ini", "--tags", "always"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert later.returncode == 0, later.stdout[-3000:] + later.stderr[-2000:]
    assert (killed / ".scrubbed").exists()
    leftovers = [str(p) for p in killed.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]
    assert leftovers == []
    assert "HF_TOKEN" in command.read_text()  # the name stays, the value went
    assert all(TOKEN.encode() not in p.read_bytes() for p in state.rglob("*") if p.is_file())
