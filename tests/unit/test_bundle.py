"""The stand-in engines' bundle (k31deploy/bundle.py) and the lookup k31_engine writes it with on the controller."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from k31deploy import bundle

REPO = Path(__file__).resolve().parents[2]


def test_same_sources_same_bytes_and_only_the_nodes_parts(tmp_path):
    first, second = tmp_path / "a.tar", tmp_path / "b.tar"
    assert bundle.write_bundle(first)[0] and bundle.write_bundle(second)[0]
    assert first.read_bytes() == second.read_bytes()
    changed, digest = bundle.write_bundle(first)
    assert not changed and digest == hashlib.sha256(first.read_bytes()).hexdigest()[:16]
    with tarfile.open(first) as tar:
        names = tar.getnames()
        assert {m.mtime for m in tar.getmembers()} == {0}
    assert "k31deploy/standin/__init__.py" in names and "k31deploy/data/flags.yaml" in names
    assert not [n for n in names if "recipe/" in n or n.endswith(".pyc") or "__pycache__" in n]


def test_the_role_writes_it_in_the_controllers_process_once_and_reports_what_a_host_records(tmp_path):
    """The lookup through Ansible itself (the role's plugin dir, as include_role loads it): its digest is the
    bundle's, a second run rewrites nothing, a changed file changes the digest."""
    dest = tmp_path / "k31deploy.tar"
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
           "ANSIBLE_LOOKUP_PLUGINS": str(REPO / "roles/k31_engine/lookup_plugins"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0",
           "ANSIBLE_CALLBACK_RESULT_FORMAT": "json"}

    def lookup(options: str = "") -> dict:
        done = subprocess.run([str(Path(sys.executable).parent / "ansible"), "localhost", "-m", "debug", "-a",
                               f"msg={{{{ lookup('k31_bundle', '{dest}'{options}) | to_json }}}}"],
                              capture_output=True, text=True, env=env, cwd=REPO, timeout=120, check=True)
        return json.loads(json.loads(done.stdout.split("=>", 1)[1])["msg"])

    made = lookup()
    assert made == {"changed": True, "digest": hashlib.sha256(dest.read_bytes()).hexdigest()[:16]}
    assert lookup() == {**made, "changed": False}
    # base64: the bytes too, for k31_files to write on a host (the copy task's stat and transfer spared)
    assert lookup(", base64=true") == {**made, "changed": False,
                                       "base64": base64.b64encode(dest.read_bytes()).decode()}
    dest.write_bytes(b"another version")
    assert lookup() == {**made, "changed": True}
