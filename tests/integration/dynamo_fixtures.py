"""The real NVIDIA Dynamo frontend and k31's Dynamo worker stand-in on 127.0.0.1, for integration tests.

Dynamo runs from its own venv (``state_dir()/venvs/dynamo``), built offline from the wheelhouse:
installed into the test venv it registers pytest plugins that silently skip ``test_sglang_*`` files.

Every listener stays on loopback: discovery is a folder (``--discovery-backend file``), the event
plane is a NATS server bound to 127.0.0.1 (the ZMQ event plane binds 0.0.0.0 on random ports
whatever its advertised host says), and the request/response planes take ``DYN_TCP_*_HOST``.
Each process runs in its own process group and is stopped through it, by PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from k31deploy import wheelhouse
from k31deploy.paths import state_dir

REPO = Path(__file__).resolve().parents[2]
MODEL = "k31-tiny"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_system_port() -> int:
    """A free port for DYN_SYSTEM_PORT, which the 1.6.1 runtime reads as an i16 (the kernel's ephemeral
    ports start at 32768)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with contextlib.suppress(OSError), socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
            return port
    raise AssertionError("no free port below 32768")


def dynamo_venv() -> Path:
    """The Dynamo venv, built from the wheelhouse when absent (both steps are no-ops when done)."""
    house = wheelhouse.build("dynamo", wheelhouse.default_wheelhouse(), wheelhouse.host_arch())
    return wheelhouse.install("dynamo", state_dir() / "venvs" / "dynamo", house)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def stop(self, grace: float = 10.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(grace)

    def tail(self, chars: int = 3000) -> str:
        return f"--- {self.name} (exit {self.popen.poll()})\n{self.log.read_text(errors='replace')[-chars:]}"


@dataclass
class Processes:
    workdir: Path
    env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env={**self.env, **(env or {})}, cwd=self.workdir,
                start_new_session=True,
            )
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def check_alive(self) -> None:
        dead = [p for p in self.procs if p.popen.poll() is not None]
        if dead:
            raise AssertionError("process exited early:\n" + "\n".join(p.tail() for p in dead))

    def tails(self) -> str:
        return "\n".join(p.tail() for p in self.procs)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def base_env(workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(
        DYN_FILE_KV=str(workdir / "discovery"),
        DYN_TCP_RPC_HOST="127.0.0.1",
        DYN_TCP_RESPONSE_STREAM_HOST="127.0.0.1",
        DYN_EVENT_PLANE_HOST="127.0.0.1",
        DYN_SYSTEM_HOST="127.0.0.1",
        HOME=str(workdir),  # the frontend caches model cards in ~/.cache/dynamo (XDG_CACHE_HOME is ignored)
        HF_HUB_OFFLINE="1",
    )
    return env


def start_nats(procs: Processes) -> str:
    binary = shutil.which("nats-server")
    if binary is None:
        raise AssertionError("nats-server is not installed (Debian package nats-server)")
    port = free_port()
    procs.start("nats", [binary, "-a", "127.0.0.1", "-p", str(port)])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        procs.check_alive()
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return f"nats://127.0.0.1:{port}"
        time.sleep(0.1)
    raise AssertionError("nats-server did not listen within 10 s\n" + procs.tails())


def write_model(venv: Path, directory: Path) -> Path:
    """Generate the tiny model with the Dynamo venv's interpreter (tokenizers lives there)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    argv = [str(venv / "bin" / "python"), "-m", "k31deploy.tinymodel", str(directory), MODEL]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{argv} failed:\n{done.stderr}"
    return directory


@dataclass
class Stack:
    """One Dynamo namespace: a frontend and its workers."""

    procs: Processes
    venv: Path
    model_dir: Path
    namespace: str
    http_port: int = 0
    system_ports: dict[str, int] = field(default_factory=dict)   # worker name -> its DYN_SYSTEM_PORT

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def python(self, module: str, *args: str) -> list[str]:
        return [str(self.venv / "bin" / "python"), "-m", module, *args]

    def start_frontend(self) -> None:
        self.http_port = free_port()
        self.procs.start(
            f"frontend-{self.namespace}",
            self.python(
                "dynamo.frontend",
                "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                "--router-mode", "kv", "--router-session-affinity-ttl-secs", "60", "--migration-limit", "3",
                "--discovery-backend", "file", "--event-plane", "nats", "--namespace", self.namespace,
            ),
        )  # fmt: skip

    def start_worker(self, name: str, mode: str = "null", env: dict[str, str] | None = None) -> Proc:
        """`python -m k31deploy.standin.dynamo` with the SGLang flags a dynamo.sglang worker gets and the Dynamo
        settings by environment, as the plan gives them; `env` adds to them (the stand-in's timing model ...)."""
        argv = ["--model-path", str(self.model_dir), "--served-model-name", MODEL, "--disaggregation-mode", mode]
        if mode == "prefill":
            argv += ["--disaggregation-bootstrap-port", str(free_port())]
        self.system_ports[name] = free_system_port()
        dynamo_env = {
            "PYTHONPATH": str(REPO), "K31_STANDIN_MODEL_DIR": str(self.model_dir), "DYN_NAMESPACE": self.namespace,
            "DYN_DISCOVERY_BACKEND": "file", "DYN_EVENT_PLANE": "nats", "DYN_SYSTEM_PORT": str(self.system_ports[name]),
            "DYN_REASONING_PARSER": "kimi_k3", "DYN_TOOL_CALL_PARSER": "kimi_k3",
        }  # fmt: skip
        return self.procs.start(f"{name}-{self.namespace}", self.python("k31deploy.standin.dynamo", *argv),
                                {**dynamo_env, **(env or {})})

    def instances(self, component: str) -> set[int]:
        """Worker ids registered for `component`'s generate endpoint, read from the discovery folder."""
        folder = Path(self.procs.env["DYN_FILE_KV"]) / "v1" / "instances"
        ids = set()
        for path in folder.glob("*") if folder.is_dir() else ():
            with contextlib.suppress(OSError, ValueError):
                record = json.loads(path.read_text())
                if (record.get("namespace"), record.get("component"), record.get("endpoint")) == (
                    self.namespace,
                    component,
                    "generate",
                ):
                    ids.add(int(record["instance_id"]))
        return ids

    def wait_ready(self, expected: dict[str, int], timeout: float = 90.0) -> None:
        """Gate: every worker registered and the model listed (frontend /health is 200 with none)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.procs.check_alive()
            if all(len(self.instances(c)) >= n for c, n in expected.items()):
                with contextlib.suppress(httpx.HTTPError):
                    models = httpx.get(f"{self.url}/v1/models", timeout=2).json()
                    if MODEL in [m["id"] for m in models.get("data", [])]:
                        return
            time.sleep(0.25)
        raise AssertionError(f"{self.namespace} not ready within {timeout} s\n" + self.procs.tails())


def listening_sockets(pids: list[int]) -> list[tuple[int, str]]:
    """(pid, local address) of every TCP socket in LISTEN state that one of `pids` holds (Linux)."""
    owner = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("socket:["):
                        owner[target[8:-1]] = pid
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with contextlib.suppress(OSError), open(table) as lines:
            for line in list(lines)[1:]:
                cols = line.split()
                local, state, inode = cols[1], cols[3], cols[9]
                if state == "0A" and inode in owner:  # 0A: LISTEN
                    found.append((owner[inode], _address(local, width)))
    return found


def _address(hex_addr: str, width: int) -> str:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if sys.byteorder == "little":  # /proc prints each 32-bit word in host byte order
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, raw)
    return f"{ip}:{int(port, 16)}"


def process_tree(root_pids: list[int]) -> list[int]:
    """The given PIDs and every process in their process groups (the workers' children too)."""
    groups = set(root_pids)
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError):
                if os.getpgid(int(entry)) in groups:
                    members.append(int(entry))
    return members
