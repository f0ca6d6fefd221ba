"""A host's firewall from the plan: each planned port open to its sources only, checked by real nft."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from k31deploy import firewall
from k31deploy.errors import K31Error
from k31deploy.recipe import from_mapping, resolve

ANY = ("0.0.0.0/0", "::/0")


def pd(router="sglang", **router_vars):
    hosts = [from_mapping("p0", ["k31_prefill"], {"ansible_host": "10.0.0.1"}),
             from_mapping("d0", ["k31_decode"], {"ansible_host": "10.0.0.2"}),
             from_mapping("r0", ["k31_router"], {"ansible_host": "10.0.0.9", **router_vars})]
    return resolve({"platform": "mi355x", "agents": 92, "router": router}, hosts)


def gb300():
    hosts = [from_mapping(f"{s}-t{t}", [f"k31_{s[:-1]}"], {"k31_server": s, "ansible_host": f"10.1.{i}.{t + 1}"})
             for i, s in enumerate(("prefill0", "decode0")) for t in range(2)]
    hosts.append(from_mapping("fe", ["k31_router"], {"ansible_host": "10.1.9.1", "k31_public_address": "192.0.2.1"}))
    return resolve({"platform": "gb300", "topology": "pd", "prefill_strategy": "low-latency",
                    "max_running_requests": 8}, hosts)


def by_port(rules):
    return {(r.ports, r.proto): r for r in rules}


def test_each_planned_port_is_open_to_the_cluster_and_the_endpoint_to_its_public_sources():
    plan = pd(k31_public_address="192.0.2.9")
    cluster = ("10.0.0.1/32", "10.0.0.2/32", "10.0.0.9/32")
    p0 = by_port(firewall.rules(plan, "p0", firewall.Settings()))
    assert p0[("30000", "tcp")].sources == cluster and p0[("8998", "tcp")].sources == cluster
    assert p0[("15000-17000", "tcp")].sources == ("10.0.0.1/32", "10.0.0.2/32")    # engines only
    assert p0[("22", "tcp")].sources == ANY
    r0 = by_port(firewall.rules(plan, "r0", firewall.Settings(public_sources=["198.51.100.0/24"])))
    assert r0[("8000", "tcp")].sources == ("198.51.100.0/24",)
    assert r0[("29000", "tcp")].sources == cluster                                   # metrics stay internal
    assert ("15000-17000", "tcp") not in r0                                          # not an engine host
    planned = {(e["port"], e["host"]) for e in plan["ports"]}
    for host in ("p0", "d0", "r0"):
        opened = {int(r.ports) for r in firewall.rules(plan, host, firewall.Settings()) if r.ports.isdigit()}
        assert opened - {22} == {port for port, h in planned if h == host}, host


def test_dynamo_control_planes_and_multi_node_peers():
    plan = gb300()
    fe = by_port(firewall.rules(plan, "fe", firewall.Settings()))
    cluster = tuple(f"{a}/32" for a in ("10.1.0.1", "10.1.0.2", "10.1.1.1", "10.1.1.2", "10.1.9.1", "192.0.2.1"))
    assert fe[("8000", "tcp")].sources == ANY
    assert set(fe[("2379", "tcp")].sources) <= set(cluster) and "10.1.0.1/32" in fe[("4222", "tcp")].sources
    tray = firewall.rules(plan, "prefill0-t0", firewall.Settings())
    # the request plane's whole range: each start of the worker takes the next port of it
    assert set(by_port(tray)[("29110-29125", "tcp")].sources) <= set(cluster)
    assert ("29110-29125", "tcp") not in by_port(firewall.rules(plan, "prefill0-t1", firewall.Settings()))
    assert "tcp dport 29110-29125 accept" in firewall.nftables(plan, "prefill0-t0", firewall.Settings())
    assert any(" port 29110:29125 proto tcp " in r for r in firewall.ufw(plan, "prefill0-t0", firewall.Settings()))
    peers = [r for r in tray if not r.ports]
    assert {r.proto for r in peers} == {"tcp", "udp"} and all(r.sources == ("10.1.0.2/32",) for r in peers)


def test_site_settings_are_networks_or_a_sentence():
    plan = pd()
    rules = firewall.rules(plan, "p0", firewall.Settings(
        cluster_sources=["10.0.0.0/16"], ssh_sources=["10.255.0.0/24"],
        extra=[{"ports": "9100", "sources": ["10.0.0.0/8"], "comment": "node exporter"}]))
    found = by_port(rules)
    assert found[("30000", "tcp")].sources == ("10.0.0.0/16",) and found[("22", "tcp")].sources == ("10.255.0.0/24",)
    assert found[("9100", "tcp")].comment == "node exporter"
    with pytest.raises(K31Error, match=r"k31_firewall_public_sources entry 'everyone' is not an IP address"):
        firewall.rules(plan, "r0", firewall.Settings(public_sources=["everyone"]))
    # the role's own check, behind the plan's: a port or protocol nftables would read as more statements
    for bad in ({"ports": "9100\n}\ntable inet evil {"}, {"ports": "9100", "proto": "tcp; drop"}):
        with pytest.raises(K31Error, match=r"^k31_firewall_extra entry .* is not valid; valid: a list of \{ports"):
            firewall.rules(plan, "p0", firewall.Settings(extra=[bad]))


def test_changes_add_missing_then_remove_only_k31s_stale_rules():
    assert firewall.changes(["a", "b"], ["b", "site", "old"], ["b", "old"]) == [
        {"op": "add", "rule": "a"}, {"op": "remove", "rule": "old"}]
    assert firewall.changes(["a"], ["a", "site"], ["a"]) == []


def test_backends_say_the_same_rules():
    plan = pd(k31_public_address="192.0.2.9")
    s = firewall.ruleset(plan, "r0", firewall.Settings(public_sources=["203.0.113.0/24"]))
    assert 'rule family="ipv4" source address="203.0.113.0/24" port port="8000" protocol="tcp" accept' in s["firewalld"]
    assert any(r.startswith("allow from 203.0.113.0/24 to any port 8000 proto tcp comment 'k31 sglang-router")
               for r in s["ufw"])
    assert "ip saddr { 203.0.113.0/24 } tcp dport 8000 accept" in s["nft"]
    assert s["nft"].splitlines()[1:3] == ["table inet k31", "delete table inet k31"]    # replaced whole
    assert "policy drop;" in s["nft"]


@pytest.mark.skipif(shutil.which("nft") is None, reason="nftables is installed by scripts/system-packages")
@pytest.mark.parametrize("host", ["p0", "d0", "r0", "prefill0-t1", "fe"])
def test_nft_accepts_every_rendered_table(tmp_path, host):
    plan = gb300() if host in ("prefill0-t1", "fe") else pd()
    path = tmp_path / "k31.nft"
    path.write_text(firewall.nftables(plan, host, firewall.Settings(extra=[{"ports": "9100", "comment": 'a "b" c'}])))
    proc = subprocess.run(["nft", "-c", "-f", str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
