"""The typed plan (k31deploy/plan.py): every plan the resolver writes reads back, field for field, and a
document that is no k31 plan is refused with the key that is wrong."""

from __future__ import annotations

import copy
import json
from dataclasses import fields
from pathlib import Path

import pytest
from recipe_helpers import plan as resolve_plan

from k31deploy.errors import K31Error
from k31deploy.plan import EngineSettings, Plan, Rank, Server

GOLDEN = Path(__file__).parent / "golden"

SHAPES = {
    "gb300 pd dynamo": dict(platform="gb300", topology="pd", agents=64),
    "mi355x pd sglang mooncake": dict(platform="mi355x", topology="pd", agents=92, kv_offload="mooncake"),
    "mi355x unified monitoring": dict(platform="mi355x", agents=48, monitoring="prometheus"),
    "b300 unified no router": dict(platform="b300", agents=16, router="none"),
}


def _check(doc: dict, plan: Plan) -> None:
    """Each record holds what the document says."""
    assert (plan.model, plan.platform, plan.topology, plan.image) == (
        doc["model"], doc["platform"], doc["topology"], doc["image"])
    assert plan.hardware.family == doc["hardware"]["family"] and plan.hardware.nvl72 == doc["hardware"]["nvl72"]
    assert [s.name for s in plan.servers] == [s["name"] for s in doc["servers"]]
    for server, sdoc in zip(plan.servers, doc["servers"], strict=True):
        assert (server.role, server.port, server.bootstrap_port) == (sdoc["role"], sdoc["port"], sdoc["bootstrap_port"])
        assert {f.name: getattr(server.layout, f.name) for f in fields(server.layout)} == sdoc["layout"]
        assert server.settings is not None and server.settings.as_dict() == sdoc["settings"]
        assert dict(server.memory) == sdoc["memory"]
        for rank, rdoc in zip(server.ranks, sdoc["ranks"], strict=True):
            assert list(rank.argv) == rdoc["argv"] and dict(rank.env) == rdoc["env"]
            assert (rank.host, rank.address, rank.unit, rank.node_rank) == (
                rdoc["host"], rdoc["address"], rdoc["unit"], rdoc["node_rank"])
            assert rank.request_plane_ports == (tuple(rdoc["request_plane_ports"])
                                                if rdoc["request_plane_ports"] else None)
    if doc["router"]:
        assert plan.router is not None
        assert (plan.router.kind, plan.router.host, plan.router.port, list(plan.router.argv)) == (
            doc["router"]["kind"], doc["router"]["host"], doc["router"]["port"], doc["router"]["argv"])
    else:
        assert plan.router is None
    assert [(p.host, p.port, p.service) for p in plan.ports] == [(p["host"], p["port"], p["service"])
                                                                for p in doc["ports"]]
    assert (plan.pki is None) == (doc["pki"] is None) and (plan.monitoring is None) == (doc["monitoring"] is None)
    assert (plan.mooncake_master is None) == (doc["mooncake_master"] is None)


@pytest.mark.parametrize("path", sorted(GOLDEN.glob("*.json")), ids=lambda p: p.stem)
def test_every_golden_plan_reads_back(path):
    doc = json.loads(path.read_text())
    _check(doc, Plan.of(doc))


@pytest.mark.parametrize("name", SHAPES)
def test_deploy_shapes_read_back(name):
    doc = resolve_plan(**SHAPES[name])
    plan = Plan.of(doc)
    _check(doc, plan)
    assert Plan.of(plan) is plan    # a consumer handed a Plan reads it as it is


def test_records_answer_what_consumers_ask():
    doc = resolve_plan(**SHAPES["mi355x pd sglang mooncake"])
    plan = Plan.of(doc)
    assert plan.mooncake_master is not None and plan.mooncake_master.kind == "mooncake"
    assert plan.mooncake_master.metrics_port == doc["mooncake_master"]["metrics_port"]
    prefill = next(s for s in plan.servers if s.role == "prefill")
    assert prefill.offloads_kv and prefill.url == f"http://{prefill.ranks[0].address}:{prefill.port}"
    # the SGLang router is handed exactly these URLs (recipe/argv.router_plan)
    assert prefill.url in plan.router.argv
    host = prefill.ranks[0].host
    assert [(s.name, r.unit) for s, r in plan.placed(host)] == [
        (s["name"], r["unit"]) for s in doc["servers"] for r in s["ranks"] if r["host"] == host]
    assert plan.engine_hosts == list(dict.fromkeys(r["host"] for s in doc["servers"] for r in s["ranks"]))
    assert plan.server(prefill.name) is prefill
    with pytest.raises(K31Error, match="server nope is not in the plan; valid: "):
        plan.server("nope")
    assert plan.rank(prefill.ranks[0].unit) is prefill.ranks[0]
    assert Rank.of(doc["servers"][0]["ranks"][0]) == plan.servers[0].ranks[0]
    assert Server.of(doc["servers"][0]) == plan.servers[0]
    assert plan.knob("kv_offload") == "mooncake" and plan.knob("not_a_knob", 7) == 7
    assert [Plan.of(resolve_plan(**SHAPES[n])).router_kind for n in ("gb300 pd dynamo", "b300 unified no router")] \
        == ["dynamo", None] and plan.router_kind == "sglang"


def test_the_plan_is_read_only():
    plan = Plan.of(resolve_plan(**SHAPES["gb300 pd dynamo"]))
    with pytest.raises(AttributeError):
        plan.servers[0].port = 1    # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.servers[0].ranks[0].env["X"] = "1"    # type: ignore[index]


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("hardware"), "the plan's document has no 'hardware'"),
    (lambda d: d["servers"][0]["ranks"][0].pop("unit"), r"the plan's servers\[0\]\.ranks\[0\] has no 'unit'"),
    (lambda d: d["servers"][0]["layout"].update(tp="8"),
     r"the plan's servers\[0\]\.layout\.tp is '8'; valid: an integer"),
    (lambda d: d["servers"][1].update(port=True), r"the plan's servers\[1\]\.port is True; valid: an integer"),
    (lambda d: d["servers"][0].update(ranks=[]), r"the plan's servers\[0\]\.ranks is empty"),
    (lambda d: d["router"].pop("port"), "the plan's router has no 'port'"),
    (lambda d: d["servers"][0]["settings"].update(radix_cache="yes"),
     r"servers\[0\]\.settings\.radix_cache is 'yes'; valid: true or false"),
    (lambda d: d.update(servers={"a": 1}), r"the plan's servers is \{'a': 1\}; valid: a list"),
])
def test_a_document_that_is_no_plan_is_refused_naming_the_key(mutate, message):
    doc = copy.deepcopy(resolve_plan(**SHAPES["gb300 pd dynamo"]))
    mutate(doc)
    with pytest.raises(K31Error, match=message):
        Plan.of(doc)


def test_engine_settings_are_one_record_for_the_resolver_and_the_plan():
    from k31deploy.recipe import model
    assert model.EngineSettings is EngineSettings    # the resolver fills the record consumers read
    doc = resolve_plan(platform="mi355x", agents=48)
    assert set(doc["servers"][0]["settings"]) == {f.name for f in fields(EngineSettings)}
