"""Dynamo's discovery and event plane (k31deploy.discovery): etcd's command line and NATS's configuration as
k31_dynamo writes them, pinned to the byte, since a changed unit or config restarts etcd / NATS on a deploy."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jinja2
import pytest
from ansible.errors import AnsibleFilterError
from unit_render import render_units

from k31deploy import discovery
from k31deploy.errors import K31Error
from k31deploy.recipe import from_mapping, resolve

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles/k31_dynamo"
_spec = importlib.util.spec_from_file_location("k31_dynamo_filters", ROLE / "filter_plugins/k31_dynamo.py")
_plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_plugin)
FILTERS = _plugin.FilterModule().filters()

GB300_PD = {"platform": "gb300", "topology": "pd", "prefill_strategy": "low-latency", "decode_strategy": "balanced",
            "max_running_requests": 64}
TOKEN = "e6" * 32


def gb300_plan(router_address: str = "10.0.0.5") -> dict:
    """gb300-pd (Dynamo) on an inventory, the router host at `router_address`."""
    hosts = [from_mapping(name, [group], {"ansible_host": f"10.0.0.{i}", "k31_server": server})
             for i, (name, group, server) in enumerate([("p0", "k31_prefill", "prefill0"),
                                                        ("p1", "k31_prefill", "prefill0"),
                                                        ("d0", "k31_decode", "decode0"),
                                                        ("d1", "k31_decode", "decode0")], 1)]
    hosts.append(from_mapping("r0", ["k31_router"], {"ansible_host": router_address}))
    return resolve(GB300_PD, hosts)


def test_etcd_command_line():
    assert discovery.etcd_argv(gb300_plan(), "/var/lib/k31") == [
        "/usr/bin/etcd", "--name", "k31", "--data-dir", "/var/lib/k31/etcd",
        "--listen-client-urls", "https://10.0.0.5:2379,https://127.0.0.1:2379",
        "--advertise-client-urls", "https://10.0.0.5:2379",
        "--cert-file", "/etc/k31/pki/host.crt", "--key-file", "/etc/k31/pki/host.key",
        "--client-cert-auth", "--trusted-ca-file", "/etc/k31/pki/ca.crt",
        "--listen-peer-urls", "http://127.0.0.1:2380"]


def test_etcd_urls_bracket_ipv6():
    argv = discovery.etcd_argv(gb300_plan("fd00::5"), "/srv/k31")
    assert argv[argv.index("--listen-client-urls") + 1] == "https://[fd00::5]:2379,https://127.0.0.1:2379"
    assert argv[argv.index("--advertise-client-urls") + 1] == "https://[fd00::5]:2379"
    assert argv[argv.index("--data-dir") + 1] == "/srv/k31/etcd"


def render(name: str, **context) -> str:
    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined)    # Ansible's template settings
    env.filters.update(FILTERS)
    text = (ROLE / "templates" / name).read_text(encoding="utf-8")
    return env.from_string(text).render(ansible_managed="Ansible managed", **context)


def discovery_unit(name: str, **context) -> str:
    """The unit tasks/discovery.yml has role k31_unit write for `name`."""
    return render_units(ROLE / "tasks/discovery.yml", FILTERS, k31_dynamo_etc_dir="/etc/k31", **context)[name]


def test_etcd_unit_is_the_one_before_the_move():
    # Byte for byte the unit the template wrote itself before the command moved to Python (and before the unit
    # moved to k31_unit's one service template): a change would restart etcd on the next deploy.
    unit = discovery_unit("k31-etcd", _k31_plan=gb300_plan(),
                          k31_dynamo_state_dir="/var/lib/k31")
    assert unit == """\
# Ansible managed
[Unit]
Description=k31 etcd (Dynamo discovery) on the cluster address; clients show a certificate of the k31 cluster CA
After=network-online.target

[Service]
ExecStart=/usr/bin/etcd --name k31 --data-dir /var/lib/k31/etcd \\
  --listen-client-urls https://10.0.0.5:2379,https://127.0.0.1:2379 \\
  --advertise-client-urls https://10.0.0.5:2379 \\
  --cert-file /etc/k31/pki/host.crt --key-file /etc/k31/pki/host.key \\
  --client-cert-auth --trusted-ca-file /etc/k31/pki/ca.crt \\
  --listen-peer-urls http://127.0.0.1:2380
Restart=on-failure

[Install]
WantedBy=multi-user.target"""


def test_nats_conf_is_the_one_before_the_move():
    conf = render("k31-nats.conf.j2", _k31_plan=gb300_plan("fd00::5"),
                  k31_dynamo_nats_token=TOKEN)
    assert conf == f"""\
# Ansible managed
# NATS for the Dynamo event plane on the cluster address: TLS with client certificates of the k31
# cluster CA (verify), and a token derived from the CA key (k31_pki_secret) that clients send as
# NATS_AUTH_TOKEN. Holds a secret: 0600.
host: "fd00::5"
port: 4222
tls {{
  cert_file: "/etc/k31/pki/host.crt"
  key_file: "/etc/k31/pki/host.key"
  ca_file: "/etc/k31/pki/ca.crt"
  verify: true
}}
authorization {{
  token: "{TOKEN}"
}}"""


@pytest.mark.parametrize("knobs", [{"platform": "mi355x", "agents": 92}, {**GB300_PD, "router": "sglang"}])
def test_only_a_dynamo_plan_has_discovery(knobs):
    plan = resolve(knobs)
    with pytest.raises(K31Error, match=r"^Dynamo's etcd and NATS run only where the plan has router=dynamo .* "
                                       r"this plan has router=sglang$"):
        discovery.etcd_argv(plan, "/var/lib/k31")
    with pytest.raises(AnsibleFilterError, match=r"^error: Dynamo's etcd and NATS"):
        FILTERS["k31_nats_conf"](plan, TOKEN)


@pytest.mark.parametrize("state_dir", ["var/lib/k31", "/var/lib/k31 x", "/var/%h", "/var/$HOME", "/a/../b", ""])
def test_a_state_dir_that_cannot_go_into_the_unit_is_refused(state_dir):
    with pytest.raises(AnsibleFilterError, match=r"^error: k31_dynamo_state_dir=.* is not valid; valid: an absolute"):
        FILTERS["k31_etcd_exec_start"](gb300_plan(), state_dir)


@pytest.mark.parametrize("token", ["", 'a"b', "a\\b", "a\nb"])
def test_a_nats_token_that_would_break_the_config_is_refused(token):
    with pytest.raises(K31Error, match=r"^k31_dynamo_nats_token is empty or holds a quote"):
        discovery.nats_conf(gb300_plan(), token)


def test_every_etcd_flag_is_registered(monkeypatch):
    from k31deploy.catalog import flag_registry
    registry = dict(flag_registry())
    registry["etcd"] = {k: v for k, v in registry["etcd"].items() if k != "--client-cert-auth"}
    monkeypatch.setattr(discovery, "flag_registry", lambda: registry)
    with pytest.raises(AssertionError, match=r"flag --client-cert-auth is not registered in data/flags.yaml \[etcd\]"):
        discovery.etcd_argv(gb300_plan(), "/var/lib/k31")


def test_filters_have_docs():
    assert set(FILTERS) == {"k31_etcd_exec_start", "k31_nats_conf"}
    for name in FILTERS:
        assert (ROLE / "filter_plugins" / f"{name}.yml").is_file(), name
