"""Processes for integration tests on 127.0.0.1: stand-in engines and the real SGLang router.

Every process is started here and stopped by its own PID (SIGTERM, then SIGKILL after a grace
period); nothing is stopped by name.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
SGLANG_LAUNCHER = ["python3", "-m", "sglang.launch_server"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def standin_command(engine_argv: list[str], keys: Path | None = None) -> list[str]:
    """Run an engine command line (as `k31 plan` writes it) on the stand-in instead of SGLang. The planned key
    file (`--config /etc/k31/<unit>.auth.yaml`) is the hosts'; here the engine takes `keys` (a file of the
    same form) or runs without keys."""
    if engine_argv[: len(SGLANG_LAUNCHER)] == SGLANG_LAUNCHER:
        engine_argv = engine_argv[len(SGLANG_LAUNCHER):]
    if "--config" in engine_argv:
        i = engine_argv.index("--config")
        engine_argv = engine_argv[:i] + engine_argv[i + 2:]
    return [sys.executable, "-m", "k31deploy.standin", *engine_argv, *(["--config", str(keys)] if keys else [])]


def router_command(router_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "sglang_router.launch_router", *router_args]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    stdout: Path
    stderr: Path

    def stop(self, grace: float = 10.0) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(grace)
        return self.popen.returncode

    def logs(self) -> str:
        return f"--- {self.name} stdout\n{self.stdout.read_text()}\n--- {self.name} stderr\n" + \
            self.stderr.read_text()[-4000:]


@dataclass
class Processes:
    """Starts processes with logs under `workdir` and stops every one of them by PID."""

    workdir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> Proc:
        full_env = {**os.environ, **(env or {})}
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        out, err = self.workdir / f"{name}.out", self.workdir / f"{name}.err"
        with out.open("wb") as fout, err.open("wb") as ferr:
            popen = subprocess.Popen(command, stdout=fout, stderr=ferr, env=full_env, cwd=self.workdir)
        proc = Proc(name, popen, out, err)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()

    def wait_status(self, url: str, status: int = 200, timeout: float = 30.0) -> float:
        """Poll `url` until it answers `status`; seconds waited. Fails early if a process died."""
        began = time.monotonic()
        last: object = None
        while time.monotonic() - began < timeout:
            for proc in self.procs:
                if proc.popen.poll() is not None:
                    raise AssertionError(f"{proc.name} exited with {proc.popen.returncode}\n{proc.logs()}")
            try:
                last = httpx.get(url, timeout=2).status_code
                if last == status:
                    return time.monotonic() - began
            except httpx.TransportError as exc:
                last = exc
            time.sleep(0.05)
        logs = "\n".join(p.logs() for p in self.procs)
        raise AssertionError(f"{url} did not answer {status} within {timeout} s (last: {last})\n{logs}")
