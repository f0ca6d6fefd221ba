"""`k31 deploy` and friends through ansible-runner, for real, on localhost (ansible_connection=local):
the same effect as ansible-playbook, the run record, refusals naming host and task, Ctrl-C / cancel with
what was left undone, --json lines, and no extra vars or vault passwords left on disk.

The CLI runs as `python -m k31deploy.cli` (k31deploy.commands.ops in COMMAND_MODULES); the cancel tests
drive k31deploy.runner directly, since only they may run the test-only playbooks in playbooks/ here.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cmdline_watch import running
from recaps import recap
from site_secrets import write_site_vars

from k31deploy.runner import PlainView, RunRequest, run

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
PLAYBOOKS = Path(__file__).parent / "playbooks"
BIN = Path(sys.executable).parent
VALIDATE_TASK = "Refuse an invalid setup before any host is touched"
SLEEP = [b"sleep", b"31.5"]  # slow.yml's task, recognisable among the machine's processes


def single_node_inventory(extra: str = "") -> str:
    # No draft_model_path: the recipe then warns, which both ways of running must show alike.
    return (f"[k31_unified]\nlocalhost ansible_connection=local ansible_python_interpreter={sys.executable}\n\n"
            "[all:vars]\nk31_platform=mi355x\nk31_agents=32\nk31_model_path=/models/Kimi-K3.1-Pro\n"
            f"k31_image=rocm/sglang:kimi-k31\n{extra}\n")


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A scratch directory to run from, its own state dir, and the environment for subprocesses."""
    state = tmp_path / "state"
    monkeypatch.setenv("K31_STATE_DIR", str(state))
    monkeypatch.chdir(tmp_path)
    path = os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)
    env = {**os.environ, "K31_STATE_DIR": str(state), "PYTHONPATH": path, "ANSIBLE_NOCOLOR": "1"}
    (tmp_path / "hosts.ini").write_text(single_node_inventory())
    write_site_vars(tmp_path)    # the unified engine serves clients: its keys and the cluster CA
    return tmp_path, state, env


def k31(*args: str, env: dict, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    # A session of its own: no controlling terminal, so --ask-vault-pass reads stdin.
    return subprocess.run([sys.executable, "-m", "k31deploy.cli", *args], env=env, cwd=cwd, input=stdin,
                          capture_output=True, text=True, timeout=180, start_new_session=True)


def ansible_playbook(*args: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    env = {**env, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}
    return subprocess.run([str(BIN / "ansible-playbook"), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=180)


def runs(state: Path) -> list[Path]:
    return sorted((state / "runs").iterdir())


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def result_after(output: str, task: str) -> dict:
    """The JSON result ansible-playbook printed for `task` (ANSIBLE_CALLBACK_RESULT_FORMAT=json)."""
    start = output.index(f"TASK [{task}]")
    return json.JSONDecoder().raw_decode(output, output.index("=> ", start) + 3)[0]


@pytest.fixture
def no_stray_sleepers():
    before = running(SLEEP)
    yield
    time.sleep(1)  # a task a killed worker was still starting shows up late
    stray = running(SLEEP) - before
    for pid in stray:  # left by a failing cancel; stopped by PID
        os.kill(pid, signal.SIGTERM)
    assert not stray, f"cancelled tasks left running: {sorted(stray)}"


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()]


# (a) the same effect as ansible-playbook ----------------------------------------------------------

def test_deploy_matches_ansible_playbook_and_writes_its_record(work):
    cwd, state, env = work
    # --tags always: the validation plays only (tagged always, as kubespray does), so localhost is not deployed to.
    ours = k31("deploy", "-i", "hosts.ini", "--tags", "always", env=env, cwd=cwd)
    theirs = ansible_playbook("-i", "hosts.ini", str(REPO / "deploy.yml"), "--tags", "always", env=env, cwd=cwd)
    assert theirs.returncode == 0, theirs.stdout + theirs.stderr
    assert ours.returncode == 0, ours.stdout + ours.stderr
    [run_dir] = runs(state)
    summary = summary_of(run_dir)
    assert summary["status"] == "successful" and summary["rc"] == 0 and summary["command"] == "deploy"
    assert summary["playbook"] == str(REPO / "deploy.yml") and summary["inventory"] == [str(cwd / "hosts.ini")]
    assert summary["hosts"] == recap(theirs.stdout)
    [shown] = [m["msg"] for m in summary["messages"] if m["task"] == "Show what the recipe says about this setup"]
    assert shown == result_after(theirs.stdout, "k31_validate : Show what the recipe says about this setup")["msg"]
    assert "localhost | Show what the recipe says about this setup | ok | " in ours.stdout
    assert (run_dir / "artifacts" / run_dir.name / "job_events").is_dir()
    assert "k31 deploy: successful" in ours.stderr and str(run_dir) in ours.stderr


def test_the_plan_resolved_through_k31_is_the_plan_ansible_playbook_resolves(work):
    cwd, _, env = work
    outcome = run(RunRequest(command="deploy", playbook=PLAYBOOKS / "plan.yml", inventories=["hosts.ini"]),
                  PlainView(io.StringIO(), io.StringIO()))
    assert outcome.exit_code == 0
    [ours] = [m["msg"] for m in outcome.summary["messages"] if m["task"] == "Show the plan"]
    theirs = ansible_playbook("-i", "hosts.ini", str(PLAYBOOKS / "plan.yml"), env=env, cwd=cwd)
    assert theirs.returncode == 0, theirs.stdout
    assert ours == result_after(theirs.stdout, "Show the plan")
    plan = ours["k31_validate_plan"]
    assert plan["platform"] == "mi355x" and plan["servers"][0]["ranks"][0]["host"] == "localhost"


# (b) a refused inventory names host, task and sentence --------------------------------------------

@pytest.mark.parametrize(("knob", "sentence"), [
    ("k31_kv_offload=floppy", "error: kv_offload=floppy (inventory) is not valid"),
    ("k31_kv_ofload=none", "error: unknown inventory variable 'k31_kv_ofload' on host localhost"),
])
def test_a_bad_knob_fails_naming_host_task_and_error(work, knob, sentence):
    cwd, state, env = work
    (cwd / "bad.ini").write_text(single_node_inventory(knob))
    ours = k31("deploy", "-i", "bad.ini", env=env, cwd=cwd)
    theirs = ansible_playbook("-i", "bad.ini", str(REPO / "deploy.yml"), env=env, cwd=cwd)
    assert ours.returncode != 0 and ours.returncode == theirs.returncode
    summary = summary_of(runs(state)[-1])
    assert summary["status"] == "failed" and summary["rc"] == theirs.returncode
    [failure] = summary["failed_tasks"]
    assert (failure["host"], failure["task"]) == ("localhost", VALIDATE_TASK)
    assert failure["message"].startswith(sentence)
    assert failure["message"] == result_after(theirs.stdout, f"k31_validate : {VALIDATE_TASK}")["msg"]
    assert f"failed: localhost | {VALIDATE_TASK}: {sentence}" in ours.stderr


def test_input_errors_exit_2_with_one_line(work):
    cwd, state, env = work
    missing = k31("deploy", "-i", "nope.ini", env=env, cwd=cwd)
    assert missing.returncode == 2
    assert missing.stderr.splitlines() == [
        "error: inventory nope.ini does not exist; give the path to an existing file"]
    no_vars = k31("deploy", "-i", "hosts.ini", "-e", "@nope.yml", env=env, cwd=cwd)
    assert no_vars.returncode == 2 and no_vars.stderr.splitlines() == [
        "error: extra vars file nope.yml does not exist; give the path to an existing file"]
    assert not (state / "runs").exists()  # refused before any run started


# (c) cancel ----------------------------------------------------------------------------------------

def two_local_hosts(cwd: Path) -> str:
    (cwd / "two.ini").write_text("".join(f"host-{h} ansible_connection=local ansible_python_interpreter="
                                         f"{sys.executable}\n" for h in "ab"))
    return "two.ini"


def test_a_cancelled_run_stops_and_records_what_was_left_undone(work, no_stray_sleepers):
    cwd, _, _ = work
    cancel = threading.Event()
    timer = threading.Timer(2.0, cancel.set)
    timer.start()
    started = time.monotonic()
    try:
        outcome = run(RunRequest(command="deploy", playbook=PLAYBOOKS / "slow.yml", inventories=[two_local_hosts(cwd)]),
                      PlainView(io.StringIO(), io.StringIO()), cancel)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 20  # not the 31.5 s the task sleeps
    assert outcome.exit_code == 130
    summary = summary_of(outcome.run_dir)
    assert summary == outcome.summary
    assert summary["cancelled"] is True and summary["status"] == "cancelled"
    undone = summary["undone"]
    assert {"play": "Slow play", "task": "Wait for the slow step", "hosts": ["host-a", "host-b"]} in undone["tasks"]
    assert undone["plays"] == ["Slow play"] and undone["hosts_without_recap"] == ["host-a", "host-b"]
    assert summary["hosts"]["host-a"]["ok"] == 1


CTRL_C_DRIVER = """
import sys
from pathlib import Path
from k31deploy.runner import PlainView, RunRequest, run
request = RunRequest(command="deploy", playbook=Path(sys.argv[1]), inventories=[sys.argv[2]])
sys.exit(run(request, PlainView()).exit_code)
"""


def test_ctrl_c_cancels_through_the_runner_and_exits_130(work, no_stray_sleepers):
    cwd, state, env = work
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_DRIVER, str(PLAYBOOKS / "slow.yml"), two_local_hosts(cwd)],
                            env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # the first task done: the sleep is under way
            if "| Gate before the slow step | ok" in line:
                break
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "cancelling" in err
    assert "cancelled: stopped at play 'Slow play', task 'Wait for the slow step' on host-a, host-b" in err
    summary = summary_of(runs(state)[-1])
    assert summary["cancelled"] is True and summary["undone"]["hosts_without_recap"] == ["host-a", "host-b"]


# (d) --json ----------------------------------------------------------------------------------------

def test_json_output_parses_line_by_line(work):
    cwd, state, env = work
    result = k31("deploy", "-i", "hosts.ini", "--tags", "always", "--json", env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0]["type"] == "start" and lines[-1]["type"] == "summary"
    assert lines[-1]["status"] == "successful" and lines[-1] == summary_of(runs(state)[-1]) | {"type": "summary"}
    oks = [e for e in lines if e["type"] == "runner_on_ok"]
    assert oks and all(e["host"] == "localhost" and e["status"] in ("ok", "changed") for e in oks)
    assert any(e["task"] == VALIDATE_TASK for e in oks)
    counters = [e["counter"] for e in lines[1:-1]]
    assert counters == sorted(counters)


# secrets ---------------------------------------------------------------------------------------------

def test_no_extra_vars_or_vault_password_left_on_disk(work):
    cwd, state, env = work
    token, password = "hf_Zq81TokenOnlyOnTheCommandLine", "vault-pw-Rj4"
    # --ask-vault-pass: ansible-playbook prompts, the runner answers from memory.
    result = k31("deploy", "-i", "hosts.ini", "--tags", "always", "-e", f"test_hf_token={token}",
                 "--ask-vault-pass", env=env, cwd=cwd, stdin=password + "\n")
    assert result.returncode == 0, result.stderr
    run_dir = runs(state)[-1]
    assert sorted(p.name for p in (run_dir / "env").iterdir()) == ["settings"]
    for path in files_under(run_dir):
        data = path.read_bytes()
        assert token.encode() not in data and password.encode() not in data, path
    assert password not in result.stdout + result.stderr


@pytest.mark.parametrize("how", ["file", "prompt"])
def test_vaulted_secrets_decrypt_without_being_shown(work, monkeypatch, how):
    cwd, _, env = work
    password, secret = "vault-pw-Tq2", "hf_VaultedSecretValue9"
    (cwd / "vault-pass").write_text(password)
    vaulted = subprocess.run([str(BIN / "ansible-vault"), "encrypt_string", "--vault-password-file", "vault-pass",
                              secret, "--name", "vault_secret"], cwd=cwd, env=env, capture_output=True, text=True,
                             check=True).stdout
    (cwd / "secrets.yml").write_text("---\n" + vaulted)
    vault = {"vault_password_files": ["vault-pass"]} if how == "file" else {"vault_password": password}
    for expect, code in ((secret, 0), ("something else", 2)):
        monkeypatch.setenv("K31_TEST_EXPECT", expect)
        outcome = run(RunRequest(command="deploy", playbook=PLAYBOOKS / "vault.yml", inventories=["hosts.ini"],
                                 extra_vars=["@secrets.yml"], **vault), PlainView(io.StringIO(), io.StringIO()))
        assert outcome.exit_code == code, outcome.summary
        for path in files_under(outcome.run_dir):
            data = path.read_bytes()
            assert secret.encode() not in data and password.encode() not in data, path
