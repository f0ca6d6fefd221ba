"""library/k31_files.py writes a role's rendered files in one module run per host (k31_unit, the engine's tools). Run
here as Ansible runs it (its arguments from a file): each file written only when it differs, atomically, checked by
its `validate` first, mode and owner fixed, nothing under --check, a diff under --diff, and no content echoed back
into the run records."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MODULE = Path(__file__).resolve().parents[2] / "library" / "k31_files.py"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the module makes its files root's (k31 runs as root)")


def k31_files(tmp_path: Path, files: list[dict], *, check: bool = False, diff: bool = False,
              dirs: list[dict] | None = None) -> dict:
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {"files": files, "_ansible_check_mode": check,
                                                         "_ansible_diff": diff, **({"dirs": dirs} if dirs else {})}}))
    done = subprocess.run([sys.executable, str(MODULE), str(args)], capture_output=True, text=True, check=False)
    return json.loads(done.stdout)


def test_writes_what_differs_creates_directories_and_a_second_run_changes_nothing(tmp_path):
    env, script = tmp_path / "etc/k31/a.env", tmp_path / "lib/k31/run.sh"
    files = [{"dest": str(env), "content": "A=1\n", "mode": "0600"},
             {"dest": str(script), "content": "#!/bin/sh\nexit 0\n", "mode": "0755"}]
    first = k31_files(tmp_path, files)
    assert first["changed"] and first["changed_files"] == [str(env), str(script)]
    assert env.read_text() == "A=1\n" and script.read_text() == "#!/bin/sh\nexit 0\n"
    assert (env.stat().st_mode & 0o7777, script.stat().st_mode & 0o7777) == (0o600, 0o755)
    assert env.parent.stat().st_mode & 0o7777 == 0o755
    again = k31_files(tmp_path, files)
    assert not again["changed"] and again["changed_files"] == []
    files[0]["content"] = "A=2\n"
    third = k31_files(tmp_path, files)
    assert third["changed_files"] == [str(env)] and env.read_text() == "A=2\n"
    assert sorted(p.name for p in env.parent.iterdir()) == ["a.env"]    # no temporary file left


def test_a_wrong_mode_alone_is_fixed_and_reported(tmp_path):
    dest = tmp_path / "a.env"
    dest.write_text("A=1\n")
    dest.chmod(0o644)
    result = k31_files(tmp_path, [{"dest": str(dest), "content": "A=1\n", "mode": "0600"}])
    assert result["changed_files"] == [str(dest)] and dest.stat().st_mode & 0o7777 == 0o600


def test_check_mode_writes_nothing_and_diff_mode_shows_each_change(tmp_path):
    dest, new = tmp_path / "a.sh", tmp_path / "sub/b.sh"
    dest.write_text("old\n")
    files = [{"dest": str(dest), "content": "new\n", "mode": "0644"},
             {"dest": str(new), "content": "b\n", "mode": "0644"}]
    result = k31_files(tmp_path, files, check=True, diff=True)
    assert result["changed_files"] == [str(dest), str(new)]
    assert dest.read_text() == "old\n" and not new.parent.exists()
    assert [(d["before_header"], d["before"], d["after"]) for d in result["diff"]] == [
        (str(dest), "old\n", "new\n"), (str(new), "", "b\n")]


def test_a_file_failing_its_validate_leaves_the_old_one_and_no_temporary_file(tmp_path):
    dest = tmp_path / "rules.nft"
    dest.write_text("good\n")
    result = k31_files(tmp_path, [{"dest": str(dest), "content": "bad\n", "mode": "0644",
                                   "validate": "grep -q good %s"}])
    assert result["failed"] and str(dest) in result["msg"] and "grep -q good" in result["msg"]
    assert "bad" not in json.dumps(result["invocation"])    # a failure echoes no content either
    assert dest.read_text() == "good\n" and [p.name for p in tmp_path.iterdir() if p.name != "args.json"] == [
        "rules.nft"]
    ok = k31_files(tmp_path, [{"dest": str(dest), "content": "good too\n", "mode": "0644",
                               "validate": "grep -q good %s"}])
    assert ok["changed_files"] == [str(dest)] and dest.read_text() == "good too\n"


def test_the_result_names_the_files_but_never_repeats_their_content(tmp_path):
    secret = "k31-test-secret-9e2f"
    result = k31_files(tmp_path, [{"dest": str(tmp_path / "k.yaml"), "content": f"api-key: {secret}\n",
                                   "mode": "0600"}])
    assert result["invocation"] == {"module_args": {"files": [str(tmp_path / "k.yaml")]}}
    assert secret not in json.dumps(result)


def test_a_relative_dest_is_refused(tmp_path):
    result = k31_files(tmp_path, [{"dest": "etc/k31/a.env", "content": "", "mode": "0600"}])
    assert result["failed"] and "absolute" in result["msg"]


def test_fix_parents_makes_the_files_directories_roots_with_dir_mode_and_is_off_by_default(tmp_path):
    """k31_unit's directories are root's 0755 whoever made them first (k31_pki makes /etc/k31 0700, which would
    keep the monitoring units' group from their configuration)."""
    etc = tmp_path / "etc"
    etc.mkdir(mode=0o700)
    etc.chmod(0o700)
    files = [{"dest": str(etc / "a.env"), "content": "A=1\n", "mode": "0600"}]
    left = k31_files(tmp_path, files)
    assert left["changed_files"] == [str(etc / "a.env")] and etc.stat().st_mode & 0o7777 == 0o700
    (etc / "a.env").unlink()
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {"files": files, "fix_parents": True,
                                                         "_ansible_check_mode": True}}))
    checked = json.loads(subprocess.run([sys.executable, str(MODULE), str(args)], capture_output=True, text=True,
                                        check=False).stdout)
    assert checked["changed_files"] == [str(etc), str(etc / "a.env")] and etc.stat().st_mode & 0o7777 == 0o700
    args.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": {"files": files, "fix_parents": True}}))
    fixed = json.loads(subprocess.run([sys.executable, str(MODULE), str(args)], capture_output=True, text=True,
                                      check=False).stdout)
    assert fixed["changed_files"] == [str(etc), str(etc / "a.env")] and etc.stat().st_mode & 0o7777 == 0o755


def test_a_files_group_is_set_and_an_unknown_group_is_refused(tmp_path):
    dest = tmp_path / "prometheus.yml"
    result = k31_files(tmp_path, [{"dest": str(dest), "content": "x\n", "mode": "0640", "group": "daemon"}])
    assert result["changed_files"] == [str(dest)] and (dest.stat().st_uid, dest.stat().st_gid) == (0, 1)
    assert k31_files(tmp_path, [{"dest": str(dest), "content": "x\n", "mode": "0640", "group": "daemon"}])[
        "changed_files"] == []
    refused = k31_files(tmp_path, [{"dest": str(dest), "content": "x\n", "mode": "0640", "group": "k31-no-such"}])
    assert refused["failed"] and "k31-no-such does not exist" in refused["msg"]


def test_dirs_are_made_or_fixed_first_and_a_src_file_is_copied_without_showing_it(tmp_path):
    """k31_monitoring's folders (group daemon here for prometheus) and the host certificate's copies in one run:
    a src's bytes are copied, never shown in a diff, and a second run changes nothing."""
    tls, key = tmp_path / "mon/tls", tmp_path / "pki/host.key"
    key.parent.mkdir()
    key.write_text("k31-test-key-77a1\n")
    dirs = [{"path": str(tmp_path / "mon"), "mode": "0750", "group": "daemon"},
            {"path": str(tls), "mode": "0750", "group": "daemon"}]
    files = [{"dest": str(tls / "host.key"), "src": str(key), "mode": "0640", "group": "daemon"}]
    checked = k31_files(tmp_path, files, dirs=dirs, check=True, diff=True)
    assert checked["changed_files"] == [str(tmp_path / "mon"), str(tls), str(tls / "host.key")]
    assert not (tmp_path / "mon").exists() and "k31-test-key-77a1" not in json.dumps(checked)
    first = k31_files(tmp_path, files, dirs=dirs, diff=True)
    assert first["changed_files"] == checked["changed_files"] and "k31-test-key-77a1" not in json.dumps(first)
    assert (tls / "host.key").read_text() == "k31-test-key-77a1\n"
    assert [(p.stat().st_mode & 0o7777, p.stat().st_gid) for p in (tmp_path / "mon", tls, tls / "host.key")] == [
        (0o750, 1), (0o750, 1), (0o640, 1)]
    assert k31_files(tmp_path, files, dirs=dirs)["changed_files"] == []
    tls.chmod(0o755)
    assert k31_files(tmp_path, files, dirs=dirs)["changed_files"] == [str(tls)] and tls.stat().st_mode & 0o777 == 0o750


def test_a_file_takes_one_of_content_content_base64_and_src_and_a_missing_src_is_named(tmp_path):
    both = k31_files(tmp_path, [{"dest": str(tmp_path / "a"), "content": "x", "src": "/etc/hostname", "mode": "0644"}])
    assert both["failed"] and "one of content, content_base64 and src" in both["msg"]
    none = k31_files(tmp_path, [{"dest": str(tmp_path / "a"), "mode": "0644"}])
    assert none["failed"] and "one of content, content_base64 and src" in none["msg"]
    missing = k31_files(tmp_path, [{"dest": str(tmp_path / "a"), "src": str(tmp_path / "none"), "mode": "0644"}])
    assert missing["failed"] and str(tmp_path / "none") in missing["msg"] and not (tmp_path / "a").exists()


def test_content_base64_writes_the_bytes_never_shows_them_and_refuses_what_is_not_base64(tmp_path):
    """The stand-in bundle (a tarball) goes to the hosts this way, in the module run, not a copy task's three steps."""
    data = bytes(range(256)) * 64
    dest = tmp_path / "bundle.tar"
    files = [{"dest": str(dest), "content_base64": base64.b64encode(data).decode(), "mode": "0644"}]
    result = k31_files(tmp_path, files, diff=True)
    assert result["changed_files"] == [str(dest)] and dest.read_bytes() == data and result["diff"] == []
    assert k31_files(tmp_path, files)["changed_files"] == []
    bad = k31_files(tmp_path, [{**files[0], "content_base64": "not base64!"}])
    assert bad["failed"] and "content_base64 is not base64" in bad["msg"] and dest.read_bytes() == data
