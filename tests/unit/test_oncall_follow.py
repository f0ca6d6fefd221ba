"""The k31-pd-follow watcher (k31deploy/oncall/follow.py, installed as k31-pd-follow.py) against a fake host: a
decode seen up, down and up again makes the local prefill restart -- drained through the router, re-added after
its /health -- unless a redeploy holds it or the prefill already restarted after the decode came back."""

import pytest
from host_scripts import ONCALL, load

follow = load(ONCALL / "follow.py", "k31_pd_follow")

ROUTER = "http://router:8000"
ME = "http://p0:30000"
PEER = "http://p1:30000"


class FakeHost(follow.Host):
    def __init__(self):
        super().__init__()
        self.clock = 100.0
        self.up = {"d0": True, "d1": True, "local": True}
        self.started = {"k31-p0-r0": 50.0}
        self.hold = False
        self.calls = []
        self.posted = []
        self.workers = [{"id": "w-me", "url": ME, "is_healthy": True},
                        {"id": "w-peer", "url": PEER, "is_healthy": True}]
        self.load = 0
        self.rejoins = []  # (time, worker): workers that come back to the router while the watcher waits

    def now(self):
        return self.clock

    def sleep(self, seconds):
        self.clock += seconds
        self.workers += [w for t, w in self.rejoins if t <= self.clock and w not in self.workers]

    def health(self, url):
        name = url.split("//")[1].split(":")[0]
        state = self.up["local" if name == "127.0.0.1" else name]
        return state if isinstance(state, str) else "up" if state else "down"

    def started_at(self, unit):
        return self.started[unit]

    def held(self, path):
        return self.hold

    def restart(self, units):
        self.calls.append(("restart", tuple(units)))
        for unit in units:
            self.started[unit] = self.clock

    def request(self, method, url, body=None, key="router"):
        self.calls.append((method, url.removeprefix(ROUTER)))
        if url == f"{ROUTER}/workers" and method == "GET":
            return 200, {"workers": self.workers}
        if method == "DELETE":
            self.workers = [w for w in self.workers if not url.endswith(w["id"])]
            return 202, {}
        if method == "POST":
            self.posted.append(body)
            self.workers.append({"id": "w-new", "url": body["url"], "is_healthy": True})
            return 202, {}
        if url.endswith("/get_load"):
            self.load = max(0, self.load - 1)
            return 200, [{"num_reqs": self.load, "num_waiting_reqs": 0}]
        return 404, None


CONFIG = {
    "units": ["k31-p0-r0"], "index": 0, "peers": [PEER], "poll_seconds": 1, "settle_seconds": 60,
    "stagger_seconds": 10, "drain_timeout": 30, "health_timeout": 30,
    "decodes": [{"name": "d0", "health": "http://d0:30100/health"}, {"name": "d1", "health": "http://d1:30100/health"}],
    "drains": [{"router": ROUTER, "worker_url": ME,
                "worker": {"url": ME, "worker_type": "prefill", "bootstrap_port": 8998},
                "health": "http://127.0.0.1:30000/health", "load": "http://127.0.0.1:30000/get_load"}],
}


def tick(f, host, seconds=1.0):
    host.clock += seconds
    return f.poll()


def crash(f, host, name="d0"):
    tick(f, host)                 # seen up
    host.up[name] = False
    tick(f, host)                 # seen down
    host.up[name] = True


def restarts(host):
    return [c for c in host.calls if c[0] == "restart"]


def test_the_readded_prefill_carries_the_engines_api_key_only_when_there_is_one():
    for key, want in (("ek-123", {"api_key": "ek-123"}), ("", {})):
        host = FakeHost()
        f = follow.Follower({**CONFIG, "engine_api_key": key}, host)
        crash(f, host)
        assert tick(f, host) is True
        assert host.posted == [{"url": ME, "worker_type": "prefill", "bootstrap_port": 8998, **want}]


def test_decode_restart_drains_restarts_and_readds_the_prefill():
    host = FakeHost()
    host.load = 3
    f = follow.Follower(dict(CONFIG), host)
    crash(f, host)
    assert tick(f, host) is True
    assert restarts(host) == [("restart", ("k31-p0-r0",))]
    methods = [c for c in host.calls if c[0] in ("DELETE", "POST", "restart")]
    assert methods == [("DELETE", "/workers/w-me"), ("restart", ("k31-p0-r0",)), ("POST", "/workers")]
    assert host.load == 0 and any(w["url"] == ME for w in host.workers)
    assert f.last_restart["because"] == "d0"
    assert tick(f, host) is False  # once


def test_a_decode_never_seen_up_is_not_a_restart():
    host = FakeHost()
    host.up["d0"] = False
    f = follow.Follower(dict(CONFIG), host)
    tick(f, host)
    host.up["d0"] = True
    tick(f, host)
    tick(f, host)
    assert restarts(host) == []


def test_a_decode_that_only_stops_answering_has_not_restarted():
    host = FakeHost()
    f = follow.Follower(dict(CONFIG), host)
    tick(f, host)
    host.up["d0"] = "silent"  # hung host or network cut: timeouts, no refusal
    tick(f, host)
    host.up["d0"] = True
    tick(f, host)
    assert f.pending is None and restarts(host) == []


def test_a_decode_that_answers_an_error_status_for_a_while_has_not_restarted():
    host = FakeHost()
    f = follow.Follower(dict(CONFIG), host)
    tick(f, host)
    host.up["d0"] = "error"  # a busy SGLang's /health: its probe generation timed out, 503
    tick(f, host)
    tick(f, host)
    host.up["d0"] = True
    for _ in range(3):
        assert tick(f, host) is False
    assert f.pending is None and restarts(host) == []


@pytest.mark.parametrize("seen", [["down", "error", "error"],      # crashed, then loading (503 until ready)
                                  ["error", "down", "error"]])     # a graceful stop (503 while it drains)
def test_a_decode_gone_then_loading_then_up_has_restarted(seen):
    host = FakeHost()
    f = follow.Follower(dict(CONFIG), host)
    tick(f, host)
    for state in seen:
        host.up["d0"] = state
        tick(f, host)
    host.up["d0"] = True
    assert tick(f, host) is True
    assert restarts(host) == [("restart", ("k31-p0-r0",))]


def test_a_hold_defers_and_a_prefill_restarted_after_the_decode_counts():
    host = FakeHost()
    f = follow.Follower(dict(CONFIG), host)
    crash(f, host)
    host.hold = True
    for _ in range(5):
        assert tick(f, host) is False
    host.started["k31-p0-r0"] = host.clock  # the redeploy's own drained restart
    host.hold = False
    assert tick(f, host) is False
    assert restarts(host) == [] and f.pending is None


def test_a_hold_that_ends_without_the_restart_hands_it_to_the_watcher():
    host = FakeHost()
    f = follow.Follower(dict(CONFIG), host)
    crash(f, host)
    host.hold = True
    tick(f, host)
    host.hold = False  # the redeploy stopped before the prefill step; its hold expired
    assert tick(f, host) is True


def test_waits_for_a_second_decode_still_down_but_not_forever():
    host = FakeHost()
    f = follow.Follower(dict(CONFIG), host)
    tick(f, host)
    host.up["d0"] = host.up["d1"] = False
    tick(f, host)
    host.up["d0"] = True
    assert tick(f, host) is False          # d1 still down
    host.up["d1"] = True
    assert tick(f, host) is True           # one restart covers both
    assert f.last_restart["because"] == "d0, d1"
    assert len(restarts(host)) == 1


@pytest.mark.parametrize(("index", "expect_wait"), [(0, 0), (1, 10), (2, 20)])
def test_prefill_servers_take_turns(index, expect_wait):
    host = FakeHost()
    f = follow.Follower(dict(CONFIG, index=index), host)
    crash(f, host)
    start = host.clock
    while not tick(f, host, 0.5):
        assert host.clock - start < 60
    assert host.clock - start == pytest.approx(expect_wait + 0.5, abs=0.6)


def test_waits_for_the_peer_prefill_to_be_back_before_leaving_the_router():
    host = FakeHost()
    peer = host.workers.pop()  # the peer prefill is out of the router: it restarts right now
    f = follow.Follower(dict(CONFIG), host)
    crash(f, host)
    host.rejoins.append((host.clock + 15, peer))
    assert tick(f, host) is True
    assert host.calls.index(("DELETE", "/workers/w-me")) > host.calls.index(("GET", "/workers"))
    assert host.clock >= host.rejoins[0][0]  # it left the router only once the peer was back


def test_a_prefill_that_never_answers_health_is_not_readded():
    host = FakeHost()
    f = follow.Follower(dict(CONFIG), host)
    crash(f, host)
    host.up["local"] = False
    assert tick(f, host) is True
    assert ("POST", "/workers") not in host.calls and all(w["url"] != ME for w in host.workers)


def test_hold_file_counts_from_its_mtime(tmp_path):
    hold = tmp_path / "hold"
    real = follow.Host()
    assert real.held(str(hold)) is False
    hold.write_text("3600\n")
    assert real.held(str(hold)) is True
    hold.write_text("0\n")
    assert real.held(str(hold)) is False


def test_the_real_host_tells_an_error_status_from_nothing_listening():
    import http.server
    import socket
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        code = 200

        def do_GET(self):
            self.send_response(Health.code)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    real = follow.Host(timeout=2.0)
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    try:
        assert real.health(url) == "up"
        Health.code = 503
        assert real.health(url) == "error"      # a process answers: unhealthy or loading, not gone
    finally:
        server.shutdown()
        server.server_close()
    with socket.socket() as probe:                # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    assert real.health(f"http://127.0.0.1:{closed}/health") == "down"
