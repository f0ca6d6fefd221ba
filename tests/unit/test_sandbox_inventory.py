"""The sandbox inventory follows the inventory contract, and Ansible reads it as meant."""

import shlex
from pathlib import Path

import pytest
import yaml
from ansible.inventory.manager import InventoryManager
from ansible.parsing.dataloader import DataLoader
from ansible.vars.manager import VariableManager

from k31deploy.sandbox.inventory import build_inventory, dump_inventory, known_hosts_text, ssh_common_args
from k31deploy.sandbox.shapes import resolve_shape

KEY = Path("/state dir/sandbox/x/id_ed25519")
KNOWN = Path("/state dir/sandbox/x/known_hosts")


def _addresses(shape):
    return {host.name: f"10.231.7.{10 + i}" for i, host in enumerate(shape.hosts)}


def _load(tmp_path, shape):
    path = tmp_path / "inventory.yml"
    path.write_text(dump_inventory(build_inventory(shape, _addresses(shape), KEY, KNOWN)))
    inventory = InventoryManager(loader=DataLoader(), sources=[str(path)])
    return path, inventory, VariableManager(loader=DataLoader(), inventory=inventory)


def test_groups_hosts_and_addresses_of_1p1d(tmp_path):
    shape = resolve_shape("mi355x-1p1d", None)
    _, inventory, _ = _load(tmp_path, shape)
    groups = inventory.get_groups_dict()
    assert groups["k31_prefill"] == ["prefill0"]
    assert groups["k31_decode"] == ["decode0"]
    assert groups["k31_router"] == ["router0"]
    # Empty engine groups exist, so playbooks can index groups['k31_unified'].
    assert groups["k31_unified"] == []
    assert "k31_mooncake_master" not in groups
    hostvars = inventory.get_host("decode0").get_vars()
    assert hostvars["ansible_host"] == "10.231.7.11"
    assert "k31_server" not in hostvars


def test_connection_and_knob_vars(tmp_path):
    shape = resolve_shape("gb300-pd", None)
    _, inventory, variables = _load(tmp_path, shape)
    hostvars = variables.get_vars(host=inventory.get_host("prefill0-t1"))
    assert hostvars["ansible_user"] == "root"
    assert hostvars["ansible_python_interpreter"] == "/usr/bin/python3"
    assert hostvars["ansible_ssh_private_key_file"] == str(KEY)
    assert hostvars["k31_platform"] == "gb300"
    assert hostvars["k31_router"] == "dynamo"
    assert hostvars["k31_max_running_requests"] == 64
    assert hostvars["k31_speculative"] == "dflash"
    assert hostvars["k31_engine_runtime"] == "standin"


def test_trays_of_one_server_share_k31_server_in_inventory_order(tmp_path):
    shape = resolve_shape("gb300-pd", None)
    path, inventory, _ = _load(tmp_path, shape)
    servers = {h.name: h.get_vars().get("k31_server") for h in inventory.get_hosts()}
    assert servers == {
        "prefill0-t0": "prefill0",
        "prefill0-t1": "prefill0",
        "decode0-t0": "decode0",
        "decode0-t1": "decode0",
        "router0": None,
    }
    # Node ranks follow inventory order: tray 0 before tray 1.
    assert inventory.get_groups_dict()["k31_prefill"] == ["prefill0-t0", "prefill0-t1"]
    assert path.read_text().startswith("---\n")


def test_ssh_args_check_host_keys_against_the_sandbox_file():
    args = shlex.split(ssh_common_args(KNOWN))
    options = dict(args[i + 1].split("=", 1) for i in range(0, len(args), 2) if args[i] == "-o")
    assert options["StrictHostKeyChecking"] == "yes"
    # The path has a space: it must survive Ansible's shlex split as one option.
    assert options["UserKnownHostsFile"] == str(KNOWN)
    assert options["GlobalKnownHostsFile"] == "/dev/null"


def test_inventory_is_plain_yaml_round_trip():
    shape = resolve_shape(None, 3)
    text = dump_inventory(build_inventory(shape, _addresses(shape), KEY, KNOWN))
    data = yaml.safe_load(text)
    assert list(data["all"]["children"]["k31_unified"]["hosts"]) == ["unified0", "unified1", "unified2"]
    assert data["all"]["vars"]["k31_agents"] == 16 and data["all"]["vars"]["k31_preflight_require_gpu"] is False


def test_known_hosts_lists_each_address_with_its_own_key():
    addresses = {"a": "10.231.7.10", "b": "10.231.7.11"}
    keys = {"a": "ssh-ed25519 AAAAkeyA root@a", "b": "ssh-ed25519 AAAAkeyB root@b"}
    assert known_hosts_text(addresses, keys) == ("10.231.7.10 ssh-ed25519 AAAAkeyA\n10.231.7.11 ssh-ed25519 AAAAkeyB\n")
    with pytest.raises(KeyError):
        known_hosts_text({"c": "10.231.7.12"}, keys)


@pytest.mark.parametrize("shape, router, files", [
    ("mi355x-1p1d", "sglang", {"router-api-key", "client", "client/ca.crt", "client/client.crt",
                               "client/client.key", "secrets.yml"}),
    ("gb300-pd", "dynamo", {"client", "client/ca.crt", "client/client.crt", "client/client.key", "secrets.yml"}),
])
def test_sandbox_secrets_are_the_credentials_its_endpoint_takes_made_once_and_private(tmp_path, shape, router,
                                                                                       files):
    from k31deploy import pki
    from k31deploy.sandbox.inventory import router_kind, sandbox_secrets

    assert router_kind(resolve_shape(shape, None)) == router
    data = sandbox_secrets(tmp_path, router)
    assert {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")} == files
    assert all(p.stat().st_mode & 0o077 == 0 for p in tmp_path.rglob("*"))
    assert pki.matches(data["k31_pki_ca_key"], data["k31_pki_ca_cert"])
    assert ("k31_router_api_key" in data) == (router != "dynamo")     # Dynamo checks certificates, not a key
    assert sandbox_secrets(tmp_path, router) == data                    # kept: a redeploy changes nothing
    # a client certificate for the Dynamo frontend, Prometheus and Alertmanager
    assert pki.renewal_reason((tmp_path / "client/client.crt").read_text(), data["k31_pki_ca_cert"],
                              ["k31-sandbox-client"]) is None


def test_a_sandbox_router_key_never_starts_with_a_dash(tmp_path, monkeypatch):
    # One token in 64 starts with '-'; SGLang would read that key, from the engines' --config file, as an option.
    import secrets

    from k31deploy.sandbox.inventory import sandbox_secrets

    tokens = iter(["-starts-with-a-dash", "--again", "Rk-fine"])
    monkeypatch.setattr(secrets, "token_urlsafe", lambda n: next(tokens))
    assert sandbox_secrets(tmp_path, "sglang")["k31_router_api_key"] == "Rk-fine"
