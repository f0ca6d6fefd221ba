"""The converge stamp (k31deploy/stamp.py, roles/k31_stamp): what makes a deploy skip the host plays, and what
makes it run whole."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest
import yaml

from k31deploy import stamp

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "k31_stamp"
PLAN = {"servers": [{"name": "prefill0", "port": 30000}], "router": {"kind": "sglang"}}
VARS = {"prefill0": {"k31_server": "prefill0", "k31_engine_hf_token": "hf_secret", "ansible_host": "10.0.0.2"},
        "router0": {"k31_router_api_key": "key1"}}


@pytest.fixture
def project(tmp_path):
    """A copy of the parts of k31 the inputs digest reads, and a wheelhouse."""
    root = tmp_path / "k31"
    for name in ("roles", "playbooks", "filter_plugins"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "k31deploy").mkdir()
    (root / "k31deploy" / "stamp.py").write_text((ROOT / "k31deploy" / "stamp.py").read_text())
    (root / "deploy.yml").write_text((ROOT / "deploy.yml").read_text())
    wheelhouse = tmp_path / "wheelhouse"          # flat, as k31 wheelhouse build writes it
    wheelhouse.mkdir()
    (wheelhouse / "a-1.0-py3-none-any.whl").write_bytes(b"x" * 10)
    (wheelhouse / "router.txt").write_text("a==1.0\n")
    return root, wheelhouse


def digest(project, plan=PLAN, host_vars=VARS):
    root, wheelhouse = project
    return stamp.inputs_digest(plan, host_vars, root, wheelhouse)


def test_the_inputs_digest_is_the_same_for_the_same_inputs(project):
    assert digest(project) == digest(project) and len(digest(project)) == 64


@pytest.mark.parametrize("change", ["plan", "variable", "secret", "new variable", "code", "wheelhouse"])
def test_each_input_changes_the_digest(project, change):
    root, wheelhouse = project
    before = digest(project)
    plan, host_vars = json.loads(json.dumps(PLAN)), json.loads(json.dumps(VARS))
    if change == "plan":
        plan["servers"][0]["port"] = 30001
    elif change == "variable":
        host_vars["prefill0"]["k31_server"] = "prefill1"
    elif change == "secret":
        host_vars["router0"]["k31_router_api_key"] = "key2"
    elif change == "new variable":
        host_vars["router0"]["k31_router_port"] = 8001
    elif change == "code":
        path = root / "roles" / "k31_engine" / "templates" / "engine.sh.j2"
        path.write_text(path.read_text() + "\n# edited\n")
    elif change == "wheelhouse":
        (wheelhouse / "b-2.0-py3-none-any.whl").write_bytes(b"y")
    assert digest(project, plan, host_vars) != before


@pytest.mark.parametrize("name", ["k31_stamp_check", "k31_validate_plan", "ansible_host", "group_names",
                                  "k31_redeploy_targets", "k31_redeploy_batch"])
def test_what_only_chooses_whether_the_stamp_is_used_or_is_set_by_the_run_is_not_an_input(project, name):
    host_vars = json.loads(json.dumps(VARS))
    host_vars["prefill0"][name] = False
    assert digest(project, PLAN, host_vars) == digest(project)


def test_the_packs_a_deploy_writes_into_the_wheelhouse_are_not_an_input(project):
    """k31deploy.wheelhouse.pack writes packs/<set>.tar the first time a deploy copies a set: derived from the
    wheels, so the deploy after the one that packed is not whole for it."""
    _, wheelhouse = project
    before = digest(project)
    (wheelhouse / "packs").mkdir()
    (wheelhouse / "packs" / "router.tar").write_bytes(b"t" * 100)
    (wheelhouse / "packs" / "router.digest").write_text("0123")
    assert digest(project) == before


def test_compiled_files_are_not_code(project):
    root, _ = project
    before = digest(project)
    (root / "k31deploy" / "__pycache__").mkdir()
    (root / "k31deploy" / "__pycache__" / "stamp.cpython-311.pyc").write_bytes(b"\0")
    assert digest(project) == before


def read(state="s1", inputs="i1"):
    return {"state": state, "stamp": {"inputs": inputs, "state": "s1"}}


def test_settled_only_when_every_host_has_the_same_inputs_and_state():
    assert stamp.settled({"a": read(), "b": read()}, "i1") == {"settled": True, "why": []}


@pytest.mark.parametrize(("reads", "why"), [
    ({"a": read(), "b": read(state="s2")},
     "b: its files, units, firewall or images changed since its last whole deploy"),
    ({"a": read(inputs="i0"), "b": read()}, "a: the inputs changed since its last whole deploy"),
    ({"a": read(), "b": {"state": "s1", "stamp": None}}, "b: no record of a whole deploy"),
    ({"a": read(), "b": None}, "b: its state could not be read"),
    ({"a": read(), "b": {"state": None, "stamp": {"inputs": "i1", "state": "s1"}}}, "b: its state could not be read"),
])
def test_one_host_that_is_not_settled_makes_the_whole_deploy_run_and_is_named(reads, why):
    verdict = stamp.settled(reads, "i1")
    assert verdict["settled"] is False
    assert len(verdict["why"]) == 1 and verdict["why"][0].startswith(why)


def test_no_hosts_is_not_settled():
    assert stamp.settled({}, "i1")["settled"] is False


# The host-side script (roles/k31_stamp/templates/host-state.sh.j2), run here against a folder tree.
def host_state(tmp_path, mode, inputs="", image_clis=()):
    defaults = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    env.filters["quote"] = lambda s: "'" + str(s).replace("'", "'\"'\"'") + "'"
    text = env.from_string((ROLE / "templates" / "host-state.sh.j2").read_text()).render(
        mode=mode, inputs=inputs, k31_stamp_paths=[str(tmp_path / "etc")], k31_stamp_opt_dir=str(tmp_path / "opt"),
        k31_stamp_units=defaults["k31_stamp_units"], k31_stamp_file=str(tmp_path / "var" / "converged.json"),
        k31_stamp_image_clis=list(image_clis))
    path = f"{tmp_path / 'bin'}:{os.environ['PATH']}"
    done = subprocess.run(["bash", "-c", text], capture_output=True, text=True, check=True,
                          env={**os.environ, "PATH": path})
    return done.stdout.strip()


@pytest.fixture
def host(tmp_path):
    (tmp_path / "etc" / "k31").mkdir(parents=True)
    (tmp_path / "etc" / "k31" / "engine.env").write_text("A=1\n")
    (tmp_path / "opt" / "venv").mkdir(parents=True)
    return tmp_path


def test_the_state_is_stable_and_a_stamp_is_written_once_0600(host):
    assert json.loads(host_state(host, "read")) == {"state": None, "stamp": None}    # no stamp: nothing computed
    assert host_state(host, "write", "i1") == "changed"
    assert host_state(host, "write", "i1") == "unchanged"
    first = json.loads(host_state(host, "read"))
    assert len(first["state"]) == 64 and first["stamp"] == {"inputs": "i1", "state": first["state"]}
    assert json.loads(host_state(host, "read")) == first
    assert (host / "var" / "converged.json").stat().st_mode & 0o777 == 0o600
    assert host_state(host, "write", "i2") == "changed"


@pytest.mark.parametrize("drift", ["content", "mode", "new file", "removed file", "link", "venv removed"])
def test_any_drift_of_what_k31_manages_changes_the_state(host, drift):
    host_state(host, "write", "i1")
    before = json.loads(host_state(host, "read"))["state"]
    env_file = host / "etc" / "k31" / "engine.env"
    if drift == "content":
        env_file.write_text("A=2\n")
    elif drift == "mode":
        env_file.chmod(0o644 if env_file.stat().st_mode & 0o777 != 0o644 else 0o600)
    elif drift == "new file":
        (host / "etc" / "k31" / "extra.conf").write_text("")
    elif drift == "removed file":
        env_file.unlink()
    elif drift == "link":
        (host / "etc" / "k31" / "wants").symlink_to("/etc/systemd/system/k31-prefill0-r0.service")
    elif drift == "venv removed":
        (host / "opt" / "venv").rmdir()
    assert json.loads(host_state(host, "read"))["state"] != before


def test_the_copies_a_redeploy_keeps_for_its_roll_back_and_the_standins_start_record_are_not_drift(host):
    """k31 redeploy's stop keeps each live file as /etc/k31/NAME.prev (oncall/rollout.py step_files): a restart of
    what runs leaves the host as its last whole deploy left it, so the next deploy or redeploy may skip its work."""
    host_state(host, "write", "i1")
    before = json.loads(host_state(host, "read"))["state"]
    (host / "etc" / "k31" / "engine.env.prev").write_text("A=1\n")
    (host / "etc" / "k31" / "k31-decode0-r0.service.prev").write_text("[Unit]\n")
    (host / "etc" / "k31" / "k31-decode0-r0.standin.json").write_text('{"pid": 649}')    # the stand-in's own
    assert json.loads(host_state(host, "read"))["state"] == before
    (host / "etc" / "k31" / "engine.env.prev2").write_text("")
    assert json.loads(host_state(host, "read"))["state"] != before


def test_an_image_swapped_under_the_plans_name_is_drift(host):
    """The container CLIs' image lists are part of the state: a load or tag that points the plan's name at
    other content changes it (here a stand-in CLI prints its images from a file)."""
    (host / "bin").mkdir()
    cli = host / "bin" / "fakectl"
    images = host / "images.txt"
    cli.write_text(f"#!/bin/sh\n[ \"$1 $2 $3\" = \"images --no-trunc --format\" ] && cat {images}\n")
    cli.chmod(0o755)
    images.write_text("reg/k31:r1 <none> sha256:" + "a" * 64 + "\n")
    assert host_state(host, "write", "i1", ["fakectl", "absentctl"]) == "changed"
    before = json.loads(host_state(host, "read", image_clis=["fakectl", "absentctl"]))
    assert before["state"] == before["stamp"]["state"]
    images.write_text("reg/k31:r1 <none> sha256:" + "b" * 64 + "\n")
    after = json.loads(host_state(host, "read", image_clis=["fakectl", "absentctl"]))
    assert after["state"] != before["state"]
    # the defaults list both CLIs k31 runs images with
    assert yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())["k31_stamp_image_clis"] == ["podman", "docker"]
