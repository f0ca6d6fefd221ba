"""Deterministic model output of the stand-in: the same request always gets the same text.

Words come from a hash of the prompt, one word per "token". Reasoning and tool calls follow the
Kimi parsers' contract: with the parser on they come back structured (`reasoning_content`,
`tool_calls`); with it off they stay inline in `content`, as the raw Kimi output would.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

VOCAB = (
    "kimi", "stand", "in", "token", "decode", "prefill", "cache", "router", "agent", "layer",
    "expert", "page", "radix", "batch", "stream", "node", "rank", "shard", "kernel", "queue",
    "state", "draft", "verify", "block", "tensor", "route", "reply", "steady", "bright", "quiet",
    "swift", "amber",
)
# Natural reply length when the request sets no smaller limit.
NATURAL_TOKENS = 16
# Reasoning length per `reasoning_effort` (seed 3.1: low | high | max, default max).
REASONING_TOKENS = {"low": 8, "high": 32, "max": 64}
DEFAULT_EFFORT = "max"


class BadRequest(ValueError):
    """The request is malformed: the server answers 400 with this message."""


@dataclass(frozen=True)
class Reply:
    prompt_tokens: int
    content: list[str]  # token pieces; "".join() is the text
    reasoning: list[str]
    tool_calls: list[dict[str, Any]]
    finish_reason: str

    @property
    def completion_tokens(self) -> int:
        args = sum(len(c["function"]["arguments"].split()) for c in self.tool_calls)
        return len(self.content) + len(self.reasoning) + args

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def words(seed: str, n: int) -> list[str]:
    out: list[str] = []
    block = 0
    while len(out) < n:
        digest = hashlib.sha256(f"{seed}\x00{block}".encode()).digest()
        out.extend(VOCAB[b % len(VOCAB)] for b in digest)
        block += 1
    return out[:n]


def pieces(seed: str, n: int) -> list[str]:
    """n token pieces whose concatenation is the words joined by spaces."""
    return [w if i == 0 else f" {w}" for i, w in enumerate(words(seed, n))]


def count_tokens(text: str) -> int:
    return len(text.split())


def _limit(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _length(limit: int | None) -> tuple[int, str]:
    if limit is not None and limit < NATURAL_TOKENS:
        return limit, "length"
    return NATURAL_TOKENS, "stop"


def text_reply(prompt: str, limit: int | None) -> Reply:
    n, finish = _length(limit)
    return Reply(count_tokens(prompt), pieces("text:" + prompt, n), [], [], finish)


def _message_text(message: Any) -> str:
    if not isinstance(message, dict) or "role" not in message:
        raise BadRequest("each message must be an object with a role")
    content = message.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return f"{message['role']}: {content or ''}"


def example_value(schema: Any) -> Any:
    """A deterministic value that satisfies a (simple) JSON schema."""
    if not isinstance(schema, dict):
        return "k31"
    if schema.get("enum"):
        return schema["enum"][0]
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        props = schema.get("properties", {})
        return {name: example_value(props.get(name)) for name in schema.get("required", [])}
    return {"integer": 1, "number": 1.5, "boolean": True, "array": [], "null": None}.get(kind, "k31")


def _pick_tool(tools: Any, choice: Any) -> dict[str, Any] | None:
    if not tools or choice == "none":
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name")
        for t in tools
    ):
        raise BadRequest("tools must be a list of {type: function, function: {name, parameters}}")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        for tool in tools:
            if tool["function"]["name"] == name:
                return tool["function"]
        raise BadRequest(f"tool_choice names {name!r}, which is not among the tools")
    return tools[0]["function"]


def chat_reply(body: dict[str, Any], reasoning_parser: str | None, tool_call_parser: str | None) -> Reply:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    prompt = "\n".join(_message_text(m) for m in messages)
    effort = body.get("reasoning_effort") or DEFAULT_EFFORT
    if effort not in REASONING_TOKENS:
        raise BadRequest(f"reasoning_effort must be one of {', '.join(REASONING_TOKENS)}, got {effort!r}")
    limit = _limit(body.get("max_completion_tokens", body.get("max_tokens")), "max_tokens")
    reasoning = pieces("reasoning:" + prompt, REASONING_TOKENS[effort])
    tool = _pick_tool(body.get("tools"), body.get("tool_choice"))
    calls = []
    if tool is not None:
        args = json.dumps(example_value(tool.get("parameters") or {"type": "object"}), sort_keys=True)
        call_id = "call_" + hashlib.sha256(("call:" + prompt).encode()).hexdigest()[:24]
        calls = [{"id": call_id, "type": "function", "function": {"name": tool["name"], "arguments": args}}]
    if calls:
        content, finish = [], "tool_calls"
    else:
        n, finish = _length(limit)
        content = pieces("chat:" + prompt, n)
    if reasoning_parser is None:  # raw Kimi output: the thinking stays in the text
        content = ["<think>", *reasoning, "</think>", *content]
        reasoning = []
    if calls and tool_call_parser is None:
        call = calls[0]["function"]
        content = [*content, "<|tool_calls_section_begin|>", "<|tool_call_begin|>",
                   f"functions.{call['name']}:0", "<|tool_call_argument_begin|>", call["arguments"],
                   "<|tool_call_end|>", "<|tool_calls_section_end|>"]
        calls, finish = [], "stop"
    return Reply(count_tokens(prompt), content, reasoning, calls, finish)


def chat_response(reply: Reply, rid: str, model: str, created: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": "".join(reply.content) or None}
    if reply.reasoning:
        message["reasoning_content"] = "".join(reply.reasoning)
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": reply.finish_reason}],
        "usage": reply.usage(),
    }


def chat_chunks(reply: Reply, rid: str, model: str, created: int, usage: bool) -> Iterator[dict[str, Any]]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    for piece in reply.reasoning:
        yield chunk({"reasoning_content": piece})
    for piece in reply.content:
        yield chunk({"content": piece})
    for index, call in enumerate(reply.tool_calls):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    yield chunk({}, reply.finish_reason)
    if usage:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
               "choices": [], "usage": reply.usage()}


def completion_prompts(body: dict[str, Any]) -> list[str]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [" ".join(map(str, prompt))]  # token ids: one prompt, one token each
    raise BadRequest("prompt must be a string, a list of strings or a list of token ids")


def completion_limit(body: dict[str, Any]) -> int | None:
    return _limit(body.get("max_tokens"), "max_tokens")


def completion_response(replies: list[Reply], rid: str, model: str, created: int) -> dict[str, Any]:
    choices = [{"index": i, "text": "".join(r.content), "logprobs": None, "finish_reason": r.finish_reason}
               for i, r in enumerate(replies)]
    prompt = sum(r.prompt_tokens for r in replies)
    completion = sum(r.completion_tokens for r in replies)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion}}


def completion_chunks(reply: Reply, rid: str, model: str, created: int) -> Iterator[dict[str, Any]]:
    def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

    for piece in reply.content:
        yield chunk(piece)
    yield chunk("", reply.finish_reason)


def generate_prompts(body: dict[str, Any]) -> tuple[list[str], bool]:
    """SGLang's native /generate: `text` or `input_ids`, one prompt or a batch; (prompts, is_batch)."""
    text, ids = body.get("text"), body.get("input_ids")
    if isinstance(text, str):
        return [text], False
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return text, True
    if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
        return [" ".join(map(str, ids))], False
    if isinstance(ids, list) and ids and all(isinstance(i, list) for i in ids):
        return [" ".join(map(str, i)) for i in ids], True
    raise BadRequest("generate needs text (string or list of strings) or input_ids")


def generate_limit(body: dict[str, Any]) -> int | None:
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object")
    return _limit(params.get("max_new_tokens"), "sampling_params.max_new_tokens")


def generate_result(reply: Reply, rid: str, produced: int | None = None) -> dict[str, Any]:
    """One /generate answer; with `produced` set, the partial result after that many tokens."""
    done = produced is None
    n = len(reply.content) if done else produced
    finish = None
    if done:
        finish = {"type": "length", "length": n} if reply.finish_reason == "length" else {"type": "stop"}
    return {"text": "".join(reply.content[:n]),
            "meta_info": {"id": rid, "finish_reason": finish, "prompt_tokens": reply.prompt_tokens,
                          "completion_tokens": n, "cached_tokens": 0}}
