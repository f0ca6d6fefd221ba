"""The host-side client (k31deploy/oncall/probe.py, installed as k31_probe.py) against a real loopback router: the
drain and re-add k31 redeploy runs on the router host (with the key the router checks, read from the router's own
env file: no call carries it) and the k31-pd-follow watcher calls, and the health classes both rely on."""

from __future__ import annotations

import http.server
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from loopback import free_port, only_cluster_clients

from k31deploy import envfile
from k31deploy.oncall import probe, rollout

KEY = "cp-secret-9"
WORKER_KEY = "engines-secret-4"


class Router(http.server.ThreadingHTTPServer):
    """The SGLang router's worker API as k31 uses it: GET/POST /workers, DELETE /workers/ID, with a Bearer key.
    A worker posted is listed unhealthy first and healthy from the next listing on (the router checks it)."""

    def __init__(self, workers, healthy_after_post=True):
        super().__init__(("127.0.0.1", 0), RouterHandler)
        self.workers = workers
        self.healthy_after_post = healthy_after_post
        self.seen = []

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class RouterHandler(http.server.BaseHTTPRequestHandler):
    def _answer(self, status, body=None):
        raw = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _authorised(self):
        self.server.seen.append((self.command, self.path))
        if self.headers.get("Authorization") != f"Bearer {KEY}":
            self._answer(401, {"error": "unauthorised"})
            return False
        return True

    def do_GET(self):
        if self._authorised():
            listed = [dict(w) for w in self.server.workers]
            for worker in self.server.workers:
                worker["is_healthy"] = worker["is_healthy"] or worker.pop("posted", False)
            self._answer(200, {"workers": listed})

    def do_DELETE(self):
        if self._authorised():
            self.server.workers[:] = [w for w in self.server.workers if f"/workers/{w['id']}" != self.path]
            self._answer(202, {})

    def do_POST(self):
        if self._authorised():
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.server.workers.append({"id": "w-new", "url": body["url"], "is_healthy": False,
                                        "posted": self.server.healthy_after_post, "body": body})
            self._answer(202, {})

    def log_message(self, *args):
        pass


@pytest.fixture
def router():
    servers = []

    def start(workers, **kw):
        server = Router(workers, **kw)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def router_env(tmp_path, key=KEY, container=False, worker_key=WORKER_KEY):
    """The router's env file as k31_router writes it (router.env.j2: the key it sends its workers, its control-plane
    key as id:name:role:key, a container's quoting too), and the auth spec the rollout hands the client
    (rollout.router_auth, there)."""
    path = tmp_path / "k31-router.env"
    path.write_text("# Ansible managed\nRUST_LOG=info\n"
                    + (envfile.line("K31_ROUTER_API_KEY", worker_key, container=container) + "\n" if worker_key else "")
                    + envfile.line("K31_ROUTER_CONTROL_PLANE_KEYS", "k31:k31:admin:" + key, container=container) + "\n")
    return {**rollout.router_auth("k31-router"), "env_file": str(path)}


def cli(action, spec):
    """`python3 k31_probe.py --call ACTION` as the redeploy runs it: the spec on stdin, a proxy in the
    environment that would swallow every call. Neither the command line nor the spec holds the router's key."""
    env = {"PATH": os.environ["PATH"], "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}
    argv = [sys.executable, "-I", probe.__file__, "--call", action]
    done = subprocess.run(argv, input=json.dumps(spec), capture_output=True, text=True, env=env, timeout=60,
                          check=False)
    assert not {KEY, WORKER_KEY} & {*argv, *json.dumps(spec).split('"')}
    return done.returncode, json.loads(done.stdout)


@pytest.mark.parametrize("container", [False, True])
def test_the_router_host_drains_a_worker_and_waits_until_it_is_gone(router, tmp_path, container):
    r = router([{"id": "w1", "url": "http://10.0.0.2:30000", "is_healthy": True},
                {"id": "w2", "url": "http://10.0.0.3:30000", "is_healthy": True}])
    rc, out = cli("drain", {"router": r.url, "auth": router_env(tmp_path, container=container), "timeout": 10,
                            "worker_url": "http://10.0.0.2:30000"})
    assert (rc, out["ok"], out["reason"]) == (0, True, "")
    assert [w["id"] for w in r.workers] == ["w2"]
    assert ("DELETE", "/workers/w1") in r.seen and r.seen[-1] == ("GET", "/workers")
    assert isinstance(out["at"], float)


def test_a_drain_the_router_refuses_says_why_and_fails(router, tmp_path):
    r = router([{"id": "w1", "url": "http://10.0.0.2:30000", "is_healthy": True}])
    rc, out = cli("drain", {"router": r.url, "auth": router_env(tmp_path, key="wrong"), "timeout": 10,
                            "worker_url": "http://10.0.0.2:30000"})
    assert rc == 1 and not out["ok"] and "GET /workers" in out["reason"]
    # a router host without the env file (not k31's router): asked without a key, refused the same way
    rc, out = cli("drain", {"router": r.url, "auth": {**router_env(tmp_path), "env_file": str(tmp_path / "none")},
                            "timeout": 10, "worker_url": "http://10.0.0.2:30000"})
    assert rc == 1 and "GET /workers" in out["reason"]
    assert len(r.workers) == 1
    rc, out = cli("drain", {"router": f"http://127.0.0.1:{free_port()}", "auth": router_env(tmp_path), "timeout": 10,
                            "worker_url": "http://10.0.0.2:30000"})
    assert rc == 1 and "did not list" in out["reason"]


@pytest.mark.parametrize("container", [False, True])
def test_the_router_host_readds_a_worker_with_the_key_the_router_sends_its_workers(router, tmp_path, container):
    """The worker's entry carries the engines' key, read (like the control-plane key the call is made with) from
    the router's env file on its host, so the spec the redeploy pipes in holds neither."""
    r = router([])
    worker = {"url": "http://10.0.0.2:30000", "worker_type": "prefill", "bootstrap_port": 8998}
    rc, out = cli("rejoin", {"router": r.url, "auth": router_env(tmp_path, container=container), "timeout": 10,
                             "worker": worker})
    assert (rc, out["reason"]) == (0, "")
    assert r.workers[0]["body"] == {**worker, "api_key": WORKER_KEY} and r.workers[0]["is_healthy"]


def test_a_router_without_a_worker_key_gets_the_worker_without_one(router, tmp_path):
    r = router([])
    worker = {"url": "http://10.0.0.2:30000"}
    rc, out = cli("rejoin", {"router": r.url, "auth": router_env(tmp_path, worker_key=""), "timeout": 10,
                             "worker": worker})
    assert (rc, out["reason"]) == (0, "")
    assert r.workers[0]["body"] == worker


def test_a_readded_worker_the_router_never_finds_healthy_fails_after_the_timeout(router):
    r = router([], healthy_after_post=False)
    clock = iter(range(0, 1000, 1))
    reason = probe.rejoin(_call, r.url, {"url": "http://10.0.0.2:30000"}, 5,
                          now=lambda: next(clock), sleep=lambda s: None)
    assert reason == "the router does not list http://10.0.0.2:30000 healthy after 5 s"


def test_the_drain_and_readd_poll_the_routers_listing_four_times_a_second(router):
    """A 1 s poll added up to a second to each step's drain and re-add; the router's own listing costs nothing."""
    r = router([], healthy_after_post=False)
    slept: list[float] = []
    clock = iter(range(0, 1000, 1))
    probe.rejoin(_call, r.url, {"url": "http://10.0.0.2:30000"}, 3, now=lambda: next(clock), sleep=slept.append)
    probe.drain(_call, r.url, "http://10.0.0.2:30000", 3, now=lambda: next(clock), sleep=slept.append)
    assert slept and set(slept) == {probe.ROUTER_POLL} and probe.ROUTER_POLL == 0.25


def test_the_in_flight_wait_polls_the_engine_four_times_a_second():
    """A 2 s poll added up to two seconds to each drained server's stop; the engine's /get_load is on its host."""
    slept: list[float] = []
    loads = iter([3, 1, 0])
    reason = probe.idle(lambda method, url, body: (200, [{"num_reqs": next(loads), "num_waiting_reqs": 0}]),
                        "http://127.0.0.1:30000/get_load", 30, now=lambda: 0.0, sleep=slept.append)
    assert reason == "" and slept == [probe.LOAD_POLL] * 2 and probe.LOAD_POLL == 0.25


def _call(method, url, body):
    answer = probe.request(url, method, body, {"Authorization": f"Bearer {KEY}"})
    return answer["status"], answer.get("json")


def test_health_tells_up_from_an_error_status_from_nothing_listening(router, monkeypatch):
    r = router([])
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    assert probe.health(f"{r.url}/workers") == "error"        # 401: a process answers
    assert probe.health(f"http://127.0.0.1:{free_port()}/health") == "down"
    assert probe.request(f"{r.url}/workers", headers={"Authorization": f"Bearer {KEY}"}) == {
        "status": 200, "json": {"workers": []}}


class Engine(http.server.ThreadingHTTPServer):
    """An engine's /get_load behind its API key: `load` requests in flight, one fewer at each read."""

    def __init__(self, load):
        super().__init__(("127.0.0.1", 0), EngineHandler)
        self.load = load
        self.reads = []


class EngineHandler(RouterHandler):
    def do_GET(self):
        if self.headers.get("Authorization") != "Bearer ek":
            self._answer(401, {})
            return
        self.server.reads.append(time.time())
        self._answer(200, [{"num_reqs": self.server.load, "num_waiting_reqs": 0}])
        self.server.load = max(0, self.server.load - 1)


@pytest.fixture
def host(tmp_path):
    """An engine host's k31 files under tmp_path: the client installed as k31_probe.py beside a stand-in
    k31-engine-gate (it records its arguments and answers what gate.json says), and a systemctl on PATH that
    records its calls (and fails a start when asked to)."""
    bin_dir, lib = tmp_path / "bin", tmp_path / "lib"
    bin_dir.mkdir()
    lib.mkdir()
    client = lib / "k31_probe.py"
    client.write_text(Path(probe.__file__).read_text())
    calls = tmp_path / "systemctl.calls"
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {calls}\n'
                                       f'[ "$1" = start ] && [ -e {tmp_path}/refuse-start ] && exit 1\nexit 0\n')
    (bin_dir / "systemctl").chmod(0o755)
    (bin_dir / "journalctl").write_text('#!/bin/sh\necho "journal $*"\n')
    (bin_dir / "journalctl").chmod(0o755)
    (tmp_path / "gate.json").write_text('{"ok": true, "seconds": 0.1, "healthy": ["k31-d0-r0"], "reason": ""}')
    (lib / "k31-engine-gate").write_text(f'#!/bin/sh\necho "$*" >> {tmp_path}/gate.calls\ncat {tmp_path}/gate.json\n'
                                         f'grep -q \'"ok": true\' {tmp_path}/gate.json\n')
    (lib / "k31-engine-gate").chmod(0o755)
    etc, stage = tmp_path / "etc", tmp_path / "stage"
    files = []
    for name in ("k31-d0-r0.env", "k31-d0-r0.sh"):
        live = etc / name
        live.parent.mkdir(parents=True, exist_ok=True)
        live.write_text(f"v1 {name}\n")
        live.chmod(0o600 if name.endswith(".env") else 0o755)
        staged = Path(str(stage) + str(live))
        staged.parent.mkdir(parents=True, exist_ok=True)
        staged.write_text(f"v2 {name}\n")
        staged.chmod(live.stat().st_mode & 0o777)
        files.append({"live": str(live), "staged": str(staged), "prev": f"{live}.prev"})
    spec = {"units": ["k31-d0-r0"], "files": files, "stage_dir": str(stage), "rollout": True}
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "http_proxy": "http://127.0.0.1:9"}

    def call(action, **change):
        done = subprocess.run([sys.executable, "-I", str(client), "--call", action],
                              input=json.dumps({**spec, **change}), capture_output=True, text=True, env=env,
                              timeout=60, check=False)
        return done.returncode, json.loads(done.stdout)

    def systemctl_calls():
        return calls.read_text().splitlines() if calls.exists() else []

    return call, files, systemctl_calls, tmp_path


def test_a_rollout_keeps_the_running_version_swaps_in_the_staged_one_and_can_restore_it(host):
    call, files, systemctl_calls, tmp_path = host
    env = files[0]
    assert call("stop") == (0, {"ok": True, "reason": "", "at": pytest.approx(time.time(), abs=30)})
    assert Path(env["prev"]).read_text() == "v1 k31-d0-r0.env\n" and Path(env["prev"]).stat().st_mode & 0o777 == 0o600
    assert call("start")[0] == 0
    assert [Path(f["live"]).read_text() for f in files] == ["v2 k31-d0-r0.env\n", "v2 k31-d0-r0.sh\n"]
    assert Path(env["live"]).stat().st_mode & 0o777 == 0o600 and not (tmp_path / "stage").exists()
    assert call("restore")[0] == 0
    assert [Path(f["live"]).read_text() for f in files] == ["v1 k31-d0-r0.env\n", "v1 k31-d0-r0.sh\n"]
    assert systemctl_calls() == ["stop k31-d0-r0", "daemon-reload", "start k31-d0-r0", "daemon-reload",
                                 "restart k31-d0-r0"]
    assert not list(tmp_path.rglob("*.k31-tmp"))


def test_a_rollout_with_nothing_staged_restarts_what_runs_without_a_reload(host):
    """k31 redeploy stages nothing where a host is as its last whole deploy left it (a plain restart): the start
    puts no file in place, so systemd has nothing to reread."""
    call, files, systemctl_calls, tmp_path = host
    shutil.rmtree(tmp_path / "stage")
    assert call("stop")[0] == 0 and call("start")[0] == 0
    assert [Path(f["live"]).read_text() for f in files] == ["v1 k31-d0-r0.env\n", "v1 k31-d0-r0.sh\n"]
    assert systemctl_calls() == ["stop k31-d0-r0", "start k31-d0-r0"]


def test_a_restart_for_the_pd_rule_touches_no_file_and_a_refused_start_says_so(host):
    call, files, systemctl_calls, tmp_path = host
    before = {f["live"]: Path(f["live"]).read_text() for f in files}
    assert call("stop", rollout=False)[0] == 0 and call("start", rollout="False")[0] == 0
    assert {f["live"]: Path(f["live"]).read_text() for f in files} == before
    # what the prepare play staged is not put in place, and not left behind (it may hold secrets)
    assert not any(Path(f["prev"]).exists() for f in files) and not (tmp_path / "stage").exists()
    assert systemctl_calls() == ["stop k31-d0-r0", "start k31-d0-r0"]
    (tmp_path / "refuse-start").touch()
    rc, out = call("start", rollout=False)
    assert rc == 1 and out["reason"].startswith("systemctl start k31-d0-r0 failed")


def test_rank_0_stops_after_the_grace_and_its_requests_in_flight_read_with_the_running_engines_key(host):
    call, _, systemctl_calls, tmp_path = host
    engine = Engine(load=2)
    threading.Thread(target=engine.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{engine.server_address[1]}/get_load"
        key_file = tmp_path / "engine.auth.yaml"    # as k31_engine writes it; the controller's key may be a new one
        key_file.write_text('# the engine reads its keys from here\napi-key: "ek"\nadmin-api-key: "other"\n')
        not_before = time.time() + 1.0
        idle = {"load_url": url, "auth_file": str(key_file), "timeout": 20, "not_before": not_before}
        assert call("stop", idle=idle)[1] == {"ok": True, "reason": "", "idle": "",
                                              "at": pytest.approx(time.time(), abs=30)}
        assert engine.reads[0] >= not_before and len(engine.reads) == 3     # 2 in flight, 1, then none
        assert systemctl_calls() == ["stop k31-d0-r0"]
        assert max(engine.reads) < (tmp_path / "systemctl.calls").stat().st_mtime
        engine.load = 50
        rc, out = call("stop", idle={**idle, "timeout": 0.5, "not_before": 0})
        assert rc == 0 and out["idle"].startswith("requests were still in flight")    # the stop goes on
        key_file.write_text('api-key: "wrong"\n')
        reads = len(engine.reads)
        assert call("stop", idle={**idle, "not_before": 0})[1]["idle"] == ""    # no load to read (401): nothing to wait
        assert len(engine.reads) == reads
        # the repair's drained prefill waits the same way, with nothing stopped
        key_file.write_text('api-key: "ek"\n')
        engine.load, engine.reads[:] = 1, []
        assert call("idle", load_url=url, auth_file=str(key_file), timeout=20)[1] == {
            "ok": True, "reason": "", "at": pytest.approx(time.time(), abs=30)}
        assert len(engine.reads) == 2 and systemctl_calls() == ["stop k31-d0-r0"] * 3
        engine.load = 50
        rc, out = call("idle", load_url=url, auth_file=str(key_file), timeout=0.5)
        assert rc == 1 and out["reason"].startswith(f"requests were still in flight on {url} after 0.5 s")
    finally:
        engine.shutdown()
        engine.server_close()


def test_rank_0_ends_its_start_and_restore_with_the_health_gate_and_a_failed_gate_fails_the_call(host):
    call, files, _, tmp_path = host
    gate = ["--timeout", "60", "--target=k31-d0-r0=http://10.0.0.2:30000/health", "--watch=k31-d0-r0"]
    assert call("stop")[0] == 0
    rc, out = call("start", gate=gate)
    assert rc == 0 and out["gate"]["healthy"] == ["k31-d0-r0"]
    assert (tmp_path / "gate.calls").read_text().split() == gate
    (tmp_path / "gate.json").write_text('{"ok": false, "reason": "k31-d0-r0 failed (systemd stopped restarting it)"}')
    rc, out = call("restore", gate=gate)
    assert (rc, out["ok"], out["reason"]) == (1, False, "k31-d0-r0 failed (systemd stopped restarting it)")
    assert [Path(f["live"]).read_text() for f in files] == ["v1 k31-d0-r0.env\n", "v1 k31-d0-r0.sh\n"]
    (tmp_path / "refuse-start").touch()
    (tmp_path / "gate.calls").unlink()
    rc, out = call("start", rollout=False, gate=gate)
    assert rc == 1 and out["reason"].startswith("systemctl start") and "gate" not in out    # no gate for a failed start
    assert not (tmp_path / "gate.calls").exists()
    (tmp_path / "gate.json").write_text("Traceback: not JSON")
    (tmp_path / "refuse-start").unlink()
    rc, out = call("start", rollout=False, gate=gate)
    assert rc == 1 and out["reason"].startswith(str(tmp_path / "lib" / "k31-engine-gate") + " exited 1")


def test_a_server_on_one_host_rolls_in_one_call_and_its_prefill_watcher_is_released(host):
    """`--call roll` with "start": the step's stop, start and gate in one SSH round trip; a prefill's hold goes
    once it is back."""
    call, files, systemctl_calls, tmp_path = host
    hold = tmp_path / "pd-follow.hold"
    hold.write_text("900\n")
    gate = ["--timeout", "60", "--target=k31-d0-r0=http://10.0.0.2:30000/health", "--watch=k31-d0-r0"]
    rc, out = call("roll", start=True, gate=gate, restore_gate=["--timeout", "5"], journal=40, release=str(hold))
    assert (rc, out["ok"], out["stopped"], out["released"], out["gate"]["ok"]) == (0, True, True, True, True)
    assert "rollback" not in out and not hold.exists() and not (tmp_path / "stage").exists()
    assert [Path(f["live"]).read_text() for f in files] == ["v2 k31-d0-r0.env\n", "v2 k31-d0-r0.sh\n"]
    assert systemctl_calls() == ["stop k31-d0-r0", "daemon-reload", "start k31-d0-r0"]
    assert (tmp_path / "gate.calls").read_text().split() == gate


def test_a_rollout_that_fails_its_gate_rolls_back_in_the_same_call_and_quotes_the_journal(host):
    call, files, systemctl_calls, tmp_path = host
    hold = tmp_path / "pd-follow.hold"
    hold.write_text("900\n")
    (tmp_path / "gate.json").write_text('{"ok": false, "reason": "k31-d0-r0 did not answer /health in 60 s"}')
    gate, back = ["--timeout", "60", "--watch=k31-d0-r0"], ["--timeout", "7", "--watch=k31-d0-r0"]
    rc, out = call("roll", start=True, gate=gate, restore_gate=back, journal=40, release=str(hold))
    assert (rc, out["ok"], out["stopped"]) == (1, False, True)
    assert out["reason"] == ("k31-d0-r0 did not answer /health in 60 s. Last log lines:\n"
                             "journal --no-pager -n 40 --unit=k31-d0-r0\n")
    # the roll-back's gate failed too (gate.json): its reason, and the watcher stays held
    assert out["rollback"]["ok"] is False and out["rollback"]["reason"].startswith("k31-d0-r0 did not answer")
    assert [Path(f["live"]).read_text() for f in files] == ["v1 k31-d0-r0.env\n", "v1 k31-d0-r0.sh\n"]
    assert hold.exists() and "released" not in out
    assert (tmp_path / "gate.calls").read_text().split() == gate + back
    assert systemctl_calls() == ["stop k31-d0-r0", "daemon-reload", "start k31-d0-r0", "daemon-reload",
                                 "restart k31-d0-r0"]
    # a roll-back that comes back healthy releases the watcher (the prefill is back on its old version)
    (tmp_path / "gate.calls").write_text("")
    (tmp_path / "ok.json").write_text('{"ok": true}')
    (tmp_path / "lib" / "k31-engine-gate").write_text(
        f'#!/bin/sh\necho "$*" >> {tmp_path}/gate.calls\n'
        f'case "$*" in *"--timeout 7"*) cat {tmp_path}/ok.json; exit 0;; esac\ncat {tmp_path}/gate.json\nexit 1\n')
    rc, out = call("roll", start=True, gate=gate, restore_gate=back, journal=0, release=str(hold))
    assert (rc, out["reason"], out["rollback"], out["released"]) == (
        1, "k31-d0-r0 did not answer /health in 60 s", {"ok": True, "reason": ""}, True)
    assert not hold.exists()


def test_a_server_on_several_hosts_only_stops_in_its_roll_and_a_failed_stop_goes_no_further(host):
    call, _, systemctl_calls, tmp_path = host
    rc, out = call("roll", start=False, release=str(tmp_path / "hold"))
    assert (rc, out["stopped"], out["ok"]) == (0, True, True) and "gate" not in out
    assert systemctl_calls() == ["stop k31-d0-r0"] and (tmp_path / "stage").exists()
    (tmp_path / "bin" / "systemctl").write_text("#!/bin/sh\necho refused >&2\nexit 1\n")
    rc, out = call("roll", start=True)
    assert (rc, out["stopped"], out["reason"]) == (1, False, "systemctl stop k31-d0-r0 failed: refused")


@pytest.fixture
def alertmanager(cluster):
    """Alertmanager's silences API over mutual TLS, clients of the cluster CA only: POST /api/v2/silences answers
    its id, DELETE /api/v2/silence/ID 200 for a silence it has, 404 else. (url, TLS files, the silences it holds)."""
    silences = {}

    class Handler(RouterHandler):
        def do_POST(self):
            silences[f"s{len(silences) + 1}"] = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self._answer(200, {"silenceID": f"s{len(silences)}"})

        def do_DELETE(self):
            known = silences.pop(self.path.rsplit("/", 1)[-1], None) is not None
            self._answer(200 if known else 404, {} if known else {"error": "not found"})

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    only_cluster_clients(server, cluster)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}/api/v2", cluster, silences
    server.shutdown()
    server.server_close()


def test_the_monitoring_host_silences_the_servers_a_redeploy_restarts_and_expires_it(alertmanager):
    """k31 redeploy's silence (`--call silence`, raw on the monitoring host, with that host's cluster certificate):
    created with its id in the answer, expired by that id; refused with the reason where the certificate is another
    CA's or cannot be read. Its spec holds paths, never a key."""
    url, tls, silences = alertmanager
    auth = {"ca": str(tls / "ca.crt"), "cert": str(tls / "host.crt"), "key": str(tls / "host.key")}
    body = {"matchers": [{"name": "k31_server", "value": "^(?:decode0|prefill0)$", "isRegex": True, "isEqual": True}],
            "startsAt": "2026-12-06T16:00:00Z", "endsAt": "2026-12-06T18:00:00Z", "createdBy": "k31 redeploy",
            "comment": "k31 redeploy of decode0, prefill0"}
    rc, out = cli("silence", {"url": f"{url}/silences", "auth": auth, "body": body})
    assert (rc, out["ok"], out["id"]) == (0, True, "s1") and silences == {"s1": body}
    rc, out = cli("silence", {"url": f"{url}/silence/s1", "auth": auth, "expire": True})
    assert (rc, out["ok"]) == (0, True) and silences == {}
    rc, out = cli("silence", {"url": f"{url}/silence/s1", "auth": auth, "expire": True})
    assert (rc, out["ok"], out["reason"]) == (1, False, "Alertmanager answered HTTP 404")
    stranger = {**auth, "cert": str(tls / "stranger.crt"), "key": str(tls / "stranger.key")}
    rc, out = cli("silence", {"url": f"{url}/silences", "auth": stranger, "body": body})
    assert rc == 1 and not out["ok"] and out["reason"] and silences == {}
    rc, out = cli("silence", {"url": f"{url}/silences", "auth": {**auth, "key": str(tls / "gone.key")}, "body": body})
    assert rc == 1 and out["reason"].startswith("the host's cluster certificate cannot be loaded")


def test_the_call_filter_reads_the_clients_answer_from_a_raw_tasks_result():
    """k31_call (filter_plugins/k31.py): what the roles read of a call's registered result."""
    spec = importlib.util.spec_from_file_location(
        "k31_filters", Path(__file__).resolve().parents[2] / "filter_plugins" / "k31.py")
    filters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(filters)
    call = filters.FilterModule().filters()["k31_call"]
    ok = {"rc": 0, "stdout": 'noise\n{"ok": true, "reason": "", "at": 17.5}\n', "stderr": ""}
    assert call(ok) == {"ok": True, "reason": "", "at": 17.5}
    refused = {"rc": 1, "failed": True, "stdout": '{"ok": false, "reason": "the router still lists it"}'}
    assert call(refused, "x") == {"ok": False, "reason": "the router still lists it"}
    # no JSON: the command's stderr, else Ansible's word for a host that did not answer, else the caller's words
    assert call({"rc": 1, "failed": True, "stdout": "", "stderr": "python3: not found\n"}, "x")["reason"] == \
        "python3: not found"
    assert call({"rc": 1, "failed": True, "stdout": "", "msg": "non-zero return code"}, "the drain timed out") == \
        {"ok": False, "reason": "the drain timed out"}
    assert call({"unreachable": True, "msg": "Failed to connect to the host via ssh"}, "x")["reason"] == \
        "Failed to connect to the host via ssh"
    assert call({"skipped": True})["reason"] == "no answer"
    timed_out = {"failed": True, "timedout": {"frame": "", "period": 90}, "msg": "The task was terminated"}
    assert call(timed_out, "the drain did not answer within its timeout")["reason"] == \
        "the drain did not answer within its timeout"
    # a loop: the first item that failed, else the last
    loop = {"results": [ok, refused, {"rc": 1, "failed": True, "stdout": '{"ok": false, "reason": "later"}'}]}
    assert call(loop)["reason"] == "the router still lists it"
    assert call({"results": [refused | {"failed": False}, ok]})["ok"] is True
