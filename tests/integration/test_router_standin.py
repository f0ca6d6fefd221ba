"""The REAL SGLang router (PyPI sglang-router 0.3.2) in front of stand-in engines on 127.0.0.1,
regular and PD mode, driven by the official `openai` client; plus the stand-in as a process
(loading, argv record, SIGTERM, node ranks, monokernel)."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from openai import OpenAI
from standin_fixtures import Processes, free_port, router_command, standin_command

from k31deploy.recipe import resolve
from k31deploy.standin import replies
from k31deploy.standin.server import WIDE_LOG_LINE

pytestmark = pytest.mark.integration

MODEL = "moonshotai/Kimi-K3.1-Pro"
QUESTION = [{"role": "user", "content": "What is 15% of 240?"}]
WEATHER = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]


def _set(argv: list[str], flag: str, value: str) -> None:
    argv[argv.index(flag) + 1] = value


def engine_launch(role: str, port: int, bootstrap_port: int | None = None,
                  monokernel: bool = False) -> tuple[list[str], dict[str, str]]:
    """(argv, env) of one MI355X server exactly as `k31 plan --json` lists its rank 0, moved onto
    loopback test ports: the 92-agent 1P1D for prefill/decode, the 16-agent single node (HiCache) or
    the 8-agent one (monokernel) for unified."""
    agents = 92 if role in ("prefill", "decode") else 8 if monokernel else 16
    plan = resolve({"platform": "mi355x", "agents": agents, "model_path": "/models/kimi",
                    "draft_model_path": "/models/kimi-dflash"})
    rank = next(s for s in plan["servers"] if s["role"] == role)["ranks"][0]
    argv = list(rank["argv"])
    _set(argv, "--host", "127.0.0.1")
    _set(argv, "--port", str(port))
    if role == "prefill":
        _set(argv, "--disaggregation-bootstrap-port", str(bootstrap_port))
    return argv, dict(rank["env"])


def router_args(port: int, workers: list[str] | None = None, prefill: tuple[str, int] | None = None,
                decode: str | None = None, policy: str = "round_robin") -> list[str]:
    # launch_router binds 0.0.0.0 and a metrics port 29000 unless told otherwise (field notes §4).
    args = ["--host", "127.0.0.1", "--port", str(port), "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-timeout-secs", "60", "--log-level", "warn"]
    if workers:
        args += ["--worker-urls", *workers]
    if prefill:
        args += ["--pd-disaggregation", "--prefill", prefill[0], str(prefill[1]), "--decode", decode]
    return args


@pytest.fixture
def procs(tmp_path):
    processes = Processes(tmp_path)
    yield processes
    processes.stop_all()


def requests_seen(url: str) -> int:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("sglang:num_requests_total{"):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError(f"{url}/metrics has no sglang:num_requests_total")


def wait_workers(procs: Processes, router: str, want: dict[str, int], timeout: float = 60.0) -> float:
    """Wait until the router lists `want` healthy workers per type (regular, prefill, decode)."""
    procs.wait_status(f"{router}/readiness", 200, timeout)
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        workers = httpx.get(f"{router}/workers", timeout=5).json()["workers"]
        healthy = {kind: sum(w["worker_type"] == kind and w["is_healthy"] for w in workers) for kind in want}
        if healthy == want:
            return time.monotonic() - began
        time.sleep(0.1)
    raise AssertionError(f"router workers never reached {want}: {workers}")


def exercise(router: str) -> int:
    """Drive the router as a user would; returns how many generation requests were sent."""
    client = OpenAI(base_url=f"{router}/v1", api_key="EMPTY", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == [MODEL]

    expected = replies.chat_reply({"messages": QUESTION}, "kimi_k3", "kimi_k3")
    answer = client.chat.completions.create(model=MODEL, messages=QUESTION)
    assert answer.choices[0].message.content == "".join(expected.content)
    assert answer.choices[0].message.reasoning_content == "".join(expected.reasoning)

    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == "".join(expected.content)

    # The openai client hides the SSE framing; a truncated stream must not pass for a whole one.
    body = {"model": MODEL, "messages": QUESTION, "stream": True, "max_tokens": 4}
    with httpx.stream("POST", f"{router}/v1/chat/completions", json=body, timeout=30) as raw:
        assert raw.status_code == 200
        events = [line for line in raw.iter_lines() if line.startswith("data:")]
    assert events[-1].replace(" ", "") == "data:[DONE]"
    assert json.loads(events[-2].removeprefix("data:"))["choices"][0]["finish_reason"] == "length"

    lengths = {}
    for effort in ("low", "high", "max"):
        msg = client.chat.completions.create(model=MODEL, messages=QUESTION, reasoning_effort=effort)
        lengths[effort] = len(msg.choices[0].message.reasoning_content.split())
    assert lengths["low"] < lengths["high"] < lengths["max"], lengths

    weather = [{"role": "user", "content": "What's the weather in Beijing?"}]
    called = client.chat.completions.create(model=MODEL, messages=weather, tools=WEATHER)
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    return 7


def test_router_regular_mode_over_two_unified_standins(procs):
    timings = {}
    began = time.monotonic()
    workers = []
    for i in range(2):
        port = free_port()
        argv, env = engine_launch("unified", port)
        procs.start(f"unified{i}", standin_command(argv), env)
        workers.append(f"http://127.0.0.1:{port}")
    for url in workers:
        procs.wait_status(f"{url}/health")
    timings["engines_healthy"] = time.monotonic() - began
    r_port = free_port()
    router = f"http://127.0.0.1:{r_port}"
    procs.start("router", router_command(router_args(r_port, workers=workers)))
    timings["router_ready"] = wait_workers(procs, router, {"regular": 2})
    began = time.monotonic()
    sent = exercise(router)
    timings["client_requests"] = time.monotonic() - began
    seen = [requests_seen(url) for url in workers]
    assert sum(seen) == sent and all(seen), seen  # round robin reached both engines
    print(f"regular-mode timings (s): { {k: round(v, 2) for k, v in timings.items()} }")


def test_router_pd_mode_over_prefill_and_decode_standins(procs):
    timings = {}
    began = time.monotonic()
    p_port, b_port, d_port = free_port(), free_port(), free_port()
    prefill, decode = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    argv, env = engine_launch("prefill", p_port, b_port)
    procs.start("prefill", standin_command(argv), env)
    argv, env = engine_launch("decode", d_port)
    procs.start("decode", standin_command(argv), env)
    for url in (prefill, decode, f"http://127.0.0.1:{b_port}"):
        procs.wait_status(f"{url}/health")
    timings["engines_healthy"] = time.monotonic() - began
    # A decode on its own refuses work: only the PD router adds the bootstrap fields.
    direct = httpx.post(f"{decode}/v1/chat/completions", json={"model": MODEL, "messages": QUESTION})
    assert direct.status_code == 400 and "bootstrap_room" in direct.json()["message"]

    r_port = free_port()
    router = f"http://127.0.0.1:{r_port}"
    args = router_args(r_port, prefill=(prefill, b_port), decode=decode, policy="power_of_two")
    procs.start("router", router_command(args))
    timings["router_ready"] = wait_workers(procs, router, {"prefill": 1, "decode": 1})
    began = time.monotonic()
    sent = exercise(router)
    timings["client_requests"] = time.monotonic() - began
    # Every request reached both roles: the decode answered only after the prefill took its room.
    assert (requests_seen(prefill), requests_seen(decode)) == (sent, sent)
    print(f"PD-mode timings (s): { {k: round(v, 2) for k, v in timings.items()} }")


# -- the stand-in as a process ------------------------------------------------------------------


def test_standin_process_loads_records_argv_and_exits_0_on_sigterm(procs, tmp_path):
    port = free_port()
    argv, env = engine_launch("unified", port)
    record = tmp_path / "record.json"
    proc = procs.start("engine", standin_command(argv), {**env, "K31_STANDIN_LOAD_SECONDS": "3",
                                                         "K31_STANDIN_RECORD": str(record)})
    url = f"http://127.0.0.1:{port}"
    procs.wait_status(f"{url}/health", 503)
    assert httpx.get(f"{url}/health_generate").status_code == 503
    assert procs.wait_status(f"{url}/health", 200) > 0.5
    recorded = json.loads(record.read_text())
    assert recorded["argv"] == standin_command(argv)[3:]    # the planned flags, without the hosts' key file
    assert recorded["env"]["SGLANG_USE_AITER"] == "1"
    assert recorded["pid"] == proc.popen.pid
    assert proc.stop(grace=5) == 0


def test_standin_node_rank_1_serves_only_health(procs):
    port = free_port()
    argv, env = engine_launch("unified", port)
    argv += ["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "127.0.0.1:5000"]
    procs.start("rank1", standin_command(argv), env)
    url = f"http://127.0.0.1:{port}"
    procs.wait_status(f"{url}/health")
    for path in ("/server_info", "/v1/models", "/get_load"):
        assert httpx.get(f"{url}{path}").status_code == 404
    assert httpx.post(f"{url}/generate", json={"text": "hi"}).status_code == 404


def test_standin_monokernel_logs_first_wide_step_once(procs):
    port = free_port()
    argv, env = engine_launch("unified", port, monokernel=True)
    proc = procs.start("mono", standin_command(argv), env)
    url = f"http://127.0.0.1:{port}"
    procs.wait_status(f"{url}/health")
    for _ in range(3):
        assert httpx.post(f"{url}/v1/chat/completions", json={"messages": QUESTION}).status_code == 200
    assert proc.stop() == 0
    assert proc.stdout.read_text().splitlines().count(WIDE_LOG_LINE) == 1


@pytest.mark.parametrize(
    ("extra", "rc", "message"),
    [
        (["--enable-amd-monokernel"], 1, "HiCache is on"),  # the unified cell carries HiCache
        (["--enable-amd-monokernel", "--pp-size", "2"], 1, "the layout is TP8·DCP8·PP2"),
        (["--no-such-flag"], 2, "unrecognized arguments: --no-such-flag"),
    ],
)
def test_standin_refuses_at_startup(procs, extra, rc, message):
    argv, env = engine_launch("unified", free_port())
    proc = procs.start("refused", standin_command([*argv, *extra]), env)
    assert proc.popen.wait(30) == rc
    assert message in proc.stderr.read_text()
