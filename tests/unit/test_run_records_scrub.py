"""Run records keep no secret, also for a run whose driver was killed before it scrubbed (the next run does
it), and private files (`k31 logs`) are 0600 in directories k31 makes 0700."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from recipe_helpers import plan as resolve_plan

from k31deploy.oncall import gather
from k31deploy.runner import records

TOKEN = "hf_RecordToken4f1a"
KEY = "rk-RouterKey-8b2c"
JSONKEY = 'k"q\\x-9912'  # written JSON-escaped in event files


def killed_run(root: Path, name: str = "20261130-101010-000001-deploy") -> Path:
    """A run directory as ansible-runner leaves it when its driver is SIGKILLed mid-run."""
    run = root / name
    art = run / "artifacts" / name
    (art / "job_events").mkdir(parents=True)
    (run / "env").mkdir()
    (run / "env" / "settings").write_text("{}")
    (run / "env" / "extravars").write_text(f"k31_router_api_key: {KEY}\n")
    (run / "env" / "passwords").write_text('{"^Vault password:": "pw-123456"}')
    (art / "command").write_text(json.dumps({
        "command": ["ansible-playbook", "-e", f"k31_router_api_key={KEY} other=plain",
                    "-e", json.dumps({"k31_engine_hf_token": JSONKEY}), "-e", "@/site/secrets.yml", "deploy.yml"],
        "cwd": "/repo",
        "env": {"HF_TOKEN": TOKEN, "HOME": "/root", "ANSIBLE_CONFIG": "/repo/ansible.cfg", "PYTHONPATH": "/repo"},
    }))
    (art / "job_events" / "1-abc.json").write_text(json.dumps({"stdout": f"EXEC sh -c 'HF_TOKEN={TOKEN} python'",
                                                                "key": JSONKEY}))
    (art / "stdout").write_text(f"<host> EXEC K={KEY}\n")
    return run


def everything(root: Path) -> bytes:
    return b"".join(p.read_bytes() for p in root.rglob("*") if p.is_file())


def test_a_killed_run_is_scrubbed_of_every_secret_it_recorded(tmp_path):
    run = killed_run(tmp_path)
    records.scrub_run(run, {"PYTHONPATH"})
    data = everything(run)
    for secret in (TOKEN, KEY, JSONKEY, json.dumps(JSONKEY)[1:-1], "pw-123456"):
        assert secret.encode() not in data, secret
    assert sorted(p.name for p in (run / "env").iterdir()) == ["settings"]
    command = json.loads((run / "artifacts" / run.name / "command").read_text())
    assert command["scrubbed"] is True and command["env_names"] == ["HF_TOKEN", "HOME"]
    assert command["command"][-2:] == ["@/site/secrets.yml", "deploy.yml"]
    event = json.loads((run / "artifacts" / run.name / "job_events" / "1-abc.json").read_text())
    assert event == {"stdout": "EXEC sh -c 'HF_TOKEN=<redacted> python'", "key": "<redacted>"}
    assert (run / records.SCRUBBED).exists()
    # A second scrub finds nothing more to do and changes nothing.
    before = everything(run)
    records.scrub_run(run, {"PYTHONPATH"})
    assert everything(run) == before


def test_the_next_run_scrubs_what_killed_runs_left_and_only_those(tmp_path):
    killed = killed_run(tmp_path)
    done = killed_run(tmp_path, "20261130-101011-000002-deploy")
    (done / records.SCRUBBED).write_text("")
    other = tmp_path / "notes"
    other.mkdir()
    (other / "command").write_text(TOKEN)
    assert records.scrub_leftovers(tmp_path, set()) == [killed]
    assert TOKEN.encode() not in everything(killed)
    assert TOKEN.encode() in everything(done)  # marked scrubbed: left as it is
    assert (other / "command").read_text() == TOKEN  # not a run directory
    assert records.scrub_leftovers(tmp_path / "absent", set()) == []


def test_a_command_record_cut_short_by_the_kill_is_replaced(tmp_path):
    (tmp_path / "command").write_text('{"command": ["ansible-playbook"], "env": {"HF_TOKEN": "hf_cut')
    assert records.scrub_command_file(tmp_path, set()) == set()
    assert json.loads((tmp_path / "command").read_text())["scrubbed"] is True


@pytest.mark.parametrize(("argv", "found"), [
    (["-e", f"k31_router_api_key={KEY}"], {KEY}),
    ([f"--extra-vars={json.dumps({'hf_token': TOKEN, 'k31_agents': 92})}"], {TOKEN}),
    (["-e", "@secrets.yml", "-e", "k31_agents=92"], set()),
    (["-e", "k31_router_api_key=short"], set()),  # too short to search for
    (["-e", "{not json"], set()),
])
def test_inline_extra_vars_that_name_a_secret_give_its_value(argv, found):
    assert records.inline_secrets(["ansible-playbook", *argv]) == found


def test_private_files_are_0600_in_directories_made_0700(tmp_path):
    old = os.umask(0o022)
    try:
        made = records.private_dir(tmp_path / "logs" / "20261130")
        path = records.write_private(made / "k31-router.log", "journal")
        existing = tmp_path / "open.log"
        existing.write_text("x")
        existing.chmod(0o644)
        records.write_private(existing, "y")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "logs").stat().st_mode) == 0o700
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_text() == "journal"
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600 and existing.read_text() == "y"
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    records.private_dir(shared)  # a folder the operator named and made is left as it is
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755


def test_k31_logs_writes_each_unit_0600_into_a_0700_folder(tmp_path):
    plan = resolve_plan(platform="mi355x", agents=48, router="none")
    rank = plan["servers"][0]["ranks"][0]

    def fake_runner(inventory, source, hosts, become):
        return {rank["host"]: {"logs": {rank["unit"]: "line 1\n"}}}

    old = os.umask(0o022)
    try:
        out = gather.logs(plan, ["inv"], None, 50, tmp_path / "logs" / "t1", runner=fake_runner)
    finally:
        os.umask(old)
    [path] = [Path(p) for p in out["files"]]
    assert path.read_text() == "line 1\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.parent.stat().st_mode) == 0o700


def test_the_standin_records_that_a_secret_arrived_not_its_value(tmp_path, monkeypatch):
    from k31deploy.standin import server

    assert server.SECRET_ENV.pattern == records.SECRET_NAME.pattern
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("SGLANG_USE_AITER", "1")
    out = tmp_path / "k31-decode0-r0.standin.json"
    server.record(["--port", "30100"], str(out))
    recorded = json.loads(out.read_text())
    assert recorded["env"]["HF_TOKEN"] == "<redacted>" and recorded["env"]["SGLANG_USE_AITER"] == "1"
    assert TOKEN not in out.read_text()
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
