"""library/k31_files.py's `units`: after its files, it brings a host's units to their states in the same module run
(k31_unit, k31_monitoring). Run here as Ansible runs it, against a stand-in `systemctl` on PATH that answers `show`
from a state file and records every other call: every unit enabled; a unit not running is started, once, whatever
its state asks; `restarted` and `reloaded` act on a running one; a unit file written in the run reloads systemd
once and restarts its unit, a file of `restart_on` (written now, or named in `changed`) restarts it, one of
`reload_on` reloads it; one daemon-reload first when asked; nothing done under --check. Its `wait`
polls HTTPS endpoints with mutual TLS (k31_monitoring's readiness), against a loopback server that asks for a
client certificate of the cluster CA."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from loopback import free_port, only_cluster_clients

MODULE = Path(__file__).resolve().parents[2] / "library" / "k31_files.py"

SYSTEMCTL = """#!/bin/sh
if [ "$1" = show ]; then
  shift 2
  for unit in "$@"; do
    [ "$unit" = -- ] && continue
    grep "^$unit " "$K31_TEST_STATES" | while read -r name file active; do
      printf 'Id=%s\\nUnitFileState=%s\\nActiveState=%s\\n\\n' "$name" "$file" "$active"
    done
  done
  exit 0
fi
echo "$*" >> "$K31_TEST_CALLS"
[ "$2" = -- ] && [ "$3" = k31-broken.service ] && { echo "Job for k31-broken.service failed." >&2; exit 1; }
exit 0
"""


def k31_units(tmp_path: Path, units: list[dict], states: dict[str, tuple[str, str]], *,
                 daemon_reload: bool = False, check: bool = False, wait: dict | None = None,
                 env: dict[str, str] | None = None, files: list[dict] | None = None,
                 changed: list[str] | None = None, unit_files: list[str] | None = None) -> tuple[dict, list[str]]:
    """k31_files with these units (and files, and files changed before), its result and systemctl's calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "systemctl").write_text(SYSTEMCTL)
    (bin_dir / "systemctl").chmod(0o755)
    (tmp_path / "states").write_text("".join(f"{n}.service {f} {a}\n" for n, (f, a) in states.items()))
    calls = tmp_path / "calls"
    calls.write_text("")
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {"files": files or [], "units": units,
                                                         "daemon_reload": daemon_reload, "changed": changed or [],
                                                         "unit_files": unit_files or [],
                                                         "_ansible_check_mode": check,
                                                         **({"wait": wait} if wait else {})}}))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "K31_TEST_STATES": str(tmp_path / "states"), "K31_TEST_CALLS": str(calls), **(env or {})}
    done = subprocess.run([sys.executable, str(MODULE), str(args)], capture_output=True, text=True, env=env,
                          check=False)
    return json.loads(done.stdout), calls.read_text().splitlines()


STATES = {"k31-a": ("enabled", "active"), "k31-b": ("disabled", "inactive"), "k31-c": ("enabled", "failed"),
          "k31-d": ("enabled", "active")}


def test_each_unit_is_enabled_and_running_and_a_running_one_restarts_or_reloads_as_asked(tmp_path):
    units = [{"name": "k31-a", "state": "restarted"}, {"name": "k31-b", "state": "restarted"},
             {"name": "k31-c", "state": "reloaded"}, {"name": "k31-d", "state": "reloaded"}]
    result, calls = k31_units(tmp_path, units, STATES, daemon_reload=True)
    assert calls == ["enable --no-reload -- k31-b.service", "daemon-reload", "restart -- k31-a.service",
                     "start -- k31-b.service", "start -- k31-c.service", "reload -- k31-d.service"]
    assert result["changed"] and result["acted"] == ["k31-b enabled", "systemd daemon-reload", "k31-a restarted",
                                                     "k31-b started", "k31-c started", "k31-d reloaded"]


def test_units_not_enabled_are_enabled_in_one_call_and_one_daemon_reload_follows(tmp_path):
    """`systemctl enable` reloads systemd itself: per unit, on top of the reload asked for, that was a reload per
    fresh unit. Now one enable without a reload of its own, then the one reload (asked for or not)."""
    states = {**STATES, "k31-e": ("disabled", "inactive")}
    units = [{"name": "k31-b"}, {"name": "k31-a"}, {"name": "k31-e"}]
    for daemon_reload in (True, False):
        result, calls = k31_units(tmp_path, units, states, daemon_reload=daemon_reload)
        assert calls == ["enable --no-reload -- k31-b.service k31-e.service", "daemon-reload",
                         "start -- k31-b.service", "start -- k31-e.service"]
        assert result["acted"] == ["k31-b enabled", "k31-e enabled", "systemd daemon-reload", "k31-b started",
                                   "k31-e started"]
    result, calls = k31_units(tmp_path, [{"name": "k31-a"}], STATES, daemon_reload=True)
    assert calls == ["daemon-reload"] and result["acted"] == ["systemd daemon-reload"]


def test_started_leaves_a_running_enabled_unit_alone(tmp_path):
    result, calls = k31_units(tmp_path, [{"name": "k31-a", "state": "started"}], STATES)
    assert (result["changed"], result["acted"], calls) == (False, [], [])


def test_check_mode_reports_what_it_would_do_and_does_nothing(tmp_path):
    units = [{"name": "k31-a", "state": "started"}, {"name": "k31-b", "state": "started"}]
    result, calls = k31_units(tmp_path, units, STATES, daemon_reload=True, check=True)
    assert result["changed"] and result["acted"] == ["k31-b enabled", "systemd daemon-reload", "k31-b started"]
    assert calls == []


def test_a_failed_start_names_the_unit_and_what_was_done_before(tmp_path):
    states = {**STATES, "k31-broken": ("enabled", "inactive")}
    result, _ = k31_units(tmp_path, [{"name": "k31-a", "state": "restarted"}, {"name": "k31-broken"}], states)
    assert result["failed"] and "k31-broken.service" in result["msg"] and "Job for" in result["msg"]
    assert result["acted"] == ["k31-a restarted"]


@pytest.fixture
def mtls_server(cluster):
    """An HTTPS server on 127.0.0.1 that takes only clients of the cluster CA; answers 200 once `ready` is set
    (503 before), in a thread; shut down at teardown."""
    ready = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if ready.is_set() else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    only_cluster_clients(server, cluster)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}/metrics", ready
    server.shutdown()
    server.server_close()


def wait_spec(tls: Path, urls: list[str], client: str = "host", timeout: int = 10) -> dict:
    return {"urls": urls, "ca": str(tls / "ca.crt"), "cert": str(tls / f"{client}.crt"),
            "key": str(tls / f"{client}.key"), "timeout": timeout}


def test_wait_returns_once_every_endpoint_answers_200_with_the_cluster_certificate(tmp_path, cluster, mtls_server):
    url, ready = mtls_server
    threading.Timer(1.0, ready.set).start()    # 503 for a second, as a unit still loading
    began = time.monotonic()
    result, _ = k31_units(tmp_path, [{"name": "k31-a"}], STATES, wait=wait_spec(cluster, [url]))
    assert not result.get("failed"), result.get("msg")
    assert 1.0 <= result["waited"] <= time.monotonic() - began


def test_wait_fails_naming_the_endpoint_that_did_not_answer_in_time(tmp_path, cluster, mtls_server):
    url, _ = mtls_server    # never ready: 503
    dead = f"https://127.0.0.1:{free_port()}/metrics"
    result, _ = k31_units(tmp_path, [], {}, wait=wait_spec(cluster, [url, dead], timeout=1))
    assert result["failed"] and "within 1 s" in result["msg"]
    assert f"{url}: HTTP 503" in result["msg"] and f"{dead}: " in result["msg"] and "refused" in result["msg"]


def test_wait_does_not_take_a_certificate_of_another_ca(tmp_path, cluster, mtls_server):
    url, ready = mtls_server
    ready.set()
    result, _ = k31_units(tmp_path, [], {}, wait=wait_spec(cluster, [url], client="stranger", timeout=1))
    assert result["failed"] and url in result["msg"]


def test_wait_is_skipped_under_check(tmp_path, cluster, mtls_server):
    url, _ = mtls_server    # would never answer 200
    result, _ = k31_units(tmp_path, [], {}, wait=wait_spec(cluster, [url], timeout=1), check=True)
    assert not result.get("failed") and result["waited"] == 0.0


def test_wait_asks_the_cluster_address_itself_whatever_proxy_the_environment_names(tmp_path, cluster, mtls_server):
    """A host with https_proxy set (a site's egress proxy) and no no_proxy for the cluster: the wait still asks the
    endpoint, as k31_probe.py does, not a proxy that cannot reach it (here: nothing listens there)."""
    url, ready = mtls_server
    ready.set()
    dead = f"http://127.0.0.1:{free_port()}"
    proxies = {"https_proxy": dead, "HTTPS_PROXY": dead, "http_proxy": dead, "HTTP_PROXY": dead,
               "no_proxy": "", "NO_PROXY": ""}
    result, _ = k31_units(tmp_path, [], {}, wait=wait_spec(cluster, [url], timeout=2), env=proxies)
    assert not result.get("failed"), result.get("msg")


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the module makes its files root's (k31 runs as root)")


def unit_files(tmp_path: Path, *contents: str) -> list[dict]:
    """k31-a's unit file, its env file and its configuration, with these contents."""
    names = ("k31-a.service", "k31-a.env", "k31-a.yml")
    return [{"dest": str(tmp_path / name), "content": text, "mode": "0644"} for name, text in zip(names, contents,
                                                                                                 strict=True)]


def unit_a(tmp_path: Path) -> dict:
    return {"name": "k31-a", "unit_file": str(tmp_path / "k31-a.service"), "restart_on": [str(tmp_path / "k31-a.env")],
            "reload_on": [str(tmp_path / "k31-a.yml")]}


@needs_root
def test_the_files_then_their_units_in_one_run_a_changed_unit_file_reloads_systemd_and_restarts_its_unit(tmp_path):
    """One run writes a role's files and starts its units: where a write and a start cost two module runs per role
    and host. A unit file written now reloads systemd once and restarts its unit; a second run changes nothing."""
    files = unit_files(tmp_path, "[Service]\n", "A=1\n", "x: 1\n")
    result, calls = k31_units(tmp_path, [unit_a(tmp_path)], STATES, files=files)
    assert result["changed_files"] == [f["dest"] for f in files]
    assert calls == ["daemon-reload", "restart -- k31-a.service"]
    assert result["acted"] == ["systemd daemon-reload", "k31-a restarted"]
    result, calls = k31_units(tmp_path, [unit_a(tmp_path)], STATES, files=files)
    assert (result["changed"], result["changed_files"], result["acted"], calls) == (False, [], [], [])


@needs_root
def test_a_restart_on_file_restarts_a_reload_on_file_reloads_and_restart_wins(tmp_path):
    k31_units(tmp_path, [unit_a(tmp_path)], STATES, files=unit_files(tmp_path, "[Service]\n", "A=1\n", "x: 1\n"))
    _, calls = k31_units(tmp_path, [unit_a(tmp_path)], STATES,
                            files=unit_files(tmp_path, "[Service]\n", "A=1\n", "x: 2\n"))
    assert calls == ["reload -- k31-a.service"]    # a new configuration: no restart, no daemon-reload
    _, calls = k31_units(tmp_path, [unit_a(tmp_path)], STATES,
                            files=unit_files(tmp_path, "[Service]\n", "A=2\n", "x: 3\n"))
    assert calls == ["restart -- k31-a.service"]
    # an inactive unit is started whatever changed, once
    _, calls = k31_units(tmp_path, [unit_a(tmp_path)], {**STATES, "k31-a": ("enabled", "inactive")},
                            files=unit_files(tmp_path, "[Service]\n", "A=3\n", "x: 3\n"))
    assert calls == ["start -- k31-a.service"]


@needs_root
def test_files_an_earlier_run_changed_restart_their_units_without_another_daemon_reload(tmp_path):
    """`changed`: the secret files' no_log run before, or the first group's run that already reloaded systemd for
    every unit file (an engine's decodes start on every host before its prefills)."""
    files = unit_files(tmp_path, "[Service]\n", "A=1\n", "x: 1\n")
    k31_units(tmp_path, [unit_a(tmp_path)], STATES, files=files)
    for earlier in ("k31-a.env", "k31-a.service"):
        result, calls = k31_units(tmp_path, [unit_a(tmp_path)], STATES, files=files,
                                     changed=[str(tmp_path / earlier)])
        assert result["changed_files"] == [] and calls == ["restart -- k31-a.service"]
    _, calls = k31_units(tmp_path, [unit_a(tmp_path)], STATES, files=files, changed=[str(tmp_path / "k31-a.yml")])
    assert calls == ["reload -- k31-a.service"]


@needs_root
def test_check_mode_with_files_reports_the_writes_and_the_restarts_and_does_neither(tmp_path):
    files = unit_files(tmp_path, "[Service]\n", "A=1\n", "x: 1\n")
    result, calls = k31_units(tmp_path, [unit_a(tmp_path)], STATES, files=files, check=True)
    assert result["changed"] and result["changed_files"] == [f["dest"] for f in files]
    assert result["acted"] == ["systemd daemon-reload", "k31-a restarted"]
    assert calls == [] and not any(Path(f["dest"]).exists() for f in files)


@needs_root
def test_a_failed_start_after_the_writes_names_the_unit_and_the_files_written(tmp_path):
    files = [{"dest": str(tmp_path / "k31-broken.service"), "content": "[Service]\n", "mode": "0644"}]
    states = {**STATES, "k31-broken": ("enabled", "inactive")}
    result, _ = k31_units(tmp_path, [{"name": "k31-broken", "unit_file": files[0]["dest"]}], states, files=files)
    assert result["failed"] and "k31-broken.service" in result["msg"]
    assert result["changed_files"] == [files[0]["dest"]] and result["acted"] == ["systemd daemon-reload"]


@needs_root
def test_a_unit_file_written_for_a_later_run_reloads_systemd_in_the_run_that_wrote_it(tmp_path):
    """An engine host's write run starts only its decodes (or nothing, on a prefill host) and writes every unit file;
    a prefill's changed unit file reloads systemd there, so the next task's restart runs the new unit."""
    files = [{"dest": str(tmp_path / "k31-a.service"), "content": "[Service]\n", "mode": "0644"}]
    result, calls = k31_units(tmp_path, [], STATES, files=files, unit_files=[files[0]["dest"]])
    assert calls == ["daemon-reload"] and result["acted"] == ["systemd daemon-reload"]
    _, calls = k31_units(tmp_path, [unit_a(tmp_path)], STATES, changed=[files[0]["dest"]])
    assert calls == ["restart -- k31-a.service"]
    # unchanged, or not one of the unit files: no reload, and no systemctl call at all without units
    assert k31_units(tmp_path, [], STATES, files=files, unit_files=[files[0]["dest"]])[1] == []
    files[0]["content"] = "[Service]\nX=1\n"
    assert k31_units(tmp_path, [], STATES, files=files)[1] == []
