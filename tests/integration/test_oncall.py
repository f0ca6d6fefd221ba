"""On-call fault tests on one sandbox (shape mi355x-2p2d: two prefill and two decode stand-in servers
behind the real sglang-router), deployed once with deploy.yml plus the k31-pd-follow watcher. The stand-ins
run a timing model (time to first token, 25 ms per token), and the load is k31deploy.loadgen's concurrent
multi-turn streaming sessions, so streams are in flight whenever a fault strikes; each scenario counts every
request's outcome (complete / truncated / refused / error):

(a) kill -9 a decode engine mid-stream: its in-flight streams are truncated (counted), systemd restarts it,
    the paired prefill restarts follow (the watcher), and every request started after that completes;
(b) rolling redeploy of every server under load: zero failed or truncated requests, the seed's rule kept
    (both prefills restart after the decodes);
(c) a new version that never becomes healthy rolls back by itself, with the reason, and serves again;
(d) a host that becomes unreachable mid-redeploy: every other server keeps serving, the run and
    `k31 status` report it;
(d2) the router host unreachable mid-redeploy: the run fails clearly within the reach timeout (no hang),
    stops nothing it could not drain, and every engine keeps serving;
(f) interrupted redeploys recover: a real `k31 redeploy decode1` is interrupted once decode1 has restarted --
    drained out of the router, the prefills' watchers held, the PD rule's prefill restarts still owed:
    (f1) a lost controller (kill -9 of the whole k31 process group): `k31 status` exits 1 naming the drained
         decode and the held watchers; `k31 status --repair` refuses while a live redeploy holds the lock, then
         restarts both prefills (drained) and re-adds decode1; `k31 status` is clean; a second repair changes
         nothing;
    (f2) Ctrl-C (SIGINT to k31): the CLI repairs at once and says so;
    (f3) a lost controller again, and the next `k31 redeploy` (of a prefill) repairs before its own rollout;
(e) teardown asks first, then removes what the deploy created, idempotently (last: the other scenarios share
    the one deployed sandbox).

Monitoring (Prometheus, Alertmanager, node exporters, deployed with the fleet on router0; fast intervals here)
is asserted along the way: the crash in (a) raises K31EngineCrashed, a hung decode pages K31EngineDown and
clears once it answers again, the redeploy under load in (b) pages nobody, and the console page is captured
with headless Chromium.

Needs root, podman, runc, debootstrap and the router wheels (built into .k31/wheelhouse when missing).
"""

from __future__ import annotations

import contextlib
import http.server
import ipaddress
import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import httpx
import pytest
import yaml
from recaps import changed
from sandbox_cli import REPO, cli_env, host_addresses, k31, node, node_sh, playbook, unit_state, wait_for

from k31deploy import pki, wheelhouse
from k31deploy.loadgen import LoadGen, Report

pytestmark = pytest.mark.integration

NAME = f"oncall-{os.getpid()}"
SHAPE = "mi355x-2p2d"
MODEL = "moonshotai/Kimi-K3.1-Pro"
ENGINES = ("prefill0", "prefill1", "decode0", "decode1")
# Monitoring at test speed: what a site runs at 15 s / 30 s / 20 m, shortened so each alert shows in seconds.
MONITORING = {"k31_monitoring_scrape_interval": "2s", "k31_monitoring_evaluation_interval": "2s",
              "k31_monitoring_group_wait": "1s", "k31_monitoring_group_interval": "5s",
              "k31_monitoring_rule_settings": {"engine_down_for": "20s", "restart_window": "3m"}}
ENGINE_DOWN_FOR_S = 20
# The stand-ins' timing model (group_vars of the sandbox inventory, so deploy and redeploy render the same):
# a 160-token answer streams for about 4 s.
TIMING = {"k31_engine_standin_ttft_base_ms": 300, "k31_engine_standin_ttft_per_1k_prompt_tokens_ms": 200,
          "k31_engine_standin_token_ms": 25}
LONG_ANSWER = 160
# Where the console screenshot goes (docs/img/monitoring-console.png in the README is one of these).
SCREENSHOT = REPO / ".k31" / "artifacts" / "monitoring-console.png"


def ctr(host):
    return node(NAME, host)


def sh(host, command, check=True):
    return node_sh(NAME, host, command, check)


def unit(host, name):
    return unit_state(NAME, host, name)


def write(host, path, text):
    proc = subprocess.run(["podman", "exec", "-i", ctr(host), "sh", "-c", f"cat > {path}"], input=text,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def hold_load(host):
    """Hold `host`'s stand-in in its load when it next starts (the stand-in's LoadHold) until the returned release
    is called: a redeploy that restarts it waits in its gate, where the (d) and (f) tests act, for as long as the
    test takes. A load time instead was a race a busy machine lost (the run went on to its next step first)."""
    path = f"/etc/k31/k31-{host}-r0.standin.hold"
    sh(host, f"touch {path}")
    return lambda: sh(host, f"rm -f {path}")


def started(host):
    """When the host's rank-0 unit's main process started (us, on the monotonic clock the sandbox shares)."""
    return unit_state(NAME, host, f"k31-{host}-r0")["started"]


def kill_tree(pid):
    """SIGKILL a process this test started and everything under it (ansible-playbook runs in a session of
    its own, so a process group is not enough), all at once, as a controller that vanished."""
    tree, todo = [], [pid]
    while todo:
        parent = todo.pop()
        tree.append(parent)
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(parent)], capture_output=True, text=True).stdout
        todo += [int(p) for p in out.split()]
    for p in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


class Cluster:
    def __init__(self, env, inventory):
        self.env = env
        self.inventory = inventory
        self.address = host_addresses(inventory)
        self.router = f"http://{self.address['router0']}:8000"
        # The sandbox's credentials: clients send the router key; the worker API takes the control-plane key.
        secrets = yaml.safe_load((inventory.parent / "secrets.yml").read_text())
        self.router_key = secrets["k31_router_api_key"]
        self.client_headers = {"Authorization": f"Bearer {self.router_key}"}
        self.admin_headers = {"Authorization": "Bearer " + pki.derived_secret(secrets["k31_pki_ca_key"],
                                                                              "router-control-plane")}
        # Prometheus and Alertmanager take a client certificate of the sandbox's cluster CA.
        client = inventory.parent / "client"
        self.tls = ssl.create_default_context(cafile=str(client / "ca.crt"))
        self.tls.load_cert_chain(str(client / "client.crt"), str(client / "client.key"))
        self.prometheus = f"https://{self.address['router0']}:9090"
        self.alertmanager = f"https://{self.address['router0']}:9093"

    def alerts(self):
        """Alertmanager's alerts: [(name, server, severity, state)] (state active or suppressed)."""
        with httpx.Client(verify=self.tls, timeout=10) as client:
            listed = client.get(f"{self.alertmanager}/api/v2/alerts").json()
        return [(a["labels"]["alertname"], a["labels"].get("k31_server"), a["labels"].get("severity"),
                 a["status"]["state"]) for a in listed]

    def firing(self, name, server):
        return any(a[:2] == (name, server) and a[3] == "active" for a in self.alerts())

    def workers(self):
        listed = httpx.get(f"{self.router}/workers", headers=self.admin_headers, timeout=10).json()["workers"]
        return {w["url"]: w["is_healthy"] for w in listed}

    def url(self, host, port):
        return f"http://{self.address[host]}:{port}"

    def load(self, **settings):
        """Streaming multi-turn sessions through the router, bounded (k31deploy.loadgen)."""
        settings = {"sessions": 6, "turns": 4, "max_requests": 2000, "deadline": 600, "max_tokens": LONG_ANSWER,
                    "timeout": 120, **settings}
        return LoadGen(self.router, api_key=self.router_key, model=MODEL, **settings)

    def engine_url(self, host):
        return self.url(host, 30100 if host.startswith("decode") else 30000)

    def holds(self):
        return [h for h in ("prefill0", "prefill1")
                if subprocess.run(["podman", "exec", ctr(h), "test", "-e", "/run/k31/pd-follow.hold"]).returncode == 0]

    def healthy(self, host):
        return httpx.get(self.engine_url(host) + "/health", timeout=3).status_code == 200

    def held(self, host):
        """The restarted stand-in answers /health with 503: it is held in its load (hold_load), so the run that
        restarted it still waits in its gate. Asked through wait_for, which takes a closed port as "not yet"."""
        return httpx.get(self.engine_url(host) + "/health", timeout=3).status_code == 503

    def interrupt_redeploy(self, sig):
        """Start `k31 redeploy decode1` and send `sig` once decode1 restarted (drained, prefills owed a restart,
        watchers held): to k31 alone for SIGINT (Ctrl-C); SIGKILL to k31 and every process under it for a lost
        controller (it takes ansible-playbook and its SSH sessions with it). Returns (process, its output file)."""
        before = started("decode1")
        out = self.inventory.parent / f"redeploy-{sig.name}-{time.monotonic_ns()}.log"
        # decode1 stays loading until the interruption landed: the run waits in its gate, having drained it and
        # held the watchers, and has not reached prefill0's drain.
        release = hold_load("decode1")
        try:
            with out.open("w") as fh:
                proc = subprocess.Popen([sys.executable, "-m", "k31deploy.cli", "redeploy", "decode1",
                                         "-i", str(self.inventory)], env=self.env, cwd=REPO,
                                        stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                wait_for("the redeploy to restart decode1", lambda: started("decode1") > before, timeout=180,
                         interval=0.3)
                wait_for("decode1 to answer, held in its load", lambda: self.held("decode1"), timeout=30)
                assert self.engine_url("decode1") not in self.workers()
                assert self.holds() == ["prefill0", "prefill1"]
                if sig == signal.SIGKILL:
                    kill_tree(proc.pid)
                else:
                    os.kill(proc.pid, sig)
            except BaseException:
                kill_tree(proc.pid)
                raise
        finally:
            release()
        return proc, out

    def all_in_router(self):
        want = {self.engine_url(h) for h in ENGINES}
        return set(self.workers()) == want and all(self.workers().values())


def running(url):
    """The engine's running requests (SGLang's num_running_reqs gauge on its open /metrics)."""
    found = re.findall(r"^sglang:num_running_reqs(?:\{[^}]*\})? (\S+)$", httpx.get(url + "/metrics", timeout=3).text,
                       re.MULTILINE)
    return sum(float(v) for v in found)


def serve_all(cluster, n=24):
    """n short requests through the router from 4 sessions at once: the non-complete ones (empty when all served)."""
    report = cluster.load(sessions=4, turns=3, max_requests=n, deadline=120, max_tokens=16).run()
    assert len(report.records) == n, report.summary()
    return [f"{r.outcome}: {r.detail}" for r in report.failures()]


def outcomes(report: Report, since: float = 0.0) -> dict[str, int]:
    """Outcome counts of the requests that started `since` seconds or later into the load."""
    counts = dict.fromkeys(("complete", "truncated", "refused", "error"), 0)
    for record in report.records:
        if record.start >= since:
            counts[record.outcome] += 1
    return counts


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    env = cli_env(state)
    # The roles install the router from the repo's wheelhouse (k31_router_wheelhouse).
    wheelhouse.build("router", REPO / ".k31" / "wheelhouse", wheelhouse.host_arch())
    t0 = time.monotonic()
    proc = k31(env, "sandbox", "up", "--shape", SHAPE, "--name", NAME)
    try:
        assert proc.returncode == 0, proc.stderr
        inventory = Path(proc.stdout.strip().splitlines()[-1])
        (inventory.parent / "group_vars").mkdir()
        (inventory.parent / "group_vars" / "all.yml").write_text(yaml.safe_dump(TIMING))
        # This machine watches the engines' /health directly: it is in the firewall's cluster sources here.
        nodes = yaml.safe_load(inventory.read_text())["all"]["children"]["k31_router"]["hosts"]
        subnet = ipaddress.ip_network(f"{next(iter(nodes.values()))['ansible_host']}/24", strict=False)
        # up to 20 minutes on a machine busy with other sandboxes
        proc = playbook(env, inventory, "deploy.yml",
                        "-e", json.dumps({"k31_firewall_cluster_sources": [str(subnet)], **MONITORING}),
                        timeout=1200)
        assert proc.returncode == 0, proc.stdout[-4000:]
        proc = playbook(env, inventory, "playbooks/redeploy.yml", "--tags", "k31_pd_follow")
        assert proc.returncode == 0, proc.stdout[-4000:]
        print(f"sandbox {NAME} deployed in {time.monotonic() - t0:.0f} s")
        yield Cluster(env, inventory)
    finally:
        for host in ("decode1",):
            subprocess.run(["podman", "unpause", ctr(host)], capture_output=True)
        k31(env, "sandbox", "down", "--name", NAME)


def test_a_decode_killed_mid_stream_truncates_its_streams_and_the_fleet_recovers(cluster):
    before = {h: unit(h, f"k31-{h}-r0") for h in ("decode0", "prefill0", "prefill1")}
    with cluster.load() as load:
        time.sleep(6)    # every session has a stream in flight (each lasts about 4 s)
        # ... but the router may have put them all on decode1 just now: strike while decode0 streams.
        wait_for("decode0 to be streaming", lambda: running(cluster.url("decode0", 30100)) > 0, timeout=60,
                 interval=0.1)
        t0 = time.monotonic()
        killed_at = load.report().elapsed
        sh("decode0", "kill -9 $(systemctl show -p MainPID --value k31-decode0-r0)")
        decode = wait_for("systemd to restart decode0",
                          lambda: (u := unit("decode0", "k31-decode0-r0"))["restarts"] > before["decode0"]["restarts"]
                          and u["active"] == "active" and u)
        wait_for("decode0 /health", lambda: httpx.get(cluster.url("decode0", 30100) + "/health", timeout=3)
                 .status_code == 200)
        healthy_s = time.monotonic() - t0
        for host in ("prefill0", "prefill1"):
            after = wait_for(f"{host} to restart after decode0",
                             lambda h=host: (u := unit(h, f"k31-{h}-r0"))["started"] > decode["started"]
                             and u["active"] == "active" and u, timeout=120)
            # An orderly restart by the watcher, not a crash of its own.
            assert after["restarts"] == before[host]["restarts"]
            journal = sh(host, "journalctl -u k31-pd-follow --no-pager")
            assert f"restarting k31-{host}-r0: decode decode0 restarted" in journal
        wait_for("every server back in the router", cluster.all_in_router, timeout=60)
        recovered_at = load.report().elapsed
        recovered_s = time.monotonic() - t0
        time.sleep(12)    # and the load goes on through the recovered fleet
    report = load.report()
    during = outcomes(report)
    later = outcomes(report, since=recovered_at)
    print(f"(a) decode0 killed {killed_at:.1f} s into the load -> healthy again in {healthy_s:.1f} s, both prefills "
          f"restarted and every server back in the router {recovered_s:.1f} s after the kill; {report.summary()}; "
          f"started after the recovery: {later}; not complete: "
          f"{[(round(r.start, 1), r.outcome, r.detail[:80]) for r in report.failures()]}")
    # The streams decode0 was serving broke (counted, as a client sees them); nothing after the recovery failed.
    assert during["truncated"] >= 1, during
    assert later["complete"] >= 12 and later["complete"] == sum(later.values()), later
    assert not [r for r in report.failures() if r.start < killed_at - 30], "failures before the kill"
    assert serve_all(cluster) == []
    # Monitoring saw the crash (a ticket), and only the crash: the watcher's prefill restarts are k31's own.
    wait_for("K31EngineCrashed for decode0 in Alertmanager", lambda: cluster.firing("K31EngineCrashed", "decode0"),
             timeout=60)
    crash_alert_s = time.monotonic() - t0
    assert not [a for a in cluster.alerts() if a[0] == "K31EngineCrashed" and a[1] != "decode0"]
    print(f"(a) K31EngineCrashed for decode0 fired in Alertmanager {crash_alert_s:.1f} s after the kill")
    assert crash_alert_s < 90


def test_a2_a_hung_decode_pages_and_clears_once_it_answers(cluster):
    """SIGSTOP: the process lives (systemd restarts nothing) but answers nothing, the failure only monitoring
    sees. K31EngineDown pages once engine_down_for has passed and clears when the process runs again."""
    pid = sh("decode0", "systemctl show -p MainPID --value k31-decode0-r0").strip()
    t0 = time.monotonic()
    sh("decode0", f"kill -STOP {pid}")
    try:
        wait_for("K31EngineDown for decode0", lambda: cluster.firing("K31EngineDown", "decode0"),
                 timeout=ENGINE_DOWN_FOR_S + 60, interval=1)
        page_s = time.monotonic() - t0
        status = k31(cluster.env, "status", "-i", str(cluster.inventory))
        assert status.returncode == 1
        row = next(line for line in status.stdout.splitlines() if line.startswith("decode0 "))
        assert row.rstrip().endswith("K31EngineDown"), row
        assert "problem: alert K31EngineDown (page) firing for decode0" in status.stdout
        listing = k31(cluster.env, "alerts", "-i", str(cluster.inventory), "--json")
        assert listing.returncode == 1
        down = [a for a in json.loads(listing.stdout)["alerts"] if a["alert"] == "K31EngineDown"]
        assert [(a["server"], a["severity"], a["state"]) for a in down] == [("decode0", "page", "active")]
        assert "k31 logs -i" in down[0]["runbook"]
    finally:
        sh("decode0", f"kill -CONT {pid}")
    t1 = time.monotonic()
    wait_for("K31EngineDown for decode0 to clear", lambda: not cluster.firing("K31EngineDown", "decode0"),
             timeout=60, interval=1)
    clear_s = time.monotonic() - t1
    print(f"(a2) decode0 hung -> K31EngineDown paged after {page_s:.1f} s (engine_down_for {ENGINE_DOWN_FOR_S} s, "
          f"scrape and evaluation 2 s, group_wait 1 s); cleared {clear_s:.1f} s after it answered again")
    assert ENGINE_DOWN_FOR_S <= page_s < ENGINE_DOWN_FOR_S + 30
    wait_for("every server back in the router", cluster.all_in_router, timeout=60)
    assert serve_all(cluster) == []


def test_b_rolling_redeploy_of_every_server_under_load_fails_no_request(cluster):
    before = {h: unit(h, f"k31-{h}-r0") for h in ENGINES}
    # (a)'s kill still shows as a crash (its restart window); the redeploy must add none
    crashed_before = {a[1] for a in cluster.alerts() if a[0] == "K31EngineCrashed"}
    seen: set[tuple] = set()
    watching = threading.Event()

    def watch_alerts():
        while not watching.is_set():
            seen.update(cluster.alerts())
            time.sleep(1)

    watcher = threading.Thread(target=watch_alerts, daemon=True)
    watcher.start()
    with cluster.load() as load:
        time.sleep(6)
        began = load.report().elapsed
        t0 = time.monotonic()
        proc = k31(cluster.env, "redeploy", "-i", str(cluster.inventory))
        took = time.monotonic() - t0
        ended = load.report().elapsed
        time.sleep(5)
    report = load.report()
    # Nothing pages through a planned redeploy (its silence, the for: windows), during it or once it is over.
    time.sleep(ENGINE_DOWN_FOR_S)
    watching.set()
    watcher.join(10)
    seen.update(cluster.alerts())
    print(f"(b) redeploy of every server took {took:.1f} s under load: {report.summary()}; "
          f"during the redeploy: {len([r for r in report.records if began <= r.start <= ended])} requests started; "
          f"alerts seen: {sorted(seen)}")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "did not take the redeploy's silence" not in proc.stdout    # the host-side client asked Alertmanager
    # The promise: a drained rolling redeploy fails and truncates nothing.
    assert report.failures() == [], [(r.outcome, r.detail) for r in report.failures()[:5]]
    # The load was steady: streams ran from before the redeploy until after it ended.
    starts = [r.start for r in report.records]
    assert min(starts) < began and max(starts) > ended, (began, ended)
    assert len([s for s in starts if began <= s <= ended]) >= 30
    paged = sorted(a for a in seen if a[2] == "page" and a[3] == "active")
    assert paged == [], paged
    assert not [a for a in seen if a[0] == "K31EngineCrashed" and a[1] not in crashed_before], sorted(seen)
    after = {h: unit(h, f"k31-{h}-r0") for h in ENGINES}
    for host in ENGINES:
        assert after[host]["started"] > before[host]["started"], host
        assert after[host]["restarts"] == 0, host    # a start by k31 resets systemd's count: no crash since
    # Canary first, then the other decode, then the prefills (the seed's rule: after the decodes).
    order = sorted(ENGINES, key=lambda h: after[h]["started"])
    assert order[:2] == ["decode0", "decode1"] and set(order[2:]) == {"prefill0", "prefill1"}, order
    assert "Mooncake mapping" in proc.stdout
    assert cluster.all_in_router()
    steps = [line.split("| ")[-1] for line in proc.stdout.splitlines() if " ok in " in line]
    print(f"(b) steps: {steps}")


class _ConsoleProxy(http.server.BaseHTTPRequestHandler):
    """Loopback HTTP in front of Prometheus for the headless browser, which has no client certificate."""

    upstream = ""
    tls: ssl.SSLContext | None = None

    def do_GET(self):
        try:
            with urllib.request.urlopen(self.upstream + self.path, timeout=10, context=self.tls) as resp:
                body, status, kind = resp.read(), resp.status, resp.headers.get("Content-Type", "text/plain")
        except urllib.error.HTTPError as exc:
            body, status, kind = exc.read(), exc.code, "text/plain"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_b2_the_console_page_shows_the_fleet(cluster, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is installed by scripts/system-packages"
    handler = type("Proxy", (_ConsoleProxy,), {"upstream": cluster.prometheus, "tls": cluster.tls})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        page = f"http://127.0.0.1:{server.server_address[1]}/consoles/k31.html"
        html = httpx.get(page, timeout=10).text
        for name in ("prefill0", "prefill1", "decode0", "decode1"):
            assert name in html
        assert "error executing template" not in html
        shot = tmp_path / "console.png"
        # the graphs' time range: the last 15 minutes (prom_console.js reads it from the URL's #pctc)
        proc = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                               "--window-size=1400,1100", "--virtual-time-budget=8000",
                               f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                               page + "#pctc" + urllib.parse.quote(json.dumps({"duration": 900, "endTime": 0}))],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and shot.is_file(), proc.stderr[-2000:]
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, SCREENSHOT)
        print(f"(b2) console page captured: {SCREENSHOT} ({shot.stat().st_size} bytes)")
    finally:
        server.shutdown()


def test_c_a_version_that_never_gets_healthy_rolls_back_by_itself(cluster):
    env_file = "/etc/k31/k31-decode0-r0.env"
    good = sh("decode0", f"cat {env_file}")
    before = unit("decode0", "k31-decode0-r0")
    proc = k31(cluster.env, "redeploy", "decode0", "-i", str(cluster.inventory),
               "-e", "k31_engine_standin_load_seconds=100000", "-e", "k31_engine_health_timeout=10")
    assert proc.returncode != 0
    out = proc.stdout
    assert "decode0: rolled_back" in out and "did not answer /health within 10 s" in out, out[-3000:]
    assert "rolled back to the previous unit, env file and launch script" in out
    assert "did not answer /health within 10 s. Last log lines:\n" in out    # the host-side client quotes the journal
    # The previous env file is back (the new one said K31_STANDIN_LOAD_SECONDS=100000) and serves.
    assert sh("decode0", f"cat {env_file}") == good
    assert "K31_STANDIN_LOAD_SECONDS=100000" not in good
    after = unit("decode0", "k31-decode0-r0")
    assert after["active"] == "active" and after["started"] > before["started"]
    assert httpx.get(cluster.url("decode0", 30100) + "/health", timeout=3).status_code == 200
    # decode0 restarted (twice), so the prefills still follow it -- as they are, no new version.
    for host in ("prefill0", "prefill1"):
        assert unit(host, f"k31-{host}-r0")["started"] > after["started"]
    assert "no new version; restarted as it is" in out
    assert cluster.all_in_router()
    assert serve_all(cluster) == []


def pause_once_restarted(cluster, host, server, started):
    """Freeze `host` (podman pause) as soon as a redeploy restarted `server`'s rank 0 (its start time passed
    `started`), from a thread: (the thread, an event set once paused). `server` stays loading (hold_load) until the
    freeze landed, so the run's next step cannot reach `host` first."""
    paused = threading.Event()
    release = hold_load(server)

    def pause():
        try:
            wait_for(f"the redeploy to restart {server}",
                     lambda: unit(server, f"k31-{server}-r0")["started"] > started, timeout=180, interval=0.3)
            wait_for(f"{server} to answer, held in its load", lambda: cluster.held(server), timeout=30)
            subprocess.run(["podman", "pause", ctr(host)], check=True, capture_output=True)
            paused.set()
        finally:
            release()

    thread = threading.Thread(target=pause, daemon=True)
    thread.start()
    return thread, paused


def test_d_a_host_lost_mid_redeploy_leaves_the_others_serving_and_is_reported(cluster, tmp_path):
    before = unit("decode0", "k31-decode0-r0")
    watcher, paused = pause_once_restarted(cluster, "decode1", "decode0", before["started"])
    # Fresh SSH control connections: a host frozen behind an old one hangs rather than refusing.
    env = {**cluster.env, "ANSIBLE_SSH_CONTROL_PATH_DIR": str(tmp_path / "cp")}
    try:
        t0 = time.monotonic()
        proc = k31(env, "redeploy", "decode", "-i", str(cluster.inventory))
        took = time.monotonic() - t0
        watcher.join(5)
        assert paused.is_set()
        assert proc.returncode != 0
        out = proc.stdout
        assert "decode1: unreachable" in out and "every other server keeps serving" in out, out[-3000:]
        assert "decode0: ok" in out
        # decode0 restarted, so both prefills followed it despite the failure.
        d0 = unit("decode0", "k31-decode0-r0")
        for host in ("prefill0", "prefill1"):
            assert unit(host, f"k31-{host}-r0")["started"] > d0["started"]
        workers = cluster.workers()
        assert cluster.url("decode1", 30100) not in workers and all(workers.values()) and len(workers) == 3
        assert serve_all(cluster) == []
        t1 = time.monotonic()
        status = k31(env, "status", "-i", str(cluster.inventory), "--json")
        status_s = time.monotonic() - t1
        assert status.returncode == 1
        doc = json.loads(status.stdout)
        assert doc["hosts"]["decode1"] == "unreachable"
        assert any(p.startswith("decode1: unreachable") for p in doc["problems"])
        servers = {s["name"]: s for s in doc["servers"]}
        assert servers["decode1"]["in_router"] is False
        for name in ("decode0", "prefill0", "prefill1"):
            assert servers[name]["health"] == 200 and servers[name]["in_router"] is True
            assert servers[name]["ranks"][0]["active"] == "active"
        assert doc["router"]["readiness"] == 200
        print(f"(d) redeploy with decode1 lost took {took:.1f} s; k31 status answered in {status_s:.1f} s")
    finally:
        subprocess.run(["podman", "unpause", ctr("decode1")], capture_output=True)
    # decode1 only stopped answering (paused), it never restarted: no prefill restart for it.
    time.sleep(3)
    for host in ("prefill0", "prefill1"):
        journal = sh(host, "journalctl -u k31-pd-follow --no-pager")
        assert f"restarting k31-{host}-r0: decode decode1" not in journal


def test_d2_the_router_host_lost_mid_redeploy_fails_the_run_and_every_engine_keeps_serving(cluster, tmp_path):
    """router0 freezes once the redeploy restarted decode1: no step may hang on it. decode1 waits out of the
    router (its prefills could not be drained, so they were not restarted: no request meets a stale mapping),
    the run fails within the reach timeout saying so, and once the router answers `k31 status` shows what is
    owed and `k31 status --repair` settles it."""
    before = {h: unit(h, f"k31-{h}-r0") for h in ENGINES}
    pauser, paused = pause_once_restarted(cluster, "router0", "decode1", before["decode1"]["started"])
    env = {**cluster.env, "ANSIBLE_SSH_CONTROL_PATH_DIR": str(tmp_path / "cp")}
    try:
        t0 = time.monotonic()
        proc = k31(env, "redeploy", "decode1", "-i", str(cluster.inventory), "-e", "k31_redeploy_reach_timeout=15",
                   timeout=300)  # a step that hung on the frozen host
        took = time.monotonic() - t0
        pauser.join(5)
        assert paused.is_set()
        # every engine still serves, nothing but decode1 restarted
        for host in ENGINES:
            assert cluster.healthy(host), host
        after = {h: unit(h, f"k31-{h}-r0") for h in ENGINES}
        assert after["decode1"]["started"] > before["decode1"]["started"]
        for host in ("decode0", "prefill0", "prefill1"):
            assert after[host]["started"] == before[host]["started"], host
    finally:
        subprocess.run(["podman", "unpause", ctr("router0")], capture_output=True)
    out = proc.stdout
    assert proc.returncode != 0
    assert "the router host router0 did not answer within 15 s" in out, out[-3000:]
    assert "decode1 failed (restarted and answers /health, but was not re-added to the router" in out
    assert "prefill0 failed (not drained, so not stopped" in out
    assert "k31 status -i INV --repair" in out
    # One wait for the frozen router in the rollout, not one per step: once a task waited out the reach timeout,
    # the later steps knew it was gone. The finish asks once more, to re-add the held decode (the router may be
    # back by then). Counted, not timed: the run's length is mostly the restart and varies with the machine.
    waited = [line for line in out.splitlines() if re.search(r" \| (ignored|unreachable)( \||$)", line)]
    assert len(waited) <= 2, waited
    assert any(line.startswith("localhost | Reach the router host |") for line in waited), waited
    print(f"(d2) redeploy with the router host frozen failed in {took:.1f} s, {len(waited)} waits for it: {waited}; "
          "every engine kept serving")
    wait_for("the router to answer again", lambda: httpx.get(cluster.router + "/health", timeout=3)
             .status_code == 200, timeout=60)
    assert cluster.url("decode1", 30100) not in cluster.workers()
    # Once the router answers, k31 status names what is owed and --repair settles it: the prefills restart
    # (drained) after decode1, then decode1 rejoins.
    status = k31(cluster.env, "status", "-i", str(cluster.inventory), "--json")
    assert status.returncode == 1
    assert any(p.startswith("decode1: healthy but out of the router") for p in json.loads(status.stdout)["problems"])
    repaired = k31(cluster.env, "status", "--repair", "-i", str(cluster.inventory))
    assert repaired.returncode == 0, repaired.stdout[-3000:]
    assert "repair: re-add decode1 to the router" in repaired.stdout
    d1 = unit("decode1", "k31-decode1-r0")
    for host in ("prefill0", "prefill1"):
        assert unit(host, f"k31-{host}-r0")["started"] > d1["started"], host
    assert cluster.all_in_router()
    assert k31(cluster.env, "status", "-i", str(cluster.inventory)).returncode == 0
    assert serve_all(cluster) == []


def assert_whole_and_pd_rule_kept(cluster):
    assert cluster.all_in_router()
    assert cluster.holds() == []
    decode1 = started("decode1")
    for host in ("prefill0", "prefill1"):
        assert started(host) > decode1, f"{host} did not restart after decode1 (the PD rule)"


def test_f1_a_lost_controller_is_reported_and_repaired(cluster):
    t0 = time.monotonic()
    proc, _ = cluster.interrupt_redeploy(signal.SIGKILL)
    proc.wait(10)
    killed_s = time.monotonic() - t0
    # What the lost run left: decode1 (once loaded) healthy but out of the router, both watchers held.
    wait_for("decode1 to finish loading", lambda: cluster.healthy("decode1"), timeout=60)
    status = k31(cluster.env, "status", "-i", str(cluster.inventory), "--json")
    assert status.returncode == 1
    problems = json.loads(status.stdout)["problems"]
    assert any(p.startswith("decode1: healthy but out of the router (no redeploy is running: k31 status --repair")
               for p in problems), problems
    assert sum("k31-pd-follow held until" in p and "k31 status --repair releases it" in p for p in problems) == 2
    assert json.loads(status.stdout)["redeploy"]["lock"] == "stale"   # its ansible-playbook is gone

    # A redeploy that still runs (here: another controller's lock, not expired) is never fought.
    lock = sh("router0", "cat /run/k31/redeploy.lock")
    other = {**json.loads(lock), "id": "0" * 16, "controller": "elsewhere", "expires": time.time() + 600}
    write("router0", "/run/k31/redeploy.lock", json.dumps(other))
    refused = k31(cluster.env, "status", "--repair", "-i", str(cluster.inventory))
    assert refused.returncode == 2
    assert refused.stderr.strip().count("\n") == 0
    assert refused.stderr.startswith("error: k31 status --repair refused: k31 redeploy of decode1") and \
        "from elsewhere" in refused.stderr and "ends by itself" in refused.stderr, refused.stderr
    assert cluster.engine_url("decode1") not in cluster.workers() and cluster.holds() == ["prefill0", "prefill1"]
    write("router0", "/run/k31/redeploy.lock", lock)

    t1 = time.monotonic()
    repaired = k31(cluster.env, "status", "--repair", "-i", str(cluster.inventory))
    repair_s = time.monotonic() - t1
    assert repaired.returncode == 0, repaired.stdout[-3000:]
    out = repaired.stdout
    assert "repair: restart prefill0, drained: it started before decode1 last started" in out
    assert "repair: re-add decode1 to the router" in out and "no problems found" in out
    assert "taking over the redeploy lock" in out and "its process is gone" in out
    assert_whole_and_pd_rule_kept(cluster)
    assert sh("router0", "test -e /run/k31/redeploy.lock || echo gone").strip() == "gone"
    # The released watchers find their prefill restarted after decode1 came back: no second restart.
    after = {h: started(h) for h in ENGINES}
    time.sleep(3)
    assert {h: started(h) for h in ENGINES} == after
    assert k31(cluster.env, "status", "-i", str(cluster.inventory)).returncode == 0

    # Nothing left to do: the repair says so and changes nothing (the CLI, and its playbook run directly).
    again = k31(cluster.env, "status", "--repair", "-i", str(cluster.inventory))
    assert again.returncode == 0 and "repair: nothing to repair" in again.stdout
    run = playbook(cluster.env, cluster.inventory, "playbooks/repair.yml")
    assert run.returncode == 0 and changed(run.stdout) and not any(changed(run.stdout).values()), run.stdout[-3000:]
    assert {h: started(h) for h in ENGINES} == after
    print(f"(f1) redeploy killed {killed_s:.1f} s in; k31 status --repair brought it back in {repair_s:.1f} s")


def test_f2_ctrl_c_repairs_at_once(cluster):
    t0 = time.monotonic()
    proc, out = cluster.interrupt_redeploy(signal.SIGINT)
    assert proc.wait(300) == 130
    took = time.monotonic() - t0
    text = out.read_text()
    print(text[-4000:])
    assert "k31 redeploy: interrupted; bringing back what it left (k31 status --repair -i" in text
    assert "k31 redeploy: repaired: every healthy server is back in the router" in text
    assert_whole_and_pd_rule_kept(cluster)
    assert k31(cluster.env, "status", "-i", str(cluster.inventory)).returncode == 0
    print(f"(f2) Ctrl-C'd redeploy and its repair took {took:.1f} s")


def test_f3_the_next_redeploy_repairs_first(cluster):
    proc, _ = cluster.interrupt_redeploy(signal.SIGKILL)
    proc.wait(10)
    t0 = time.monotonic()
    before = started("prefill1")
    # A prefill: its rollout has no PD cascade of its own, so what brings decode1 back is the repair.
    nxt = k31(cluster.env, "redeploy", "prefill1", "-i", str(cluster.inventory))
    took = time.monotonic() - t0
    assert nxt.returncode == 0, nxt.stdout[-3000:]
    out = nxt.stdout
    assert "taking over the redeploy lock" in out and "its process is gone" in out
    assert out.index("re-add decode1 to the router") < out.index("prefill1: ok in")
    assert started("prefill1") > before
    assert_whole_and_pd_rule_kept(cluster)
    assert k31(cluster.env, "status", "-i", str(cluster.inventory)).returncode == 0
    print(f"(f3) the next redeploy (prefill1) repaired first and rolled in {took:.1f} s")


def test_e_status_logs_and_teardown(cluster, tmp_path):
    proc = k31(cluster.env, "logs", "-i", str(cluster.inventory), "decode0", "--lines", "20",
               "--dest", str(tmp_path / "logs"))
    assert proc.returncode == 0 and proc.stdout.strip() == str(tmp_path / "logs")
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["k31-decode0-r0.log"]
    assert "k31 stand-in: decode server" in (tmp_path / "logs" / "k31-decode0-r0.log").read_text()

    units = "systemctl list-unit-files --no-legend 'k31-*' | cut -d' ' -f1"
    proc = playbook(cluster.env, cluster.inventory, "playbooks/teardown.yml")
    assert proc.returncode != 0 and "teardown not confirmed, nothing was removed" in proc.stdout
    assert "k31-decode0-r0.service" in sh("decode0", units)

    proc = k31(cluster.env, "teardown", "--yes", "-i", str(cluster.inventory))
    assert proc.returncode == 0
    for host in ("prefill0", "prefill1", "decode0", "decode1", "router0"):
        left = [u for u in sh(host, units).split() if u != "k31-ssh-host-keys.service"]  # the sandbox's own
        assert left == ["k31-firewall.service"], (host, left)    # host preparation stays: the host stays closed
        kept = {"prometheus", "pki", "k31-firewall.nft"}
        assert set(sh(host, "ls /etc/k31").split()) <= kept, host
    assert "k31-ssh-host-keys.service" in sh("decode0", units)
    proc = playbook(cluster.env, cluster.inventory, "playbooks/teardown.yml", "-e", "k31_teardown_confirm=true")
    assert proc.returncode == 0 and changed(proc.stdout)
    assert not any(changed(proc.stdout).values()), changed(proc.stdout)
