"""Smoke check of an OpenAI-compatible endpoint (SGLang router, Dynamo frontend or a server) with the
official `openai` client: the first things a user of the recipe does (seed 3.1, 3.2).

`python -m k31deploy.smoke --base-url URL --model NAME [--api-key-file F] [--json]`: exit 0 when every
check passes, 1 when one fails, 2 on bad input. The API key (file, or env K31_ROUTER_API_KEY) is
never printed: it is masked in every detail.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from k31deploy.errors import K31Error

if TYPE_CHECKING:
    from openai import OpenAI

API_KEY_ENV = "K31_ROUTER_API_KEY"
DEFAULT_TIMEOUT = 120.0
CONNECT_TIMEOUT = 10.0
DETAIL_CHARS = 300
# Caps a runaway generation well before the timeout; generous enough for a real model's short answer.
MAX_TOKENS = 2048
MASK = "***"

QUESTION = [{"role": "user", "content": "What is 15% of 240?"}]
WEATHER_QUESTION = [{"role": "user", "content": "What's the weather in Beijing?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
# `reasoning_effort` goes in extra_body: it is not a typed parameter in every openai release the
# pinned range (>=1.40) admits, and the JSON sent is the same. Short thinking keeps the checks
# that are not about reasoning quick on a real model (seed 3.1: low | high | max, default max).
QUICK = {"reasoning_effort": "low"}


@dataclass(frozen=True)
class CheckResult:
    name: str
    ok: bool
    seconds: float
    detail: str
    skipped: bool = False


def mask(text: str, secret: str | None) -> str:
    return text.replace(secret, MASK) if secret else text


def _words(text: str) -> int:
    return len(text.split())


def check_models(client: OpenAI, model: str, max_tokens: int = MAX_TOKENS) -> tuple[bool, str]:
    ids = [m.id for m in client.models.list()]
    if model in ids:
        return True, f"{model} is listed"
    return False, f"{model} is not listed; the endpoint lists {', '.join(ids) or 'no model'}"


def check_chat(client: OpenAI, model: str, max_tokens: int = MAX_TOKENS) -> tuple[bool, str]:
    resp = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=max_tokens,
                                          extra_body=QUICK)
    if not resp.choices:
        return False, "the reply has no choices"
    choice = resp.choices[0]
    content = choice.message.content or ""
    if not content.strip():
        return False, f"the reply has no content (finish_reason {choice.finish_reason})"
    return True, f"{_words(content)} words, finish_reason {choice.finish_reason}"


def check_stream(client: OpenAI, model: str, max_tokens: int = MAX_TOKENS) -> tuple[bool, str]:
    # The client's parsed stream hides the SSE framing (a truncated stream ends like a whole one),
    # so read the raw events through its streaming-response API (field notes §4).
    with client.chat.completions.with_streaming_response.create(
        model=model, messages=QUESTION, stream=True, max_tokens=max_tokens, extra_body=QUICK,
    ) as response:
        events = [line.removeprefix("data:").strip() for line in response.iter_lines() if line.startswith("data:")]
    if not events or events[-1] != "[DONE]":
        return False, (f"the stream ended without data: [DONE] after {len(events)} events "
                       "(truncated: did a worker die mid-stream?)")
    content, finish = [], None
    for n, event in enumerate(events[:-1], 1):
        try:
            chunk = json.loads(event)
        except json.JSONDecodeError:
            return False, f"event {n} of the stream is not JSON: {event[:80]}"
        if "error" in chunk:
            return False, f"the stream carried an error: {json.dumps(chunk['error'])}"
        for choice in chunk.get("choices") or []:
            content.append((choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    text = "".join(content)
    if not text.strip():
        return False, f"no content in {len(events) - 1} chunks"
    if finish is None:
        return False, f"{len(events) - 1} chunks but none has a finish_reason"
    return True, f"{len(events) - 1} chunks, {_words(text)} words, finish_reason {finish}, ends with [DONE]"


def check_reasoning(client: OpenAI, model: str, max_tokens: int = MAX_TOKENS) -> tuple[bool, str]:
    resp = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=max_tokens,
                                          extra_body={"reasoning_effort": "high"})
    message = resp.choices[0].message
    reasoning = getattr(message, "reasoning_content", None)
    if isinstance(reasoning, str) and reasoning.strip():
        return True, f"reasoning_effort=high: {_words(reasoning)} words of reasoning_content"
    if "<think>" in (message.content or ""):
        return False, ("no reasoning_content: the thinking came back inline in content "
                       "(is the server started with --reasoning-parser?)")
    return False, "no reasoning_content in the reply"


def check_tool_call(client: OpenAI, model: str, max_tokens: int = MAX_TOKENS) -> tuple[bool, str]:
    resp = client.chat.completions.create(model=model, messages=WEATHER_QUESTION, tools=[WEATHER_TOOL],
                                          max_tokens=max_tokens, extra_body=QUICK)
    choice = resp.choices[0]
    calls = [c for c in choice.message.tool_calls or [] if c.function.name == "get_weather"]
    if calls:
        return True, f"get_weather({calls[0].function.arguments}), finish_reason {choice.finish_reason}"
    if "<|tool_call" in (choice.message.content or ""):
        return False, ("no tool_calls: the call came back as text in content "
                       "(is the server started with --tool-call-parser?)")
    names = [c.function.name for c in choice.message.tool_calls or []]
    return False, f"no get_weather in tool_calls ({', '.join(names) or 'none'}; finish_reason {choice.finish_reason})"


CHECKS: tuple[tuple[str, Callable[[OpenAI, str, int], tuple[bool, str]]], ...] = (
    ("models", check_models),
    ("chat", check_chat),
    ("stream", check_stream),
    ("reasoning", check_reasoning),
    ("tool_call", check_tool_call),
)


def _failure(exc: Exception) -> str:
    import openai

    if isinstance(exc, openai.APIStatusError):
        return f"HTTP {exc.status_code}: {exc.message}"
    if isinstance(exc, openai.APIConnectionError) and exc.__cause__ is not None:
        return f"{exc.message} {type(exc.__cause__).__name__}: {exc.__cause__}"
    return f"{type(exc).__name__}: {exc}"


def validate(base_url: str, model: str, timeout: float) -> None:
    url = urlsplit(base_url)
    try:
        port_ok = url.port is None or url.port > 0
    except ValueError:    # e.g. an IPv6 address without brackets: its colons read as a port
        port_ok = False
    if url.scheme not in ("http", "https") or not url.hostname or not port_ok:
        raise K31Error(f"base URL {base_url!r} is not valid; give http://HOST:PORT/v1 or https://HOST:PORT/v1 "
                       f"(an IPv6 address in brackets: http://[fd00::1]:8000/v1)")
    if not model.strip():
        raise K31Error("model is empty; give the served model name, e.g. moonshotai/Kimi-K3.1-Pro")
    if not timeout > 0:
        raise K31Error(f"timeout {timeout} is not valid; give a number of seconds above 0")


@dataclass(frozen=True)
class ClientTLS:
    """TLS settings for an https endpoint: the CA to verify the server with (None: this machine's trust store)
    and, for an endpoint that takes only clients with a k31 cluster-CA certificate (the Dynamo frontend), that
    certificate and its key."""

    ca: str | None
    cert: str | None = None
    key: str | None = None

    @classmethod
    def from_args(cls, ca: str | None, cert: str | None, key: str | None) -> ClientTLS | None:
        if not (ca or cert or key):
            return None
        if bool(cert) != bool(key):
            raise K31Error("--client-cert and --client-key go together; give both (k31 pki client-cert writes "
                           "them)")
        for flag, path in (("--ca-cert", ca), ("--client-cert", cert), ("--client-key", key)):
            if path and not Path(path).expanduser().is_file():
                raise K31Error(f"{flag} {path} does not exist")
        return cls(*(str(Path(p).expanduser()) if p else None for p in (ca, cert, key)))


def run_smoke(base_url: str, model: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT,
              skip: tuple[str, ...] = (), max_tokens: int = MAX_TOKENS,
              tls: ClientTLS | None = None) -> list[CheckResult]:
    """Every check in order, each against its own request; one failing does not stop the others.
    `skip` names checks an endpoint cannot pass by design (one serving a model without reasoning or
    tool calls); they are reported as skipped, never as passed."""
    validate(base_url, model, timeout)
    unknown = sorted(set(skip) - {name for name, _ in CHECKS})
    if unknown:
        raise K31Error(f"--skip {unknown[0]} is not a check; valid checks: {', '.join(n for n, _ in CHECKS)}")
    if max_tokens < 1:
        raise K31Error(f"--max-tokens {max_tokens} is not valid; give a whole number above 0")
    # The client's own timeout and HTTP client types: openai 3.63 moved from httpx to httpx2 and refuses the other's.
    from openai import DefaultHttpxClient, OpenAI, Timeout

    limits = Timeout(timeout, connect=min(CONNECT_TIMEOUT, timeout))
    http_client = None
    if tls is not None:
        import ssl

        context = ssl.create_default_context(cafile=tls.ca)
        if tls.cert:
            context.load_cert_chain(tls.cert, tls.key)
        http_client = DefaultHttpxClient(verify=context, timeout=limits)
    # No retries: a retried request would hide the failure the smoke is there to show.
    client = OpenAI(base_url=base_url, api_key=api_key or "EMPTY", max_retries=0, timeout=limits,
                    http_client=http_client)
    results = []
    with client:
        for name, check in CHECKS:
            if name in skip:
                results.append(CheckResult(name, True, 0.0, "skipped on request", skipped=True))
                continue
            began = time.monotonic()
            try:
                ok, detail = check(client, model, max_tokens)
            except Exception as exc:  # whatever a broken endpoint makes the client raise is a failed check
                ok, detail = False, _failure(exc)
            # Mask before cutting: a cut could leave part of the key unmasked.
            detail = mask(" ".join(detail.split()), api_key)[:DETAIL_CHARS]
            results.append(CheckResult(name, ok, round(time.monotonic() - began, 3), detail))
    return results


def read_api_key(path: str | None, env: dict[str, str] | None = None) -> str | None:
    """The key from `path` (first line, stripped), else from K31_ROUTER_API_KEY; None for no key."""
    env = dict(os.environ) if env is None else env
    if path is None:
        return env.get(API_KEY_ENV, "").strip() or None
    file = Path(path).expanduser()
    if not file.is_file():
        raise K31Error(f"--api-key-file {path} does not exist; give a file holding the router API key")
    lines = file.read_text(encoding="utf-8").splitlines()
    key = lines[0].strip() if lines else ""
    if not key:
        raise K31Error(f"--api-key-file {path} is empty; give a file holding the router API key")
    return key


def report(results: list[CheckResult], target: str, model: str, as_json: bool = False) -> str:
    passed = sum(r.ok and not r.skipped for r in results)
    ran = sum(not r.skipped for r in results)
    if as_json:
        return json.dumps({"target": target, "model": model, "ok": passed == ran,
                           "checks": [asdict(r) for r in results]}, indent=2)
    rows = [("CHECK", "RESULT", "SECONDS", "DETAIL")]
    rows += [(r.name, "SKIP" if r.skipped else "ok" if r.ok else "FAIL", f"{r.seconds:.3f}", r.detail)
             for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ["  ".join([*(c.ljust(w) for c, w in zip(row[:3], widths, strict=True)), row[3]]).rstrip()
             for row in rows]
    skipped = len(results) - ran
    lines.append(f"{passed} of {ran} checks passed against {target} (model {model})"
                 + (f", {skipped} skipped" if skipped else ""))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m k31deploy.smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the OpenAI base URL, e.g. http://router:8000/v1")
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--api-key-file", help=f"file holding the API key (default: env {API_KEY_ENV}, else none)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per request")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--skip", action="append", default=[], metavar="CHECK",
                   help="leave a check out (reported as skipped); repeatable")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help="cap of every generated reply")
    add_tls_args(p)
    return p


def add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca-cert", help="CA certificate to verify an https endpoint with: the k31 cluster CA's behind "
                                     "Dynamo, the site's with public_tls (default: this machine's trust store)")
    p.add_argument("--client-cert", help="a client certificate of that CA (k31 pki client-cert)")
    p.add_argument("--client-key", help="its key")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        key = read_api_key(args.api_key_file)
        tls = ClientTLS.from_args(args.ca_cert, args.client_cert, args.client_key)
        results = run_smoke(args.base_url, args.model, key, args.timeout, tuple(args.skip), args.max_tokens, tls)
    except K31Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return K31Error.exit_code
    print(report(results, mask(args.base_url, key), args.model, args.json))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
