"""The plan's port table (k31deploy.recipe.ports): every port each host listens on, built once; a machine
listening twice on one port is refused before any host is touched; `k31 plan` shows the table."""

from __future__ import annotations

import re

import pytest
from recipe_helpers import argv, flag

from k31deploy import lane_cases as cases
from k31deploy.cli import main
from k31deploy.errors import K31Error
from k31deploy.recipe import resolve
from k31deploy.recipe.hosts import from_mapping
from k31deploy.recipe.ports import dp_attention_ports

GB300_PD = {"platform": "gb300", "topology": "pd", "max_running_requests": 8}
GB300_UNIFIED = {"platform": "gb300", "router": "none", "max_running_requests": 8}
WIDE_EP = {**GB300_PD, "wide_ep": True}


def listening(plan: dict, host: str) -> dict[int, str]:
    return {p["port"]: p["service"] for p in plan["ports"] if p["host"] == host}


def test_every_planned_case_has_a_collision_free_table_with_each_process_in_it():
    seen = 0
    for case_id, plan in cases.plans():
        table = plan["ports"]
        keys = {"host", "port", "proto", "service", "purpose"}
        assert all(set(p) == keys or set(p) == keys | {"port_last"} for p in table), case_id
        assert len({(p["host"], p["port"]) for p in table}) == len(table), case_id
        for s in plan["servers"]:
            for rank in s["ranks"]:
                assert s["port"] in listening(plan, rank["host"]), (case_id, s["name"])
            if s["bootstrap_port"]:
                assert listening(plan, s["ranks"][0]["host"])[s["bootstrap_port"]] == "sglang-bootstrap"
        if plan["router"]:
            assert plan["router"]["port"] in listening(plan, plan["router"]["host"]), case_id
        seen += 1
    assert seen > 1000


def test_the_table_names_every_service_and_its_purpose():
    plan = resolve({**GB300_PD, "kv_offload": "mooncake", "router": "sglang", "router_dialect": "launch_router"})
    assert listening(plan, "node0") == {
        8000: "sglang-router", 8998: "sglang-bootstrap", 9003: "mooncake-master-metrics",
        9090: "prometheus", 9093: "alertmanager", 9100: "node-exporter",
        20000: "torch-dist-init", 29000: "sglang-router-metrics", 30000: "sglang", 50051: "mooncake-master"}
    assert listening(plan, "node1") == {9100: "node-exporter", 30000: "sglang"}
    assert listening(plan, "node2") == {9100: "node-exporter", 20000: "torch-dist-init", 30100: "sglang"}
    purposes = {(p["host"], p["port"]): p["purpose"] for p in plan["ports"]}
    assert purposes[("node1", 30000)] == "prefill0 rank 1: /health"
    assert purposes[("node0", 20000)] == "prefill0: --dist-init-addr rendezvous of its 2 nodes"
    assert "MOONCAKE_MASTER" in purposes[("node0", 50051)]
    assert all("port_last" not in p for p in plan["ports"])
    dynamo = resolve({**GB300_PD, "monitoring": "none"})
    assert [p["port_last"] for p in dynamo["ports"] if "port_last" in p] == [29125] * 2    # one per server (rank 0)
    assert listening(dynamo, "node0") == {2379: "etcd", 4222: "nats", 8000: "dynamo-frontend", 8998: "sglang-bootstrap",
                                          20000: "torch-dist-init", 29110: "dynamo-request-plane",
                                          29101: "dynamo-response-plane", 30000: "dynamo-worker"}


def test_dp_attention_reserves_the_ports_after_dist_init():
    plan = resolve(WIDE_EP)
    decode0 = listening(plan, "node2")
    assert [p for p, s in decode0.items() if s == "sglang-dp-zmq"] == list(range(20001, 20007))
    assert dp_attention_ports(65535) == list(range(65528, 65534))    # SGLang counts down near the top


@pytest.mark.parametrize("knobs,port,other", [
    (GB300_UNIFIED, 30000, "unified0 \\(unified\\): OpenAI API"),
    (GB300_PD, 8998, "prefill0: PD bootstrap server"),
    (GB300_PD, 8000, "Dynamo frontend"),
    (GB300_PD, 2379, "Dynamo discovery"),
    (GB300_PD, 4222, "Dynamo event plane"),
    ({**GB300_PD, "router": "sglang", "router_dialect": "launch_router"}, 29000, "SGLang router: Prometheus"),
    ({**GB300_PD, "router": "sglang", "router_dialect": "launch_router"}, 8000, "SGLang router: OpenAI API"),
    ({**GB300_PD, "kv_offload": "mooncake"}, 50051, "Mooncake store master RPC"),
    ({**GB300_PD, "kv_offload": "mooncake"}, 9003, "Mooncake store master: Prometheus"),
])
def test_dist_init_port_colliding_on_its_host_is_refused(knobs, port, other):
    with pytest.raises(K31Error) as info:
        resolve({**knobs, "dist_init_port": port})
    message = str(info.value)
    assert message.startswith(f"port {port}/tcp on host node0 is planned twice, for "), message
    assert "--dist-init-addr rendezvous" in message
    assert "set dist_init_port to a port that no other service on host node0 uses (taken: " in message
    assert re.search(other, message), message


def test_a_dp_attention_port_colliding_is_refused_naming_dist_init_port():
    with pytest.raises(K31Error, match=r"port 30100/tcp on host node2 is planned twice, for decode0 \(decode\): "
                                       r"OpenAI API.* and for decode0: DP-attention ZMQ port .*set dist_init_port"):
        resolve({**WIDE_EP, "router": "sglang", "router_dialect": "launch_router", "dist_init_port": 30094})


def test_a_free_dist_init_port_is_used():
    plan = resolve({**GB300_PD, "dist_init_port": 21000})
    assert flag(argv(plan, "prefill"), "--dist-init-addr") == "node0:21000"
    assert listening(plan, "node0")[21000] == "torch-dist-init"


def test_hosts_sharing_an_address_are_one_machine():
    hosts = [from_mapping(n, ["k31_unified"], {"ansible_host": "10.0.0.1"}) for n in ("u0", "u1")]
    with pytest.raises(K31Error, match=r"port 30000/tcp on hosts u0 and u1 \(both at 10.0.0.1\) is planned twice, for "
                                       r"u0 \(unified\): .* and for u1 \(unified\): .*; give these hosts their own "
                                       r"addresses"):
        resolve({"platform": "mi355x", "agents": 16}, hosts)


def test_a_port_range_collides_with_any_port_inside_it():
    from k31deploy.recipe.ports import Listener, check
    plane = Listener("h", "10.0.0.1", 29110, "dynamo-request-plane", "worker requests", last=29125)
    check([plane, Listener("h", "10.0.0.1", 29126, "x", "next door")])
    with pytest.raises(K31Error, match=r"port 29117/tcp on host h is planned twice, for worker requests and for "
                                       r"metrics;"):
        check([plane, Listener("h", "10.0.0.1", 29117, "x", "metrics")])
    with pytest.raises(K31Error, match=r"port 29120/tcp on host h is planned twice"):
        check([Listener("h", "10.0.0.1", 29120, "x", "metrics"), plane])


def test_plan_text_shows_the_table(capsys):
    assert main(["plan", "--platform", "mi355x", "--agents", "92"]) == 0
    out = capsys.readouterr().out
    assert "ports (every port each host listens on):" in out
    assert "  node0  8998/tcp   sglang-bootstrap       prefill0: PD bootstrap server" in out
    assert "  node1  30100/tcp  sglang                 decode0 (decode): OpenAI API" in out
