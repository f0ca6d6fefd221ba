"""What a run shows while it runs: a rich live table on a terminal, `host | task | status` lines when
stdout is a pipe or a file, or one JSON object per line (--json) for automation.

Views are fed from ansible-runner's thread and rendered from rich's refresh thread; the lock keeps
the two from seeing a half-updated state.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, TextIO

from k31deploy.runner.events import RunState, json_line, plain_line


def closing_lines(summary: dict[str, Any], run_dir: Path) -> list[str]:
    """The verdict every human-facing view ends with: what failed where, where a stop happened, the record."""
    lines = [f"{f['status']}: {f['host']} | {f['task']}: {f['message']}" for f in summary["failed_tasks"]]
    if summary["status"] == "failed" and not summary["failed_tasks"]:
        lines += [f"error: {e}" for e in summary["errors"]] or ["error: ansible-playbook exited with "
                                                                  f"rc {summary['rc']} before any task failed"]
    if summary["cancelled"]:
        undone = summary["undone"]
        lines.append(f"cancelled: stopped at {summary['stopped_at']}; {len(undone['tasks'])} task(s) not finished"
                     + (f", no recap for {', '.join(undone['hosts_without_recap'])}"
                        if undone["hosts_without_recap"] else ""))
    lines.append(f"k31 {summary['command']}: {summary['status']} in {summary['duration']:.1f} s "
                 f"(rc {summary['rc']}); run record: {run_dir}")
    return lines


def recap_lines(summary: dict[str, Any]) -> list[str]:
    return [f"{host} : " + " ".join(f"{k}={v}" for k, v in counts.items())
            for host, counts in sorted(summary["hosts"].items())]


class View(ABC):
    """Folds events into a RunState and shows each one; subclasses decide how."""

    def __init__(self) -> None:
        self.state = RunState()
        self.lock = threading.Lock()

    def feed(self, event: dict[str, Any]) -> None:
        # Only the fold holds the lock: showing may wait on rich's own lock, whose refresh thread
        # waits on this one to read the state.
        with self.lock:
            record = self.state.feed(event)
        self.show(record)

    @abstractmethod
    def show(self, record: dict[str, Any]) -> None: ...

    @abstractmethod
    def start(self, meta: dict[str, Any]) -> None: ...

    @abstractmethod
    def note(self, text: str) -> None: ...

    @abstractmethod
    def finish(self, summary: dict[str, Any], run_dir: Path) -> None: ...


class PlainView(View):
    """One line per task result, for logs and pipes."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        super().__init__()
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def start(self, meta: dict[str, Any]) -> None:
        print(f"k31 {meta['command']}: {meta['playbook']} on {', '.join(meta['inventory'])}", file=self.err)

    def show(self, record: dict[str, Any]) -> None:
        if record["type"] == "playbook_on_play_start":
            print(f"PLAY {record['play']}", file=self.out, flush=True)
        elif record.get("level"):
            print(record["text"], file=self.err, flush=True)
        line = plain_line(record)
        if line:
            print(line, file=self.out, flush=True)

    def note(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None:
        for line in recap_lines(summary):
            print(line, file=self.out)
        self.out.flush()
        for line in closing_lines(summary, run_dir):
            print(line, file=self.err)


class JsonView(View):
    """One JSON object per line on stdout, nothing else there; the last line is the summary."""

    def __init__(self, out: TextIO | None = None, err: TextIO | None = None) -> None:
        super().__init__()
        self.out = out or sys.stdout
        self.err = err or sys.stderr

    def start(self, meta: dict[str, Any]) -> None:
        self._write({"type": "start", **meta})

    def show(self, record: dict[str, Any]) -> None:
        if "text" in record and not record["text"]:
            return
        self._write(record)

    def note(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None:
        # Whole, empty fields included: the same document as the run's summary.json.
        self.out.write(json.dumps({"type": "summary", **summary}, default=str) + "\n")
        self.out.flush()

    def _write(self, record: dict[str, Any]) -> None:
        self.out.write(json_line(record) + "\n")
        self.out.flush()


class LiveView(View):
    """A table that redraws in place: per host the current task, its counts and its latest health gate."""

    def __init__(self, out: TextIO | None = None) -> None:
        from rich.console import Console

        super().__init__()
        self.console = Console(file=out or sys.stdout)
        self.started = time.monotonic()
        self.live: Any = None

    def start(self, meta: dict[str, Any]) -> None:
        from rich.live import Live

        self.started = time.monotonic()
        self._say(f"k31 {meta['command']}: {meta['playbook']} on {', '.join(meta['inventory'])}", "bold")
        self.live = Live(console=self.console, get_renderable=self._render, refresh_per_second=4,
                         redirect_stderr=False)
        self.live.start()

    def show(self, record: dict[str, Any]) -> None:
        # Printed above the table, so they stay on screen after it redraws.
        msg = record.get("msg")
        if record.get("status") in ("failed", "unreachable"):
            self._say(f"{record['status']}: {record['host']} | {record['task']}: {msg}", "red")
        elif msg is not None:
            text = msg if isinstance(msg, str) else json.dumps(msg, indent=2, default=str)
            self._say(f"{record['host']} | {record['task']}:\n{text}")
        elif record.get("level"):
            self._say(record["text"], "yellow" if record["level"] == "warning" else "red")

    def note(self, text: str) -> None:
        self._say(text, "bold yellow")

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None:
        if self.live is not None:
            self.live.stop()
        style = {"successful": "green", "failed": "red"}.get(summary["status"], "yellow")
        for line in closing_lines(summary, run_dir):
            self._say(line, style if line.startswith("k31 ") else "")

    def _say(self, text: str, style: str = "") -> None:
        from rich.text import Text

        # Styled as a Text, not through print(style=...): that style would also paint the live table,
        # which rich redraws in the same write.
        self.console.print(Text(text, style=style))

    def _render(self) -> Any:
        from rich.table import Table

        counts = ("ok", "changed", "failed", "skipped", "unreachable")
        with self.lock:
            play = self.state.play or "starting"
            rows = [(name, h.task, dict(h.counts), f"{h.gate}: {h.gate_status}" if h.gate else "")
                    for name, h in sorted(self.state.hosts.items())]
        table = Table(title=f"{play} · {time.monotonic() - self.started:.0f} s", title_justify="left")
        table.add_column("host")
        table.add_column("task")
        for col in counts:
            table.add_column(col, justify="right")
        table.add_column("health gate")
        for name, task, c, gate in rows:
            table.add_row(name, task, *(str(c[k]) for k in counts), gate,
                          style="red" if c["failed"] or c["unreachable"] else None)
        return table


def make_view(json_mode: bool, out: TextIO | None = None) -> View:
    stream = out or sys.stdout
    if json_mode:
        return JsonView(stream)
    if stream.isatty():
        return LiveView(stream)
    return PlainView(stream)
