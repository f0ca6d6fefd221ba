"""Where a run's time went, read from its recorded job events after the fact (what
ansible.posix.profile_tasks prints, without re-running): each task's wall time, its action, how many hosts ran
it, and what kind of work it was -- a module on the hosts, controller-only work (set_fact, debug, argument
validation, includes: Ansible still forks a worker per host for each), or a task every host skipped.
`compare` lines up two runs of the same playbook task by task (2 hosts and 16, say) to show what grows with
the host count. bench/run_profile.py prints both; like events.py this is pure Python over the event dicts.

A task's wall time runs from its start to the next task's or play's start (or the end of the run): under the
linear strategy a task ends when its last host does, so the times add up to the run's wall time.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from k31deploy.runner.events import result_status

# Actions that run on the controller only: no connection to the host, but still a forked worker per host.
CONTROLLER_ACTIONS = frozenset({
    "set_fact", "debug", "assert", "fail", "meta", "include_role", "include_tasks", "import_role", "import_tasks",
    "validate_argument_spec", "include_vars", "add_host", "group_by", "set_stats", "pause", "noop"})
KINDS = ("module", "controller", "skipped")
_BOUNDARIES = ("playbook_on_task_start", "playbook_on_play_start", "playbook_on_stats")
# events.result_status of a host's last word on a task (not started, retrying or one loop item)
_FINAL = frozenset({"ok", "changed", "failed", "ignored", "skipped", "unreachable"})


@dataclass(frozen=True)
class TaskTime:
    play: str
    role: str
    name: str
    action: str          # the short name: command, set_fact, k31_files, ...
    kind: str            # module | controller | skipped (every host that got it skipped it)
    hosts: int           # hosts that ran or skipped it
    seconds: float
    occurrence: int      # 1 for the first task of this play, role and name in the run, 2 for the next, ...

    @property
    def key(self) -> tuple[str, str, str, int]:
        return (self.play, self.role, self.name, self.occurrence)


@dataclass(frozen=True)
class Profile:
    wall: float
    tasks: tuple[TaskTime, ...]

    def kinds(self) -> dict[str, dict[str, float]]:
        """Task count and seconds per kind of work."""
        out = {k: {"tasks": 0, "seconds": 0.0} for k in KINDS}
        for t in self.tasks:
            out[t.kind]["tasks"] += 1
            out[t.kind]["seconds"] = round(out[t.kind]["seconds"] + t.seconds, 2)
        return out


def load_events(run: Path) -> list[dict[str, Any]]:
    """A run record's job events (`.k31/runs/ID`, or its artifacts/ID folder); profile() orders them."""
    found = list(run.glob("job_events/*.json")) or list(run.glob("artifacts/*/job_events/*.json"))
    if not found:
        raise FileNotFoundError(f"{run} holds no job events (a run record of k31 deploy, redeploy, ... is "
                                ".k31/runs/ID)")
    return [json.loads(p.read_text()) for p in found]


def _at(event: dict[str, Any]) -> datetime:
    return datetime.fromisoformat(event["created"])


def _short(action: str | None) -> str:
    return (action or "").rsplit(".", 1)[-1]


def profile(events: list[dict[str, Any]]) -> Profile:
    events = sorted(events, key=lambda e: e["counter"])
    if not events:
        return Profile(0.0, ())
    # each host's last word on a task (a looped task has item events first; a retried one, retries)
    ends: dict[str, dict[str, str]] = {}
    for e in events:
        data = e.get("event_data", {})
        status = result_status(e)
        if status in _FINAL and data.get("task_uuid"):
            ends.setdefault(data["task_uuid"], {})[data.get("host", "")] = status
    marks = [e for e in events if e["event"] in _BOUNDARIES]
    seen: Counter[tuple[str, str, str]] = Counter()
    tasks = []
    for start, nxt in itertools.pairwise(marks):
        if start["event"] != "playbook_on_task_start":
            continue
        data = start["event_data"]
        action = _short(data.get("task_action") or data.get("resolved_action"))
        hosts = ends.get(data.get("task_uuid", ""), {})
        if hosts and all(v == "skipped" for v in hosts.values()):
            kind = "skipped"
        elif action in CONTROLLER_ACTIONS or not hosts:
            kind = "controller"
        else:
            kind = "module"
        ident = (data.get("play", ""), data.get("role", ""), data.get("task", ""))
        seen[ident] += 1
        tasks.append(TaskTime(*ident, action=action, kind=kind, hosts=len(hosts),
                              seconds=round((_at(nxt) - _at(start)).total_seconds(), 3), occurrence=seen[ident]))
    return Profile(round((_at(events[-1]) - _at(events[0])).total_seconds(), 2), tuple(tasks))


def compare(small: Profile, large: Profile) -> list[dict[str, Any]]:
    """Every task of either run with its seconds in each and the growth, largest growth first."""
    a = {t.key: t for t in small.tasks}
    b = {t.key: t for t in large.tasks}
    rows = []
    for key in list(a) + [k for k in b if k not in a]:
        x, y = a.get(key), b.get(key)
        t = y or x
        rows.append({"play": t.play, "role": t.role, "task": t.name, "occurrence": t.occurrence,
                     "action": t.action, "kind": t.kind, "hosts": [x.hosts if x else 0, y.hosts if y else 0],
                     "seconds": [x.seconds if x else 0.0, y.seconds if y else 0.0],
                     "growth": round((y.seconds if y else 0.0) - (x.seconds if x else 0.0), 3)})
    return sorted(rows, key=lambda r: -r["growth"])


def report(run: Profile, top: int) -> dict[str, Any]:
    slowest = sorted(run.tasks, key=lambda t: -t.seconds)[:top]
    return {"wall_s": run.wall, "tasks": len(run.tasks), "kinds": run.kinds(),
            "slowest": [asdict(t) for t in slowest]}


def compare_report(small: Profile, large: Profile, top: int) -> dict[str, Any]:
    ka, kb = small.kinds(), large.kinds()
    return {"wall_s": [small.wall, large.wall],
            "kinds": {k: {"tasks": [ka[k]["tasks"], kb[k]["tasks"]],
                          "seconds": [ka[k]["seconds"], kb[k]["seconds"]],
                          "growth": round(kb[k]["seconds"] - ka[k]["seconds"], 2)} for k in KINDS},
            "growth": compare(small, large)[:top]}


def _task_label(role: str, name: str, occurrence: int) -> str:
    return f"{role + ': ' if role else ''}{name}{f' (#{occurrence})' if occurrence > 1 else ''}"


def render(rep: dict[str, Any]) -> str:
    lines = [f"wall {rep['wall_s']} s over {rep['tasks']} tasks"]
    lines += [f"  {k:<10} {v['tasks']:4d} tasks {v['seconds']:8.2f} s" for k, v in rep["kinds"].items()]
    lines.append("slowest tasks (s, hosts, action, kind, role: task):")
    lines += [f"  {t['seconds']:7.2f} {t['hosts']:3d}  {t['action']:<22} {t['kind']:<10} "
              f"{_task_label(t['role'], t['name'], t['occurrence'])}" for t in rep["slowest"]]
    return "\n".join(lines)


def render_compare(rep: dict[str, Any]) -> str:
    a, b = rep["wall_s"]
    lines = [f"wall {a} s -> {b} s (+{round(b - a, 2)} s)"]
    lines += [f"  {k:<10} tasks {v['tasks'][0]:4d} -> {v['tasks'][1]:4d}   {v['seconds'][0]:8.2f} -> "
              f"{v['seconds'][1]:8.2f} s (+{v['growth']} s)" for k, v in rep["kinds"].items()]
    lines.append("largest growth (s: growth, first run, second run; hosts; action, kind, role: task):")
    lines += [f"  {r['growth']:7.2f} {r['seconds'][0]:7.2f} {r['seconds'][1]:7.2f}  {r['hosts'][0]:3d}->"
              f"{r['hosts'][1]:<3d} {r['action']:<22} {r['kind']:<10} "
              f"{_task_label(r['role'], r['task'], r['occurrence'])}" for r in rep["growth"]]
    return "\n".join(lines)
