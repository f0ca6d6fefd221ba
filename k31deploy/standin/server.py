"""HTTP surface of the stand-in: what the SGLang router, Dynamo-less smoke tests and k31's health
checks see of a real `sglang.launch_server` (field notes §2, §4), served from the standard library.
"""

from __future__ import annotations

import argparse
import hmac
import http.client
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from k31deploy.standin import replies
from k31deploy.standin.parser import parse_args
from k31deploy.standin.replies import BadRequest, Reply

WIDE_LOG_LINE = "[k31 wide] first wide step"
# Environment names whose values the record never holds (the same rule as k31deploy.runner.records.SECRET_NAME,
# which nodes cannot import): the record shows that HF_TOKEN arrived, not what it is.
SECRET_ENV = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|(API|ACCESS|PRIVATE)_?KEY", re.IGNORECASE)
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


class HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def layout_name(args: argparse.Namespace) -> str:
    parts = [f"TP{args.tp_size}"]
    for name, size in (("DCP", args.dcp_size), ("PP", args.pp_size), ("EP", args.ep_size),
                       ("DP", args.attn_dp_size), ("PCP", args.attn_cp_size)):
        if size > 1:
            parts.append(f"{name}{size}")
    text = "·".join(parts)
    return f"{text} over {args.nnodes} nodes" if args.nnodes > 1 else text


def monokernel_problems(args: argparse.Namespace) -> list[str]:
    """Why --enable-amd-monokernel cannot run this setup (seed: it takes TP8 or DCP8, not HiCache)."""
    if not args.enable_amd_monokernel:
        return []
    problems = []
    if args.enable_hierarchical_cache:
        problems.append("HiCache is on (--enable-hierarchical-cache) and the monokernel takes no KV offload")
    layout = layout_name(args)
    if layout not in ("TP8", "TP8·DCP8"):
        problems.append(f"the layout is {layout}; the monokernel runs TP8 or TP8·DCP8 only")
    return problems


class RoomBoard:
    """Bootstrap rooms a prefill has taken: the decode waits for its room as it would for the KV."""

    def __init__(self, keep: int = 4096):
        self._rooms: OrderedDict[str, None] = OrderedDict()
        self._keep = keep
        self._cond = threading.Condition()

    def add(self, room: Any) -> None:
        with self._cond:
            self._rooms[str(room)] = None
            self._rooms.move_to_end(str(room))
            while len(self._rooms) > self._keep:
                self._rooms.popitem(last=False)
            self._cond.notify_all()

    def wait(self, room: str, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: room in self._rooms, timeout)


# Upstream's default buckets (TokenizerMetricsCollector in observability/metrics_collector.py).
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
               0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
# The stand-in has no memory pools: usage is running requests over the ceiling (or this many), and a HiCache
# host pool of this many tokens that it never fills.
STANDIN_POOL_REQUESTS = 64
STANDIN_HOST_TOKENS = 1_000_000
# The timing model, in milliseconds (all 0 by default: answers are instant). Time to first token is the base plus
# the per-1k-prompt-token part (a prefill's work); every output token then takes TOKEN_MS (a decode's work).
TIMING_ENV = ("K31_STANDIN_TTFT_BASE_MS", "K31_STANDIN_TTFT_PER_1K_PROMPT_TOKENS_MS", "K31_STANDIN_TOKEN_MS")


def timing_seconds(env: Mapping[str, str]) -> tuple[float, float, float]:
    """(TTFT base, TTFT per prompt token, seconds per output token) from the environment."""
    values = []
    for name in TIMING_ENV:
        raw = env.get(name) or "0"
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 <= value < float("inf"):
            raise ValueError(f"{name} must be a number of milliseconds >= 0, got {raw!r}")
        values.append(value / 1000)
    base, per_1k, token = values
    return base, per_1k / 1000, token


class Timeline:
    """One request's clock: arrival, admission into the running batch, the prefill part done, and when its
    first output token left."""

    def __init__(self, arrived: float, admitted: float, prompt_tokens: int, prefill_s: float, token_s: float,
                 steps: int):
        self.arrived, self.admitted, self.prompt_tokens = arrived, admitted, prompt_tokens
        self.prefilled = admitted + prefill_s
        self.token_s, self.steps = token_s, steps
        self.first: float | None = None
        self.ended = False

    def wait(self, tokens: int) -> None:
        """Sleep until `tokens` output tokens exist (0: until the prefill part is done)."""
        delay = self.prefilled + tokens * self.token_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)


class _Histogram:
    """A Prometheus histogram (cumulative buckets, +Inf, sum, count), as prometheus_client exposes it."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1, total: float | None = None) -> None:
        i = next((k for k, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += count
        self.sum += value * count if total is None else total

    def samples(self, labels: str) -> list[tuple[str, str, Any]]:
        out, running = [], 0
        for bound, n in zip([*map(repr, map(float, self.bounds)), "+Inf"], self.counts, strict=True):
            running += n
            out.append(("_bucket", f'{labels},le="{bound}"', running))
        return [*out, ("_sum", labels, self.sum), ("_count", labels, running)]


class LoadHold:
    """A test's hold on the load: a server that starts while a file named like its record with `.hold` for `.json`
    exists (/etc/k31/k31-decode1-r0.standin.hold) keeps loading after its load seconds until the file is gone. A
    test that must act while a redeploy waits for a restarted server (freeze a host, kill the controller) holds it
    there, acts, then removes the file, instead of racing a load time. Released once, it stays released; a server
    already running when the file appears is not held."""

    def __init__(self, record: str | None):
        path = f"{record.removesuffix('.json')}.hold" if record else None
        self.path = path if path and os.path.exists(path) else None

    def held(self) -> bool:
        if self.path and not os.path.exists(self.path):
            self.path = None
        return self.path is not None

    def wait(self, stop: threading.Event) -> bool:
        """Wait out the hold (rank >= 1, which has no /health until loaded): True when stopped meanwhile."""
        while self.held():
            if stop.wait(0.2):
                return True
        return False


class Engine:
    """State one stand-in server shares between its request threads."""

    def __init__(self, args: argparse.Namespace, load_seconds: float = 0.0,
                 env: Mapping[str, str] | None = None):
        env = os.environ if env is None else env
        self.args = args
        self.ready_at = time.monotonic() + load_seconds
        self.hold = LoadHold(env.get("K31_STANDIN_RECORD"))
        self.kv_timeout = float(env.get("K31_STANDIN_KV_TIMEOUT", "10"))
        self.wide = args.enable_amd_monokernel and env.get("SGLANG_AMD_MONO_K31_WIDE") == "1"
        ttft_base, ttft_per_token, token_s = timing_seconds(env)
        # In PD a prefill does the TTFT part and a decode the per-token part; a unified server does both.
        self.ttft_base = 0.0 if self.mode == "decode" else ttft_base
        self.ttft_per_token = 0.0 if self.mode == "decode" else ttft_per_token
        self.token_s = 0.0 if self.mode == "prefill" else token_s
        # Requests past --max-running-requests wait for a slot in arrival order (SGLang's waiting queue).
        self.ceiling = args.max_running_requests or float("inf")
        self.rooms = RoomBoard()
        self._lock = threading.Lock()
        self._slots = threading.Condition(self._lock)
        self._tickets = 0    # handed out on arrival
        self._admitted = 0   # tickets admitted so far: the queue's head is ticket number _admitted
        self._wide_logged = False
        self.running_reqs = 0
        self.queued_reqs = 0
        self.running_tokens = 0
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Upstream's TokenizerMetricsCollector histograms, observed from this stand-in's own request timings.
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self._last_gen = (time.monotonic(), 0)
        self.transfer_failed_total = 0

    @property
    def mode(self) -> str:
        return self.args.disaggregation_mode

    def loading(self) -> bool:
        return time.monotonic() < self.ready_at or self.hold.held()

    def server_info(self) -> dict[str, Any]:
        # No model_path: the router would try to fetch that tokenizer from the hub (field notes §4). SGLang
        # 0.5.23 reports its keys here too (build_server_info redacts only watermark secrets); the stand-in
        # does not repeat that.
        info = {k: ("<redacted>" if k in ("api_key", "admin_api_key") and v else v)
                for k, v in vars(self.args).items() if k != "model_path"}
        info["version"] = "k31-standin"
        info["internal_states"] = [{"last_gen_throughput": 0.0}]
        return info

    def model_info(self) -> dict[str, Any]:
        return {"served_model_name": self.args.served_model_name, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": "default",
                "has_image_understanding": False, "has_audio_understanding": False}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.args.served_model_name, "object": "model",
                                            "created": 0, "owned_by": "sglang"}]}

    def load(self) -> list[dict[str, int]]:
        with self._lock:
            busy = {"num_reqs": self.running_reqs, "num_waiting_reqs": self.queued_reqs,
                    "num_tokens": self.running_tokens}
        idle = {"num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        return [{"dp_rank": r, **(busy if r == 0 else idle)} for r in range(self.args.attn_dp_size)]

    def metrics(self) -> str:
        """SGLang's exposition for what the stand-in knows (names, types and label names as upstream's
        observability/metrics_collector.py; see k31deploy.monitoring.rules): the scheduler's gauges carry
        model_name, engine_type and the ranks, the tokenizer's counters and histograms model_name only."""
        args = self.args
        model = f'model_name="{args.served_model_name}"'
        engine_type = self.mode if self.mode in ("prefill", "decode") else "unified"
        rank = f'{model},engine_type="{engine_type}",tp_rank="0",pp_rank="0",moe_ep_rank="0"'
        if args.attn_dp_size > 1:
            rank += ',dp_rank="0"'
        lines: list[str] = []

        def family(name: str, kind: str, text: str, samples: Iterable[tuple[str, str, Any]]) -> None:
            lines.extend([f"# HELP sglang:{name} {text}", f"# TYPE sglang:{name} {kind}"])
            lines.extend(f"sglang:{name}{suffix}{{{labels}}} {value}" for suffix, labels, value in samples)

        with self._lock:
            running, queued, total = self.running_reqs, self.queued_reqs, self.requests_total
            prompt, generated = self.prompt_tokens_total, self.generation_tokens_total
            histograms = [(n, t, h.samples(model)) for n, t, h in (
                ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft),
                ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", self.itl),
                ("e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", self.e2e))]
        ceiling = args.max_running_requests or STANDIN_POOL_REQUESTS
        usage = min(1.0, running / ceiling)
        family("num_running_reqs", "gauge", "The number of running requests.", [("", rank, running)])
        family("num_queue_reqs", "gauge", "The number of requests in the waiting queue.", [("", rank, queued)])
        family("token_usage", "gauge", "The token usage.", [("", rank, usage)])
        # Kimi-K3's KDA states sit in SGLang's mamba pool: one state per running request here.
        family("mamba_usage", "gauge", "The token usage for Mamba layers.", [("", rank, usage)])
        family("gen_throughput", "gauge", "The generation throughput (token/s).",
               [("", rank, self._gen_throughput(generated))])
        if args.enable_hierarchical_cache:
            family("hicache_host_used_tokens", "gauge", "Number of tokens currently used in the host KV cache.",
                   [("", rank, 0)])
            family("hicache_host_total_tokens", "gauge", "Total capacity of the host KV cache in tokens.",
                   [("", rank, STANDIN_HOST_TOKENS)])
        if self.mode in ("prefill", "decode"):
            family("num_transfer_failed_reqs_total", "counter", "The number of transfer failed requests.",
                   [("", rank, self.transfer_failed_total)])
            family("num_bootstrap_failed_reqs_total", "counter", "The number of bootstrap failed requests.",
                   [("", rank, 0)])
        family("num_requests_total", "counter", "Number of requests processed.", [("", model, total)])
        family("prompt_tokens_total", "counter", "Number of prefill tokens processed.", [("", model, prompt)])
        family("generation_tokens_total", "counter", "Number of generation tokens processed.",
               [("", model, generated)])
        for name, text, samples in histograms:
            family(name, "histogram", text, samples)
        return "\n".join(lines) + "\n"

    def _gen_throughput(self, generated: int) -> float:
        """Tokens a second since the previous scrape, as upstream's gauge reports over its log interval."""
        now = time.monotonic()
        last_t, last_n = self._last_gen
        self._last_gen = (now, generated)
        return round((generated - last_n) / (now - last_t), 3) if now > last_t else 0.0

    def begin(self, reply_list: list[Reply], arrived: float | None = None) -> Timeline:
        """Admit a request into the running batch, waiting in the queue while the batch is at the ceiling."""
        arrived = time.monotonic() if arrived is None else arrived
        prompt_tokens = sum(r.prompt_tokens for r in reply_list)
        with self._slots:
            ticket = self._tickets
            self._tickets += 1
            self.queued_reqs += 1
            self._slots.wait_for(lambda: ticket == self._admitted and self.running_reqs < self.ceiling)
            self._admitted += 1
            self.queued_reqs -= 1
            self._slots.notify_all()  # the next in line may fit too
            self.running_reqs += 1
            self.running_tokens += prompt_tokens
            # Totals count at admission, so a client sees its request in /metrics once answered.
            self.requests_total += 1
            self.prompt_tokens_total += prompt_tokens
            self.generation_tokens_total += sum(r.completion_tokens for r in reply_list)
            log_wide = self.wide and self.mode != "prefill" and not self._wide_logged
            self._wide_logged = self._wide_logged or log_wide
        if log_wide:
            print(WIDE_LOG_LINE, flush=True)
        prefill_s = self.ttft_base + self.ttft_per_token * prompt_tokens
        # A batch is decoded side by side: it takes as many steps as its longest answer.
        steps = max((r.completion_tokens for r in reply_list), default=0)
        return Timeline(arrived, time.monotonic(), prompt_tokens, prefill_s, self.token_s, steps)

    def end(self, timeline: Timeline) -> None:
        """The request is done (called once, before its last bytes leave: a client that has its answer sees it in
        /metrics)."""
        if timeline.ended:
            return
        timeline.ended = True
        now = time.monotonic()
        # Without a streamed token (a non-streamed answer) the first token was made steps - 1 tokens before the
        # end; with no timing set that is the time of the answer, which leaves with every token at once.
        first = timeline.first
        if first is None:
            first = max(timeline.admitted, now - max(0, timeline.steps - 1) * timeline.token_s)
        tokens = max(1, timeline.steps)
        with self._slots:
            self.running_reqs -= 1
            self.running_tokens -= timeline.prompt_tokens
            self._slots.notify_all()
            self.ttft.observe(first - timeline.arrived)
            self.e2e.observe(now - timeline.arrived)
            # Decoding time spread over the output tokens, counted per token as upstream's
            # observe_inter_token_latency does.
            decoding = max(0.0, now - timeline.prefilled)
            self.itl.observe(decoding / tokens, count=tokens, total=decoding)

    def take_rooms(self, body: dict[str, Any]) -> None:
        """A prefill has the request's KV once its prefill part is done: the decode waiting on the room may take
        it from then on."""
        if self.mode != "prefill":
            return
        room = body.get("bootstrap_room")
        for r in room if isinstance(room, list) else [room]:
            if r is not None:
                self.rooms.add(r)

    def pd_gate(self, body: dict[str, Any]) -> None:
        """The PD contract, decode side: a decode needs the prefill to have the request's room (take_rooms)."""
        if self.mode != "decode":
            return
        room = body.get("bootstrap_room")
        rooms = room if isinstance(room, list) else [room]
        missing = [f for f in BOOTSTRAP_FIELDS if body.get(f) is None]
        if missing:
            raise HTTPError(400, f"a decode server needs {', '.join(missing)} in the request "
                                 "(send requests through the PD router)")
        hosts, ports = (v if isinstance(v, list) else [v] * len(rooms)
                        for v in (body["bootstrap_host"], body["bootstrap_port"]))
        if not len(hosts) == len(ports) == len(rooms):
            raise HTTPError(400, "bootstrap_host, bootstrap_port and bootstrap_room differ in length")
        for host, port, room_ in zip(hosts, ports, rooms, strict=True):
            try:
                port = int(port)
            except (TypeError, ValueError) as exc:
                raise HTTPError(400, f"bootstrap_port must be an integer, got {port!r}") from exc
            self._fetch_kv(str(host), port, str(room_))

    def _transfer_failed(self) -> None:
        """sglang:num_transfer_failed_reqs_total: a decode that never got its KV from the prefill."""
        with self._lock:
            self.transfer_failed_total += 1

    def _fetch_kv(self, host: str, port: int, room: str) -> None:
        conn = http.client.HTTPConnection(host, port, timeout=self.kv_timeout + 5)
        try:
            conn.request("GET", f"/kv/{room}?wait={self.kv_timeout}")
            status = conn.getresponse().status
        except OSError as exc:
            message = f"the prefill bootstrap server http://{host}:{port} does not answer: {exc}"
            self._transfer_failed()
            raise HTTPError(502, message) from exc
        finally:
            conn.close()
        if status != 200:
            self._transfer_failed()
            raise HTTPError(504, f"the prefill at http://{host}:{port} never took bootstrap_room {room} "
                                 f"(waited {self.kv_timeout:g} s)")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "k31-standin"

    def setup(self) -> None:
        # Without it Nagle + delayed ACK add ~44 ms to every response (field notes §4).
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # no access log in the journal
        pass

    def send_body(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def send_json(self, status: int, payload: Any) -> None:
        self.send_body(status, json.dumps(payload).encode(), "application/json")

    def send_error_json(self, status: int, message: str) -> None:
        self.send_json(status, {"object": "error", "message": message, "code": status,
                                "type": http.client.responses.get(status, "Error")})

    def read_json(self) -> dict[str, Any]:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as exc:
            raise HTTPError(400, f"the request body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise HTTPError(400, "the request body must be a JSON object")
        return body


class RankHealthHandler(_Handler):
    """Node ranks >= 1 of a multi-node server: a dummy /health and nothing else (field notes §2)."""

    def do_GET(self) -> None:
        if urlsplit(self.path).path == "/health":
            self.send_body(200, b"", "text/plain")
        else:
            self.send_error_json(404, "not found")

    do_POST = do_GET


class BootstrapHandler(_Handler):
    """The prefill's bootstrap port: the decode reaches it before taking a request's KV."""

    engine: Engine

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/health":
            self.send_body(200, b"OK", "text/plain")
        elif url.path == "/route":
            a = self.engine.args
            self.send_json(200, {"tp_size": a.tp_size, "dp_size": a.dp_size, "pp_size": a.pp_size,
                                 "dcp_size": a.dcp_size,
                                 "transfer_backend": a.disaggregation_transfer_backend})
        elif url.path.startswith("/kv/"):
            wait = min(float(parse_qs(url.query).get("wait", ["0"])[0]), 60.0)
            if self.engine.rooms.wait(url.path.removeprefix("/kv/"), wait):
                self.send_json(200, {"room": url.path.removeprefix("/kv/")})
            else:
                self.send_error_json(404, "no such bootstrap room")
        else:
            self.send_error_json(404, "not found")


class EngineHandler(_Handler):
    engine: Engine

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        path = urlsplit(self.path).path
        route = ROUTES.get(path)
        if route is None or (path == "/metrics" and not self.engine.args.enable_metrics):
            self._refuse(404, f"no route {path}")
            return
        if not authorized(path, self.headers.get("Authorization"), self.engine.args):
            self._refuse(401, None)
            return
        methods, func = route
        if method not in methods:
            self._refuse(405, f"{path} takes {' or '.join(methods)}")
            return
        try:
            func(self)
        except HTTPError as exc:
            self.send_error_json(exc.status, str(exc))
        except BadRequest as exc:
            self.send_error_json(400, str(exc))
        except ConnectionError:
            self.close_connection = True  # the client went away mid-answer

    def _refuse(self, status: int, message: str | None) -> None:
        # The unread body would otherwise be parsed as the keep-alive connection's next request.
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if message is None:
            self.send_json(status, {"error": "Unauthorized"})
        else:
            self.send_error_json(status, message)

    # -- probes ---------------------------------------------------------------------------------
    def health(self) -> None:
        if self.engine.loading():
            self.send_error_json(503, "the model is loading")
        else:
            self.send_body(200, b"", "text/plain")

    def server_info(self) -> None:
        self.send_json(200, self.engine.server_info())

    def model_info(self) -> None:
        self.send_json(200, self.engine.model_info())

    def models(self) -> None:
        self.send_json(200, self.engine.models())

    def get_load(self) -> None:
        self.send_json(200, self.engine.load())

    def metrics(self) -> None:
        self.send_body(200, self.engine.metrics().encode(), "text/plain; version=0.0.4")

    def flush_cache(self) -> None:
        self.send_body(200, b"Cache flushed.\n", "text/plain")

    # -- generation -----------------------------------------------------------------------------
    def _request(self) -> dict[str, Any]:
        self.arrived = time.monotonic()
        if self.engine.loading():
            raise HTTPError(503, "the model is loading")
        body = self.read_json()
        self.engine.pd_gate(body)
        return body

    def _serve(self, body: dict[str, Any], replies_: list[Reply], answer: Callable[[], None]) -> None:
        self.current = (body, replies_)
        answer()

    @contextmanager
    def _running(self) -> Iterator[Timeline]:
        """The current request in the running batch: queued for a slot, then its prefill part done (a prefill's
        KV is the decode's to take from then on)."""
        body, replies_ = self.current
        timeline = self.engine.begin(replies_, self.arrived)
        try:
            timeline.wait(0)
            self.engine.take_rooms(body)
            yield timeline
        finally:
            self.engine.end(timeline)  # when the answer broke off before its end

    def _stream(self, events: Iterable[Any]) -> None:
        """Write the events as SSE chunks, each once the tokens it carries exist."""
        # The status and headers leave at once, as Starlette's StreamingResponse sends them: a queued or
        # prefilling stream is already a 200 to its client.
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        with self._running() as timeline:
            produced = 0
            for event in [*events, "[DONE]"]:
                produced = tokens_after(event, produced)
                timeline.wait(produced)
                if event == "[DONE]":
                    self.engine.end(timeline)
                data = event if isinstance(event, str) else json.dumps(event)
                chunk = f"data: {data}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
                if produced and timeline.first is None:
                    timeline.first = time.monotonic()
            self.wfile.write(b"0\r\n\r\n")

    def _answer(self, payload: Callable[[], Any]) -> None:
        """A non-streamed answer: it leaves whole once its last token exists."""
        with self._running() as timeline:
            timeline.wait(timeline.steps)
            body = payload()
            self.engine.end(timeline)
            self.send_json(200, body)

    def _model(self, body: dict[str, Any]) -> str:
        return body.get("model") or self.engine.args.served_model_name

    def chat(self) -> None:
        body = self._request()
        args = self.engine.args
        reply = replies.chat_reply(body, args.reasoning_parser, args.tool_call_parser)
        rid, model, created = f"chatcmpl-{uuid.uuid4().hex}", self._model(body), int(time.time())
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._serve(body, [reply], lambda: self._stream(
                replies.chat_chunks(reply, rid, model, created, usage)))
        else:
            self._serve(body, [reply], lambda: self._answer(
                lambda: replies.chat_response(reply, rid, model, created)))

    def completions(self) -> None:
        body = self._request()
        limit = replies.completion_limit(body)
        batch = [replies.text_reply(p, limit) for p in replies.completion_prompts(body)]
        rid, model, created = f"cmpl-{uuid.uuid4().hex}", self._model(body), int(time.time())
        if body.get("stream"):
            if len(batch) > 1:
                raise BadRequest("the stand-in streams one prompt at a time")
            self._serve(body, batch, lambda: self._stream(
                replies.completion_chunks(batch[0], rid, model, created)))
        else:
            self._serve(body, batch, lambda: self._answer(
                lambda: replies.completion_response(batch, rid, model, created)))

    def generate(self) -> None:
        body = self._request()
        limit = replies.generate_limit(body)
        prompts, is_batch = replies.generate_prompts(body)
        batch = [replies.text_reply(p, limit) for p in prompts]
        rid = str(body.get("rid") or uuid.uuid4().hex)
        if body.get("stream"):
            if len(batch) > 1:
                raise BadRequest("the stand-in streams one prompt at a time")
            reply = batch[0]
            n = len(reply.content)
            events = [replies.generate_result(reply, rid, k) for k in range(1, n)]
            self._serve(body, batch, lambda: self._stream([*events, replies.generate_result(reply, rid)]))
        elif is_batch:
            self._serve(body, batch, lambda: self._answer(lambda: [replies.generate_result(r, rid) for r in batch]))
        else:
            self._serve(body, batch, lambda: self._answer(lambda: replies.generate_result(batch[0], rid)))


def tokens_after(event: Any, produced: int) -> int:
    """Output tokens that exist once this SSE event is out (its first token paces a stream's TTFT, the rest its
    inter-token latency): one per chat or completion piece, a tool call's argument words, /generate's count."""
    if not isinstance(event, dict):
        return produced
    if "meta_info" in event:
        return int(event["meta_info"]["completion_tokens"])
    choice = (event.get("choices") or [{}])[0]
    if "text" in choice:
        return produced + bool(choice["text"])
    delta = choice.get("delta") or {}
    calls = sum(len(c["function"]["arguments"].split()) for c in delta.get("tool_calls") or [])
    return produced + bool(delta.get("content") or delta.get("reasoning_content")) + calls


def authorized(path: str, authorization: str | None, args: argparse.Namespace) -> bool:
    """SGLang 0.5.23's decide_request_auth (utils/auth.py): health, readiness and metrics are always open;
    admin endpoints want --admin-api-key when it is set (else --api-key); the rest want --api-key."""
    if path.startswith(("/health", "/ready", "/metrics")):
        return True
    want = (args.admin_api_key or args.api_key) if path in ADMIN_PATHS else args.api_key
    if not want:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), want.encode())


# SGLang's AuthLevel.ADMIN_OPTIONAL endpoints the stand-in serves (http_server.py): the cache flush.
ADMIN_PATHS = {"/flush_cache"}

ROUTES: dict[str, tuple[tuple[str, ...], Callable[[EngineHandler], None]]] = {
    "/health": (("GET",), EngineHandler.health),
    "/health_generate": (("GET",), EngineHandler.health),
    "/server_info": (("GET",), EngineHandler.server_info),
    "/get_server_info": (("GET",), EngineHandler.server_info),
    "/model_info": (("GET",), EngineHandler.model_info),
    "/get_model_info": (("GET",), EngineHandler.model_info),
    "/v1/models": (("GET",), EngineHandler.models),
    "/get_load": (("GET",), EngineHandler.get_load),
    "/metrics": (("GET",), EngineHandler.metrics),
    "/generate": (("POST",), EngineHandler.generate),
    "/v1/completions": (("POST",), EngineHandler.completions),
    "/v1/chat/completions": (("POST",), EngineHandler.chat),
    "/flush_cache": (("POST",), EngineHandler.flush_cache),
}


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        # Routers drop idle keep-alive connections; that is no error worth a traceback.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def serve(host: str, port: int, handler: type[BaseHTTPRequestHandler],
          engine: Engine | None = None) -> ThreadingHTTPServer:
    """Bind and serve in a daemon thread; the caller shuts it down."""
    cls = handler if engine is None else type(handler.__name__, (handler,), {"engine": engine})
    server = _Server((host, port), cls)
    # A short poll interval keeps shutdown (SIGTERM, test teardown) quick.
    threading.Thread(target=server.serve_forever, args=(0.05,), name=f"standin-{port}", daemon=True).start()
    return server


def record(argv: list[str], path: str | None) -> None:
    """Write argv and environment for tests and molecule verify (atomically: readers poll for it), root-only
    and with secret values (HF_TOKEN ...) replaced by <redacted>."""
    if not path:
        return
    env = {k: "<redacted>" if SECRET_ENV.search(k) else v for k, v in os.environ.items()}
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as fh:
        json.dump({"argv": argv, "env": env, "pid": os.getpid()}, fh, indent=1, sort_keys=True)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    record(argv, os.environ.get("K31_STANDIN_RECORD"))
    args = parse_args(argv)
    problems = monokernel_problems(args)
    if problems:
        print("error: --enable-amd-monokernel cannot run this setup: " + "; ".join(problems), file=sys.stderr)
        return 1
    load_seconds = float(os.environ.get("K31_STANDIN_LOAD_SECONDS") or 0)
    try:
        timing_seconds(os.environ)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    servers: list[ThreadingHTTPServer] = []
    try:
        if args.node_rank >= 1:
            # Real ranks >= 1 open their dummy /health only once their schedulers have loaded.
            hold = LoadHold(os.environ.get("K31_STANDIN_RECORD"))    # as it is at the start, as rank 0's
            if stop.wait(load_seconds) or hold.wait(stop):
                return 0
            servers.append(serve(args.host, args.port, RankHealthHandler))
            role = f"node rank {args.node_rank} (/health only)"
        else:
            engine = Engine(args, load_seconds)
            if engine.mode == "prefill":
                servers.append(serve(args.host, args.disaggregation_bootstrap_port, BootstrapHandler, engine))
            servers.append(serve(args.host, args.port, EngineHandler, engine))
            role = "unified" if engine.mode == "null" else engine.mode
    except OSError as exc:
        print(f"error: cannot listen on {args.host}: {exc}", file=sys.stderr)
        for server in servers:
            server.shutdown()
        return 1
    print(f"k31 stand-in: {role} server {args.served_model_name} on {args.host}:{args.port}", flush=True)
    stop.wait()
    for server in servers:
        server.shutdown()
        server.server_close()
    return 0
