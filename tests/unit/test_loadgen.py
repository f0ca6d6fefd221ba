"""k31deploy.loadgen against stand-ins on 127.0.0.1: growing multi-turn contexts, outcomes that add up, a server
killed mid-stream, the run's bounds, and no load anywhere but loopback and private addresses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from loopback import free_port

from k31deploy import loadgen
from k31deploy.loadgen import LoadGen, LoadGenError, check_target
from k31deploy.standin.parser import parse_args
from k31deploy.standin.server import Engine, EngineHandler

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--model-path", "/models/kimi", "--served-model-name", "k3", "--reasoning-parser", "kimi_k3"]
LOW = {"reasoning_effort": "low"}   # 8 reasoning tokens + max_tokens content tokens a turn


@pytest.fixture
def standin(loopback):
    def _start(argv: list[str] = (), env: dict[str, str] | None = None) -> str:
        server = loopback.serve(EngineHandler, Engine(parse_args([*MODEL, *argv]), env=env or {}))
        return f"http://127.0.0.1:{server.server_address[1]}"

    return _start


def test_sessions_grow_their_context_turn_by_turn(standin):
    url = standin()
    report = loadgen.run(url, sessions=2, turns=3, max_requests=100, deadline=10, conversations=1, extra_body=LOW,
                         max_tokens=8)
    assert report.counts == {"complete": 6, "truncated": 0, "refused": 0, "error": 0}
    for session in (0, 1):
        turns = sorted((r for r in report.records if r.session == session), key=lambda r: r.turn)
        assert [(r.conversation, r.turn, r.messages) for r in turns] == [(0, 1, 1), (0, 2, 3), (0, 3, 5)]
        # What the server counted: each turn's prompt holds the previous one, its answer and a new message.
        prompts = [r.prompt_tokens for r in turns]
        assert prompts[0] > 30 and prompts[1] > prompts[0] + 8 + 30 and prompts[2] > prompts[1] + 8 + 30
        assert all(r.completion_tokens == 16 and r.ttft is not None and r.ttft <= r.duration for r in turns)
    assert report.summary().startswith(f"6 requests in {report.elapsed:.1f} s from 2 sessions to {url}: 6 complete")
    assert report.to_dict()["counts"]["complete"] == 6


def test_max_requests_bounds_the_run_and_sessions_start_new_conversations(standin):
    url = standin()
    report = loadgen.run(url, sessions=3, turns=2, max_requests=7, deadline=10, extra_body=LOW, max_tokens=4)
    assert len(report.records) == 7 and sum(report.counts.values()) == 7 and report.counts["complete"] == 7
    # 3 sessions x 2 turns, then new conversations (threads race for the last ones), each from turn 1.
    assert max(r.conversation for r in report.records) >= 1
    held = {(r.session, r.conversation) for r in report.records}
    for session, conversation in held:
        turns = sorted(r.turn for r in report.records if (r.session, r.conversation) == (session, conversation))
        assert turns == list(range(1, len(turns) + 1))
    assert report.elapsed < 2


def test_deadline_bounds_the_run(standin):
    url = standin([], {"K31_STANDIN_TOKEN_MS": "25"})   # 16 tokens: 0.4 s a request
    report = loadgen.run(url, sessions=2, turns=5, max_requests=1000, deadline=1.0, extra_body=LOW, max_tokens=8)
    assert 1.0 <= report.elapsed < 1.6                       # the last ones started before 1 s and finished
    assert all(r.start < 1.0 for r in report.records)
    assert 4 <= report.counts["complete"] == len(report.records) <= 6


def test_the_context_manager_runs_in_the_background_until_the_block_ends(standin):
    url = standin([], {"K31_STANDIN_TOKEN_MS": "10"})
    with LoadGen(url, sessions=2, turns=2, max_requests=1000, deadline=30, extra_body=LOW, max_tokens=8) as load:
        time.sleep(0.5)
        assert len(load.report().records) > 0
    report = load.report()
    assert report.elapsed < 1.2 and report.counts["complete"] == len(report.records) >= 4
    assert report.counts == load.report().counts   # nothing runs after the block


def test_an_http_error_is_refused_and_a_bearer_key_is_sent(standin):
    url = standin(["--api-key", "k-api"])
    refused = loadgen.run(url, sessions=1, turns=1, max_requests=2, deadline=5, model="k3", failure_pause=0.01)
    assert refused.counts["refused"] == 2
    assert all(r.status == 401 and r.detail.startswith("HTTP 401") for r in refused.records)
    ok = loadgen.run(url, sessions=1, turns=2, max_requests=2, deadline=5, api_key="k-api", extra_body=LOW)
    assert ok.counts["complete"] == 2


def test_non_streamed_turns_complete_with_the_whole_answer(standin):
    url = standin()
    report = loadgen.run(url, sessions=1, turns=2, max_requests=2, deadline=5, stream=False, extra_body=LOW)
    assert report.counts["complete"] == 2
    assert report.records[1].prompt_tokens > report.records[0].prompt_tokens


def test_a_server_killed_mid_stream_truncates_the_streams_and_refuses_what_follows():
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "K31_STANDIN_TOKEN_MS": "100"}   # 16 tokens: 1.6 s a request
    proc = subprocess.Popen([sys.executable, "-m", "k31deploy.standin", *MODEL, "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the stand-in did not start"
            time.sleep(0.05)
        load = LoadGen(url, sessions=2, turns=3, max_requests=8, deadline=10, extra_body=LOW, max_tokens=8,
                       failure_pause=0.05).start()
        try:
            time.sleep(0.5)   # both sessions are a few tokens into their first stream
            killed = load.report().elapsed
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)
            report = load.wait()   # the run goes on to its 8 requests
        finally:
            load.stop()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert len(report.records) == 8 and sum(report.counts.values()) == 8
    truncated = [r for r in report.records if r.outcome == "truncated"]
    assert [(r.session, r.turn, r.status) for r in sorted(truncated, key=lambda r: r.session)] == \
        [(0, 1, 200), (1, 1, 200)]
    assert all(r.ttft is not None and r.start < killed for r in truncated)   # tokens came, then the break
    refused = [r for r in report.records if r.outcome == "refused"]
    assert len(refused) == 6 and all(r.start > killed and r.status is None for r in refused)
    assert "no answer" in refused[0].detail and "mid-answer" in truncated[0].detail


@pytest.mark.parametrize("url", ["http://127.0.0.1:1", "http://localhost:8000", "https://10.1.2.3",
                                 "http://172.31.255.1:8000", "http://192.168.0.9", "http://[::1]:8000",
                                 "http://[fd00::9]:8000", "http://[::ffff:10.0.0.1]:8000"])
def test_loopback_and_private_targets_are_allowed(url):
    check_target(url)


@pytest.mark.parametrize("url", ["http://8.8.8.8:8000", "https://172.32.0.1", "http://100.64.0.1",
                                 "http://[2001:4860:4860::8888]:443", "http://[::ffff:8.8.8.8]", "ftp://127.0.0.1"])
def test_a_public_target_is_refused_before_anything_is_sent(url, monkeypatch, capsys):
    def no_client(*args, **kwargs):
        raise AssertionError("an HTTP client was made")

    monkeypatch.setattr(httpx, "Client", no_client)
    with pytest.raises(LoadGenError) as exc:
        LoadGen(url, sessions=1, max_requests=1, deadline=1).run()
    message = str(exc.value)
    assert message.count(". ") == 0 and "\n" not in message   # one sentence
    assert loadgen.main(["--base-url", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    if "8.8.8.8" in url:
        assert message == f"refusing to send load to {url}: 8.8.8.8 is neither a loopback nor a private " \
                          "(RFC 1918 / ULA) address"


def test_bounds_must_be_bounds():
    for settings in ({"max_requests": 0}, {"deadline": float("inf")}, {"sessions": 0}, {"turns": -1}):
        with pytest.raises(LoadGenError):
            LoadGen("http://127.0.0.1:1", **settings)
