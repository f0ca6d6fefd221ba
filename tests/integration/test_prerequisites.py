"""`ansible-playbook deploy.yml` refuses a run whose prerequisites are missing in the validate play, on the
controller, with one sentence, before any host is touched: the hosts here do not exist (TEST-NET addresses),
so a run that reached one would report it unreachable. Real Ansible decides what an undefined or
undecryptable vault value looks like; the filter's other cases are unit-tested."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from recaps import recap
from site_secrets import write_site_vars

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PASSWORD = "vault-pw-Pq7"


MI355X = {"k31_platform": "mi355x", "k31_agents": 92}


def inventory(tmp_path: Path, extra: dict, knobs: dict = MI355X) -> Path:
    common = {**knobs, "k31_model_path": "/models/Kimi-K3.1-Pro", "k31_image": "reg.example/k31:rocm10",
              "ansible_ssh_common_args": "-o ConnectTimeout=2", **extra}
    doc = {"all": {"children": {
        "k31_prefill": {"hosts": {"p0": {"ansible_host": "192.0.2.1"}}},
        "k31_decode": {"hosts": {"d0": {"ansible_host": "192.0.2.2"}}},
        "k31_router": {"hosts": {"r0": {"ansible_host": "192.0.2.3"}}}}, "vars": common}}
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    write_site_vars(tmp_path, router_key=False)    # the site's cluster CA; each test gives the key it tests
    return path


def vaulted(tmp_path: Path, name: str, value: str) -> str:
    (tmp_path / "vault-pass").write_text(PASSWORD)
    return subprocess.run([str(BIN / "ansible-vault"), "encrypt_string", "--vault-password-file", "vault-pass", value,
                           "--name", name], cwd=tmp_path, capture_output=True, text=True, check=True).stdout


def deploy(tmp_path: Path, inv: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_CALLBACK_RESULT_FORMAT": "json",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([str(BIN / "ansible-playbook"), "-i", str(inv), str(REPO / "deploy.yml"), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def refused_before_any_host(done: subprocess.CompletedProcess) -> str:
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode != 0, out[-2000:]
    assert set(recap(done.stdout)) == {"localhost"}, out[-2000:]  # no engine or router host was reached
    assert "Refuse a run whose prerequisites are missing" in out
    return out


def test_deploy_without_a_wheelhouse_says_to_build_it_before_touching_a_host(tmp_path):
    missing = tmp_path / "wheelhouse"
    done = deploy(tmp_path, inventory(tmp_path, {"k31_router_runtime": "venv", "k31_router_wheelhouse": str(missing)}))
    out = refused_before_any_host(done)
    assert (f"error: the router runs from a venv (k31_router_runtime=venv on r0), but wheelhouse {missing} does "
            f"not exist; run `k31 wheelhouse build --set router --dest {missing}`") in out
    assert "JSON" not in out


def test_an_undefined_vault_reference_is_named(tmp_path):
    inv = inventory(tmp_path, {"k31_router_api_key": "{{ vault_k31_router_api_key }}"})
    out = refused_before_any_host(deploy(tmp_path, inv))
    assert ("error: k31_router_api_key on p0, d0, r0, localhost cannot be resolved ('vault_k31_router_api_key' is "
            "undefined); pass the vaulted vars file that defines it (-e @secrets.yml)") in out


def test_a_vaulted_value_without_its_password_is_named_and_with_it_validation_passes(tmp_path):
    (tmp_path / "secrets.yml").write_text("---\n" + vaulted(tmp_path, "vault_k31_router_api_key", "rk-7f3a9c21"))
    inv = inventory(tmp_path, {"k31_router_api_key": "{{ vault_k31_router_api_key }}"})
    # An inline !vault value decrypts only when used (a vaulted vars file is refused by Ansible at load time).
    inline = vaulted(tmp_path, "k31_engine_hf_token", "hf_token_9d8e7f")
    inv.write_text(inv.read_text() + "".join(f"    {line}\n" for line in inline.splitlines()))
    (tmp_path / "wrong-pass").write_text("not-the-password")
    out = refused_before_any_host(deploy(tmp_path, inv, "--vault-password-file", "wrong-pass"))
    assert ("error: k31_engine_hf_token is vault-encrypted on p0, d0, r0, localhost but could not be decrypted"
            in out and "give its vault password (--vault-password-file FILE or --ask-vault-pass)" in out)
    assert "error: k31_router_api_key on p0, d0, r0, localhost cannot be resolved" in out
    ok = deploy(tmp_path, inv, "-e", "@secrets.yml", "--vault-password-file", "vault-pass", "--tags", "always")
    assert ok.returncode == 0, ok.stdout[-3000:]
    assert "rk-7f3a9c21" not in ok.stdout + ok.stderr and "hf_token_9d8e7f" not in ok.stdout + ok.stderr


def test_a_missing_image_tarball_and_a_key_dynamo_would_ignore_are_each_one_sentence(tmp_path):
    b300 = {"k31_platform": "b300", "k31_topology": "pd", "k31_router": "dynamo", "k31_speculative": "none"}
    inv = inventory(tmp_path, {"k31_image_source": "tarball", "k31_image_tarball": str(tmp_path / "k31.tar"),
                               "k31_router_api_key": "rk-7f3a9c21"}, knobs=b300)
    out = refused_before_any_host(deploy(tmp_path, inv))
    assert f"error: k31_image_tarball={tmp_path / 'k31.tar'} (for p0, d0, r0) does not exist on the controller" in out
    assert ("error: k31_router_api_key is set (p0, d0, r0, localhost) but router=dynamo: the Dynamo frontend "
            "(ai-dynamo 1.6.1) has no API key check") in out


def test_the_wheelhouse_role_itself_fails_with_the_pack_sentence_not_a_parse_error(tmp_path):
    """Past validation (a wheelhouse removed mid-run, a play run alone), the role still says what to do."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "K31_TEST_WHEELHOUSE": str(tmp_path / "empty"), "K31_TEST_VENV": str(tmp_path / "venv"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    (tmp_path / "empty").mkdir()
    done = subprocess.run([str(BIN / "ansible-playbook"), "-i", "localhost,", "-e",
                           f"ansible_python_interpreter={sys.executable}",
                           str(REPO / "tests" / "integration" / "playbooks" / "wheelhouse.yml")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode != 0
    assert "Refuse a wheelhouse that lacks the set" in out
    assert f"error: wheelhouse {tmp_path / 'empty'} lacks " in out and "run `k31 wheelhouse build --set router`" in out
    assert "JSON" not in out and "from_json" not in out
