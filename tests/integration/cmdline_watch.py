"""Watch every /proc/<pid>/cmdline of this machine while a test runs -- sandbox nodes are containers on it, so
their processes are seen too -- and keep the command lines that hold a secret."""

from __future__ import annotations

import threading
from pathlib import Path


class CmdlineWatch:
    def __init__(self, *secrets: str, pause: float = 0.01) -> None:
        self.secrets = [s.encode() for s in secrets if s]
        assert self.secrets, "nothing to watch for"
        self.pause = pause
        self.hits: set[str] = set()
        self.scans = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def scan(self) -> None:
        for path in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                data = path.read_bytes()
            except OSError:  # the process ended meanwhile
                continue
            if any(secret in data for secret in self.secrets):
                self.hits.add(data.replace(b"\0", b" ").decode(errors="replace"))
        self.scans += 1

    def _run(self) -> None:
        while not self.stop.wait(self.pause):
            self.scan()

    def __enter__(self) -> CmdlineWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
