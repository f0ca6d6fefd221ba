"""The real Dynamo frontend (KV router, session affinity) over k31's Dynamo worker stand-in, on 127.0.0.1.

Two namespaces, each with its own frontend: ``k31agg`` has two aggregated workers (KV routing and
``X-Dynamo-Session-ID`` affinity), ``k31pd`` a prefill and a decode worker (the disaggregated split).
Driven with the official ``openai`` client; ``nvext.extra_fields = ["worker_id"]`` makes every reply
name the workers that served it, which the tests compare with the ids in the discovery folder.
"""

from __future__ import annotations

import json
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from dynamo_fixtures import (
    MODEL,
    Processes,
    Stack,
    base_env,
    dynamo_venv,
    listening_sockets,
    process_tree,
    start_nats,
    write_model,
)

from k31deploy import smoke
from k31deploy.standin import replies

pytestmark = pytest.mark.integration
WEATHER = smoke.WEATHER_TOOL

WORDS = [
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta",
    "theta", "iota", "kappa", "lambda", "omicron", "sigma", "omega",
]  # fmt: skip


@pytest.fixture(scope="module")
def procs(tmp_path_factory) -> Iterator[Processes]:
    workdir = tmp_path_factory.mktemp("dynamo")
    processes = Processes(workdir, env=base_env(workdir))
    try:
        processes.env["NATS_SERVER"] = start_nats(processes)
        yield processes
    finally:
        processes.stop_all()


@pytest.fixture(scope="module")
def venv() -> Path:
    return dynamo_venv()


@pytest.fixture(scope="module")
def model_dir(venv, tmp_path_factory) -> Path:
    return write_model(venv, tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def agg(procs, venv, model_dir) -> Stack:
    stack = Stack(procs, venv, model_dir, "k31agg")
    stack.start_frontend()
    stack.start_worker("worker-a")
    stack.start_worker("worker-b")
    stack.wait_ready({"backend": 2})
    return stack


@pytest.fixture(scope="module")
def pd(procs, venv, model_dir) -> Stack:
    stack = Stack(procs, venv, model_dir, "k31pd")
    stack.start_frontend()
    stack.start_worker("prefill", mode="prefill")
    stack.start_worker("decode", mode="decode")
    stack.wait_ready({"prefill": 1, "backend": 1})
    return stack


def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=30, max_retries=0)


def ask(stack: Stack, prompt: str, session: str | None = None, max_tokens: int = 4) -> dict:
    """One chat completion; returns its nvext worker ids (prefill_worker_id, decode_worker_id)."""
    reply = client(stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        extra_body={"nvext": {"extra_fields": ["worker_id"]}},
        extra_headers={"X-Dynamo-Session-ID": session} if session else None,
    )
    return reply.model_extra["nvext"]["worker_id"]


def prompt(rng: random.Random) -> str:
    # 200 words: well over a few 16-token KV blocks, so a repeat has real overlap to route on
    return " ".join(rng.choice(WORDS) for _ in range(200))


def test_tiny_model_has_what_the_frontend_and_worker_read(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    ids = set(vocab.values()) | {t["id"] for t in tokenizer["added_tokens"]}
    assert config["vocab_size"] == len(ids)
    # every word of the stand-in's replies is one token, with or without its leading space (byte-level "Ġ")
    assert all(w in vocab and f"\u0120{w}" in vocab for w in replies.VOCAB)
    added = {t["content"]: t["special"] for t in tokenizer["added_tokens"]}
    # the XTML markers are plain tokens: the frontend detokenises without special tokens, its parser needs them
    assert {added[m] for m in ("<|open|>", "<|close|>", "<|sep|>")} == {False}
    assert added[tokenizer_config["eos_token"]] and added["<|im_start|>"]
    assert "tools | tojson" in tokenizer_config["chat_template"]
    assert "reasoning_effort" in tokenizer_config["chat_template"]


def test_model_is_listed_and_chat_completes(agg):
    llm = client(agg)
    assert MODEL in [m.id for m in llm.models.list().data]

    reply = llm.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=8
    )
    # the SGLang stand-in's contract: max_tokens bounds the answer, not the reasoning
    assert len(reply.choices[0].message.content.split()) == 8 and reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.model_extra["reasoning_content"].strip()

    stream = llm.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "And stream it."}], max_tokens=6, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason is not None


def test_replies_are_the_sglang_stand_ins_with_reasoning_and_tool_calls(pd):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for effort in ("low", "high"):
        want = replies.chat_reply({"messages": messages, "reasoning_effort": effort}, "kimi_k3", "kimi_k3")
        got = client(pd).chat.completions.create(
            model=MODEL, messages=messages, extra_body={"reasoning_effort": effort}
        )
        message = got.choices[0].message
        assert message.model_extra["reasoning_content"] == "".join(want.reasoning)
        assert message.content == "".join(want.content) and got.choices[0].finish_reason == "stop"

    want = replies.chat_reply({"messages": messages, "tools": [WEATHER]}, "kimi_k3", "kimi_k3")
    got = client(pd).chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    (call,) = got.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather", json.loads(want.tool_calls[0]["function"]["arguments"]))
    assert got.choices[0].finish_reason == "tool_calls"


def test_smoke_passes_every_check(pd):
    results = smoke.run_smoke(f"{pd.url}/v1", MODEL)
    assert [(r.name, r.ok, r.skipped) for r in results] == [(name, True, False) for name, _ in smoke.CHECKS], results


def test_kv_router_uses_both_workers_and_follows_cached_prefixes(agg):
    workers = agg.instances("backend")
    rng = random.Random(31)
    seen = set()
    for _ in range(40):
        ids = ask(agg, prompt(rng))
        assert ids["prefill_worker_id"] == ids["decode_worker_id"], "aggregated workers do both phases"
        seen.add(ids["decode_worker_id"])
        if seen == workers:
            break
    assert seen == workers, f"unrelated prompts reached {seen}, registered workers are {workers}"

    cached = prompt(rng)
    first = ask(agg, cached)["decode_worker_id"]
    assert [ask(agg, cached)["decode_worker_id"] for _ in range(5)] == [first] * 5


def test_session_affinity_beats_kv_overlap(agg):
    rng = random.Random(131)
    cached = prompt(rng)
    owner = ask(agg, cached)["decode_worker_id"]  # the worker that now holds `cached` in its KV cache
    # open sessions until one is bound to the other worker (each first request is routed freely)
    for attempt in range(40):
        session = f"k31-session-{attempt}"
        bound = ask(agg, prompt(rng), session)["decode_worker_id"]
        if bound != owner:
            break
    else:
        pytest.fail(f"40 new sessions all landed on worker {owner}")
    # without affinity the KV router sends `cached` to `owner` (see the test above); with it, the
    # session's worker serves it, and every other request of the session
    assert [ask(agg, cached, session)["decode_worker_id"] for _ in range(3)] == [bound] * 3
    assert [ask(agg, prompt(rng), session)["decode_worker_id"] for _ in range(4)] == [bound] * 4


def test_prefill_and_decode_run_on_their_own_workers(pd):
    (prefill,) = pd.instances("prefill")
    (decode,) = pd.instances("backend")
    assert prefill != decode
    rng = random.Random(7)
    # the frontend switches to disaggregated routing once it has seen the prefill worker
    deadline = time.monotonic() + 20
    while ask(pd, prompt(rng))["prefill_worker_id"] != prefill:
        assert time.monotonic() < deadline, "the frontend never routed a prefill to the prefill worker"
        time.sleep(0.25)
    for _ in range(3):
        assert ask(pd, prompt(rng)) == {
            "prefill_worker_id": prefill,
            "prefill_dp_rank": 0,
            "decode_worker_id": decode,
            "decode_dp_rank": 0,
        }


def test_every_listener_is_on_loopback(procs, agg, pd):
    pids = process_tree([p.popen.pid for p in procs.procs])
    sockets = listening_sockets(pids)
    http_ports = {agg.http_port, pd.http_port}
    assert http_ports <= {int(addr.rsplit(":", 1)[1]) for _pid, addr in sockets}, sockets
    exposed = [(pid, addr) for pid, addr in sockets if not addr.startswith("127.0.0.1:")]
    assert exposed == [], f"listeners beyond loopback: {exposed}"


def metric(base: str, name: str) -> float:
    lines = httpx.get(f"{base}/metrics", timeout=5).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def test_sigterm_leaves_discovery_then_finishes_in_flight_streams_then_exits(procs, venv, model_dir):
    """What a drain builds on (upstream dynamo.sglang's shutdown): SIGTERM takes the worker out of discovery at
    once, its in-flight stream runs to [DONE] past the grace period, then the process exits 0. Runs last: its
    worker is gone afterwards."""
    stack = Stack(procs, venv, model_dir, "k31drain")
    stack.start_frontend()
    timing = {"K31_STANDIN_TTFT_BASE_MS": "500", "K31_STANDIN_TOKEN_MS": "100",
              "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "1"}
    worker = stack.start_worker("worker", env=timing)
    stack.wait_ready({"backend": 1})
    (instance,) = stack.instances("backend")
    system = f"http://127.0.0.1:{stack.system_ports['worker']}"
    assert httpx.get(f"{system}/health", timeout=5).json()["status"] == "ready"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "drain me"}], "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=60) as response:
        events = (line for line in response.iter_lines() if line)
        next(events)
        assert time.monotonic() - start >= 0.5, "the first token came before the TTFT base"
        assert metric(system, "dynamo_component_inflight_requests") == 1
        worker.popen.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while instance in stack.instances("backend"):
            assert time.monotonic() - signalled < 2, "SIGTERM left the worker in discovery"
            time.sleep(0.05)
        assert worker.popen.poll() is None
        rest = list(events)
    finished = time.monotonic() - signalled
    procs.procs.remove(worker)
    assert rest[-1] == "data: [DONE]", rest[-3:]
    # ~80 tokens of 100 ms: the stream outlived the 1 s grace period, and the worker waited for it
    assert finished > 3, finished
    assert worker.popen.wait(30) == 0
