"""The sandbox's Ansible inventory (inventory contract in docs/architecture.md) and its known_hosts."""

from __future__ import annotations

import os
import secrets as secrets_
import shlex
from pathlib import Path
from typing import Any

import yaml

from k31deploy import pki
from k31deploy.recipe import from_mapping, resolve
from k31deploy.sandbox.shapes import GROUPS, Shape

# No GPUs, no serving image: engines run the CPU stand-in, the router and Dynamo frontend run from
# venvs built out of the wheelhouse (the roles' air-gapped path).
RUNTIME_VARS = {"k31_engine_runtime": "standin", "k31_router_runtime": "venv", "k31_dynamo_runtime": "venv",
                "k31_mooncake_store_runtime": "venv", "k31_preflight_require_gpu": False}


def ssh_common_args(known_hosts: Path) -> str:
    """Host keys are checked against the keys read out of each container, never accepted blindly."""
    options = {
        "UserKnownHostsFile": str(known_hosts),
        "GlobalKnownHostsFile": "/dev/null",
        "StrictHostKeyChecking": "yes",
        "IdentitiesOnly": "yes",
        "ControlMaster": "auto",
        "ControlPersist": "60s",
    }
    return " ".join(f"-o {shlex.quote(f'{key}={value}')}" for key, value in options.items())


def router_kind(shape: Shape) -> str:
    """What fronts the shape's engines (sglang, dynamo or none), as its plan says."""
    hosts = [from_mapping(h.name, list(h.groups), {"ansible_host": f"192.0.2.{i + 1}",
                                                    **({"k31_server": h.server} if h.server else {})})
             for i, h in enumerate(shape.hosts)]
    return (resolve(dict(shape.knobs), hosts, engine_check=False)["router"] or {}).get("kind", "none")


def sandbox_secrets(directory: Path, router: str) -> dict[str, str]:
    """The sandbox's own cluster CA and, where engines serve HTTP (not behind Dynamo, which checks client
    certificates instead of a key), the router API key: made once and kept (0600) so that redeploying the same
    sandbox changes nothing. A site keeps these in Ansible Vault (k31 pki init); a throwaway sandbox keeps them
    beside its inventory, which is 0600 too. For `k31 smoke`: the key is also in `router-api-key`
    (--api-key-file); `client/` holds the CA and a client certificate of it, what the Dynamo frontend (--ca-cert,
    --client-cert, --client-key), Prometheus and Alertmanager take."""
    path = directory / "secrets.yml"
    if path.is_file():
        return yaml.safe_load(path.read_text())
    ca = pki.new_ca("k31 sandbox CA")
    data = {"k31_pki_ca_cert": ca.cert, "k31_pki_ca_key": ca.key}
    client = pki.issue(ca, "k31-sandbox-client", ["k31-sandbox-client"])
    (directory / "client").mkdir(mode=0o700, exist_ok=True)
    files = {"client/ca.crt": ca.cert, "client/client.crt": client.cert, "client/client.key": client.key}
    if router != "dynamo":
        key = secrets_.token_urlsafe(24)
        while key.startswith("-"):    # SGLang reads its --config file as arguments: "-..." would be an option
            key = secrets_.token_urlsafe(24)
        data["k31_router_api_key"] = key
        files["router-api-key"] = data["k31_router_api_key"] + "\n"
    for name, text in {**files, "secrets.yml": yaml.safe_dump(data)}.items():    # secrets.yml last: it says done
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
    return data


def build_inventory(shape: Shape, addresses: dict[str, str], key_file: Path, known_hosts: Path,
                    secrets: dict[str, str] | None = None) -> dict:
    """Every engine/router group is present (empty ones too, so playbooks can index `groups`);
    `k31_server` only where hosts share a multi-node server."""
    all_vars: dict[str, Any] = {
        "ansible_user": "root",
        "ansible_python_interpreter": "/usr/bin/python3",
        "ansible_ssh_private_key_file": str(key_file),
        "ansible_ssh_common_args": ssh_common_args(known_hosts),
        **{f"k31_{knob}": value for knob, value in shape.knobs.items()},
        **RUNTIME_VARS,
        **(secrets or {}),
        **shape.role_vars,
    }
    children: dict[str, dict] = {}
    for group in GROUPS:
        hosts = {}
        for host in shape.hosts:
            if group in host.groups:
                hostvars = {"ansible_host": addresses[host.name]}
                if host.server:
                    hostvars["k31_server"] = host.server
                hosts[host.name] = hostvars
        if hosts:
            children[group] = {"hosts": hosts}
        elif group != "k31_mooncake_master":
            children[group] = {}
    return {"all": {"vars": all_vars, "children": children}}


def dump_inventory(inventory: dict) -> str:
    return "---\n" + yaml.safe_dump(inventory, sort_keys=False, default_flow_style=False)


def known_hosts_text(addresses: dict[str, str], host_keys: dict[str, str]) -> str:
    """One line per node: its address and the ed25519 public key it generated on first boot."""
    lines = []
    for host, address in addresses.items():
        keytype, key = host_keys[host].split()[:2]
        lines.append(f"{address} {keytype} {key}\n")
    return "".join(lines)
