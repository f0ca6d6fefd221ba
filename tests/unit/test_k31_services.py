"""library/k31_services.py brings a host's units to their states in one module run (k31_unit, k31_monitoring). Run
here as Ansible runs it, against a stand-in `systemctl` on PATH that answers `show` from a state file and records
every other call: every unit enabled; a unit not running is started, once, whatever its state asks; `restarted`
and `reloaded` act on a running one; one daemon-reload first when asked; nothing done under --check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

MODULE = Path(__file__).resolve().parents[2] / "library" / "k31_services.py"

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


def k31_services(tmp_path: Path, units: list[dict], states: dict[str, tuple[str, str]], *,
                 daemon_reload: bool = False, check: bool = False) -> tuple[dict, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "systemctl").write_text(SYSTEMCTL)
    (bin_dir / "systemctl").chmod(0o755)
    (tmp_path / "states").write_text("".join(f"{n}.service {f} {a}\n" for n, (f, a) in states.items()))
    calls = tmp_path / "calls"
    calls.write_text("")
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {"units": units, "daemon_reload": daemon_reload,
                                                         "_ansible_check_mode": check}}))
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "K31_TEST_STATES": str(tmp_path / "states"), "K31_TEST_CALLS": str(calls)}
    done = subprocess.run([sys.executable, str(MODULE), str(args)], capture_output=True, text=True, env=env,
                          check=False)
    return json.loads(done.stdout), calls.read_text().splitlines()


STATES = {"k31-a": ("enabled", "active"), "k31-b": ("disabled", "inactive"), "k31-c": ("enabled", "failed"),
          "k31-d": ("enabled", "active")}


def test_each_unit_is_enabled_and_running_and_a_running_one_restarts_or_reloads_as_asked(tmp_path):
    units = [{"name": "k31-a", "state": "restarted"}, {"name": "k31-b", "state": "restarted"},
             {"name": "k31-c", "state": "reloaded"}, {"name": "k31-d", "state": "reloaded"}]
    result, calls = k31_services(tmp_path, units, STATES, daemon_reload=True)
    assert calls == ["daemon-reload", "restart -- k31-a.service", "enable -- k31-b.service", "start -- k31-b.service",
                     "start -- k31-c.service", "reload -- k31-d.service"]
    assert result["changed"] and result["acted"] == ["systemd daemon-reload", "k31-a restarted", "k31-b enabled",
                                                     "k31-b started", "k31-c started", "k31-d reloaded"]


def test_started_leaves_a_running_enabled_unit_alone(tmp_path):
    result, calls = k31_services(tmp_path, [{"name": "k31-a", "state": "started"}], STATES)
    assert (result["changed"], result["acted"], calls) == (False, [], [])


def test_check_mode_reports_what_it_would_do_and_does_nothing(tmp_path):
    units = [{"name": "k31-a", "state": "started"}, {"name": "k31-b", "state": "started"}]
    result, calls = k31_services(tmp_path, units, STATES, daemon_reload=True, check=True)
    assert result["changed"] and result["acted"] == ["systemd daemon-reload", "k31-b enabled", "k31-b started"]
    assert calls == []


def test_a_failed_start_names_the_unit_and_what_was_done_before(tmp_path):
    states = {**STATES, "k31-broken": ("enabled", "inactive")}
    result, _ = k31_services(tmp_path, [{"name": "k31-a", "state": "restarted"}, {"name": "k31-broken"}], states)
    assert result["failed"] and "k31-broken.service" in result["msg"] and "Job for" in result["msg"]
    assert result["acted"] == ["k31-a restarted"]
