"""k31deploy.runner.profile and bench/run_profile.py on recorded runner events
(tests/unit/fixtures/runner_events/: mixed is tests/integration/playbooks/mixed.yml on two local hosts and an
unreachable one, validate_ok `k31 deploy --tags always` on one host)."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from k31deploy.runner import profile

FIXTURES = Path(__file__).parent / "fixtures" / "runner_events"
BENCH = Path(__file__).resolve().parents[2] / "bench" / "run_profile.py"


def events(name: str) -> list[dict]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def by_name(run: profile.Profile) -> dict[str, profile.TaskTime]:
    return {t.name: t for t in run.tasks}


def test_each_task_gets_the_time_to_the_next_start_and_the_times_add_up_to_the_run():
    run = profile.profile(events("mixed"))
    tasks = by_name(run)
    assert list(tasks) == ["Show the host", "Change something", "Skip on purpose", "Fail but carry on",
                           "Gate until the second attempt", "Fail on the second host"]
    # Change something started 17:44:54.207788, Skip on purpose 17:44:55.376717
    assert tasks["Change something"].seconds == pytest.approx(1.169, abs=0.001)
    # the last task runs to the stats event (17:44:57.849899 -> 17:44:57.913704)
    assert tasks["Fail on the second host"].seconds == pytest.approx(0.064, abs=0.001)
    assert run.wall == pytest.approx(3.85, abs=0.01)
    # all but the play start's few milliseconds before the first task
    assert sum(t.seconds for t in run.tasks) == pytest.approx(run.wall, abs=0.02)


def test_kinds_hosts_and_actions():
    tasks = by_name(profile.profile(events("mixed")))
    # a module on the hosts, whatever the outcome (host-c unreachable, failures carried on)
    assert (tasks["Change something"].kind, tasks["Change something"].action, tasks["Change something"].hosts) == (
        "module", "file", 3)
    assert tasks["Fail but carry on"].kind == "module" and tasks["Fail but carry on"].hosts == 2
    # controller-only actions, even where they failed on a host
    assert tasks["Show the host"].kind == "controller"
    assert tasks["Fail on the second host"].kind == "controller"
    # every host that got it skipped it
    assert tasks["Skip on purpose"].kind == "skipped" and tasks["Skip on purpose"].hosts == 2
    kinds = profile.profile(events("mixed")).kinds()
    assert {k: v["tasks"] for k, v in kinds.items()} == {"module": 3, "controller": 2, "skipped": 1}


def test_argument_validation_and_set_fact_are_controller_work_and_repeats_are_numbered():
    run = profile.profile(events("validate_ok"))
    assert {t.kind for t in run.tasks} == {"controller"}
    validations = [t for t in run.tasks if t.action == "validate_argument_spec"]
    assert [t.role for t in validations] == ["k31_validate", "k31_engine", "k31_smoke"]
    assert all(t.occurrence == 1 for t in run.tasks)    # different plays, roles or names: no repeats

    doubled = events("mixed")
    again = [copy.deepcopy(e) for e in doubled if e["event"] != "playbook_on_stats"]
    last = datetime.fromisoformat(doubled[-1]["created"])
    for e in again:
        e["counter"] += 1000
        e["created"] = (datetime.fromisoformat(e["created"]) + timedelta(seconds=10)).isoformat()
        e.setdefault("event_data", {})
        if e["event_data"].get("task_uuid"):
            e["event_data"]["task_uuid"] += "-again"
    stats = copy.deepcopy(doubled[-1])
    stats["counter"] = 5000
    stats["created"] = (last + timedelta(seconds=20)).isoformat()
    run2 = profile.profile(doubled[:-1] + again + [stats])
    shows = [t for t in run2.tasks if t.name == "Show the host"]
    assert [t.occurrence for t in shows] == [1, 2]


def test_compare_lines_up_tasks_and_reports_growth():
    small = profile.profile(events("mixed"))
    assert all(r["growth"] == 0 for r in profile.compare(small, small))

    slower = events("mixed")
    # the file task takes 2 s longer: every event from the next task on happens 2 s later
    cut = next(e["counter"] for e in slower if e.get("event_data", {}).get("task") == "Skip on purpose")
    for e in slower:
        if e["counter"] >= cut:
            e["created"] = (datetime.fromisoformat(e["created"]) + timedelta(seconds=2)).isoformat()
    large = profile.profile(slower)
    rows = profile.compare(small, large)
    assert rows[0]["task"] == "Change something" and rows[0]["growth"] == pytest.approx(2.0, abs=0.001)
    assert rows[0]["hosts"] == [3, 3] and rows[0]["kind"] == "module"
    rep = profile.compare_report(small, large, top=3)
    assert rep["wall_s"][1] == pytest.approx(rep["wall_s"][0] + 2, abs=0.01)
    assert rep["kinds"]["module"]["growth"] == pytest.approx(2.0, abs=0.01)
    assert rep["kinds"]["controller"]["growth"] == pytest.approx(0, abs=0.01)
    assert len(rep["growth"]) == 3
    assert profile.render_compare(rep).splitlines()[0] == "wall 3.85 s -> 5.85 s (+2.0 s)"


def write_record(root: Path, name: str, evs: list[dict]) -> Path:
    folder = root / name / "artifacts" / name / "job_events"
    folder.mkdir(parents=True)
    for e in evs:
        (folder / f"{e['counter']}-{e.get('uuid', e['counter'])}.json").write_text(json.dumps(e))
    return root / name


def test_bench_profile_reads_a_run_record_and_refuses_a_folder_without_events(tmp_path):
    record = write_record(tmp_path, "20261129-174454-000000-deploy", events("mixed"))
    out = subprocess.run([sys.executable, str(BENCH), str(record), "--json", "--top", "2"],
                         capture_output=True, text=True, check=True)
    rep = json.loads(out.stdout)
    assert rep["tasks"] == 6 and len(rep["slowest"]) == 2
    assert rep["slowest"][0]["name"] == "Gate until the second attempt"    # 1.357 s, the slowest
    assert rep["kinds"]["skipped"]["tasks"] == 1

    both = subprocess.run([sys.executable, str(BENCH), str(record), str(record)], capture_output=True, text=True,
                          check=True)
    assert both.stdout.startswith("wall 3.85 s -> 3.85 s (+0.0 s)")

    bad = subprocess.run([sys.executable, str(BENCH), str(tmp_path)], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip() == (f"error: {tmp_path} holds no job events (a run record of k31 deploy, redeploy, "
                                  "... is .k31/runs/ID)")
