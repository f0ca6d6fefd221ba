"""The smoke checks (k31deploy.smoke) against in-process stand-ins on 127.0.0.1, and `k31 smoke -i`
(plan -> endpoint, SSH tunnel through an in-process paramiko server with checked host keys)."""

from __future__ import annotations

import argparse
import json
import re
import select
import socket
import threading

import paramiko
import pytest
from loopback import free_port
from recipe_helpers import plan as resolve_plan

from k31deploy.commands import smoke as smoke_cmd
from k31deploy.errors import K31Error
from k31deploy.launch import endpoint_address
from k31deploy.smoke import API_KEY_ENV, CHECKS, MASK, CheckResult, main, read_api_key, run_smoke
from k31deploy.standin.parser import parse_args
from k31deploy.standin.server import Engine, EngineHandler

MODEL = "moonshotai/Kimi-K3.1-Pro"
PARSERS = ["--reasoning-parser", "kimi_k3", "--tool-call-parser", "kimi_k3"]
NAMES = [name for name, _ in CHECKS]
KEY = "sk-k31-0123456789abcdef"


class TruncatingHandler(EngineHandler):
    """A worker killed mid-stream as the router passes it on: HTTP 200, a few events, no [DONE]."""

    def _stream(self, events):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for event in list(events)[:3]:
            chunk = f"data: {json.dumps(event)}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")


class KeyHandler(EngineHandler):
    """Wants `Bearer KEY`; a wrong key gets a 401 that echoes the header it got (as careless servers do)."""

    def _dispatch(self, method):
        got = self.headers.get("Authorization", "")
        if got != f"Bearer {KEY}":
            self.rfile.read(int(self.headers.get("Content-Length") or 0))  # keep the connection in step
            self.send_error_json(401, f"invalid API key in Authorization: {got}")
        else:
            super()._dispatch(method)


@pytest.fixture
def standin(loopback):
    def _start(argv: list[str], handler=EngineHandler) -> tuple[Engine, str]:
        engine = Engine(parse_args(["--model-path", "/models/kimi", "--served-model-name", MODEL, *argv]), env={})
        return engine, f"http://127.0.0.1:{loopback.serve(handler, engine).server_address[1]}/v1"

    return _start


def outcome(results) -> dict[str, bool]:
    assert [r.name for r in results] == NAMES  # every check, in a fixed order
    return {r.name: r.ok for r in results}


# -- the checks ---------------------------------------------------------------------------------


def test_all_checks_pass_with_both_parsers_on(standin):
    engine, url = standin(PARSERS)
    results = run_smoke(url, MODEL, timeout=10)
    assert all(outcome(results).values()), results
    detail = {r.name: r.detail for r in results}
    assert "ends with [DONE]" in detail["stream"]
    assert detail["tool_call"].startswith("get_weather(")
    assert all(r.seconds >= 0 for r in results)
    assert engine.requests_total == 4  # chat, stream, reasoning, tool call: one request each


def test_reasoning_fails_without_reasoning_parser(standin):
    _, url = standin(["--tool-call-parser", "kimi_k3"])
    results = run_smoke(url, MODEL, timeout=10)
    assert outcome(results) == {**dict.fromkeys(NAMES, True), "reasoning": False}
    assert "--reasoning-parser" in results[NAMES.index("reasoning")].detail


def test_tool_call_fails_without_tool_call_parser(standin):
    _, url = standin(["--reasoning-parser", "kimi_k3"])
    results = run_smoke(url, MODEL, timeout=10)
    assert outcome(results) == {**dict.fromkeys(NAMES, True), "tool_call": False}
    assert "--tool-call-parser" in results[NAMES.index("tool_call")].detail


def test_truncated_stream_without_done_fails_the_stream_check(standin):
    _, url = standin(PARSERS, TruncatingHandler)
    results = run_smoke(url, MODEL, timeout=10)
    assert outcome(results) == {**dict.fromkeys(NAMES, True), "stream": False}
    assert "without data: [DONE] after 3 events" in results[NAMES.index("stream")].detail


def test_unlisted_model_fails_the_models_check(standin):
    _, url = standin(PARSERS)
    results = run_smoke(url, "other/model", timeout=10)
    assert not outcome(results)["models"]
    assert f"the endpoint lists {MODEL}" in results[0].detail


def test_unreachable_endpoint_fails_every_check_quickly():
    results = run_smoke(f"http://127.0.0.1:{free_port()}/v1", MODEL, timeout=5)
    assert not any(outcome(results).values())
    assert all("Connection" in r.detail for r in results)


@pytest.mark.parametrize(("url", "model", "timeout", "message"), [
    ("127.0.0.1:8000/v1", MODEL, 10, "base URL '127.0.0.1:8000/v1' is not valid"),
    ("ftp://router/v1", MODEL, 10, "is not valid; give http://"),
    ("http://router/v1", " ", 10, "model is empty"),
    ("http://router/v1", MODEL, 0, "timeout 0 is not valid"),
])
def test_bad_input_is_refused_before_any_request(url, model, timeout, message):
    with pytest.raises(K31Error, match=message):
        run_smoke(url, model, timeout=timeout)


# -- API key ------------------------------------------------------------------------------------


def test_api_key_is_sent_and_checks_pass(standin):
    _, url = standin(PARSERS, KeyHandler)
    assert all(outcome(run_smoke(url, MODEL, KEY, timeout=10)).values())
    assert not any(outcome(run_smoke(url, MODEL, None, timeout=10)).values())  # the server does check


def test_api_key_is_masked_in_every_detail_and_in_output(standin, tmp_path, capsys):
    _, url = standin(PARSERS, KeyHandler)
    wrong = "sk-wrong-" + "x" * 400  # longer than a detail: masking must come before the cut
    results = run_smoke(url, MODEL, wrong, timeout=10)
    assert not any(outcome(results).values())
    for r in results:
        assert r.detail.startswith("HTTP 401") and MASK in r.detail
        assert "sk-wrong" not in r.detail
    key_file = tmp_path / "key"
    key_file.write_text(wrong + "\n")
    for extra in ([], ["--json"]):
        assert main(["--base-url", url, "--model", MODEL, "--api-key-file", str(key_file), *extra]) == 1
        out, err = capsys.readouterr()
        assert "sk-wrong" not in out + err and MASK in out


def test_read_api_key_prefers_the_file_then_env(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}  \nsecond line\n")
    assert read_api_key(str(key_file), {API_KEY_ENV: "from-env"}) == KEY
    assert read_api_key(None, {API_KEY_ENV: " from-env\n"}) == "from-env"
    assert read_api_key(None, {API_KEY_ENV: ""}) is None
    assert read_api_key(None, {}) is None
    with pytest.raises(K31Error, match="does not exist"):
        read_api_key(str(tmp_path / "nope"), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(K31Error, match="is empty"):
        read_api_key(str(tmp_path / "empty"), {})


# -- python -m k31deploy.smoke ------------------------------------------------------------------


def test_main_prints_a_table_and_exits_0_or_1(standin, capsys):
    _, good = standin(PARSERS)
    assert main(["--base-url", good, "--model", MODEL]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["CHECK", "RESULT", "SECONDS", "DETAIL"]
    assert [line.split()[:2] for line in out[1:6]] == [[n, "ok"] for n in NAMES]
    assert out[-1] == f"5 of 5 checks passed against {good} (model {MODEL})"
    _, bad = standin([])
    assert main(["--base-url", bad, "--model", MODEL, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["target"] == bad
    assert [(c["name"], c["ok"]) for c in doc["checks"]] == [
        ("models", True), ("chat", True), ("stream", True), ("reasoning", False), ("tool_call", False)]
    assert set(doc["checks"][0]) == {"name", "ok", "seconds", "detail", "skipped"}


def test_skipped_checks_are_reported_as_skipped_not_passed(standin, capsys):
    _, bad = standin([])    # no parsers: reasoning and tool_call would fail
    assert main(["--base-url", bad, "--model", MODEL, "--skip", "reasoning", "--skip", "tool_call",
                 "--max-tokens", "16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out[4:6]] == [["reasoning", "SKIP"], ["tool_call", "SKIP"]]
    assert out[-1] == f"3 of 3 checks passed against {bad} (model {MODEL}), 2 skipped"
    assert main(["--base-url", bad, "--model", MODEL, "--skip", "everything"]) == 2
    assert "valid checks: models, chat, stream, reasoning, tool_call" in capsys.readouterr().err


def test_main_exits_2_on_bad_input(tmp_path, capsys):
    assert main(["--base-url", "router:8000", "--model", MODEL]) == 2
    assert capsys.readouterr().err.startswith("error: base URL 'router:8000' is not valid")
    assert main(["--base-url", "http://r/v1", "--model", MODEL, "--api-key-file", str(tmp_path / "k")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--model", MODEL])
    assert exc.value.code == 2


# -- k31 smoke -i INV ---------------------------------------------------------------------------

PD_INVENTORY = """\
[k31_prefill]
p0 ansible_host=k31-prefill.cluster.internal

[k31_decode]
d0 ansible_host=k31-decode.cluster.internal

[k31_router]
p0

[bastion]
jump {jump}

[all:vars]
k31_platform=mi355x
k31_agents=92
"""
UNIFIED_INVENTORY = """\
[k31_unified]
u0 ansible_host=10.31.0.7

[all:vars]
k31_platform=mi355x
k31_agents=32
"""


def k31(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="k31")
    smoke_cmd.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_endpoint_is_the_router_else_the_first_unified_server_rank_0(tmp_path, monkeypatch, capsys):
    seen = []

    def fake_run(base_url, model, api_key=None, timeout=0, tls=None, skip=(), max_tokens=0):
        seen.append((base_url, model, api_key, timeout))
        return []

    monkeypatch.setattr(smoke_cmd, "run_smoke", fake_run)
    monkeypatch.setenv(API_KEY_ENV, KEY)
    pd, unified = tmp_path / "pd.ini", tmp_path / "unified.ini"
    pd.write_text(PD_INVENTORY.format(jump=""))
    unified.write_text(UNIFIED_INVENTORY)
    assert k31(["smoke", "-i", str(pd), "--timeout", "7"]) == 0
    assert k31(["smoke", "-i", str(unified)]) == 0
    assert seen == [("http://k31-prefill.cluster.internal:8000/v1", MODEL, KEY, 7.0),
                    ("http://10.31.0.7:30000/v1", MODEL, KEY, 120.0)]
    assert KEY not in capsys.readouterr().out
    with pytest.raises(K31Error, match="needs -i INVENTORY"):
        k31(["smoke"])
    with pytest.raises(K31Error, match="neither a router nor a unified server"):
        endpoint_address({**resolve_plan(platform="mi355x", agents=92), "router": None})    # PD: no unified server


@pytest.mark.parametrize(("detail", "hint"), [("Connection error. ConnectError: refused", True),
                                              ("HTTP 500: boom", False)])
def test_unreachable_endpoint_hints_at_via(tmp_path, monkeypatch, capsys, detail, hint):
    failed = [CheckResult(name, False, 0.0, detail) for name in NAMES]
    monkeypatch.setattr(smoke_cmd, "run_smoke", lambda *a, **k: failed)
    inv = tmp_path / "unified.ini"
    inv.write_text(UNIFIED_INVENTORY)
    assert k31(["smoke", "-i", str(inv), "--json"]) == 1
    out, err = capsys.readouterr()
    assert [c["ok"] for c in json.loads(out)["checks"]] == [False] * 5
    assert ("hint: this machine cannot reach 10.31.0.7:30000; --via HOST" in err) == hint


@pytest.mark.parametrize(("args", "files"), [
    ("-o UserKnownHostsFile=/k/a -o StrictHostKeyChecking=yes", ("/k/a",)),
    ("-oUserKnownHostsFile=/k/a", ("/k/a",)),
    ("-o 'UserKnownHostsFile /k/a /k/b'", ("/k/a", "/k/b")),
    ("-o 'userknownhostsfile = /k/a'", ("/k/a",)),
    ("-o StrictHostKeyChecking=yes", None),
    ("", None),
])
def test_known_hosts_files_from_ssh_common_args(args, files):
    got = smoke_cmd.known_hosts_files(args)
    assert (None if got is None else tuple(map(str, got))) == files


def _pump(a, b) -> None:
    with a, b:
        while True:
            ready, _, _ = select.select([a, b], [], [], 5)
            if not ready:
                return
            for src, dst in ((a, b), (b, a)):
                if src in ready:
                    data = src.recv(65536)
                    if not data:
                        return
                    dst.sendall(data)


class JumpHost(paramiko.ServerInterface):
    """SSH on 127.0.0.1 standing in for a host on the cluster network: it resolves `routes`
    (cluster address -> local port) for direct-tcpip and refuses every other destination."""

    def __init__(self, routes: dict[tuple[str, int], int]):
        self.host_key = paramiko.ECDSAKey.generate()
        self.client_key = paramiko.ECDSAKey.generate()
        self.routes = routes
        self.requested: list[tuple[str, int]] = []
        self._chan_dest: dict[int, tuple[str, int]] = {}
        self._transports: list[paramiko.Transport] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def get_allowed_auths(self, username):
        return "publickey"

    def check_auth_publickey(self, username, key):
        ok = username == "k31" and key.get_base64() == self.client_key.get_base64()
        return paramiko.AUTH_SUCCESSFUL if ok else paramiko.AUTH_FAILED

    def check_channel_direct_tcpip_request(self, chanid, origin, destination):
        destination = (destination[0], int(destination[1]))
        self.requested.append(destination)
        if destination not in self.routes:
            return paramiko.OPEN_FAILED_CONNECT_FAILED
        self._chan_dest[chanid] = destination
        return paramiko.OPEN_SUCCEEDED

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            transport = paramiko.Transport(conn)
            transport.add_server_key(self.host_key)
            self._transports.append(transport)
            threading.Thread(target=self._session, args=(transport,), daemon=True).start()

    def _session(self, transport: paramiko.Transport) -> None:
        try:
            transport.start_server(server=self)
        except (paramiko.SSHException, EOFError, OSError):
            return  # the client refused our host key and hung up
        while transport.is_active():
            chan = transport.accept(0.2)
            if chan is not None:
                port = self.routes[self._chan_dest.pop(chan.get_id())]
                upstream = socket.create_connection(("127.0.0.1", port))
                threading.Thread(target=_pump, args=(chan, upstream), daemon=True).start()

    def known_hosts_line(self) -> str:
        return f"[127.0.0.1]:{self.port} {self.host_key.get_name()} {self.host_key.get_base64()}\n"

    def close(self) -> None:
        self._sock.close()
        for transport in self._transports:
            transport.close()


@pytest.fixture
def jump(standin, tmp_path):
    """A PD inventory whose router (k31-prefill.cluster.internal:8000) only the jump host reaches."""
    engine, url = standin(PARSERS)
    host = JumpHost({("k31-prefill.cluster.internal", 8000): int(url.rsplit(":", 1)[1].split("/")[0])})
    key = tmp_path / "id_k31"
    host.client_key.write_private_key_file(str(key))
    yield host, engine, key
    host.close()


def write_jump_inventory(tmp_path, host: JumpHost, key, known_hosts=None):
    common = f" ansible_ssh_common_args='-o UserKnownHostsFile={known_hosts} -o StrictHostKeyChecking=yes'"
    jump_vars = (f"ansible_host=127.0.0.1 ansible_port={host.port} ansible_user=k31 "
                 f"ansible_ssh_private_key_file={key}" + (common if known_hosts else ""))
    inv = tmp_path / "hosts.ini"
    inv.write_text(PD_INVENTORY.format(jump=jump_vars))
    return str(inv)


def test_via_tunnels_to_the_router_address_of_the_plan(jump, tmp_path, capsys):
    host, engine, key = jump
    known = tmp_path / "known_hosts"
    known.write_text(host.known_hosts_line())
    inv = write_jump_inventory(tmp_path, host, key, known)
    assert k31(["smoke", "-i", inv, "--via", "jump"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out[1:6]] == [[n, "ok"] for n in NAMES]
    assert out[-1].endswith("against http://k31-prefill.cluster.internal:8000/v1 via jump "
                            f"(model {MODEL})")
    assert set(host.requested) == {("k31-prefill.cluster.internal", 8000)}
    assert engine.requests_total == 4


def test_via_refuses_an_unknown_host_key(jump, tmp_path):
    host, engine, key = jump
    known = tmp_path / "known_hosts"
    other = paramiko.ECDSAKey.generate()
    known.write_text(f"[127.0.0.1]:{host.port + 1} {other.get_name()} {other.get_base64()}\n")
    inv = write_jump_inventory(tmp_path, host, key, known)
    fingerprint = re.escape(host.host_key.fingerprint)
    with pytest.raises(K31Error, match=rf"host key of --via jump .*{fingerprint}.* is not in "
                                       rf"UserKnownHostsFile of jump's ansible_ssh_common_args"):
        k31(["smoke", "-i", inv, "--via", "jump"])
    assert host.requested == [] and engine.requests_total == 0


def test_via_refuses_a_changed_host_key(jump, tmp_path):
    host, engine, key = jump
    known = tmp_path / "known_hosts"
    other = paramiko.ECDSAKey.generate()
    known.write_text(f"[127.0.0.1]:{host.port} {other.get_name()} {other.get_base64()}\n")
    inv = write_jump_inventory(tmp_path, host, key, known)
    with pytest.raises(K31Error, match="does not match"):
        k31(["smoke", "-i", inv, "--via", "jump"])
    assert engine.requests_total == 0


def test_via_uses_home_known_hosts_without_common_args(jump, tmp_path, monkeypatch):
    host, engine, key = jump
    monkeypatch.setenv("HOME", str(tmp_path))
    inv = write_jump_inventory(tmp_path, host, key)
    with pytest.raises(K31Error, match=r"is not in ~/.ssh/known_hosts"):
        k31(["smoke", "-i", inv, "--via", "jump"])
    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "known_hosts").write_text(host.known_hosts_line())
    assert k31(["smoke", "-i", inv, "--via", "jump"]) == 0
    assert engine.requests_total == 4


def test_via_input_errors(jump, tmp_path):
    host, _, key = jump
    inv = write_jump_inventory(tmp_path, host, key, tmp_path / "missing_known_hosts")
    with pytest.raises(K31Error, match="missing_known_hosts named in ansible_ssh_common_args of jump does not"):
        k31(["smoke", "-i", inv, "--via", "jump"])
    with pytest.raises(K31Error, match=r"--via nowhere is not a host of inventory .*; hosts: .*jump"):
        k31(["smoke", "-i", inv, "--via", "nowhere"])


# -- https endpoints (public_tls: the site's certificate; Dynamo: client certificates) ---------------------


@pytest.fixture
def https_standin(tmp_path):
    """A stand-in serving HTTPS with a certificate of a site CA for 127.0.0.1; yields (url, ca file)."""
    import ssl

    from k31deploy import pki
    from k31deploy.standin.server import _Server

    site = pki.new_ca("site CA")
    leaf = pki.issue(site, "router", ["127.0.0.1"])
    files = {}
    for name, text in (("ca.crt", site.cert), ("server.crt", leaf.cert), ("server.key", leaf.key),
                       ("other-ca.crt", pki.new_ca("someone else").cert)):
        (tmp_path / name).write_text(text)
        files[name] = str(tmp_path / name)
    engine = Engine(parse_args(["--model-path", "/models/kimi", "--served-model-name", MODEL, *PARSERS]), env={})
    server = _Server(("127.0.0.1", 0), type("Handler", (EngineHandler,), {"engine": engine}))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files["server.crt"], files["server.key"])
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}/v1", files
    server.shutdown()
    server.server_close()


def test_an_https_endpoint_passes_when_its_certificate_checks_out_against_the_given_ca(https_standin):
    url, files = https_standin
    from k31deploy.smoke import ClientTLS

    assert all(outcome(run_smoke(url, MODEL, tls=ClientTLS.from_args(files["ca.crt"], None, None))).values())
    refused = run_smoke(url, MODEL, timeout=5, tls=ClientTLS.from_args(files["other-ca.crt"], None, None))
    assert not any(outcome(refused).values())       # a certificate the CA did not sign: no request is sent


@pytest.mark.parametrize("args, message", [
    ((None, "c.crt", None), "--client-cert and --client-key go together"),
    (("/nonexistent/ca.crt", None, None), "--ca-cert /nonexistent/ca.crt does not exist"),
])
def test_tls_arguments_are_checked(args, message):
    from k31deploy.smoke import ClientTLS

    with pytest.raises(K31Error, match=re.escape(message)):
        ClientTLS.from_args(*args)


def test_k31_smoke_asks_dynamo_for_a_client_certificate_and_public_tls_for_https(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(smoke_cmd, "run_smoke", lambda url, *a, tls=None, **kw: seen.append((url, tls)) or [])
    dynamo = tmp_path / "dynamo.ini"
    dynamo.write_text("[k31_prefill]\np0 ansible_host=10.31.0.1\n[k31_decode]\nd0 ansible_host=10.31.0.2\n"
                      "[k31_router]\nr0 ansible_host=10.31.0.3\n[all:vars]\nk31_platform=b300\nk31_topology=pd\n"
                      "k31_prefill_strategy=low-latency\nk31_max_running_requests=8\n")
    with pytest.raises(K31Error, match=r"Dynamo frontend takes only clients with a certificate .* --client-cert"):
        k31(["smoke", "-i", str(dynamo)])
    ca = tmp_path / "ca.crt"
    ca.write_text("x")
    with pytest.raises(K31Error, match="--client-cert and --client-key"):
        k31(["smoke", "-i", str(dynamo), "--ca-cert", str(ca)])
    public = tmp_path / "public.ini"
    public.write_text(UNIFIED_INVENTORY.replace("[all:vars]", "[k31_router]\nr0 ansible_host=10.31.0.9\n"
                                                               "[all:vars]\nk31_public_tls=true"))
    assert k31(["smoke", "-i", str(public)]) == 0     # the site's certificate: this machine's trust store
    assert seen == [("https://10.31.0.9:8000/v1", None)]


def test_k31_smoke_takes_the_checks_to_skip_from_the_inventory_unless_told(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(smoke_cmd, "run_smoke", lambda *a, skip=(), max_tokens=0, **kw: seen.append(
        (skip, max_tokens)) or [])
    inventory = tmp_path / "unified.ini"
    inventory.write_text(UNIFIED_INVENTORY + "k31_smoke_skip=['reasoning', 'tool_call']\nk31_smoke_max_tokens=64\n")
    assert k31(["smoke", "-i", str(inventory)]) == 0
    assert k31(["smoke", "-i", str(inventory), "--skip", "tool_call", "--max-tokens", "8"]) == 0
    plain = tmp_path / "plain.ini"
    plain.write_text(UNIFIED_INVENTORY)
    assert k31(["smoke", "-i", str(plain)]) == 0
    assert seen == [(("reasoning", "tool_call"), 64), (("tool_call",), 8), ((), 2048)]
