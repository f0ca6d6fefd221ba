"""Watch every /proc/<pid>/cmdline of this machine while a test runs -- sandbox nodes are containers on it, so
their processes are seen too -- and keep the command lines that hold a secret. A watch that stops early fails the
test at its end: a dead watcher would otherwise pass it having looked at nothing since."""

from __future__ import annotations

import os
import threading


def command_lines() -> list[tuple[str, bytes]]:
    """(pid, NUL-separated command line) of every process now; one that ends before its read is left out. scandir
    lists /proc without a stat per entry: a pathlib glob of /proc/*/cmdline stats each one, and raised
    ProcessLookupError for a process that had just ended (the watch died of it mid-test)."""
    with os.scandir("/proc") as entries:
        pids = [entry.name for entry in entries if entry.name.isdigit()]
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                found.append((pid, fh.read()))
        except OSError:  # the process ended meanwhile
            continue
    return found


def running(argv: list[bytes]) -> set[int]:
    """PIDs of the processes whose command line starts with `argv`."""
    return {int(pid) for pid, data in command_lines() if data.split(b"\0")[:len(argv)] == argv}


class CmdlineWatch:
    def __init__(self, *secrets: str, pause: float = 0.01) -> None:
        self.secrets = [s.encode() for s in secrets if s]
        assert self.secrets, "nothing to watch for"
        self.pause = pause
        self.hits: set[str] = set()
        self.scans = 0
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def scan(self) -> None:
        for _, data in command_lines():
            if any(secret in data for secret in self.secrets):
                self.hits.add(data.replace(b"\0", b" ").decode(errors="replace"))
        self.scans += 1

    def _run(self) -> None:
        try:
            while not self.stop.wait(self.pause):
                self.scan()
        except BaseException as exc:  # kept for __exit__, which fails the test with it
            self.error = exc

    def __enter__(self) -> CmdlineWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        if self.error is not None:
            raise AssertionError(f"the command-line watch stopped after {self.scans} scans: "
                                 f"{self.error!r}") from self.error
