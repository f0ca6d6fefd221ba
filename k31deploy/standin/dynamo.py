"""`python -m k31deploy.standin.dynamo <the SGLang flags dynamo.sglang would get>`.

The sandbox's stand-in for a `dynamo.sglang` worker. It checks the flags exactly as the engine stand-in does
(unknown flag: exit 2), then serves Dynamo's own worker contract with the Dynamo bindings, as upstream's
`components/src/dynamo/sglang` does (ai-dynamo 1.6.1: main.py, init_llm.py, register.py, shutdown.py,
request_handlers/llm/{decode,prefill}_handler.py): it registers the tiny model (ModelInput.Tokens) with the real
frontend, takes token ids and answers with the token ids of the SGLang stand-in's reply
(k31deploy.standin.replies) in Kimi K3's XTML (reasoning, answer and the request's tool call in their
channels), which the frontend detokenises and parses with the worker's `--dyn-reasoning-parser` /
`--dyn-tool-call-parser` (flags or DYN_REASONING_PARSER / DYN_TOOL_CALL_PARSER). The stand-in's timing model
(K31_STANDIN_TTFT_*, K31_STANDIN_TOKEN_MS) and `--max-running-requests` queue apply as in the SGLang stand-in
(k31deploy.standin.server.Engine, whose PD bootstrap server the prefill runs too), and SIGTERM is handled as
upstream handles it: the endpoint leaves discovery, in-flight requests finish, then the process exits.

Needs the Dynamo venv (the `dynamo` package and `tokenizers`); the helpers above `serve_worker` do not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from k31deploy.standin import replies
from k31deploy.standin.parser import parse_args
from k31deploy.standin.replies import BadRequest, Reply
from k31deploy.standin.server import BootstrapHandler, Engine, HTTPError, record, serve, timing_seconds

log = logging.getLogger("k31.standin.dynamo")

# One ChatML turn of the tiny model's template (k31deploy.tinymodel.CHAT_TEMPLATE).
TURN = re.compile(r"<\|im_start\|>(?P<role>[^\n]*)\n(?P<content>.*?)<\|im_end\|>\n?", re.DOTALL)
# SGLang's default page of 1 token would make the chat template's shared prefix look cached everywhere, and the
# KV router would send every request to one worker: 16, a common engine block size.
KV_BLOCK_SIZE = 16
MAX_WAITING_THREADS = 1024
# Upstream's env names for --dyn-reasoning-parser / --dyn-tool-call-parser
# (dynamo/common/configuration/groups/runtime_args.py).
PARSER_ENV = {"reasoning": "DYN_REASONING_PARSER", "tool_call": "DYN_TOOL_CALL_PARSER"}


def dynamo_parsers(argv: list[str], env: Mapping[str, str]) -> tuple[str | None, str | None, list[str]]:
    """(reasoning parser, tool-call parser, the argv without the --dyn-* parser flags), as dynamo.sglang reads
    them: the flag, else its environment variable. SGLang's own --reasoning-parser / --tool-call-parser do not
    shape the frontend's reply (Dynamo's tokenizer path: SGLang returns token ids), so they are not read here."""
    found = {"reasoning": env.get(PARSER_ENV["reasoning"]) or None,
             "tool_call": env.get(PARSER_ENV["tool_call"]) or None}
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        flag, eq, value = arg.partition("=")
        key = {"--dyn-reasoning-parser": "reasoning", "--dyn-tool-call-parser": "tool_call"}.get(flag)
        if key is None:
            rest.append(arg)
            continue
        value = value if eq else next(it, None)
        if not value:
            raise BadRequest(f"{flag} needs a parser name")
        found[key] = value
    return found["reasoning"], found["tool_call"], rest


def parser_conflict(sglang_tool_parser: str | None, dynamo_tool_parser: str | None) -> str | None:
    """upstream args.py _validate_parser_flags: SGLang's and Dynamo's tool-call parsers exclude each other
    (both would build the tool calls); the worker exits 1 with this message."""
    if sglang_tool_parser and dynamo_tool_parser:
        return "Cannot use both --tool-call-parser and --dyn-tool-call-parser."
    return None


def request_reply(prompt: str, max_tokens: int | None) -> Reply:
    """The SGLang stand-in's reply to the request whose rendered prompt this is, in raw Kimi form (reasoning
    and tool calls inline: Dynamo's frontend parses them). A prompt of template turns is a chat (its tools and
    reasoning_effort turns are the request's fields); anything else came through /v1/completions."""
    turns = [(m["role"], m["content"]) for m in TURN.finditer(prompt)]
    if not turns:
        return replies.text_reply(prompt, max_tokens)
    body: dict[str, Any] = {"messages": [], "max_tokens": max_tokens}
    for role, content in turns:
        if role == "tools":
            body["tools"] = json.loads(content)
        elif role == "reasoning_effort":
            body["reasoning_effort"] = content
        elif role != "assistant" or content:    # the generation prompt's empty assistant turn is no message
            body["messages"].append({"role": role, "content": content})
    return replies.chat_reply(body, None, None)


def xtml(tag: str, **attrs: str) -> tuple[str, str]:
    """A Kimi K3 XTML element's open and close markers (attribute values escaped as the parser unescapes them)."""
    head = "".join(f' {k}="{v.replace("&", "&amp;").replace(chr(34), "&quot;")}"' for k, v in attrs.items())
    return f"<|open|>{tag}{head}<|sep|>", f"<|close|>{tag}<|sep|>"


def reply_pieces(reply: Reply) -> list[str]:
    """The reply as Kimi K3 writes it, one piece per stand-in token: XTML channels (Moonshot's encoding_k3.py,
    the grammar ai-dynamo 1.6.1's kimi_k3 parsers read: dynamo-parsers tool_calling/xtml/kimi_k3_parser.rs)
    with the reasoning in `think`, the answer in `response` and tool calls in `tools`, arguments as raw JSON.
    `reply` is the stand-in's raw Kimi form (replies.chat_reply without parsers), or a plain text reply."""
    if "<think>" not in reply.content:
        return list(reply.content)
    content = reply.content[reply.content.index("</think>") + 1:]
    think = xtml("think")
    pieces = [think[0], *reply.content[1:reply.content.index("</think>")], think[1]]
    if "<|tool_calls_section_begin|>" in content:
        start = content.index("<|tool_calls_section_begin|>")
        name = content[start + 2].removeprefix("functions.").rsplit(":", 1)[0]
        arguments = content[start + 4]
        tools, call, body = xtml("tools"), xtml("call", tool=name, index="1"), xtml("json")
        return [*pieces, tools[0], call[0], body[0], arguments, body[1], call[1], tools[1]]
    response = xtml("response")
    return [*pieces, response[0], *content, response[1]]


class KvBlocks:
    """The KV blocks this worker holds, published as Dynamo KV events so the frontend's KV router can route on
    prefix overlap, as dynamo.sglang relays SGLang's own (publisher.py: KvEventPublisher). Full blocks of the
    prompt only; the oldest leave (a removed event) once more than `capacity` are held."""

    def __init__(self, publisher: Any, block_size: int, capacity: int = 4096):
        self.publisher, self.block_size, self.capacity = publisher, block_size, capacity
        self._held: OrderedDict[int, None] = OrderedDict()

    def store(self, token_ids: list[int]) -> None:
        parent = None
        for end in range(self.block_size, len(token_ids) + 1, self.block_size):
            block = block_hash(parent, token_ids[end - self.block_size:end])
            if block in self._held:
                self._held.move_to_end(block)
            else:
                self.publisher.publish_stored(token_ids[end - self.block_size:end], [self.block_size], [block],
                                              parent_hash=parent)
                self._held[block] = None
            parent = block
        evicted = []
        while len(self._held) > self.capacity:
            evicted.append(self._held.popitem(last=False)[0])
        if evicted:
            self.publisher.publish_removed(evicted)


def block_hash(parent: int | None, tokens: list[int]) -> int:
    """A block's id, a signed 64-bit hash chained from its parent's, as an engine's block hashes chain: equal
    ids mean equal prefixes."""
    digest = hashlib.blake2b(array("q", [parent or 0, *tokens]).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class Worker:
    """One worker's request handlers over the stand-in Engine (its timing, queue and PD bootstrap rooms)."""

    def __init__(self, engine: Engine, tokenizer: Any, bootstrap: tuple[str, int] | None, kv: KvBlocks | None):
        self.engine, self.tokenizer, self.bootstrap, self.kv = engine, tokenizer, bootstrap, kv

    def _reply(self, request: dict[str, Any]) -> tuple[Reply, list[list[int]]]:
        ids = request.get("token_ids") or []
        prompt = self.tokenizer.decode(ids, skip_special_tokens=False)
        limit = (request.get("stop_conditions") or {}).get("max_tokens")
        reply = request_reply(prompt, limit)
        pieces = [self.tokenizer.encode(p, add_special_tokens=False).ids for p in reply_pieces(reply)]
        # The prompt's length in tokens is what a real engine's prefill takes.
        return dataclasses.replace(reply, prompt_tokens=len(ids)), pieces

    async def generate(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        """Decode (or aggregated) worker: token ids out, one stand-in token at a time."""
        reply, pieces = self._reply(request)
        if self.engine.mode == "decode":
            # The decode takes the request's KV from the prefill named in bootstrap_info (set by the frontend
            # from the prefill's disaggregated_params, as decode_handler.py reads it).
            info = request.get("bootstrap_info") or {}
            try:
                await asyncio.to_thread(self.engine.pd_gate, dict(info))
            except HTTPError as exc:
                raise RuntimeError(f"disaggregated decode: {exc}") from exc
        timeline = await asyncio.to_thread(self.engine.begin, [reply])
        try:
            await _until(timeline.prefilled)
            if self.kv is not None:
                self.kv.store(request.get("token_ids") or [])
            # One piece is one token, as the SGLang stand-in counts them; the reply's content already stops at
            # max_tokens there (replies.chat_reply), so the pieces go out whole.
            for n, ids in enumerate(pieces, 1):
                await _until(timeline.prefilled + n * timeline.token_s)
                if context.is_stopped():
                    return
                yield {"token_ids": ids}
                if timeline.first is None:
                    timeline.first = time.monotonic()
            # The frontend's tool parser turns a call into finish_reason tool_calls; the engine itself stopped.
            finish = "stop" if reply.finish_reason == "tool_calls" else reply.finish_reason
            yield {"token_ids": [], "finish_reason": finish,
                   "completion_usage": {"prompt_tokens": reply.prompt_tokens, "completion_tokens": len(pieces),
                                        "total_tokens": reply.prompt_tokens + len(pieces)}}
        finally:
            self.engine.end(timeline)

    async def prefill(self, request: dict[str, Any], context: Any) -> AsyncIterator[dict[str, Any]]:
        """Prefill worker (prefill_handler.py): bootstrap info first, then the prefill's work; the decode takes
        the KV once the room is ready."""
        inner = request.get("request", request)
        reply, _ = self._reply(inner)
        assert self.bootstrap is not None
        host, port = self.bootstrap
        room = (inner.get("bootstrap_info") or {}).get("bootstrap_room")
        if room is None:
            room = random.randint(0, 2**63 - 1)
        yield {"token_ids": [], "text": None, "finish_reason": None,
               "disaggregated_params": {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}}
        timeline = await asyncio.to_thread(self.engine.begin, [dataclasses.replace(reply, content=[])])
        try:
            await _until(timeline.prefilled)
            if self.kv is not None:
                self.kv.store(inner.get("token_ids") or [])
            self.engine.take_rooms({"bootstrap_room": room})
        finally:
            self.engine.end(timeline)


async def _until(deadline: float) -> None:
    delay = deadline - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


def bootstrap_address(args: Any, env: Mapping[str, str]) -> tuple[str, int]:
    """Where decodes reach this prefill (handler_base.py _get_bootstrap_info): --dist-init-addr's host, else
    the host's own address, here the one the plan gives the worker's planes (DYN_TCP_RPC_HOST)."""
    if args.dist_init_addr:
        host = args.dist_init_addr.rsplit(":", 1)[0].strip("[]")
    else:
        host = env.get("DYN_TCP_RPC_HOST") or "127.0.0.1"
    return host, args.disaggregation_bootstrap_port


async def serve_worker(argv: list[str], model_dir: str, reasoning: str | None, tool_call: str | None) -> None:
    from dynamo.common.utils.runtime import create_runtime
    from dynamo.llm import KvEventPublisher, ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model
    from dynamo.sglang.shutdown import install_graceful_shutdown
    from tokenizers import Tokenizer

    args = parse_args(argv)
    env = os.environ
    # Request threads only wait (for a slot in the running batch, for the prefill's KV), one per request as in the
    # SGLang stand-in's threading HTTP server: asyncio's default pool (cores + 4) would cap the batch.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=MAX_WAITING_THREADS))
    namespace = env.get("DYN_NAMESPACE", "dynamo")
    prefill = args.disaggregation_mode == "prefill"
    # upstream runtime_args.py defaults: etcd discovery, TCP request plane, the event plane chosen by the runtime
    # (NATS with etcd) unless DYN_EVENT_PLANE names one.
    runtime, loop = create_runtime(discovery_backend=env.get("DYN_DISCOVERY_BACKEND", "etcd"),
                                   request_plane=env.get("DYN_REQUEST_PLANE", "tcp"),
                                   event_plane=env.get("DYN_EVENT_PLANE") or None)
    shutdown_event = asyncio.Event()
    shutdown_endpoints: list[Any] = []
    # main.py: SIGTERM/SIGINT unregister the endpoints from discovery, wait the grace period
    # (DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS, 5 s), then shut the runtime down; serve_endpoint(...,
    # graceful_shutdown=True) lets in-flight requests finish before it returns.
    install_graceful_shutdown(loop, runtime, shutdown_endpoints, shutdown_event)

    engine = Engine(args)
    bootstrap = None
    servers = []
    if prefill:
        bootstrap = bootstrap_address(args, env)
        # On the address decodes are told to use (SGLang's own bootstrap server would take --host, which a
        # dynamo.sglang worker in the plan does not get).
        servers.append(serve(bootstrap[0], bootstrap[1], BootstrapHandler, engine))
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    component = "prefill" if prefill else "backend"     # args.py: prefill workers serve {ns}.prefill.generate
    endpoint = runtime.endpoint(f"{namespace}.{component}.generate")
    shutdown_endpoints[:] = [endpoint]
    kv = KvBlocks(KvEventPublisher(endpoint, kv_block_size=KV_BLOCK_SIZE), KV_BLOCK_SIZE)
    worker = Worker(engine, tokenizer, bootstrap, kv)

    config = ModelRuntimeConfig()
    config.reasoning_parser = reasoning          # register.py get_runtime_config
    config.tool_call_parser = tool_call
    config.context_length = args.context_length
    config.kv_event_publishing_enabled = True
    if prefill:
        model_type, worker_type, needs = ModelType.Prefill, WorkerType.Prefill, [[WorkerType.Decode]]
    elif args.disaggregation_mode == "decode":
        model_type, worker_type, needs = ModelType.Chat | ModelType.Completions, WorkerType.Decode, \
            [[WorkerType.Prefill]]
    else:
        model_type, worker_type, needs = ModelType.Chat | ModelType.Completions, WorkerType.Aggregated, []
    bos = tokenizer.token_to_id("<s>")
    # health_check.py SglangHealthCheckPayload: one token from the BOS id.
    health = {"token_ids": [bos], "stop_conditions": {"max_tokens": 1, "ignore_eos": False},
              "sampling_options": {"temperature": 0.0}, "eos_token_ids": [], "annotations": []}
    name = args.served_model_name or args.model_path
    try:
        await asyncio.gather(
            endpoint.serve_endpoint(worker.prefill if prefill else worker.generate, graceful_shutdown=True,
                                    health_check_payload=health),
            register_model(ModelInput.Tokens, model_type, endpoint, model_dir, name, worker_type=worker_type,
                           needs=needs, runtime_config=config, kv_cache_block_size=KV_BLOCK_SIZE),
        )
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    log.info("worker stopped")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    record(argv, os.environ.get("K31_STANDIN_RECORD"))
    model_dir = os.environ.get("K31_STANDIN_MODEL_DIR")
    if not model_dir:
        print("error: K31_STANDIN_MODEL_DIR must name the tiny model directory the worker registers", file=sys.stderr)
        return 2
    try:
        reasoning, tool_call, sglang_argv = dynamo_parsers(argv, os.environ)
    except BadRequest as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args = parse_args(sglang_argv)
    if args.node_rank >= 1:
        # Ranks >= 1 of a multi-node server register nothing with Dynamo (init_llm.py handle_non_leader_node);
        # like SGLang's, they only answer /health (here on the worker's system port and host, the cluster address
        # the plan gives as DYN_SYSTEM_HOST, as the status server binds it).
        cmd = [sys.executable, "-m", "k31deploy.standin", *sglang_argv,
               "--host", os.environ.get("DYN_SYSTEM_HOST", "127.0.0.1"),
               "--port", os.environ.get("DYN_SYSTEM_PORT", "30000")]
        os.environ.pop("K31_STANDIN_RECORD", None)    # the record above holds the planned argv
        os.execv(cmd[0], cmd)
    conflict = parser_conflict(args.tool_call_parser, tool_call)
    if conflict:
        print(f"error: {conflict}", file=sys.stderr)
        return 1
    try:
        timing_seconds(os.environ)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve_worker(sglang_argv, model_dir, reasoning, tool_call))
    return 0


if __name__ == "__main__":
    sys.exit(main())
