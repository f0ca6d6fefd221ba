"""The real Dynamo frontend (KV router, session affinity) over real mocker workers, on 127.0.0.1.

Two namespaces, each with its own frontend: ``k31agg`` has two aggregated workers (KV routing and
``X-Dynamo-Session-ID`` affinity), ``k31pd`` a prefill and a decode worker (the disaggregated split).
Driven with the official ``openai`` client; ``nvext.extra_fields = ["worker_id"]`` makes every reply
name the workers that served it, which the tests compare with the ids in the discovery folder.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

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

pytestmark = pytest.mark.integration

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
    stack.start_mocker("worker-a")
    stack.start_mocker("worker-b")
    stack.wait_ready({"backend": 2})
    return stack


@pytest.fixture(scope="module")
def pd(procs, venv, model_dir) -> Stack:
    stack = Stack(procs, venv, model_dir, "k31pd")
    stack.start_frontend()
    stack.start_mocker("prefill", mode="prefill")
    stack.start_mocker("decode", mode="decode")
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


def test_tiny_model_has_what_the_mocker_reads(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    ids = set(tokenizer["model"]["vocab"].values()) | {t["id"] for t in tokenizer["added_tokens"]}
    # the mocker emits ids around 1000-1999: every one of them must decode
    assert set(range(2048)) <= ids
    assert config["vocab_size"] == len(ids)
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert {tokenizer_config["eos_token"], "<|im_start|>"} <= {t["content"] for t in tokenizer["added_tokens"]}


def test_model_is_listed_and_chat_completes(agg):
    llm = client(agg)
    assert MODEL in [m.id for m in llm.models.list().data]

    reply = llm.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say something."}], max_tokens=8
    )
    assert reply.choices[0].message.content.strip()
    assert reply.usage.completion_tokens == 8

    stream = llm.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "And stream it."}], max_tokens=6, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason is not None


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
