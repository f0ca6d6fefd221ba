"""roles/k31_unit runs every role's systemd units, the engines' ranks included: one include per host, one unit per
item of k31_unit_contexts. Pinned here: an engine rank's unit is byte for byte the one k31_engine's own template
wrote before (a changed unit restarts every engine on the next deploy), decodes start first, a staged render
writes below the stage root."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from unit_render import native, render_units, unit_include

from k31deploy import launch
from k31deploy.recipe import resolve

ROOT = Path(__file__).resolve().parents[2]
ENGINE_UNITS = ROOT / "roles/k31_engine/tasks/units.yml"
PLAN = resolve({"platform": "mi355x", "topology": "pd", "agents": 92})    # prefill0 on node0, decode0 on node1

# What roles/k31_engine/templates/engine.service.j2 rendered for k31-prefill0-r0 before the engine's units moved to
# k31_unit's service template: in a docker container, and in a venv behind Dynamo (no container lines; a Dynamo
# worker's stop is the drain's 630 s).
CONTAINER = """\
# Ansible managed
[Unit]
Description=k31 prefill server prefill0 rank 0
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
EnvironmentFile=/etc/k31/k31-prefill0-r0.env
ExecStart=/etc/k31/k31-prefill0-r0.sh
ExecStartPost=-/usr/local/lib/k31/k31-unit-started k31-prefill0-r0 prefill0 prefill 0
ExecStop=-docker stop --time 30 k31-prefill0-r0
# A container of this name left by a crash or an interrupted --rm cleanup (podman leaves it "Removing"
# when its `run` is stopped) would fail every start with "name already in use" (seen in the sandbox).
ExecStartPre=-docker rm --force k31-prefill0-r0
Restart=on-failure
RestartSec=5
TimeoutStopSec=60
LimitMEMLOCK=infinity
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target"""
CONTAINER_LINES = CONTAINER.splitlines()[11:15]
BEFORE = {
    ("container", False): CONTAINER,
    ("venv", True): "\n".join(line for line in CONTAINER.splitlines() if line not in CONTAINER_LINES)
                    .replace("TimeoutStopSec=60", "TimeoutStopSec=630"),
}


def engine_context(host: str, runtime: str = "container", dynamo: bool = False, stage: str = "") -> dict:
    """The engine include's variables, its stop timeout worked out by k31_engine's own "Look up this host's ranks"."""
    (lookup,) = [t for t in yaml.safe_load((ROOT / "roles/k31_engine/tasks/main.yml").read_text())
                 if t["name"] == "Look up this host's ranks in the plan"]
    scope = {"_k31_engine_behind_dynamo": dynamo, "k31_engine_stop_timeout": 60, "k31_engine_dynamo_stop_timeout": 630}
    stop = int(native(lookup["ansible.builtin.set_fact"]["_k31_engine_stop_timeout"].strip(), scope, {}))
    return {"_k31_engine_ranks": launch.host_ranks(PLAN, host), "_k31_engine_dynamo": dynamo,
            "_k31_engine_stop_timeout": stop, "k31_engine_runtime": runtime, "k31_engine_container_cli": "docker",
            "k31_engine_etc_dir": "/etc/k31", "k31_engine_stage_dir": stage, "k31_engine_hf_token": "",
            "k31_engine_nats_token": ""}


@pytest.mark.parametrize(("runtime", "dynamo"), list(BEFORE))
def test_an_engine_ranks_unit_is_the_one_before_the_move(runtime, dynamo):
    units = render_units(ENGINE_UNITS, **engine_context("node0", runtime, dynamo))
    assert units == {"k31-prefill0-r0": BEFORE[(runtime, dynamo)]}


def _settings(host: str, key: str, stage: str = "") -> list:
    task_vars = unit_include(ENGINE_UNITS)["vars"]
    scope = {**engine_context(host, stage=stage), **{k: v for k, v in task_vars.items() if k.startswith("_")}}
    return [native(task_vars[key], {**scope, "k31_unit_context": rank}, {}) for rank in scope["_k31_engine_ranks"]]


def test_decode_ranks_start_first_and_the_others_after():
    assert _settings("node1", "k31_unit_first") == [True]
    assert _settings("node0", "k31_unit_first") == [False]
    main = yaml.safe_load((ROOT / "roles/k31_unit/tasks/main.yml").read_text())
    starts = [t for t in main[1]["block"][-1]["block"]]
    assert [t["loop"] for t in starts] == ["{{ _k31_unit_list | selectattr('first') | list }}",
                                           "{{ _k31_unit_list | rejectattr('first') | list }}"]


def test_a_staged_render_writes_below_the_stage_root_and_the_unit_still_names_the_live_paths():
    (files,) = _settings("node0", "k31_unit_files", stage="/var/lib/k31/redeploy-next")
    dests = [f["dest"] for f in files if f["dest"]]
    assert "/var/lib/k31/redeploy-next/etc/k31/k31-prefill0-r0.env" in dests
    assert "/var/lib/k31/redeploy-next/etc/k31/k31-prefill0-r0.sh" in dests
    assert all(d.startswith("/var/lib/k31/redeploy-next/") for d in dests)
    units = render_units(ENGINE_UNITS, **engine_context("node0", stage="/var/lib/k31/redeploy-next"))
    assert "ExecStart=/etc/k31/k31-prefill0-r0.sh\n" in units["k31-prefill0-r0"]
