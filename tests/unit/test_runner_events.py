"""The `k31 deploy` family's event handling, views, run records and command lines, on runner events
recorded from real runs (tests/unit/fixtures/runner_events/: the job_events of one run each, in counter
order): validate_ok (`k31 deploy --tags always` on an MI355X single-node inventory), validate_bad (the
same with k31_kv_offload=floppy), mixed (tests/integration/playbooks/mixed.yml on two local hosts and an
unreachable one) and cancelled (tests/integration/playbooks/slow.yml, cancelled during its sleep)."""

from __future__ import annotations

import argparse
import io
import json
import os
import threading
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from rich.console import Console

from k31deploy.commands import ops
from k31deploy.errors import K31Error
from k31deploy.runner import driver, records
from k31deploy.runner.events import RunState, json_line, plain_line
from k31deploy.runner.view import JsonView, LiveView, PlainView

FIXTURES = Path(__file__).parent / "fixtures" / "runner_events"
META = {"command": "deploy", "playbook": "/repo/deploy.yml", "inventory": ["/inv/hosts.ini"], "duration": 1.5}


def events(name: str) -> list[dict]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def fold(name: str, *, upto: int | None = None) -> RunState:
    state = RunState()
    for event in events(name)[:upto]:
        state.feed(event)
    return state


# --- event -> state -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["validate_ok", "validate_bad", "mixed"])
def test_live_counts_add_up_to_ansibles_recap(name):
    evs = events(name)
    assert evs[-1]["event"] == "playbook_on_stats"
    state = fold(name, upto=-1)
    live = {host: h.counts for host, h in state.hosts.items()}
    state.feed(evs[-1])
    assert state.stats is not None
    assert live == state.stats


def test_each_result_gets_its_status_and_message():
    lines = [line for e in events("mixed") if (line := plain_line(RunState().feed(e)))]
    assert "host-b | Change something | changed" in lines
    assert "host-a | Skip on purpose | skipped" in lines
    assert "host-a | Fail but carry on | ignored" in lines
    assert "host-a | Gate until the second attempt | retrying" in lines
    assert "host-b | Fail on the second host | failed | second host refuses" in lines
    assert "host-a | Show the host | ok | hello from host-a" in lines
    unreachable = [line for line in lines if line.startswith("host-c | Change something | unreachable | ")]
    assert unreachable and "Connection refused" in unreachable[0]
    # runner_on_start is progress, not a result: no line for it
    assert not any("| started" in line for line in lines)


def test_current_task_and_health_gate_per_host():
    evs = events("mixed")
    retry_at = next(i for i, e in enumerate(evs) if e["event"] == "runner_retry")
    state = fold("mixed", upto=retry_at + 1)
    host = evs[retry_at]["event_data"]["host"]
    assert state.hosts[host].gate == "Gate until the second attempt"
    assert state.hosts[host].gate_status.startswith("retrying 1/")
    state = fold("mixed")
    assert state.hosts["host-a"].gate_status == "ok"
    assert state.hosts["host-b"].task == "Fail on the second host"
    assert state.hosts["host-c"].gate == ""  # never reached the gate
    slow = fold("cancelled")
    assert {h.gate_status for h in slow.hosts.values()} == {"waiting"}
    assert {h.gate for h in slow.hosts.values()} == {"Wait for the slow step"}


def test_warnings_and_debug_output_are_kept():
    state = fold("validate_ok")
    shown = [m for m in state.messages if m["task"] == "Show what the recipe says about this setup"]
    assert shown and isinstance(shown[0]["msg"], list)
    assert any("Dflash2-Preview" in w for w in shown[0]["msg"])
    assert any("Could not match supplied host pattern" in w for w in state.warnings)
    assert not any(w.startswith("[WARNING]") for w in state.warnings)


# --- summary ------------------------------------------------------------------------------------

def test_summary_of_a_refused_inventory_names_host_task_and_sentence():
    summary = fold("validate_bad").summary(META, rc=2, status="failed")
    assert summary["status"] == "failed" and summary["rc"] == 2 and not summary["cancelled"]
    [failure] = summary["failed_tasks"]
    assert failure["host"] == "localhost"
    assert failure["task"] == "Refuse an invalid setup before any host is touched"
    assert failure["message"].startswith("error: kv_offload=floppy")
    assert summary["hosts"]["localhost"]["failed"] == 1
    assert "undone" not in summary


def test_summary_of_a_successful_run():
    summary = fold("validate_ok").summary(META, rc=0, status="successful")
    assert summary["failed_tasks"] == []
    assert summary["hosts"]["localhost"]["failed"] == 0
    assert summary["hosts"]["localhost"]["ok"] >= 4
    assert summary["command"] == "deploy" and summary["duration"] == 1.5


def test_summary_of_a_mixed_run_lists_every_failure():
    summary = fold("mixed").summary(META, rc=4, status="failed")
    got = {(f["host"], f["task"], f["status"]) for f in summary["failed_tasks"]}
    assert got == {("host-c", "Change something", "unreachable"), ("host-b", "Fail on the second host", "failed")}
    assert summary["hosts"]["host-c"]["unreachable"] == 1


def test_summary_of_a_cancelled_run_says_what_was_left_undone():
    state = fold("cancelled")
    summary = state.summary(META, rc=99, status="cancelled")
    assert summary["cancelled"] is True
    assert summary["undone"]["plays"] == ["Slow play"]
    assert summary["undone"]["tasks"] == [
        {"play": "Slow play", "task": "Wait for the slow step", "hosts": ["host-a", "host-b"]}]
    assert summary["undone"]["hosts_without_recap"] == ["host-a", "host-b"]
    assert "Wait for the slow step" in summary["stopped_at"]
    assert summary["hosts"]["host-a"]["ok"] == 1


def test_nothing_is_undone_once_the_recap_arrived():
    undone = fold("mixed").undone()
    assert undone["plays"] == [] and undone["hosts_without_recap"] == []
    assert all(not t["hosts"] for t in undone["tasks"])


# --- views --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["validate_ok", "validate_bad", "mixed", "cancelled"])
def test_json_view_writes_one_parsable_object_per_line(name):
    out, err = io.StringIO(), io.StringIO()
    view = JsonView(out, err)
    view.start(META)
    for event in events(name):
        view.feed(event)
    view.finish(view.state.summary(META, rc=0, status="successful"), Path("/runs/x"))
    lines = out.getvalue().splitlines()
    parsed = [json.loads(line) for line in lines]
    assert parsed[0]["type"] == "start" and parsed[-1]["type"] == "summary"
    types = [p["type"] for p in parsed[1:-1]]
    assert types[0] == "playbook_on_start"
    counters = [p["counter"] for p in parsed[1:-1]]
    assert counters == sorted(counters)
    assert all("host" in p and "status" in p for p in parsed if p["type"].startswith("runner_on_"))
    assert err.getvalue() == ""


def test_json_line_is_one_line_without_empty_fields():
    line = json_line({"type": "x", "msg": "a\nb", "host": None})
    assert "\n" not in line and json.loads(line) == {"type": "x", "msg": "a\nb"}


def test_plain_view_prints_results_and_recap_then_the_verdict():
    out, err = io.StringIO(), io.StringIO()
    view = PlainView(out, err)
    view.start(META)
    for event in events("validate_bad"):
        view.feed(event)
    view.finish(view.state.summary(META, rc=2, status="failed"), Path("/runs/x"))
    text = out.getvalue()
    assert "PLAY Validate the recipe plan" in text
    assert "localhost | Refuse an invalid setup before any host is touched | failed | error: kv_offload" in text
    assert "localhost : ok=2 changed=0 failed=1" in text
    assert "failed: localhost | Refuse an invalid setup before any host is touched: error: kv_offload" in err.getvalue()
    assert "k31 deploy: failed in 1.5 s (rc 2); run record: /runs/x" in err.getvalue()


def test_live_view_table_shows_counts_task_and_gate():
    view = LiveView(io.StringIO())
    for event in events("mixed"):
        view.feed(event)
    console = Console(record=True, width=200, file=io.StringIO())
    console.print(view._render())
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in console.export_text().splitlines() if line.startswith("│ host-")}
    assert rows["host-b"] == ["Fail on the second host", "4", "1", "1", "1", "0", "Gate until the second attempt: ok"]
    assert rows["host-c"] == ["Change something", "1", "0", "0", "0", "1", ""]


# --- run records --------------------------------------------------------------------------------

def test_rotation_keeps_the_newest_runs_and_nothing_else_is_touched(tmp_path):
    start = datetime(2026, 1, 1, 12, 0, 0)
    made = [records.new_run_dir("deploy", tmp_path, now=start + timedelta(seconds=i)) for i in range(25)]
    (tmp_path / "notes").mkdir()
    removed = records.rotate(tmp_path, 20)
    assert removed == made[:5]
    assert sorted(p for p in tmp_path.iterdir() if p.name != "notes") == made[5:]
    assert (tmp_path / "notes").is_dir()


@pytest.mark.parametrize(("raw", "keep"), [(None, 20), ("3", 3)])
def test_keep_runs_from_the_environment(monkeypatch, raw, keep):
    if raw is None:
        monkeypatch.delenv("K31_KEEP_RUNS", raising=False)
    else:
        monkeypatch.setenv("K31_KEEP_RUNS", raw)
    assert records.keep_runs() == keep


@pytest.mark.parametrize("raw", ["0", "-2", "lots"])
def test_keep_runs_refuses_nonsense(monkeypatch, raw):
    monkeypatch.setenv("K31_KEEP_RUNS", raw)
    with pytest.raises(K31Error, match="K31_KEEP_RUNS"):
        records.keep_runs()


def test_run_record_command_file_keeps_no_secrets(tmp_path):
    (tmp_path / "command").write_text(json.dumps({
        "command": ["ansible-playbook", "-e", "hf_token=hf_abc", "-e", "@/vars/site.yml",
                    "--extra-vars={\"k\": \"v\"}", "deploy.yml"],
        "cwd": "/repo",
        "env": {"ANSIBLE_CONFIG": "/repo/ansible.cfg", "HF_TOKEN": "hf_abc", "HOME": "/root",
                "ANSIBLE_VAULT_PASSWORD_FILE": "/pw", "PYTHONPATH": "/repo"},
    }))
    records.scrub_command_file(tmp_path, {"PYTHONPATH"})
    text = (tmp_path / "command").read_text()
    assert "hf_abc" not in text and '\\"k\\"' not in text
    recorded = json.loads(text)
    assert recorded["command"] == ["ansible-playbook", "-e", "<redacted>", "-e", "@/vars/site.yml",
                                   "--extra-vars=<redacted>", "deploy.yml"]
    assert recorded["env"] == {"ANSIBLE_CONFIG": "/repo/ansible.cfg", "ANSIBLE_VAULT_PASSWORD_FILE": "<redacted>",
                               "PYTHONPATH": "/repo"}
    assert recorded["env_names"] == ["HF_TOKEN", "HOME"]


# --- command lines ------------------------------------------------------------------------------

def test_ansible_options_pass_through_with_paths_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "site.yml").write_text("---\n")
    (tmp_path / "pw").write_text("x")
    req = driver.RunRequest(command="deploy", playbook=Path("/repo/deploy.yml"), inventories=["inv"], check=True,
                            diff=True, extra_vars=["a=1", "@site.yml", '{"b": 2}'], vault_password_files=["pw"],
                            vault_password="s3cret")
    args = driver.cmdline_args(req)
    assert args == ["--check", "--diff", "-e", "a=1", "-e", f"@{tmp_path}/site.yml", "-e", '{"b": 2}',
                    "--vault-password-file", str(tmp_path / "pw"), "--ask-vault-pass"]
    assert "s3cret" not in " ".join(args)


@pytest.mark.parametrize(("field", "value", "what"), [
    ("extra_vars", ["@missing.yml"], "extra vars file"),
    ("vault_password_files", ["missing-pw"], "vault password file"),
])
def test_missing_files_are_input_errors(tmp_path, monkeypatch, field, value, what):
    monkeypatch.chdir(tmp_path)
    req = driver.RunRequest(command="deploy", playbook=Path("/repo/deploy.yml"), inventories=["inv"],
                            **{field: value})
    with pytest.raises(K31Error, match=what):
        driver.cmdline_args(req)


def test_inventory_must_exist(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts.ini").write_text("[all]\n")
    assert driver.inventory_paths(["hosts.ini"]) == [str(tmp_path / "hosts.ini")]
    with pytest.raises(K31Error, match=r"inventory nope\.ini does not exist"):
        driver.inventory_paths(["nope.ini"])


def test_each_command_maps_to_its_playbook(tmp_path):
    (tmp_path / "deploy.yml").write_text("---\n")
    (tmp_path / "playbooks").mkdir()
    (tmp_path / "playbooks" / "preflight.yml").write_text("---\n")
    assert driver.playbook_for("deploy", tmp_path) == tmp_path / "deploy.yml"
    assert driver.playbook_for("preflight", tmp_path) == tmp_path / "playbooks" / "preflight.yml"
    with pytest.raises(K31Error, match=r"playbooks/teardown\.yml.*available: deploy, preflight"):
        driver.playbook_for("teardown", tmp_path)


def test_repo_root_is_the_checkout_with_deploy_yml():
    root = driver.repo_root()
    assert (root / "deploy.yml").is_file() and (root / "k31deploy" / "__init__.py").is_file()


def test_runner_env_uses_the_repo_config_and_keeps_host_key_checking(monkeypatch):
    monkeypatch.delenv("ANSIBLE_HOST_KEY_CHECKING", raising=False)
    monkeypatch.setenv("PYTHONPATH", f"/elsewhere{os.pathsep}/repo")
    env = driver.runner_env(Path("/repo"))
    assert env["ANSIBLE_CONFIG"] == "/repo/ansible.cfg"
    assert env["PYTHONPATH"] == f"/repo{os.pathsep}/elsewhere"
    assert env["ANSIBLE_HOST_KEY_CHECKING"] == "True"  # no ansible.cfg there: Ansible's default
    assert env["ANSIBLE_CALLBACK_PLUGINS"] == "/repo/callback_plugins"    # the runner appends its own folder
    monkeypatch.setenv("ANSIBLE_HOST_KEY_CHECKING", "False")
    assert driver.runner_env(Path("/repo"))["ANSIBLE_HOST_KEY_CHECKING"] == "False"


@pytest.mark.parametrize(("status", "rc", "code"), [("successful", 0, 0), ("failed", 2, 2), ("failed", 4, 4),
                                                     ("failed", None, 1), ("cancelled", 99, 130)])
def test_exit_codes(status, rc, code):
    assert driver.exit_code(status, rc) == code


def test_cancel_without_a_known_ansible_process_goes_straight_to_the_runner():
    flag = threading.Event()
    cancel = driver.Canceller(flag)
    assert cancel() is False
    flag.set()
    cancel.saw({"pid": 2 ** 22 + 17})  # no such process: never signalled
    assert cancel() is True


# --- the subcommands ----------------------------------------------------------------------------

def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    ops.register(parser.add_subparsers(required=True))
    return parser.parse_args(argv)


def test_redeploy_targets_and_batch_become_extra_vars():
    args = parse("redeploy", "-i", "inv", "decode0", "k31_router", "--batch", "2", "-e", "a=1", "-e", "@x.yml")
    assert ops.k31_vars(args) == {"k31_redeploy_targets": ["decode0", "k31_router"], "k31_redeploy_batch": 2}
    assert args.extra_vars == ["a=1", "@x.yml"] and args.k31_command == "redeploy"


def test_full_makes_deploy_and_redeploy_leave_the_converge_stamp_unread():
    """deploy --full runs every host play; redeploy --full renders the new version even on a settled host."""
    for command in ("deploy", "redeploy"):
        assert ops.k31_vars(parse(command, "-i", "inv", "--full")) == {"k31_stamp_check": False}
        assert ops.k31_vars(parse(command, "-i", "inv")) == {}


def test_teardown_needs_yes_to_confirm():
    assert ops.k31_vars(parse("teardown", "-i", "inv")) == {}
    assert ops.k31_vars(parse("teardown", "-i", "inv", "--yes")) == {"k31_teardown_confirm": True}


def test_common_options_parse():
    args = parse("deploy", "-i", "a", "-i", "b", "--limit", "decode*", "--tags", "k31_engine", "--skip-tags", "x",
                 "--check", "--diff", "--forks", "8", "--json", "-vv")
    assert (args.inventory, args.limit, args.tags, args.skip_tags) == (["a", "b"], "decode*", "k31_engine", "x")
    assert (args.check, args.diff, args.forks, args.json, args.verbose) == (True, True, 8, True, 2)
    assert ops.k31_vars(args) == {}


@pytest.mark.parametrize("argv", [("deploy",), ("deploy", "-i", "x", "--forks", "0"), ("redeploy", "-i", "x",
                                                                                         "--batch", "none")])
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2


def test_mitogen_runs_the_playbook_under_its_linear_strategy():
    env = driver.mitogen_env()
    assert env["ANSIBLE_STRATEGY"] == "mitogen_linear"
    assert (Path(env["ANSIBLE_STRATEGY_PLUGINS"]) / "mitogen_linear.py").is_file()
    parser = argparse.ArgumentParser()
    ops.add_run_args(parser)
    assert parser.parse_args(["-i", "x", "--mitogen"]).mitogen is True
    assert parser.parse_args(["-i", "x"]).mitogen is False


def test_mitogen_missing_is_one_sentence(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mitogen(name, *args, **kwargs):
        if name == "ansible_mitogen":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mitogen)
    with pytest.raises(K31Error, match=r"^--mitogen needs the mitogen package in k31's venv"):
        driver.mitogen_env()
