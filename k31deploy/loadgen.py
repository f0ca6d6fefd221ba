"""Client load for tests and bench: concurrent multi-turn chat sessions against an OpenAI-compatible endpoint.

Each session holds conversations whose context grows turn by turn (the previous messages, the assistant's answer,
a new user message), streamed by default (chat completions over SSE, httpx). Every request ends as one of

- `complete`: HTTP 200 and the stream ended with `data: [DONE]` (non-streamed: a whole JSON answer);
- `truncated`: HTTP 200, but the stream ended without `[DONE]` or the connection broke mid-stream;
- `refused`: HTTP 4xx/5xx, or no answer at all (connection refused or closed before any byte of a response);
- `error`: anything else (a timeout, a malformed event ...), with the reason.

Sessions keep starting conversations (or hold `conversations` each). A run is bounded by a number of requests
and a deadline (no request starts after it; one in flight finishes,
within the client timeout), and only ever targets loopback or private (RFC 1918 / ULA) addresses.

    python -m k31deploy.loadgen --base-url http://127.0.0.1:8000 --sessions 8 --turns 4 --max-requests 200 \\
        --deadline 60 [--api-key-file F] [--json]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import socket
import ssl
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

OUTCOMES = ("complete", "truncated", "refused", "error")
# Where load may go: this machine and private networks (test clusters), nowhere else.
ALLOWED_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "127.0.0.0/8", "::1/128", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"))
DETAIL_CHARS = 300


class LoadGenError(ValueError):
    """The load generator refuses its settings (a public address, a bound that is no bound)."""


def _plain(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4-mapped IPv6 address (::ffff:10.0.0.1) is the IPv4 address it carries."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def allowed(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    address = _plain(address)
    return any(address in net for net in ALLOWED_NETWORKS if net.version == address.version)


def check_target(base_url: str) -> None:
    """Refuse a base URL whose host is not (or does not resolve only to) loopback or private addresses."""
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise LoadGenError(f"the base URL {base_url!r} is not an http:// or https:// URL with a host")
    try:
        addresses = [ipaddress.ip_address(parts.hostname)]
    except ValueError:
        try:
            infos = socket.getaddrinfo(parts.hostname, None, proto=socket.IPPROTO_TCP)
        except OSError as exc:
            raise LoadGenError(f"the base URL's host {parts.hostname} does not resolve: {exc}") from exc
        addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    public = next((_plain(a) for a in addresses if not allowed(a)), None)
    if public is not None:
        raise LoadGenError(f"refusing to send load to {base_url}: {public} is neither a loopback nor a private "
                           "(RFC 1918 / ULA) address")


@dataclass
class Record:
    """One request: times in seconds, `start` from the run's start."""

    session: int
    conversation: int
    turn: int
    start: float
    ttft: float | None
    duration: float
    outcome: str
    detail: str = ""
    status: int | None = None
    messages: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


@dataclass
class Report:
    base_url: str
    sessions: int
    elapsed: float
    records: list[Record] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(OUTCOMES, 0)
        for record in self.records:
            counts[record.outcome] += 1
        return counts

    def failures(self) -> list[Record]:
        return [r for r in self.records if r.outcome != "complete"]

    def ttft_percentile(self, p: float) -> float | None:
        values = sorted(r.ttft for r in self.records if r.ttft is not None)
        return values[min(len(values) - 1, int(p / 100 * len(values)))] if values else None

    def summary(self) -> str:
        counts = ", ".join(f"{n} {outcome}" for outcome, n in self.counts.items())
        sessions = f"{self.sessions} session" + ("s" if self.sessions != 1 else "")
        line = f"{len(self.records)} requests in {self.elapsed:.1f} s from {sessions} to {self.base_url}: {counts}"
        p50, p90 = self.ttft_percentile(50), self.ttft_percentile(90)
        if p50 is not None:
            line += f"; TTFT p50 {p50:.3f} s, p90 {p90:.3f} s"
        failed = self.failures()
        if failed:
            f = failed[0]
            line += f"; first failure: session {f.session} turn {f.turn} {f.outcome} ({f.detail})"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "sessions": self.sessions, "elapsed": round(self.elapsed, 3),
                "counts": self.counts, "summary": self.summary(), "records": [asdict(r) for r in self.records]}


def _cut(text: str) -> str:
    return " ".join(text.split())[:DETAIL_CHARS]


class LoadGen:
    """N sessions on their own threads; `run()` blocks until the bounds end the run, `with LoadGen(...) as load:`
    runs it in the background until the block ends (then no new request starts) and `load.report()` tells."""

    def __init__(self, base_url: str, sessions: int = 4, turns: int = 3, max_requests: int = 100,
                 deadline: float = 60.0, *, conversations: int | None = None, model: str | None = None,
                 api_key: str | None = None, stream: bool = True, max_tokens: int = 64, prompt_words: int = 32,
                 extra_body: Mapping[str, Any] | None = None, verify: bool | str | ssl.SSLContext = True,
                 cert: str | tuple[str, str] | None = None, timeout: float = 60.0, pause: float = 0.0,
                 failure_pause: float = 0.5):
        check_target(base_url)
        for name, value in (("sessions", sessions), ("turns", turns), ("max_requests", max_requests),
                            ("conversations", 1 if conversations is None else conversations)):
            if not isinstance(value, int) or value < 1:
                raise LoadGenError(f"{name} must be a whole number above 0, got {value!r}")
        if not 0 < deadline < float("inf"):
            raise LoadGenError(f"deadline must be a number of seconds above 0, got {deadline!r}")
        self.base_url = base_url.rstrip("/")
        self.sessions, self.turns, self.max_requests, self.deadline = sessions, turns, max_requests, deadline
        self.conversations = conversations
        self.model, self.stream, self.max_tokens, self.prompt_words = model, stream, max_tokens, prompt_words
        self.extra_body = dict(extra_body or {})
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.verify = self._tls(verify, cert)
        self.timeout = httpx.Timeout(timeout, connect=min(5.0, timeout))
        self.pause, self.failure_pause = pause, failure_pause
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._records: list[Record] = []
        self._sent = 0
        self._t0 = 0.0
        self._ended: float | None = None
        self._threads: list[threading.Thread] = []

    @staticmethod
    def _tls(verify: bool | str | ssl.SSLContext, cert: str | tuple[str, str] | None) -> bool | ssl.SSLContext:
        """httpx takes an SSLContext (a CA file or client certificate as arguments is deprecated there)."""
        if isinstance(verify, ssl.SSLContext) or (isinstance(verify, bool) and cert is None):
            return verify
        context = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
        if verify is False:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        if cert is not None:
            certfile, keyfile = (cert, None) if isinstance(cert, str) else cert
            context.load_cert_chain(certfile, keyfile)
        return context

    # -- running ---------------------------------------------------------------------------------
    def start(self) -> LoadGen:
        if self._threads:
            raise LoadGenError("this load generator has already run; make a new one")
        if self.model is None:
            self.model = self._served_model()
        self._t0 = time.monotonic()
        self._threads = [threading.Thread(target=self._session, args=(i,), name=f"loadgen-{i}", daemon=True)
                         for i in range(self.sessions)]
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> Report:
        """No new request starts; those in flight finish (within the timeout)."""
        self._stop.set()
        return self.wait()

    def wait(self) -> Report:
        for thread in self._threads:
            thread.join()
        if self._ended is None:
            self._ended = time.monotonic()
        return self.report()

    def run(self) -> Report:
        return self.start().wait()

    def __enter__(self) -> LoadGen:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def report(self) -> Report:
        """The records so far (the run may still go on)."""
        end = self._ended if self._ended is not None else time.monotonic()
        with self._lock:
            records = list(self._records)
        return Report(self.base_url, self.sessions, end - self._t0, records)

    def _served_model(self) -> str:
        """The first served model's id (an SGLang server or router names one), or "default" when none answers:
        the requests then record why."""
        try:
            with httpx.Client(verify=self.verify, timeout=min(5.0, self.timeout.read or 5.0),
                              headers=self.headers) as client:
                return client.get(f"{self.base_url}/v1/models").json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return "default"

    def _take(self) -> bool:
        """A request may start: neither stopped, past the deadline nor at max_requests."""
        with self._lock:
            if self._stop.is_set() or time.monotonic() - self._t0 >= self.deadline or self._sent >= self.max_requests:
                return False
            self._sent += 1
            return True

    def _user(self, session: int, conversation: int, turn: int) -> dict[str, str]:
        filler = " ".join(f"w{(session * 7 + turn * 3 + k) % 97}" for k in range(self.prompt_words))
        return {"role": "user", "content": f"session {session} conversation {conversation} turn {turn}: {filler}"}

    def _session(self, session: int) -> None:
        with httpx.Client(verify=self.verify, timeout=self.timeout, headers=self.headers) as client:
            conversation = 0
            while self.conversations is None or conversation < self.conversations:
                messages = [self._user(session, conversation, 1)]
                for turn in range(1, self.turns + 1):
                    if not self._take():
                        return
                    record, answer = self._ask(client, session, conversation, turn, messages)
                    with self._lock:
                        self._records.append(record)
                    if record.outcome != "complete":
                        # A lost answer ends the conversation; the next one starts afresh, not at once.
                        self._stop.wait(self.failure_pause)
                        break
                    messages = [*messages, {"role": "assistant", "content": answer},
                                self._user(session, conversation, turn + 1)]
                    if self.pause:
                        self._stop.wait(self.pause)
                conversation += 1

    # -- one request ---------------------------------------------------------------------------------
    def _ask(self, client: httpx.Client, session: int, conversation: int, turn: int,
             messages: list[dict[str, str]]) -> tuple[Record, str]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": self.max_tokens,
                                **self.extra_body, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        began = time.monotonic()
        record = Record(session, conversation, turn, round(began - self._t0, 4), None, 0.0, "error",
                        messages=len(messages))
        answer = ""
        try:
            answer = self._exchange(client, body, record, began)
        except _Outcome as exc:
            record.outcome, record.detail = exc.outcome, _cut(exc.detail)
        except Exception as exc:  # whatever else breaks a request is its record's reason, not the session's end
            record.outcome, record.detail = "error", _cut(repr(exc))
        record.duration = round(time.monotonic() - began, 4)
        return record, answer

    def _exchange(self, client: httpx.Client, body: dict[str, Any], record: Record, began: float) -> str:
        try:
            with client.stream("POST", f"{self.base_url}/v1/chat/completions", json=body) as resp:
                record.status = resp.status_code
                if resp.status_code >= 400:
                    raise _Outcome("refused", f"HTTP {resp.status_code}: {_body(resp)}")
                if resp.status_code != 200:
                    raise _Outcome("error", f"unexpected HTTP {resp.status_code}: {_body(resp)}")
                return self._read(resp, record, began)
        except (httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            if record.status is None:   # not a byte of an answer: the server never took the request
                raise _Outcome("refused", f"no answer: {exc!r}") from exc
            raise _Outcome("truncated", f"the connection broke mid-answer: {exc!r}") from exc
        except httpx.TimeoutException as exc:
            raise _Outcome("error", f"timed out ({type(exc).__name__}) after {time.monotonic() - began:.1f} s") from exc
        except httpx.HTTPError as exc:
            raise _Outcome("error", repr(exc)) from exc

    def _read(self, resp: httpx.Response, record: Record, began: float) -> str:
        if not self.stream:
            try:
                data = json.loads(resp.read())
                answer = data["choices"][0]["message"]["content"] or ""
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                raise _Outcome("error", f"the answer is not a chat completion: {exc!r}") from exc
            record.ttft = round(time.monotonic() - began, 4)
            self._usage(record, data.get("usage"))
            record.outcome = "complete"
            return answer
        pieces: list[str] = []
        events = 0
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                record.outcome = "complete"
                return "".join(pieces)
            events += 1
            try:
                chunk = json.loads(data)
            except ValueError as exc:
                raise _Outcome("error", f"event {events} is not JSON: {data[:80]!r}") from exc
            self._usage(record, chunk.get("usage"))
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if record.ttft is None and (delta.get("content") or delta.get("reasoning_content")
                                            or delta.get("tool_calls")):
                    record.ttft = round(time.monotonic() - began, 4)
                pieces.append(delta.get("content") or "")
        raise _Outcome("truncated", f"the stream ended without data: [DONE] after {events} events")

    @staticmethod
    def _usage(record: Record, usage: Any) -> None:
        if isinstance(usage, dict):
            record.prompt_tokens = usage.get("prompt_tokens")
            record.completion_tokens = usage.get("completion_tokens")


class _Outcome(Exception):
    def __init__(self, outcome: str, detail: str):
        super().__init__(detail)
        self.outcome, self.detail = outcome, detail


def _body(resp: httpx.Response) -> str:
    try:
        return _cut(resp.read().decode(errors="replace"))
    except httpx.HTTPError as exc:
        return repr(exc)


def run(base_url: str, **settings: Any) -> Report:
    """One bounded run (LoadGen's settings), blocking until it ends."""
    return LoadGen(base_url, **settings).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m k31deploy.loadgen",
                                     description="Bounded multi-turn chat load against a private endpoint.")
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (loopback or private only)")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation; a session starts another")
    parser.add_argument("--conversations", type=int, help="conversations per session (default: until the bounds)")
    parser.add_argument("--max-requests", type=int, default=100)
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds; no request starts after it")
    parser.add_argument("--api-key-file", help="a file holding the API key (sent as Authorization: Bearer)")
    parser.add_argument("--model", help="default: the first of /v1/models")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-stream", dest="stream", action="store_false")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--ca", help="CA file for https")
    parser.add_argument("--cert", help="client certificate for https")
    parser.add_argument("--key", help="the client certificate's key")
    parser.add_argument("--json", action="store_true", help="the whole report, records included, as JSON")
    args = parser.parse_args(argv)
    try:
        api_key = None
        if args.api_key_file:
            with open(args.api_key_file, encoding="utf-8") as fh:
                api_key = fh.read().strip()
        cert = (args.cert, args.key) if args.cert and args.key else args.cert
        load = LoadGen(args.base_url, args.sessions, args.turns, args.max_requests, args.deadline,
                       conversations=args.conversations, model=args.model, api_key=api_key, stream=args.stream,
                       max_tokens=args.max_tokens,
                       verify=args.ca or True, cert=cert, timeout=args.timeout)
    except (LoadGenError, OSError, ssl.SSLError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = load.run()
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.summary())
    return 0 if not report.failures() else 1


if __name__ == "__main__":
    sys.exit(main())
