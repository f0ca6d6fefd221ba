"""The watch the secret tests rely on (cmdline_watch.py): it sees a secret on any command line of this machine,
keeps watching while processes come and go, and fails the test when it stopped early."""

from __future__ import annotations

import secrets
import subprocess
import time

import pytest
from cmdline_watch import CmdlineWatch, running


def test_it_sees_a_secret_on_a_command_line_and_keeps_watching_through_process_churn():
    token = f"k31-watch-{secrets.token_hex(8)}"
    with CmdlineWatch(token) as watch:
        # many short-lived processes: each may end between the watch's listing of /proc and its read
        for _ in range(200):
            subprocess.run(["true"], check=True)
        with subprocess.Popen(["sh", "-c", "sleep 30", token]) as proc:    # the token is its $0
            deadline = time.monotonic() + 10
            while not watch.hits and time.monotonic() < deadline:
                time.sleep(0.05)
            assert proc.pid in running([b"sh", b"-c", b"sleep 30", token.encode()])
            assert proc.pid not in running([b"sh", b"-c", b"sleep 31"])
            proc.kill()
        scans = watch.scans
        time.sleep(0.2)
        assert watch.scans > scans, "the watch stopped scanning"
    assert any(token in hit for hit in watch.hits), watch.hits


def test_a_watch_that_stopped_early_fails_at_its_end():
    watch = CmdlineWatch("k31-never-there")

    def gone() -> None:
        raise ProcessLookupError(3, "No such process")

    watch.scan = gone
    with pytest.raises(AssertionError, match="the command-line watch stopped after 0 scans"), watch:
        time.sleep(0.1)
