"""The CPU stand-in engine: its parser (real SGLang's, from the CLI dump), its replies, and its HTTP surface served
in-process on 127.0.0.1 (ephemeral ports, no subprocesses)."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from k31deploy.recipe import flag_registry
from k31deploy.standin import replies
from k31deploy.standin.parser import build_parser, load_engine_flags, parse_args
from k31deploy.standin.server import (
    WIDE_LOG_LINE,
    BootstrapHandler,
    Engine,
    EngineHandler,
    LoadHold,
    monokernel_problems,
)

MODEL = ["--model-path", "/models/kimi"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]},
            },
            "required": ["city", "unit", "where"],
        },
    },
}


def chat(content: str = "What is 15% of 240?", **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


# -- parser -------------------------------------------------------------------------------------


def test_parser_takes_every_flag_k31_emits_as_real_sglang_types_it():
    """The stand-in's parser is real SGLang's (the CLI dump): each flag k31 may emit, with a value of the
    dump's type, parses to that value; aliases and branch-only values parse too."""
    flags = load_engine_flags()
    emitted = flag_registry()["engine"]
    samples = {"int": ("8", 8), "float": ("2.5", 2.5)}
    argv, expected = [], {}
    for flag in emitted:
        spec = flags[flag]
        if spec["kind"] == "bool":
            argv.append(flag)
            expected[spec["dest"]] = True
            continue
        raw, value = samples.get(spec["kind"], ("x", "x"))
        if spec["choices"] is not None:
            raw = value = spec["choices"][-1]
        argv += [flag, raw]
        expected[spec["dest"]] = value
    args = build_parser().parse_args(argv)
    for dest, value in expected.items():
        assert getattr(args, dest) == value, dest
    assert parse_args([*MODEL, "--attention-data-parallel-size", "2"]).attn_dp_size == 2   # an alias
    assert parse_args([*MODEL, "--dsa-prefill-backend", "prims_ts"]).dsa_prefill_backend == "prims_ts"


def test_legacy_attention_dp_resolves_as_sglang_does():
    args = parse_args([*MODEL, "--tp-size", "16", "--dp-size", "2", "--enable-dp-attention"])
    assert (args.attn_dp_size, args.dp_size) == (2, 1)
    assert parse_args([*MODEL, "--dp-size", "2"]).attn_dp_size == 1    # plain DP counts replicas


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--tp", "8"], "unrecognized arguments: --tp"),  # no abbreviations
        (["--tp-size", "eight"], "invalid int value: 'eight'"),
        (["--dcp-comm-backend", "nccl"], "invalid choice: 'nccl'"),
        (["--hicache-ratio", "lots"], "invalid float value: 'lots'"),
    ],
)
def test_unknown_flag_or_bad_value_exits_2_with_argparse_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([*MODEL, *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_model_path_is_required(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--tp-size", "8"])
    assert exc.value.code == 2
    assert "--model-path" in capsys.readouterr().err


def test_sglang_value_parsers_take_strings_and_keep_their_choices(capsys):
    # --cuda-graph-backend-prefill has SGLang's own type function; the stand-in checks its choices.
    assert parse_args([*MODEL, "--cuda-graph-backend-prefill", "full"]).cuda_graph_backend_prefill == "full"
    with pytest.raises(SystemExit):
        parse_args([*MODEL, "--cuda-graph-backend-prefill", "piecewise"])
    assert "invalid choice: 'piecewise'" in capsys.readouterr().err


def test_served_model_name_defaults_to_model_path():
    assert parse_args(MODEL).served_model_name == "/models/kimi"
    assert parse_args([*MODEL, "--served-model-name", "k3"]).served_model_name == "k3"


def test_server_info_reports_layout_and_pd_but_no_model_path():
    args = parse_args([*MODEL, "--served-model-name", "moonshotai/Kimi-K3.1-Pro", "--tp-size", "8",
                       "--dcp-size", "8", "--disaggregation-mode", "prefill",
                       "--disaggregation-bootstrap-port", "9001", "--max-running-requests", "64"])
    info = Engine(args, env={}).server_info()
    assert "model_path" not in info
    assert "/models/kimi" not in json.dumps(info)
    sizes = ("tp_size", "dcp_size", "dp_size", "pp_size", "ep_size", "attn_cp_size", "nnodes", "node_rank")
    assert [info[k] for k in sizes] == [8, 8, 1, 1, 1, 1, 1, 0]
    assert info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == 9001
    assert info["served_model_name"] == "moonshotai/Kimi-K3.1-Pro"
    assert info["max_running_requests"] == 64
    assert Engine(parse_args(MODEL), env={}).server_info()["disaggregation_mode"] == "null"


# -- replies ------------------------------------------------------------------------------------


def test_reasoning_length_follows_reasoning_effort_and_defaults_to_max():
    lengths = {e: len(replies.chat_reply(chat(reasoning_effort=e), "kimi_k3", None).reasoning)
               for e in ("low", "high", "max")}
    assert lengths["low"] < lengths["high"] < lengths["max"]
    assert len(replies.chat_reply(chat(), "kimi_k3", None).reasoning) == lengths["max"]
    with pytest.raises(replies.BadRequest, match="reasoning_effort must be one of low, high, max"):
        replies.chat_reply(chat(reasoning_effort="medium"), "kimi_k3", None)


def test_replies_are_deterministic_and_depend_on_the_prompt():
    a = replies.chat_response(replies.chat_reply(chat("one"), "kimi_k3", None), "id", "m", 0)
    b = replies.chat_response(replies.chat_reply(chat("one"), "kimi_k3", None), "id", "m", 0)
    c = replies.chat_response(replies.chat_reply(chat("two"), "kimi_k3", None), "id", "m", 0)
    assert a == b
    assert a["choices"][0]["message"]["content"] != c["choices"][0]["message"]["content"]


def test_max_tokens_caps_the_answer_with_finish_reason_length():
    short = replies.chat_reply(chat(max_tokens=3), None, None)
    assert short.finish_reason == "length"
    assert len(replies.chat_reply(chat(max_tokens=3), "kimi_k3", None).content) == 3
    assert replies.chat_reply(chat(), "kimi_k3", None).finish_reason == "stop"


def test_without_reasoning_parser_the_thinking_stays_in_content():
    raw = replies.chat_response(replies.chat_reply(chat(), None, None), "id", "m", 0)
    message = raw["choices"][0]["message"]
    assert "reasoning_content" not in message
    assert message["content"].startswith("<think>")
    parsed = replies.chat_response(replies.chat_reply(chat(), "kimi_k3", None), "id", "m", 0)
    assert parsed["choices"][0]["message"]["reasoning_content"]
    assert "<think>" not in parsed["choices"][0]["message"]["content"]


def test_tool_call_uses_first_tool_with_required_arguments_from_its_schema():
    reply = replies.chat_reply(chat(tools=[WEATHER, {"type": "function", "function": {"name": "other"}}]),
                               "kimi_k3", "kimi_k3")
    response = replies.chat_response(reply, "id", "m", 0)
    choice = response["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    expected = {"city": "k31", "unit": "celsius", "where": {"lat": 1.5}}  # required only, nested
    assert json.loads(call["function"]["arguments"]) == expected
    assert choice["message"]["content"] is None


def test_tool_choice_none_named_and_no_parser():
    assert not replies.chat_reply(chat(tools=[WEATHER], tool_choice="none"), "kimi_k3", "kimi_k3").tool_calls
    other = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}
    named = replies.chat_reply(chat(tools=[WEATHER, other], tool_choice={"type": "function",
                                                                        "function": {"name": "other"}}),
                               "kimi_k3", "kimi_k3")
    assert named.tool_calls[0]["function"]["name"] == "other"
    raw = replies.chat_reply(chat(tools=[WEATHER]), "kimi_k3", None)
    assert not raw.tool_calls and raw.finish_reason == "stop"
    assert "<|tool_call_begin|>" in "".join(raw.content)
    with pytest.raises(replies.BadRequest, match="tools must be a list"):
        replies.chat_reply(chat(tools=[{"type": "function"}]), "kimi_k3", "kimi_k3")


def test_stream_chunks_add_up_to_the_non_stream_answer():
    reply = replies.chat_reply(chat(tools=[WEATHER]), "kimi_k3", "kimi_k3")
    chunks = list(replies.chat_chunks(reply, "id", "m", 0, usage=True))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "".join(reply.reasoning)
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == ["get_weather"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"] == reply.usage()


# -- monokernel ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--tp-size", "8"], None),
        (["--tp-size", "8", "--dcp-size", "8", "--speculative-algorithm", "DFLASH"], None),
        (["--tp-size", "16"], "the layout is TP16"),
        (["--tp-size", "8", "--pp-size", "4"], "the layout is TP8·PP4"),
        (["--tp-size", "8", "--dcp-size", "4"], "the layout is TP8·DCP4"),
        (["--tp-size", "8", "--nnodes", "2"], "over 2 nodes"),
        (["--tp-size", "8", "--enable-hierarchical-cache"], "HiCache is on"),
    ],
)
def test_monokernel_refuses_setups_outside_tp8_and_dcp8_without_hicache(argv, problem):
    problems = monokernel_problems(parse_args([*MODEL, "--enable-amd-monokernel", *argv]))
    assert (problem is None) == (not problems)
    if problem:
        assert any(problem in p for p in problems)
    assert monokernel_problems(parse_args([*MODEL, *argv])) == []  # only with the monokernel on


@pytest.mark.parametrize(
    ("argv", "env", "printed"),
    [
        (["--enable-amd-monokernel"], {"SGLANG_AMD_MONO_K31_WIDE": "1"}, True),
        (["--enable-amd-monokernel"], {}, False),
        ([], {"SGLANG_AMD_MONO_K31_WIDE": "1"}, False),
        (["--enable-amd-monokernel", "--disaggregation-mode", "prefill"],
         {"SGLANG_AMD_MONO_K31_WIDE": "1"}, False),
    ],
)
def test_wide_step_line_is_printed_once_on_first_decode(argv, env, printed, capsys):
    engine = Engine(parse_args([*MODEL, "--tp-size", "8", *argv]), env=env)
    for _ in range(3):
        engine.begin([replies.text_reply("hi", 1)])
    assert capsys.readouterr().out.count(WIDE_LOG_LINE) == (1 if printed else 0)


# -- HTTP (in-process, loopback) ----------------------------------------------------------------


@pytest.fixture
def start(loopback):
    def _start(argv: list[str], env: dict | None = None, handler=EngineHandler, engine: Engine | None = None):
        engine = engine or Engine(parse_args([*MODEL, *argv]), env=env or {})
        return engine, loopback.serve(handler, engine).server_address[1]

    return _start


def call(port: int, method: str, path: str, body: dict | None = None,
         headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def test_health_is_503_while_loading_then_200(start):
    engine, port = start([])
    engine.ready_at = time.monotonic() + 60
    for path in ("/health", "/health_generate"):
        assert call(port, "GET", path)[0] == 503
    assert call(port, "POST", "/generate", {"text": "hi"})[0] == 503
    engine.ready_at = 0
    for path in ("/health", "/health_generate"):
        assert call(port, "GET", path)[0] == 200


def test_a_hold_file_keeps_the_server_loading_until_it_is_removed(start, tmp_path):
    record = tmp_path / "k31-decode1-r0.standin.json"
    hold = tmp_path / "k31-decode1-r0.standin.hold"
    hold.touch()
    engine, port = start([], env={"K31_STANDIN_RECORD": str(record)})
    assert engine.ready_at <= time.monotonic()    # its load seconds are over: only the hold keeps it loading
    assert call(port, "GET", "/health")[0] == 503
    assert call(port, "GET", "/health")[0] == 503
    hold.unlink()
    assert call(port, "GET", "/health")[0] == 200
    hold.touch()                                  # released once, it stays released
    assert call(port, "GET", "/health")[0] == 200
    # without a record or a hold file at its start nothing holds, and a file made later does not either
    later = LoadHold(str(tmp_path / "other.standin.json"))
    (tmp_path / "other.standin.hold").touch()
    assert not LoadHold(None).held() and not later.held()


def test_waiting_out_a_hold_ends_at_its_release_or_at_a_stop(tmp_path):
    hold = tmp_path / "r1.standin.hold"
    hold.touch()
    stop, waited = threading.Event(), []
    waiter = threading.Thread(target=lambda: waited.append(LoadHold(str(tmp_path / "r1.standin.json")).wait(stop)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()
    hold.unlink()
    waiter.join(5)
    assert waited == [False]
    hold.touch()
    stop.set()                                    # a stop while held ends the wait at once, and says so
    assert LoadHold(str(tmp_path / "r1.standin.json")).wait(stop) is True


def test_a_held_rank_above_0_opens_its_health_only_once_the_hold_is_removed(tmp_path):
    hold = tmp_path / "k31-decode1-r1.standin.hold"
    hold.touch()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "K31_STANDIN_RECORD": str(tmp_path / "k31-decode1-r1.standin.json")}
    proc = subprocess.Popen([sys.executable, "-m", "k31deploy.standin", *MODEL, "--nnodes", "2", "--node-rank", "1",
                             "--dist-init-addr", "127.0.0.1:5000", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "k31-decode1-r1.standin.json").exists():    # its record: it has started
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        with pytest.raises(ConnectionRefusedError):
            call(port, "GET", "/health")
        hold.unlink()
        while True:
            try:
                assert call(port, "GET", "/health")[0] == 200
                break
            except ConnectionRefusedError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(10)


def test_probes_models_load_and_unknown_paths(start):
    _, port = start(["--served-model-name", "moonshotai/Kimi-K3.1-Pro", "--attn-dp-size", "2"])
    for path in ("/server_info", "/get_server_info"):
        status, body = call(port, "GET", path)
        assert status == 200 and "model_path" not in json.loads(body)
    for path in ("/model_info", "/get_model_info"):
        status, body = call(port, "GET", path)
        assert status == 200 and json.loads(body)["is_generation"] is True
    status, body = call(port, "GET", "/v1/models")
    assert [m["id"] for m in json.loads(body)["data"]] == ["moonshotai/Kimi-K3.1-Pro"]
    status, body = call(port, "GET", "/get_load")
    assert [set(r) >= {"num_tokens"} for r in json.loads(body)] == [True, True]
    assert call(port, "GET", "/metrics")[0] == 404  # only with --enable-metrics
    assert call(port, "GET", "/nope")[0] == 404
    assert call(port, "GET", "/generate")[0] == 405


def test_metrics_count_requests_with_enable_metrics(start):
    _, port = start(["--enable-metrics", "--served-model-name", "k3"])
    body = {"text": "a b c", "sampling_params": {"max_new_tokens": 4}}
    assert call(port, "POST", "/generate", body)[0] == 200
    status, body = call(port, "GET", "/metrics")
    assert status == 200
    text = body.decode()
    assert 'sglang:num_requests_total{model_name="k3"} 1' in text
    assert 'sglang:prompt_tokens_total{model_name="k3"} 3' in text
    assert 'sglang:generation_tokens_total{model_name="k3"} 4' in text


def sse_events(raw: bytes) -> list[str]:
    return [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line.startswith("data: ")]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat(stream=True, reasoning_effort="low")),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 4, "stream": True}),
        ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}, "stream": True}),
    ],
)
def test_streams_end_with_done(start, path, body):
    _, port = start(["--reasoning-parser", "kimi_k3"])
    status, raw = call(port, "POST", path, body)
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    assert all(json.loads(e) for e in events[:-1])
    assert len(events) > 3


def test_generate_and_completions_non_stream(start):
    _, port = start([])
    status, body = call(port, "POST", "/generate", {"text": "x y", "sampling_params": {"max_new_tokens": 5}})
    result = json.loads(body)
    assert status == 200 and len(result["text"].split()) == 5
    assert result["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    status, body = call(port, "POST", "/generate", {"text": ["a", "b"]})
    assert status == 200 and len(json.loads(body)) == 2
    status, body = call(port, "POST", "/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2})
    assert status == 200 and [len(c["text"].split()) for c in json.loads(body)["choices"]] == [2, 2]
    assert call(port, "POST", "/v1/chat/completions", {"messages": []})[0] == 400


def test_keep_alive_requests_are_not_held_back_by_nagle(start):
    _, port = start([])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    conn.getresponse().read()
    began = time.monotonic()
    for _ in range(10):
        conn.request("GET", "/get_load")
        conn.getresponse().read()
    conn.close()
    # Without TCP_NODELAY each answer (headers, then body) waits ~40 ms for a delayed ACK.
    assert time.monotonic() - began < 0.2


# -- PD contract --------------------------------------------------------------------------------


@pytest.fixture
def pd(start):
    """A prefill (HTTP + bootstrap port) and a decode; returns (prefill, bootstrap, decode) ports."""
    prefill, p_port = start(["--disaggregation-mode", "prefill"])
    _, b_port = start([], handler=BootstrapHandler, engine=prefill)
    _, d_port = start(["--disaggregation-mode", "decode"], env={"K31_STANDIN_KV_TIMEOUT": "0.3"})
    return p_port, b_port, d_port


def test_prefill_bootstrap_port_answers(pd):
    _, b_port, _ = pd
    assert call(b_port, "GET", "/health")[0] == 200
    assert call(b_port, "GET", "/route")[0] == 200


def test_decode_refuses_requests_without_bootstrap_fields(pd):
    _, b_port, d_port = pd
    status, body = call(d_port, "POST", "/v1/chat/completions", chat(bootstrap_host="127.0.0.1",
                                                                     bootstrap_port=b_port))
    assert status == 400 and "bootstrap_room" in json.loads(body)["message"]
    assert call(d_port, "POST", "/generate", {"text": "hi"})[0] == 400


def test_decode_answers_502_when_the_bootstrap_port_is_dead(pd):
    _, _, d_port = pd
    body = chat(bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=7)  # nothing listens on 1
    status, raw = call(d_port, "POST", "/v1/chat/completions", body)
    assert status == 502 and "does not answer" in json.loads(raw)["message"]


def test_decode_answers_once_the_prefill_took_the_same_room(pd):
    p_port, b_port, d_port = pd
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": b_port, "bootstrap_room": 12345}
    answers: dict[str, tuple[int, bytes]] = {}
    # The router posts to both at once; the decode may arrive first and must wait for the prefill.
    decode = threading.Thread(target=lambda: answers.update(
        d=call(d_port, "POST", "/v1/chat/completions", chat(stream=True, **fields))))
    decode.start()
    time.sleep(0.05)
    answers["p"] = call(p_port, "POST", "/v1/chat/completions", chat(stream=True, **fields))
    decode.join(5)
    assert answers["p"][0] == 200 and sse_events(answers["p"][1])[-1] == "[DONE]"
    assert answers["d"][0] == 200 and sse_events(answers["d"][1])[-1] == "[DONE]"
    other_room = {**fields, "bootstrap_room": 999}
    assert call(d_port, "POST", "/v1/chat/completions", chat(**other_room))[0] == 504


def test_keys_from_a_config_file_guard_the_api_as_sglang_does(tmp_path, start):
    config = tmp_path / "auth.yaml"
    config.write_text('api-key: "k-api"\nadmin-api-key: "k-admin"\n')
    _, port = start(["--config", str(config), "--enable-metrics"])
    for path in ("/health", "/health_generate", "/metrics"):    # probes and scraping need no key
        assert call(port, "GET", path)[0] == 200
    assert call(port, "GET", "/v1/models")[0] == 401
    assert call(port, "GET", "/v1/models", headers={"Authorization": "Bearer k-api"})[0] == 200
    assert call(port, "POST", "/flush_cache", headers={"Authorization": "Bearer k-api"})[0] == 401
    assert call(port, "POST", "/flush_cache", headers={"Authorization": "Bearer k-admin"})[0] == 200
    status, body = call(port, "GET", "/server_info", headers={"Authorization": "Bearer k-api"})
    assert status == 200 and b"k-admin" not in body and b"k-api" not in body


# -- /metrics as SGLang exposes it (names, types and labels of upstream's metrics_collector.py) ----------------

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def exposition(text: str) -> tuple[dict[str, str], dict[tuple[str, frozenset], float]]:
    """Parse the text format strictly: every sample belongs to a declared family, labels are well formed,
    values are floats, and a histogram's buckets are cumulative and end at +Inf == _count."""
    types: dict[str, str] = {}
    samples: dict[tuple[str, frozenset], float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types, f"family {name} declared twice"
            types[name] = kind
            continue
        if line.startswith("#") or not line:
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, raw, value = m.groups()
        labels = frozenset(LABEL.findall(raw or ""))
        assert raw is None or ",".join(f'{k}="{v}"' for k, v in LABEL.findall(raw)) == raw, line
        family = re.sub(r"_(bucket|sum|count)$", "", name) if name not in types else name
        assert family in types, f"{name} has no # TYPE"
        samples[(name, labels)] = float(value)
    for family, kind in types.items():
        if kind != "histogram":
            continue
        for key in [k for k in samples if k[0] == f"{family}_count"]:
            base = key[1]
            buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in samples.items()
                              if k[0] == f"{family}_bucket" and k[1] - {("le", dict(k[1])["le"])} == base))
            counts = [v for _, v in buckets]
            assert counts == sorted(counts) and buckets[-1][0] == float("inf") and counts[-1] == samples[key]
    return types, samples


def _value(samples, name: str, **labels: str) -> float:
    found = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= ls]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_metrics_export_sglang_names_types_and_labels(start):
    _, port = start(["--enable-metrics", "--served-model-name", "k3", "--max-running-requests", "8",
                     "--enable-hierarchical-cache"])
    types, samples = exposition(call(port, "GET", "/metrics")[1].decode())
    expected = {"sglang:num_running_reqs": "gauge", "sglang:num_queue_reqs": "gauge", "sglang:token_usage": "gauge",
                "sglang:mamba_usage": "gauge", "sglang:gen_throughput": "gauge",
                "sglang:hicache_host_used_tokens": "gauge", "sglang:hicache_host_total_tokens": "gauge",
                "sglang:num_requests_total": "counter", "sglang:prompt_tokens_total": "counter",
                "sglang:generation_tokens_total": "counter", "sglang:time_to_first_token_seconds": "histogram",
                "sglang:inter_token_latency_seconds": "histogram", "sglang:e2e_request_latency_seconds": "histogram"}
    assert {k: types.get(k) for k in expected} == expected
    assert "sglang:num_transfer_failed_reqs_total" not in types  # unified: no PD counters
    scheduler = {k for (n, ls) in samples if n == "sglang:num_running_reqs" for k, _ in ls}
    assert scheduler == {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}
    assert _value(samples, "sglang:num_running_reqs", engine_type="unified") == 0
    les = sorted(float(dict(ls)["le"]) for (n, ls) in samples if n == "sglang:time_to_first_token_seconds_bucket")
    assert les[:3] == [0.1, 0.2, 0.4] and les[-2:] == [400.0, float("inf")]  # upstream's default buckets


def test_ttft_and_itl_count_requests(start):
    engine, port = start(["--enable-metrics", "--served-model-name", "k3"])
    _, before = exposition(call(port, "GET", "/metrics")[1].decode())
    assert _value(before, "sglang:time_to_first_token_seconds_count") == 0
    for _ in range(2):
        assert call(port, "POST", "/generate", {"text": "a b", "sampling_params": {"max_new_tokens": 5}})[0] == 200
    _, after = exposition(call(port, "GET", "/metrics")[1].decode())
    assert _value(after, "sglang:time_to_first_token_seconds_count", model_name="k3") == 2
    assert _value(after, "sglang:e2e_request_latency_seconds_count") == 2
    assert _value(after, "sglang:inter_token_latency_seconds_count") == 10  # one per output token, as upstream
    assert _value(after, "sglang:time_to_first_token_seconds_sum") > 0
    engine.running_reqs = 6  # running over the pool's 64-request stand-in capacity
    _, busy = exposition(call(port, "GET", "/metrics")[1].decode())
    assert _value(busy, "sglang:num_running_reqs") == 6
    assert _value(busy, "sglang:token_usage") == pytest.approx(6 / 64)


def test_decode_counts_a_failed_kv_transfer(start):
    _, port = start(["--enable-metrics", "--disaggregation-mode", "decode"], env={"K31_STANDIN_KV_TIMEOUT": "0.3"})
    body = chat(bootstrap_host="127.0.0.1", bootstrap_port=1, bootstrap_room=9)  # nothing listens on 1
    assert call(port, "POST", "/v1/chat/completions", body)[0] == 502
    types, samples = exposition(call(port, "GET", "/metrics")[1].decode())
    assert types["sglang:num_transfer_failed_reqs_total"] == "counter"
    assert _value(samples, "sglang:num_transfer_failed_reqs_total", engine_type="decode") == 1
    assert _value(samples, "sglang:num_bootstrap_failed_reqs_total") == 0
