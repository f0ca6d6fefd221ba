"""Fold ansible-runner events into what operators and automation see: per-host progress, health gates,
failures with their messages, and the run summary (summary.json).

Pure Python over the event dicts ansible-runner hands its event_handler, so it is unit-tested on
recorded events without starting Ansible.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

COUNTS = ("ok", "changed", "failed", "skipped", "unreachable", "rescued", "ignored")
# playbook_on_stats keys -> our count names (Ansible calls unreachable hosts "dark")
STATS_KEYS = {"ok": "ok", "changed": "changed", "failures": "failed", "skipped": "skipped", "dark": "unreachable",
              "rescued": "rescued", "ignored": "ignored"}
# Tasks that wait for a server to become healthy; the live view shows the latest one per host.
GATE_PREFIXES = ("Wait for", "Gate")
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Events that carry only text; the level says which end up in the summary (verbose: decided by its text).
TEXT_EVENTS = {"verbose": None, "debug": None, "warning": "warning", "deprecated": "warning",
               "system_warning": "warning", "error": "error"}
LEVEL_PREFIX = re.compile(r"^(\[(WARNING|DEPRECATION WARNING|ERROR)\]:?|ERROR!)\s*")
# res keys that are bookkeeping, not what a debug task meant to show
_RES_NOISE = {"changed", "failed", "skipped"}


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text).replace("\r", "")


def text_level(text: str) -> str | None:
    if text.startswith(("[WARNING]", "[DEPRECATION WARNING]")):
        return "warning"
    if text.startswith(("[ERROR]", "ERROR!")):
        return "error"
    return None


def result_status(event: dict[str, Any]) -> str | None:
    """The status of a per-host event (None for events that are not about one host's task)."""
    kind = event.get("event", "")
    data = event.get("event_data", {})
    res = data.get("res") or {}
    if kind == "runner_on_start":
        return "started"
    if kind == "runner_on_ok":
        return "changed" if res.get("changed") else "ok"
    if kind == "runner_on_failed":
        return "ignored" if data.get("ignore_errors") else "failed"
    if kind == "runner_on_skipped":
        return "skipped"
    if kind == "runner_on_unreachable":
        return "unreachable"
    if kind == "runner_retry":
        return "retrying"
    if kind.startswith("runner_item_on_"):
        return "item " + kind.removeprefix("runner_item_on_")
    if kind.startswith("runner_on_async_"):
        return "async " + kind.removeprefix("runner_on_async_")
    return None


def failure_message(res: dict[str, Any]) -> str:
    """What went wrong, as Ansible would print it: msg first, then stderr/stdout, then loop items."""
    for key in ("msg", "stderr", "stdout", "reason", "censored"):
        text = res.get(key)
        if isinstance(text, str) and text.strip():
            return text.strip()
    items = [failure_message(r) for r in res.get("results") or [] if isinstance(r, dict) and r.get("failed")]
    items = [m for m in items if m]
    return "; ".join(items) or "(no message)"


def debug_output(res: dict[str, Any]) -> Any:
    """What a debug task shows: its msg, or the variable it was asked for."""
    if "msg" in res:
        return res["msg"]
    shown = {k: v for k, v in res.items() if not k.startswith("_") and k not in _RES_NOISE}
    return shown or None


def is_gate(task: str) -> bool:
    return task.startswith(GATE_PREFIXES)


@dataclass
class HostState:
    task: str = ""
    status: str = ""
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    gate: str = ""
    gate_status: str = ""


@dataclass
class RunState:
    """Everything the views and the summary need, built event by event."""

    hosts: dict[str, HostState] = field(default_factory=dict)
    play: str = ""
    plays: list[str] = field(default_factory=list)
    task: str = ""
    # task_uuid -> {"play", "task", "started": [hosts], "done": [hosts]}, in start order
    tasks: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stats: dict[str, dict[str, int]] | None = None

    def host(self, name: str) -> HostState:
        return self.hosts.setdefault(name, HostState())

    def feed(self, event: dict[str, Any]) -> dict[str, Any]:
        """Fold one runner event in; return its flat record (the --json line, the plain line's fields)."""
        kind = event.get("event", "")
        data = event.get("event_data", {})
        record: dict[str, Any] = {"type": kind, "counter": event.get("counter"), "created": event.get("created")}
        if kind == "playbook_on_play_start":
            self.play = data.get("name") or data.get("play") or ""
            self.plays.append(self.play)
            self.task = ""
            record["play"] = self.play
        elif kind in ("playbook_on_task_start", "playbook_on_handler_task_start"):
            self.task = data.get("task") or data.get("name") or ""
            self.tasks[data.get("task_uuid") or data.get("uuid", "")] = {
                "play": self.play, "task": self.task, "started": [], "done": []}
            record.update(play=self.play, task=self.task)
        elif kind == "playbook_on_stats":
            self.stats = {}
            for key, name in STATS_KEYS.items():
                for host, n in (data.get(key) or {}).items():
                    self.stats.setdefault(host, dict.fromkeys(COUNTS, 0))[name] = n
            for host in data.get("processed") or {}:
                self.stats.setdefault(host, dict.fromkeys(COUNTS, 0))
        elif kind in TEXT_EVENTS:
            text = strip_ansi(event.get("stdout", "")).strip()
            record["text"] = text
            level = TEXT_EVENTS[kind] or text_level(text)
            if level and text:
                record["level"] = level
                (self.warnings if level == "warning" else self.errors).append(LEVEL_PREFIX.sub("", text, count=1))
        status = result_status(event)
        if status is not None and data.get("host"):
            self._host_event(event, status, record)
        return record

    def _host_event(self, event: dict[str, Any], status: str, record: dict[str, Any]) -> None:
        data = event["event_data"]
        name, task = data["host"], data.get("task", "")
        res = data.get("res") or {}
        host = self.host(name)
        host.task, host.status = task, status
        record.update(play=data.get("play", self.play), task=task, host=name, status=status,
                      duration=data.get("duration"))
        entry = self.tasks.setdefault(data.get("task_uuid", ""), {"play": data.get("play", self.play), "task": task,
                                                                   "started": [], "done": []})
        if status == "started":
            entry["started"].append(name)
        elif status in ("ok", "changed", "failed", "ignored", "skipped", "unreachable"):
            entry["done"].append(name)
            self._count(host, status)
        if is_gate(task):
            host.gate = task
            host.gate_status = "waiting" if status == "started" else status
            if status == "retrying":
                host.gate_status = f"retrying {res.get('attempts', '?')}/{res.get('retries', '?')}"
        if status in ("failed", "unreachable"):
            message = failure_message(res)
            record["msg"] = message
            self.failures.append({"host": name, "play": data.get("play", self.play), "task": task,
                                  "role": data.get("role"), "action": data.get("resolved_action"),
                                  "status": status, "message": message})
        elif status in ("ok", "changed") and (data.get("resolved_action") or "").endswith("debug"):
            shown = debug_output(res)
            if shown is not None:
                record["msg"] = shown
                self.messages.append({"host": name, "task": task, "msg": shown})

    @staticmethod
    def _count(host: HostState, status: str) -> None:
        # Same arithmetic as Ansible's recap: changed and ignored results also count as ok.
        if status in ("ok", "changed", "ignored"):
            host.counts["ok"] += 1
        if status != "ok":
            host.counts[status] += 1

    def counts(self) -> dict[str, dict[str, int]]:
        """Per-host counts: the recap when the playbook got that far, else what the events showed."""
        live = {name: dict(h.counts) for name, h in self.hosts.items()}
        if self.stats is None:
            return live
        return {**{h: dict.fromkeys(COUNTS, 0) for h in live}, **self.stats}

    def undone(self) -> dict[str, Any]:
        """What a stopped run did not finish: the tasks in flight, the open play, hosts without a recap."""
        tasks = []
        for entry in self.tasks.values():
            pending = [h for h in entry["started"] if h not in entry["done"]]
            if pending or not entry["started"]:
                tasks.append({"play": entry["play"], "task": entry["task"], "hosts": pending})
        # A play is finished once the next one starts or the recap arrives.
        plays = [self.plays[-1]] if self.plays and self.stats is None else []
        without_recap = sorted(h for h in self.hosts if self.stats is None or h not in self.stats)
        return {"plays": plays, "tasks": tasks, "hosts_without_recap": without_recap}

    def stopped_at(self) -> str:
        """Where a stopped run was: play, task and the hosts it was running on."""
        undone = self.undone()
        if undone["tasks"]:
            last = undone["tasks"][-1]
            hosts = f" on {', '.join(last['hosts'])}" if last["hosts"] else ""
            return f"play '{last['play']}', task '{last['task']}'{hosts}"
        if self.play:
            return f"play '{self.play}'"
        return "before the first play"

    def summary(self, meta: dict[str, Any], *, rc: int | None, status: str) -> dict[str, Any]:
        """The run record: meta (command, playbook, inventory, times) plus what happened."""
        out = {**meta, "rc": rc, "status": status, "cancelled": status == "cancelled",
               "hosts": self.counts(), "failed_tasks": self.failures, "messages": self.messages,
               "warnings": self.warnings, "errors": self.errors}
        if status == "cancelled":
            out["stopped_at"] = self.stopped_at()
            out["undone"] = self.undone()
        return out


def json_line(record: dict[str, Any]) -> str:
    """One --json line: the record without empty fields, always one line."""
    return json.dumps({k: v for k, v in record.items() if v is not None}, default=str, separators=(",", ":"))


def plain_line(record: dict[str, Any]) -> str | None:
    """`host | task | status` for one task result (None for events that are not results)."""
    status = record.get("status")
    if not record.get("host") or status in (None, "started") or status.startswith(("item ", "async ")):
        return None
    line = f"{record['host']} | {record['task']} | {status}"
    msg = record.get("msg")
    if msg is not None:
        line += " | " + (msg if isinstance(msg, str) else json.dumps(msg, default=str))
    return line
