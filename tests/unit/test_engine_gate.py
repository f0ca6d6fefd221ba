"""The engines' health gate on their host (k31deploy/oncall/gate.py, installed as k31-engine-gate): quick probes
first, then the model-load cadence, and an early failure on a crash loop instead of waiting out the health
timeout."""

from __future__ import annotations

import http.server
import json
import threading

import pytest
from host_scripts import ONCALL
from host_scripts import load as load_script

SCRIPT = ONCALL / "gate.py"


def load():
    return load_script(SCRIPT, "k31_engine_gate")


class Clock:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds


def run(gate, *, healthy_at=None, restarts=lambda t: 0, active=lambda t: "active", **kw):
    clock = Clock()
    opts = {"timeout": 60, "quick": 10, "interval": 5, "max_restarts": 3, **kw}
    out = gate.gate({"k31-d0-r0": "http://h/health"}, ["k31-d0-r0", "k31-d0-r1"], clock=clock, sleep=clock.sleep,
                    probe=lambda url, timeout: healthy_at is not None and clock.now >= healthy_at,
                    state=lambda unit: (active(clock.now), restarts(clock.now)), **opts)
    return out, clock


FIRST = [0.25] * 8          # the first two seconds


def test_probes_each_quarter_second_then_every_second_first_then_at_the_model_load_interval():
    gate = load()
    out, clock = run(gate, healthy_at=0.5)
    assert out == {"ok": True, "seconds": 0.5, "healthy": ["k31-d0-r0"], "reason": ""}
    assert clock.sleeps == [0.25, 0.25]
    out, clock = run(gate, healthy_at=3)
    assert out == {"ok": True, "seconds": 3.0, "healthy": ["k31-d0-r0"], "reason": ""}
    assert clock.sleeps == [*FIRST, 1.0]
    out, clock = run(gate, healthy_at=22)
    assert out["ok"] and clock.sleeps == FIRST + [1.0] * 8 + [5.0, 5.0, 5.0]
    assert out["seconds"] == 25.0


def test_a_crash_loop_fails_at_once_naming_the_unit():
    gate = load()
    # systemd restarts the unit every 5 s (RestartSec=5); 3 restarts since the gate began is a crash loop
    out, _ = run(gate, restarts=lambda t: 2 + int(t // 5))
    assert not out["ok"] and out["seconds"] == 15.0
    assert out["reason"] == ("k31-d0-r0 exited and was restarted by systemd 3 times since the gate began "
                             "(a crash loop)")
    out, _ = run(gate, active=lambda t: "failed" if t >= 4 else "activating")
    assert out["reason"] == "k31-d0-r0 failed (systemd stopped restarting it)" and out["seconds"] == 4.0
    # a clean exit is not restarted: inactive for a second (one poll could fall inside a restart)
    out, _ = run(gate, active=lambda t: "inactive" if t in (0.5, 0.75, 1.25, 2, 5, 6) else "active")
    assert out["reason"] == "k31-d0-r0 stopped (inactive) and systemd does not restart it" and out["seconds"] == 6.0
    out, _ = run(gate, active=lambda t: "inactive" if t >= 0.5 else "active")
    assert out["reason"] == "k31-d0-r0 stopped (inactive) and systemd does not restart it" and out["seconds"] == 1.5
    # --max-restarts 0: only the timeout ends the wait
    out, _ = run(gate, restarts=lambda t: int(t), max_restarts=0)
    assert out["reason"] == "k31-d0-r0 did not answer /health within 60 s" and out["seconds"] == 60.0


def test_the_timeout_names_the_ranks_that_did_not_answer():
    gate = load()
    out, clock = run(gate, timeout=12)
    assert out == {"ok": False, "seconds": 12.0, "healthy": [], "reason":
                   "k31-d0-r0 did not answer /health within 12 s"}
    assert clock.sleeps == FIRST + [1.0] * 8 + [2.0]    # never past the timeout


@pytest.fixture
def health_server():
    calls = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            calls.append(self.path)
            self.send_response(503 if len(calls) < 3 else 200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/health", calls
    server.shutdown()
    server.server_close()


def test_the_real_probe_takes_503_as_not_yet_and_ignores_proxies(health_server, monkeypatch, capsys):
    url, calls = health_server
    gate = load()
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")     # nothing listens there: a proxy would fail
    monkeypatch.setattr(gate.time, "sleep", lambda s: None)
    assert gate.main(["--timeout", "30", "--target", f"k31-d0-r0={url}"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["healthy"] == ["k31-d0-r0"] and len(calls) == 3
    assert not gate.answers("http://127.0.0.1:9/health", 1)
    with pytest.raises(SystemExit):
        gate.main(["--timeout", "30", "--target", "k31-d0-r0=ftp://x"])


def test_it_runs_as_installed_beside_the_host_side_client(health_server, tmp_path):
    """/usr/local/lib/k31 as k31_engine lays it out: the gate finds k31_probe.py beside itself (through a link too,
    as a site's wrapper may call it), and nothing else of k31."""
    import os
    import shutil
    import subprocess
    import sys

    from k31deploy.oncall import probe

    url, _ = health_server
    lib = tmp_path / "lib"
    lib.mkdir()
    shutil.copy(SCRIPT, lib / "k31-engine-gate")
    shutil.copy(probe.__file__, lib / "k31_probe.py")
    (tmp_path / "gate").symlink_to(lib / "k31-engine-gate")
    env = {"PATH": os.environ["PATH"], "http_proxy": "http://127.0.0.1:9"}
    done = subprocess.run([sys.executable, "-I", str(tmp_path / "gate"), "--timeout", "30", "--quick", "30",
                           "--target", f"k31-d0-r0={url}"], capture_output=True, text=True, env=env, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["healthy"] == ["k31-d0-r0"]
    (lib / "k31_probe.py").unlink()
    missing = subprocess.run([sys.executable, "-I", str(lib / "k31-engine-gate"), "--timeout", "1"],
                             capture_output=True, text=True, env=env, timeout=60, check=False)
    assert missing.returncode != 0 and "k31_probe" in missing.stderr
