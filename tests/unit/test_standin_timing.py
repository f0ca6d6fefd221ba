"""The stand-in's timing model: TTFT from a base and the prompt's length, a delay per output token streamed as it
goes, and a running batch bounded by --max-running-requests with a waiting queue behind it (in-process servers on
127.0.0.1, ephemeral ports)."""

from __future__ import annotations

import itertools
import json
import re
import threading
import time

import httpx
import pytest

from k31deploy.standin.parser import parse_args
from k31deploy.standin.server import BootstrapHandler, Engine, EngineHandler, main, timing_seconds

MODEL = ["--model-path", "/models/kimi", "--enable-metrics"]


@pytest.fixture
def start(loopback):
    def _start(argv: list[str], env: dict[str, str]) -> tuple[Engine, str]:
        engine = Engine(parse_args([*MODEL, *argv]), env=env)
        return engine, f"http://127.0.0.1:{loopback.serve(EngineHandler, engine).server_address[1]}"

    return _start


def timing(base: int = 0, per_1k: int = 0, token: int = 0) -> dict[str, str]:
    return {"K31_STANDIN_TTFT_BASE_MS": str(base), "K31_STANDIN_TTFT_PER_1K_PROMPT_TOKENS_MS": str(per_1k),
            "K31_STANDIN_TOKEN_MS": str(token)}


def stream(url: str, path: str, body: dict) -> tuple[float | None, float, list[float], list[str]]:
    """(time to the first token, total time, each token's arrival time, the data lines) of one SSE request."""
    began = time.monotonic()
    arrivals, lines = [], []
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=10) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            lines.append(line)
            choices = [] if line == "data: [DONE]" else json.loads(line[6:])["choices"]
            if choices and (choices[0].get("text") or choices[0].get("delta", {}).get("content")):
                arrivals.append(time.monotonic() - began)
    return (arrivals[0] if arrivals else None), time.monotonic() - began, arrivals, lines


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    found = re.findall(rf"^sglang:{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    assert len(found) == 1, (name, found)
    return float(found[0])


def words(n: int) -> str:
    return " ".join(["w"] * n)


def test_defaults_keep_replies_instant(start):
    _, url = start([], {})
    _, total, arrivals, lines = stream(url, "/v1/completions", {"prompt": words(5000), "max_tokens": 16})
    assert lines[-1] == "data: [DONE]" and len(arrivals) == 16
    assert total < 0.2
    began = time.monotonic()
    assert httpx.post(url + "/v1/completions", json={"prompt": words(5000), "max_tokens": 16}).status_code == 200
    assert time.monotonic() - began < 0.2


def test_ttft_grows_with_the_prompt_length(start):
    _, url = start([], timing(base=50, per_1k=200))   # 50 ms + 0.2 ms a prompt token; no per-token time
    short, _, _, _ = stream(url, "/v1/completions", {"prompt": words(100), "max_tokens": 4})
    long, total, _, _ = stream(url, "/v1/completions", {"prompt": words(3000), "max_tokens": 4})
    assert 0.05 <= short < 0.2          # 70 ms
    assert 0.65 <= long < 0.9           # 650 ms
    assert total - long < 0.1           # the tokens themselves take no time
    assert metric(url, "time_to_first_token_seconds_sum") == pytest.approx(0.07 + 0.65, abs=0.15)


def test_a_stream_of_n_tokens_takes_n_token_times_and_arrives_token_by_token(start):
    _, url = start([], timing(token=40))
    ttft, total, arrivals, lines = stream(url, "/v1/completions", {"prompt": "hi", "max_tokens": 15})
    assert lines[-1] == "data: [DONE]" and len(arrivals) == 15
    assert 0.6 <= total < 0.85                     # 15 x 40 ms
    assert 0.04 <= ttft < 0.15                     # the first token alone, not the whole answer
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert min(gaps) > 0.02                        # flushed one at a time, not in a burst
    assert metric(url, "inter_token_latency_seconds_sum") / metric(url, "inter_token_latency_seconds_count") \
        == pytest.approx(0.04, abs=0.01)
    began = time.monotonic()   # a non-streamed answer takes as long
    assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 15}).status_code == 200
    assert 0.6 <= time.monotonic() - began < 0.85


def test_chat_streams_reasoning_and_content_at_the_token_rate(start):
    _, url = start(["--reasoning-parser", "kimi_k3"], timing(base=100, token=20))
    body = {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low", "max_tokens": 8}
    began = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=10) as resp:
        text = "".join(resp.iter_text())
    total = time.monotonic() - began
    assert text.rstrip().endswith("data: [DONE]")
    assert 0.42 <= total < 0.65    # 100 ms + (8 reasoning + 8 content tokens) x 20 ms


def test_requests_beyond_max_running_requests_wait_in_the_queue(start):
    _, url = start(["--max-running-requests", "1"], timing(token=50))
    body = {"prompt": "hi", "max_tokens": 10}   # 0.5 s each
    results: dict[str, tuple] = {}
    first = threading.Thread(target=lambda: results.update(a=stream(url, "/v1/completions", body)))
    first.start()
    deadline = time.monotonic() + 2
    while metric(url, "num_running_reqs") < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    second = threading.Thread(target=lambda: results.update(b=stream(url, "/v1/completions", body)))
    second.start()
    seen_queued = False
    while not seen_queued and time.monotonic() < deadline:
        seen_queued = metric(url, "num_queue_reqs") == 1
        time.sleep(0.01)
    assert seen_queued and metric(url, "num_running_reqs") == 1
    assert httpx.get(url + "/get_load").json()[0]["num_waiting_reqs"] == 1
    first.join(5)
    second.join(5)
    ttft_b = results["b"][0]
    assert ttft_b >= 0.4    # the first request's 0.5 s (less the moment before the second was sent) and a token
    assert results["b"][1] >= 0.85 and len(results["b"][2]) == 10
    assert metric(url, "num_queue_reqs") == 0 and metric(url, "num_running_reqs") == 0
    assert metric(url, "time_to_first_token_seconds_count") == 2
    assert metric(url, "time_to_first_token_seconds_sum") >= 0.45   # the queued request's wait is in its TTFT


def test_pd_prefill_takes_the_ttft_and_the_decode_the_tokens(start, loopback):
    prefill, p_url = start(["--disaggregation-mode", "prefill"], timing(base=300, token=30))
    bootstrap = loopback.serve(BootstrapHandler, prefill)
    _, d_url = start(["--disaggregation-mode", "decode"], {**timing(base=300, token=30),
                                                            "K31_STANDIN_KV_TIMEOUT": "3"})
    body = {"prompt": "hi", "max_tokens": 10, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap.server_address[1], "bootstrap_room": 77}
    results: dict[str, tuple] = {}
    decode = threading.Thread(target=lambda: results.update(d=stream(d_url, "/v1/completions", body)))
    decode.start()   # the decode arrives first and waits for the prefill's KV
    results["p"] = stream(p_url, "/v1/completions", body)
    decode.join(5)
    p_ttft, p_total, _, _ = results["p"]
    d_ttft, d_total, _, d_lines = results["d"]
    assert p_ttft >= 0.3 and p_total - p_ttft < 0.1     # the prefill: TTFT, then no per-token time
    assert 0.3 <= d_ttft < 0.5                          # the decode: the KV once prefilled, then a token
    assert 0.6 <= d_total < 0.85 and d_lines[-1] == "data: [DONE]"   # 300 ms + 10 x 30 ms


def test_a_bad_timing_value_is_refused_by_name(monkeypatch, capsys):
    with pytest.raises(ValueError, match="K31_STANDIN_TOKEN_MS must be a number of milliseconds >= 0"):
        timing_seconds({"K31_STANDIN_TOKEN_MS": "-5"})
    assert timing_seconds({}) == (0, 0, 0)
    assert timing_seconds(timing(1000, 500, 20)) == pytest.approx((1.0, 0.0005, 0.02))
    monkeypatch.setenv("K31_STANDIN_TTFT_BASE_MS", "soon")
    assert main(["--model-path", "/m", "--port", "1"]) == 1
    assert "K31_STANDIN_TTFT_BASE_MS must be a number" in capsys.readouterr().err
