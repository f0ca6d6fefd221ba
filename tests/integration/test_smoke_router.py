"""`python -m k31deploy.smoke` as a process through the REAL SGLang router (sglang-router 0.3.2) in
front of a stand-in engine process that runs the plan's own engine argv, all on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from standin_fixtures import REPO, Processes, free_port, router_command, standin_command

from k31deploy.recipe import resolve
from k31deploy.smoke import API_KEY_ENV

pytestmark = pytest.mark.integration

CHECKS = ["models", "chat", "stream", "reasoning", "tool_call"]


@pytest.fixture
def procs(tmp_path):
    processes = Processes(tmp_path)
    yield processes
    processes.stop_all()


def plan_engine(port: int, drop: tuple[str, ...] = ()) -> tuple[list[str], dict[str, str], str]:
    """(argv, env, model) of the MI355X single-node server as `k31 plan` resolves it, listening on
    127.0.0.1:port, without the flags in `drop` (and their values)."""
    plan = resolve({"platform": "mi355x", "agents": 32})
    rank = plan["servers"][0]["ranks"][0]
    argv, out = rank["argv"], []
    i = 0
    while i < len(argv):
        flag = argv[i]
        takes_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        value = argv[i + 1] if takes_value else None
        i += 2 if takes_value else 1
        if flag in drop:
            continue
        value = {"--host": "127.0.0.1", "--port": str(port)}.get(flag, value)
        out += [flag] if value is None else [flag, value]
    return out, rank["env"], plan["model"]


def start_router(procs: Processes, worker: str, extra: tuple[str, ...] = ()) -> str:
    port = free_port()
    # launch_router binds 0.0.0.0 and a metrics port 29000 unless told otherwise (field notes §4).
    procs.start("router", router_command([
        "--worker-urls", worker, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--worker-startup-timeout-secs", "60", "--log-level", "warn", *extra]))
    router = f"http://127.0.0.1:{port}"
    procs.wait_status(f"{router}/readiness", 200, 60)  # 503 until a worker is registered
    return router


def smoke(router: str, model: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop(API_KEY_ENV, None)
    return subprocess.run([sys.executable, "-m", "k31deploy.smoke", "--base-url", f"{router}/v1", "--model", model,
                           "--timeout", "30", *extra], capture_output=True, text=True, env=env, timeout=120)


def rows(stdout: str) -> dict[str, str]:
    lines = stdout.splitlines()
    assert lines[0].split() == ["CHECK", "RESULT", "SECONDS", "DETAIL"], stdout
    return {line.split()[0]: line.split()[1] for line in lines[1:-1]}


@pytest.mark.parametrize(("drop", "rc", "failed"), [
    ((), 0, set()),
    (("--tool-call-parser",), 1, {"tool_call"}),
])
def test_smoke_through_the_real_router(procs, drop, rc, failed):
    port = free_port()
    argv, env, model = plan_engine(port, drop)
    assert ("--tool-call-parser" in argv) == (not drop)
    procs.start("engine", standin_command(argv), env)
    procs.wait_status(f"http://127.0.0.1:{port}/health")
    router = start_router(procs, f"http://127.0.0.1:{port}")
    done = smoke(router, model)
    assert done.returncode == rc, done.stdout + done.stderr
    table = rows(done.stdout)
    assert list(table) == CHECKS
    assert {name for name, result in table.items() if result == "FAIL"} == failed
    assert {result for name, result in table.items() if name not in failed} == {"ok"}
    assert done.stdout.splitlines()[-1] == f"{5 - len(failed)} of 5 checks passed against {router}/v1 (model {model})"


def test_smoke_sends_the_router_api_key_and_never_prints_it(procs, tmp_path):
    key = "sk-k31-router-7f3a9c"
    port = free_port()
    argv, env, model = plan_engine(port)
    procs.start("engine", standin_command(argv), env)
    procs.wait_status(f"http://127.0.0.1:{port}/health")
    router = start_router(procs, f"http://127.0.0.1:{port}", ("--api-key", key))
    key_file = tmp_path / "router.key"
    key_file.write_text(key + "\n")
    done = smoke(router, model, "--api-key-file", str(key_file))
    assert done.returncode == 0, done.stdout + done.stderr
    # Without the key the router answers 401 to generation (0.3.2 leaves /v1/models open).
    refused = smoke(router, model)
    assert refused.returncode == 1
    assert rows(refused.stdout) == {"models": "ok", **dict.fromkeys(CHECKS[1:], "FAIL")}
    assert "HTTP 401" in refused.stdout
    for run in (done, refused):
        assert key not in run.stdout + run.stderr
