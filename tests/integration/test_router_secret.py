"""The REAL sglang-router 0.3.2 started the way the k31_router role starts a keyed router: through
k31-secret-exec, with the API key in the environment only. The key guards the router (401 without it)
and is in no process's /proc/<pid>/cmdline on this machine."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from cmdline_watch import command_lines
from standin_fixtures import Processes, free_port, standin_command

from k31deploy import launch
from k31deploy.recipe import resolve

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SECRET_EXEC = REPO / "roles" / "k31_router" / "files" / "k31-secret-exec.py"
KEY = "k31-itest-router-key-5d2e"
MODEL = "moonshotai/Kimi-K3.1-Pro"


def cmdlines_with(secret: str) -> list[str]:
    return [f"{pid}: {data.decode(errors='replace').replace(chr(0), ' ')}" for pid, data in command_lines()
            if secret.encode() in data]


@pytest.fixture
def procs(tmp_path):
    processes = Processes(tmp_path)
    yield processes
    processes.stop_all()


def test_a_keyed_router_checks_the_key_that_no_command_line_shows(procs, tmp_path):
    plan = resolve({"platform": "mi355x", "agents": 16, "model_path": "/models/kimi"})
    engine = list(next(s for s in plan["servers"] if s["role"] == "unified")["ranks"][0]["argv"])
    engine_port = free_port()
    engine[engine.index("--host") + 1] = "127.0.0.1"
    engine[engine.index("--port") + 1] = str(engine_port)
    # The engine checks the same key (sglang-router sends its --api-key to its workers), from a 0600 file.
    keys = tmp_path / "engine.auth.yaml"
    keys.write_text(f'api-key: "{KEY}"\nadmin-api-key: "admin-{KEY}"\n')
    keys.chmod(0o600)
    procs.start("engine", standin_command(engine, keys))
    port = free_port()
    planned = ["python3", "-m", "sglang_router.launch_router", "--worker-urls", f"http://127.0.0.1:{engine_port}",
               "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--worker-startup-timeout-secs", "60", "--log-level", "warn"]
    # What router.sh.j2 runs for the venv runtime, with this test's Python as the venv.
    command = launch.service_command(planned, "venv", unit="k31-router", image=None,
                                     venv=str(Path(sys.executable).parent.parent),
                                     secret_flags={"--api-key": "K31_ROUTER_API_KEY"},
                                     secret_exec=str(SECRET_EXEC))
    assert KEY not in " ".join(command)
    router = procs.start("router", command, env={"K31_ROUTER_API_KEY": KEY})
    base = f"http://127.0.0.1:{port}"
    procs.wait_status(f"{base}/readiness", 200, timeout=60)

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).status_code == 401
    wrong = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"},
                       timeout=30)
    assert wrong.status_code == 401
    right = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=30)
    assert right.status_code == 200 and right.json()["choices"][0]["message"]["content"]

    # launch_router renames its process title (setproctitle) once it runs; before that /proc shows the
    # launcher's own command line (tests/unit/test_secret_exec.py). Neither holds the key.
    own = Path(f"/proc/{router.popen.pid}/cmdline").read_bytes().decode()
    assert own.startswith("sglang::router") and KEY not in own
    assert cmdlines_with(KEY) == []
    assert KEY not in router.stdout.read_text() + router.stderr.read_text()
