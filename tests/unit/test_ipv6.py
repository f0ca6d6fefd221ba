"""IPv6 host addresses through every consumer: one helper (k31deploy.address) brackets them wherever a port
or URL follows, and the plan keeps them bare where a tool wants the address alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from recipe_helpers import argv, env, flag, server

from k31deploy import address, launch
from k31deploy.errors import K31Error
from k31deploy.oncall.rollout import follow_config, rollout
from k31deploy.recipe import resolve
from k31deploy.recipe.hosts import from_mapping
from k31deploy.smoke import validate

ROOT = Path(__file__).resolve().parents[2]


def v6(name: str, group: str, last: int, **hostvars) -> object:
    return from_mapping(name, [group], {"ansible_host": f"fd00::{last}", **hostvars})


def mi_pd_plan():
    hosts = [v6("p0", "k31_prefill", 1), v6("d0", "k31_decode", 2), v6("r0", "k31_router", 9)]
    return resolve({"platform": "mi355x", "agents": 92}, hosts)


def gb300_dynamo_plan():
    hosts = [v6(f"{s}-t{t}", f"k31_{s[:-1]}", 10 * i + t + 1, k31_server=s)
             for i, s in enumerate(("prefill0", "decode0")) for t in range(2)]
    hosts.append(v6("fe", "k31_router", 99))
    return resolve({"platform": "gb300", "topology": "pd", "max_running_requests": 64}, hosts)


@pytest.mark.parametrize("given,host,hostport", [
    ("fd00::1", "[fd00::1]", "[fd00::1]:80"),
    ("10.0.0.1", "10.0.0.1", "10.0.0.1:80"),
    ("node0.cluster", "node0.cluster", "node0.cluster:80"),
    ("::ffff:10.0.0.1", "[::ffff:10.0.0.1]", "[::ffff:10.0.0.1]:80"),
])
def test_the_helper_brackets_ipv6_only(given, host, hostport):
    assert address.url_host(given) == host
    assert address.host_port(given, 80) == hostport
    assert address.http_url(given, 80, "/health") == f"http://{hostport}/health"


def test_plan_addresses_stay_bare():
    p = mi_pd_plan()
    assert [s["ranks"][0]["address"] for s in p["servers"]] == ["fd00::1", "fd00::2"]
    assert p["router"]["address"] == "fd00::9"


def test_router_argv_urls_are_bracketed():
    args = mi_pd_plan()["router"]["argv"]
    assert args[args.index("--prefill") + 1:args.index("--prefill") + 3] == ["http://[fd00::1]:30000", "8998"]
    assert flag(args, "--decode") == "http://[fd00::2]:30100"
    hosts = [v6("u0", "k31_unified", 1), v6("r0", "k31_router", 9)]
    unified = resolve({"platform": "mi355x", "agents": 16, "router": "sglang"}, hosts)["router"]["argv"]
    assert flag(unified, "--worker-urls") == "http://[fd00::1]:30000"


def test_dist_init_addr_is_bracketed_as_sglang_parses_it():
    # SGLang 0.5.23 NetworkAddress.parse: "IPv6 addresses must be bracketed" ([::1]:8000).
    p = gb300_dynamo_plan()
    for role in ("prefill", "decode"):
        for rank in range(2):
            assert flag(argv(p, role, rank), "--dist-init-addr") == f"[fd00::{1 if role == 'prefill' else 11}]:20000"


def test_dynamo_discovery_env_is_bracketed():
    p = gb300_dynamo_plan()
    expected = {"ETCD_ENDPOINTS": "https://[fd00::99]:2379", "NATS_SERVER": "tls://[fd00::99]:4222"}
    assert expected.items() <= p["router"]["env"].items()
    assert expected.items() <= env(p, "decode").items()


def test_mooncake_master_is_bracketed():
    hosts = [v6("u0", "k31_unified", 1), v6("m0", "k31_mooncake_master", 7)]
    p = resolve({"platform": "b300", "kv_offload": "mooncake", "router": "none", "max_running_requests": 8}, hosts)
    assert env(p, "unified")["MOONCAKE_MASTER"] == "[fd00::7]:50051"
    assert p["mooncake_master"]["address"] == "fd00::7"


def test_launch_endpoint_and_metrics_targets_are_bracketed():
    p = mi_pd_plan()
    assert launch.endpoint_address(p) == ("fd00::9", 8000)
    assert launch.endpoint(p) == "http://[fd00::9]:8000/v1"
    assert launch.http_url("fd00::5", 30000) == "http://[fd00::5]:30000/v1"
    targets = launch.metrics_targets(p)
    assert [g["targets"] for g in targets["k31-engines"]] == [["[fd00::1]:30000"], ["[fd00::2]:30100"]]
    assert targets["k31-router"][0]["targets"] == ["[fd00::9]:29000"]


def test_redeploy_worker_urls_match_the_router_argv():
    """The redeploy finds a server in the router's worker list by URL: it must be the URL the plan gave it."""
    p = mi_pd_plan()
    args = p["router"]["argv"]
    r = rollout(p, ["d0"])
    assert r["steps"]["d0"]["worker_url"] == flag(args, "--decode")
    assert r["steps"]["p0"]["worker_url"] == flag(args, "--prefill")
    follow = follow_config(p, "p0")
    assert follow["drains"][0]["router"] == "http://[fd00::9]:8000"
    assert follow["drains"][0]["worker_url"] == flag(args, "--prefill")
    assert follow["decodes"] == [{"name": "d0", "health": "http://[fd00::2]:30100/health"}]


def test_the_redeploy_role_filter_uses_the_same_urls():
    path = ROOT / "roles/k31_redeploy/filter_plugins/k31_redeploy.py"
    spec = importlib.util.spec_from_file_location("k31_redeploy_filter", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    p = mi_pd_plan()
    r = module.FilterModule().filters()["k31_redeploy_rollout"](p, ["d0"])
    assert r["steps"]["d0"]["worker_url"] == flag(p["router"]["argv"], "--decode")


def test_smoke_takes_bracketed_urls_and_refuses_bare_ipv6():
    validate("http://[fd00::9]:8000/v1", "m", 5)
    with pytest.raises(K31Error, match=r"IPv6 address in brackets"):
        validate("http://fd00::9:8000/v1", "m", 5)


def test_the_filter_plugins_bracket_too():
    spec = importlib.util.spec_from_file_location("k31_filter", ROOT / "filter_plugins/k31.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    filters = module.FilterModule().filters()
    assert filters["k31_endpoint"](mi_pd_plan()) == "http://[fd00::9]:8000/v1"
    assert filters["k31_url"]("fd00::9", 2379) == "http://[fd00::9]:2379"
    assert filters["k31_url"]("node0", 4222, "nats") == "nats://node0:4222"
    assert filters["k31_host_port"]("fd00::9", 8000) == "[fd00::9]:8000"
    assert server(mi_pd_plan(), "prefill")["ranks"][0]["address"] == "fd00::1"
