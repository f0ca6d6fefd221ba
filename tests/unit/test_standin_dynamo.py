"""The Dynamo worker stand-in's pure parts: which parsers it registers, and the Kimi K3 text it answers with."""

from __future__ import annotations

import json

import pytest

from k31deploy.standin import dynamo, replies
from k31deploy.standin.dynamo import (
    KvBlocks,
    block_hash,
    dynamo_parsers,
    parser_conflict,
    reply_pieces,
    request_reply,
)
from k31deploy.standin.replies import BadRequest

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def prompt(*turns: tuple[str, str], generation: bool = True) -> str:
    """The tiny model's ChatML rendering (k31deploy.tinymodel.CHAT_TEMPLATE)."""
    text = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)
    return text + ("<|im_start|>assistant\n" if generation else "")


def test_parsers_come_from_the_dyn_flags_else_the_environment():
    env = {"DYN_REASONING_PARSER": "kimi_k3", "DYN_TOOL_CALL_PARSER": "kimi_k3"}
    assert dynamo_parsers(["--tp-size", "4"], env) == ("kimi_k3", "kimi_k3", ["--tp-size", "4"])
    assert dynamo_parsers(["--dyn-tool-call-parser", "kimi_k2", "--tp-size", "4"], env) == (
        "kimi_k3", "kimi_k2", ["--tp-size", "4"])
    assert dynamo_parsers(["--dyn-reasoning-parser=kimi_k25"], {}) == ("kimi_k25", None, [])
    assert dynamo_parsers([], {}) == (None, None, [])
    with pytest.raises(BadRequest):
        dynamo_parsers(["--dyn-reasoning-parser"], {})


def test_sglang_and_dynamo_tool_parsers_exclude_each_other():
    assert parser_conflict("kimi_k3", "kimi_k3") == "Cannot use both --tool-call-parser and --dyn-tool-call-parser."
    assert parser_conflict(None, "kimi_k3") is None and parser_conflict("kimi_k3", None) is None


def test_a_chat_prompt_gets_the_sglang_stand_ins_reply_in_kimi_k3_xtml():
    body = {"messages": [{"role": "user", "content": "hello"}], "reasoning_effort": "high"}
    expected = replies.chat_reply(body, "kimi_k3", "kimi_k3")
    reply = request_reply(prompt(("reasoning_effort", "high"), ("user", "hello")), None)
    pieces = reply_pieces(reply)
    assert pieces[0] == "<|open|>think<|sep|>" and pieces[len(expected.reasoning) + 1] == "<|close|>think<|sep|>"
    assert "".join(pieces[1:len(expected.reasoning) + 1]) == "".join(expected.reasoning)
    assert pieces[-1] == "<|close|>response<|sep|>"
    assert "".join(pieces).endswith("<|open|>response<|sep|>" + "".join(expected.content) + "<|close|>response<|sep|>")


def test_a_prompt_with_tools_gets_the_first_tool_as_a_kimi_k3_call():
    tools = json.dumps([WEATHER])
    reply = request_reply(prompt(("tools", tools), ("reasoning_effort", "low"), ("user", "weather?")), 64)
    text = "".join(reply_pieces(reply))
    assert '<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>' in text
    assert '<|open|>json<|sep|>{"city": "k31"}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>' in text
    assert "<|open|>response<|sep|>" not in text
    assert len(reply.reasoning) == 0 and text.count(" ") >= replies.REASONING_TOKENS["low"] - 1


def test_a_completion_prompt_gets_the_text_reply_and_its_length_limit():
    reply = request_reply("once upon a time", 3)
    assert reply_pieces(reply) == replies.text_reply("once upon a time", 3).content and reply.finish_reason == "length"


def test_xtml_attribute_values_are_escaped():
    body = {"messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": 'a"b&c'}}]}
    reply = replies.chat_reply(body, None, None)
    assert 'tool="a&quot;b&amp;c"' in "".join(reply_pieces(reply))


class Publisher:
    """Records what KvBlocks publishes (dynamo.llm.KvEventPublisher's publish_stored / publish_removed)."""

    def __init__(self):
        self.stored: list[tuple[list[int], int, int | None]] = []
        self.removed: list[int] = []

    def publish_stored(self, token_ids, num_block_tokens, block_hashes, parent_hash=None):
        assert num_block_tokens == [len(token_ids)] and len(block_hashes) == 1
        self.stored.append((token_ids, block_hashes[0], parent_hash))

    def publish_removed(self, block_hashes):
        self.removed.extend(block_hashes)


def test_kv_blocks_publish_each_full_block_once_chained_and_evict_the_oldest():
    publisher = Publisher()
    kv = KvBlocks(publisher, block_size=4, capacity=3)
    kv.store(list(range(10)))     # two full blocks; the last two tokens fill none
    assert [t for t, _, _ in publisher.stored] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    first, second = publisher.stored[0][1], publisher.stored[1][1]
    assert publisher.stored[0][2] is None and publisher.stored[1][2] == first
    kv.store([0, 1, 2, 3, 4, 5, 6, 7, 9, 9, 9, 9])    # a shared prefix: only the new block is published
    assert len(publisher.stored) == 3 and publisher.stored[2][2] == second and publisher.removed == []
    kv.store([7, 7, 7, 7])        # a fourth block: the least recently used one leaves
    assert publisher.removed == [first]
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1]) and block_hash(1, [5]) != block_hash(2, [5])


def test_a_rank_above_0_answers_health_on_the_system_host_and_port_only(monkeypatch, tmp_path):
    """Ranks >= 1 become the plain stand-in on DYN_SYSTEM_HOST:DYN_SYSTEM_PORT (the cluster address), never 0.0.0.0."""
    seen = []

    def execv(path, cmd):    # os.execv does not return
        seen.append(cmd)
        raise SystemExit(0)

    monkeypatch.setattr(dynamo.os, "execv", execv)
    monkeypatch.setenv("K31_STANDIN_MODEL_DIR", str(tmp_path))
    monkeypatch.setenv("DYN_SYSTEM_HOST", "10.8.0.2")
    monkeypatch.setenv("DYN_SYSTEM_PORT", "30100")
    monkeypatch.delenv("K31_STANDIN_RECORD", raising=False)
    with pytest.raises(SystemExit):
        dynamo.main(["--model-path", "/m", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.8.0.1:5000"])
    (cmd,) = seen
    assert cmd[cmd.index("--host") + 1] == "10.8.0.2" and cmd[cmd.index("--port") + 1] == "30100"
    assert "0.0.0.0" not in cmd
