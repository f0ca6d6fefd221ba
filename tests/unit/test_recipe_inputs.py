"""Bad input and the interfaces: knobs, inventories, the `k31` CLI and the Ansible filter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from recipe_helpers import flag, refused

from k31deploy.cli import main
from k31deploy.errors import K31Error
from k31deploy.recipe import Host, knob_specs, parse_sets, resolve

ROOT = Path(__file__).resolve().parents[2]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# -- knobs -----------------------------------------------------------------------------------------

def test_unknown_platform_knob_and_values_are_refused():
    refused("platform=h300 .*valid choices: b300, gb300", platform="h300")
    refused("unknown knob 'max_running_request' .*valid knobs:", platform="b300", max_running_request=8)
    refused("kv_offload=disk .*valid choices: none, hicache, mooncake", platform="b300", kv_offload="disk")
    refused("platform is not set; valid platforms:")
    refused("mem_fraction_static=1.5 .*out of range; it must be > 0 and <= 1.0", platform="b300",
            mem_fraction_static=1.5)


def test_set_strings_are_typed():
    assert parse_sets(["monokernel=yes", "agents=8", "hicache_ratio=2.5", "platform=mi355x"]) == {
        "monokernel": True, "agents": 8, "hicache_ratio": 2.5, "platform": "mi355x"}
    with pytest.raises(K31Error, match=r"agents='many' .*expected a whole number"):
        parse_sets(["agents=many"])
    with pytest.raises(K31Error, match=r"is not knob=value"):
        parse_sets(["agents"])


@pytest.mark.parametrize("knobs,match", [
    ({"platform": "b300", "prefill_strategy": "low-latency", "max_running_requests": 8},
     "prefill_strategy=low-latency applies to prefill servers, and topology=unified has none"),
    ({"platform": "b300", "dflash_block": 6, "speculative": "none"}, "dflash_block=6 needs speculative=dflash"),
    ({"platform": "b300", "hicache_ratio": 2.0, "max_running_requests": 8}, "hicache_ratio=2.0 needs kv_offload"),
    ({"platform": "b300", "megamoe_token_cap": 8, "max_running_requests": 8}, "megamoe_token_cap=8 needs moe_runner"),
    ({"platform": "b300", "dcp_comm_backend": "a2a", "max_running_requests": 8}, "dcp_comm_backend=a2a needs a DCP"),
    ({"platform": "b300", "transfer_backend": "nixl", "max_running_requests": 8}, "transfer_backend=nixl applies"),
    ({"platform": "mi355x", "agents": 16, "router_dialect": "sgl-router"}, "router_dialect=sgl-router applies"),
    ({"platform": "b300", "router": "sglang", "router_dialect": "sgl-router", "max_running_requests": 8},
     "router_dialect=sgl-router is the seed's PD command"),
])
def test_contradictory_knobs_are_refused(knobs, match):
    message = refused(match, **knobs)
    if " applies to " in message or " needs " in message:    # a knob only some setups take: unset is the way out
        knob = match.split("=")[0]
        assert message.endswith(f"; valid choices: the setup it names, or {knob} unset"), message


def test_the_readme_knob_table_is_the_generated_one():
    from k31deploy.commands.recipe import knob_table

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- knobs:start (generated: k31 catalog --knobs) -->\n")[1].split("\n<!-- knobs:end -->")[0]
    assert block == knob_table(), "regenerate the README's knob table with `k31 catalog --knobs`"
    for knob in knob_specs():
        assert f"| `{knob}` |" in block, knob


# -- host layouts ----------------------------------------------------------------------------------

def hosts(*specs: tuple[str, str, dict]) -> list[Host]:
    return [Host(name, f"10.0.0.{i}", (group,), dict(vars_)) for i, (name, group, vars_) in enumerate(specs)]


def test_inventory_servers_ranks_and_dist_init_address():
    layout = hosts(("t1", "k31_prefill", {"k31_server": "p0", "k31_node_rank": 1}),
                   ("t0", "k31_prefill", {"k31_server": "p0", "k31_node_rank": 0}),
                   ("t2", "k31_decode", {"k31_server": "d0"}), ("t3", "k31_decode", {"k31_server": "d0"}),
                   ("fe", "k31_router", {}))
    p = resolve({"platform": "gb300", "topology": "pd", "max_running_requests": 8}, layout)
    pre = p["servers"][0]
    assert [r["host"] for r in pre["ranks"]] == ["t0", "t1"]
    assert {r["argv"][r["argv"].index("--dist-init-addr") + 1] for r in pre["ranks"]} == {"10.0.0.1:20000"}
    assert p["router"]["host"] == "fe"


def test_hosts_of_a_service_the_plan_does_not_run_are_named_unused():
    engines = (("a", "k31_unified", {}),)
    knobs = {"platform": "mi355x", "agents": 16}
    p = resolve({**knobs, "router": "none", "monitoring": "none"},
                hosts(*engines, ("r", "k31_router", {}), ("m", "k31_mooncake_master", {}), ("p", "k31_monitoring", {})))
    assert p["router"] is None and p["mooncake_master"] is None
    unused = [w for w in p["warnings"] if "are unused" in w]
    assert unused == ["hosts in k31_router are unused: router=none",
                      "hosts in k31_mooncake_master are unused: the Mooncake store runs with kv_offload=mooncake only",
                      "hosts in k31_monitoring are unused: monitoring=none"]
    p = resolve({**knobs, "kv_offload": "mooncake"}, hosts(*engines, ("m", "k31_mooncake_master", {})))
    assert p["mooncake_master"]["host"] == "m" and not [w for w in p["warnings"] if "are unused" in w]


def test_the_seed_routers_tokenizer_must_be_on_its_host():
    knobs = {"platform": "gb300", "topology": "pd", "router": "sglang", "speculative": "none",
             "model_path": "/models/k31"}
    trays = (("t0", "k31_prefill", {"k31_server": "p0"}), ("t1", "k31_prefill", {"k31_server": "p0"}),
             ("t2", "k31_decode", {"k31_server": "d0"}), ("t3", "k31_decode", {"k31_server": "d0"}))
    with pytest.raises(K31Error, match=r"^router_dialect=sgl-router reads --tokenizer-path /models/k31/tokenizer.json "
                                       r"on the router host fe, which runs no engine.*valid choices: put the router on "
                                       r"an engine host, model_path=<hub id>, or router_dialect=launch_router$"):
        resolve(knobs, hosts(*trays, ("fe", "k31_router", {})))
    on_engine = [Host("t0", "10.0.0.0", ("k31_prefill", "k31_router"), {"k31_server": "p0"}), *hosts(*trays)[1:]]
    assert resolve(knobs, on_engine)["router"]["mounts"] == ["/models/k31"]
    for other in ({"model_path": "moonshotai/Kimi-K3.1-Pro"}, {"router_dialect": "launch_router"}):
        router = resolve({**knobs, **other}, hosts(*trays, ("fe", "k31_router", {})))["router"]
        assert "--tokenizer-path" not in router["argv"] and router["mounts"] == []


def test_a_knob_set_on_some_hosts_only_is_the_clusters_and_the_plan_says_so():
    layout = hosts(("p0", "k31_prefill", {"k31_attention_backend": "trtllm"}), ("d0", "k31_decode", {}),
                   ("fe", "k31_router", {}))
    p = resolve({"platform": "b300", "topology": "pd", "max_running_requests": 8}, layout)
    assert all(flag(s["ranks"][0]["argv"], "--dsa-decode-backend") == "trtllm" for s in p["servers"])
    assert ("k31_attention_backend is set on some hosts only (not on d0, fe); recipe knobs are cluster-wide, so its "
            "value applies to the whole cluster: set it once in group_vars/all") in p["warnings"]
    everywhere = [Host(h.name, h.address, h.groups, {"k31_attention_backend": "trtllm"}) for h in layout]
    p = resolve({"platform": "b300", "topology": "pd", "max_running_requests": 8}, everywhere)
    assert not [w for w in p["warnings"] if "some hosts only" in w]


def test_a_nan_knob_on_several_hosts_is_refused_as_not_finite_not_as_differing():
    layout = [Host(n, f"10.0.0.{i}", (g,), {"k31_mem_fraction_static": float("nan")})
              for i, (n, g) in enumerate((("p0", "k31_prefill"), ("d0", "k31_decode")))]
    with pytest.raises(K31Error, match=r"^mem_fraction_static=nan \(inventory\) is not valid; expected a finite"):
        resolve({"platform": "mi355x", "agents": 92}, [*layout, Host("r0", "10.0.0.9", ("k31_router",), {})])


def test_wrong_host_count_for_a_layout_is_refused():
    with pytest.raises(K31Error, match=r"server d0 has 1 host\(s\) \(t2\) but decode balanced on gb300 needs 2"):
        resolve({"platform": "gb300", "topology": "pd", "max_running_requests": 8},
                hosts(("t0", "k31_prefill", {"k31_server": "p0"}), ("t1", "k31_prefill", {"k31_server": "p0"}),
                      ("t2", "k31_decode", {"k31_server": "d0"}), ("fe", "k31_router", {})))


def test_inventory_refusals():
    base = {"platform": "mi355x", "agents": 92}
    with pytest.raises(K31Error, match=r"host a is in k31_prefill and k31_decode"):
        resolve(base, [Host("a", "a", ("k31_prefill", "k31_decode"), {}), Host("r", "r", ("k31_router",), {})])
    with pytest.raises(K31Error, match=r"needs at least one host in group k31_decode"):
        resolve(base, hosts(("a", "k31_prefill", {}), ("r", "k31_router", {})))
    with pytest.raises(K31Error, match=r"router=sglang needs a host in group k31_router"):
        resolve(base, hosts(("a", "k31_prefill", {}), ("b", "k31_decode", {})))
    with pytest.raises(K31Error, match=r"hosts in group k31_unified .* but topology=pd"):
        resolve(base, hosts(("a", "k31_prefill", {}), ("b", "k31_decode", {}), ("c", "k31_unified", {}),
                            ("r", "k31_router", {})))
    with pytest.raises(K31Error, match=r"unknown inventory variable 'k31_platfrom' on host a"):
        resolve({}, hosts(("a", "k31_unified", {"k31_platfrom": "mi355x"})))
    with pytest.raises(K31Error, match=r"k31_node_rank of server s must number its hosts 0..1"):
        resolve({"platform": "gb300", "max_running_requests": 8},
                hosts(("a", "k31_unified", {"k31_server": "s", "k31_node_rank": 0}),
                      ("b", "k31_unified", {"k31_server": "s", "k31_node_rank": 0}), ("r", "k31_router", {})))


def test_knobs_must_agree_across_hosts_and_attention_backend_across_pd_roles():
    layout = hosts(("a", "k31_prefill", {"k31_attention_backend": "trtllm"}),
                   ("b", "k31_prefill", {"k31_attention_backend": "trtllm"}),
                   ("c", "k31_decode", {"k31_attention_backend": "prims-ts"}),
                   ("d", "k31_decode", {"k31_attention_backend": "prims-ts"}), ("r", "k31_router", {}))
    for h in layout:
        h.vars.update({"k31_server": "p0" if h.name in "ab" else "d0"})
    with pytest.raises(K31Error, match=r"k31_attention_backend differs between hosts .*same backend"):
        resolve({"platform": "gb300", "topology": "pd", "max_running_requests": 8}, layout)


def test_role_variables_are_not_mistaken_for_knobs():
    layout = hosts(("a", "k31_unified", {"k31_engine_runtime": "standin", "k31_smoke_timeout": 5}))
    assert resolve({"platform": "mi355x", "agents": 16}, layout)["servers"][0]["ranks"][0]["host"] == "a"


def test_router_startup_timeout_keeps_its_inventory_variable_as_a_knob():
    # k31_router_worker_startup_timeout was a k31_router role variable; as knob router_worker_startup_timeout
    # it keeps its inventory name (INI gives a string) and lands in the plan's router argv.
    layout = hosts(("a", "k31_prefill", {"k31_router_worker_startup_timeout": "900"}), ("b", "k31_decode", {}),
                   ("r", "k31_router", {}))
    plan = resolve({"platform": "mi355x", "agents": 92}, layout)
    assert plan["router"]["argv"][-2:] == ["--worker-startup-timeout-secs", "900"]
    assert plan["knobs"]["router_worker_startup_timeout"] == 900


def test_placeholder_image_is_refused_at_deploy_time_only():
    assert resolve({"platform": "mi355x", "agents": 16})["image"] == "<K31_MI35X_IMAGE>"
    with pytest.raises(K31Error, match=r"image is <K31_MI35X_IMAGE>: set k31_image"):
        resolve({"platform": "mi355x", "agents": 16}, require_image=True)
    assert resolve({"platform": "mi355x", "agents": 16, "image": "reg/k31:rocm10"},
                   require_image=True)["image"] == "reg/k31:rocm10"


# -- CLI -------------------------------------------------------------------------------------------

def test_plan_json_contract(capsys):
    code, out, err = run_cli(capsys, "plan", "--platform", "mi355x", "--agents", "92", "--json")
    assert code == 0 and err == ""
    p = json.loads(out)
    assert {"model", "platform", "topology", "servers", "router", "warnings"} <= set(p)
    assert p["model"] == "moonshotai/Kimi-K3.1-Pro" and p["topology"] == "pd"
    for s in p["servers"]:
        assert {"name", "role", "strategy", "layout", "verification", "port", "bootstrap_port", "ranks"} <= set(s)
        assert set(s["layout"]) == {"tp", "dcp", "pp", "pcp", "ep", "dp", "nnodes"}
        assert s["verification"] in ("verified", "in-progress", "not-verified")
        for r in s["ranks"]:
            assert {"host", "node_rank", "argv", "env"} <= set(r)
            assert all(isinstance(t, str) for t in r["argv"])
            assert r["argv"][:3] == ["python3", "-m", "sglang.launch_server"]
    assert {"kind", "host", "port", "argv", "env"} <= set(p["router"])
    assert [r["host"] for s in p["servers"] for r in s["ranks"]] == ["node0", "node1"]


def test_gb300_pd_example_from_the_issue(capsys):
    code, out, _ = run_cli(capsys, "plan", "--platform", "gb300", "--topology", "pd", "--prefill-strategy",
                           "high-throughput", "--decode-strategy", "balanced")
    assert code == 0
    assert "prefill0: prefill high-throughput PP4 · PCP2 · TP2 · EP2 on 2 node(s)" in out
    assert "decode0: decode balanced TP8 · DCP8 · EP2 on 2 node(s)" in out
    assert "router (dynamo)" in out


@pytest.mark.parametrize("args,match", [
    (["plan", "--platform", "h300"], "error: platform=h300 (--platform) is not valid; valid choices: b300"),
    (["plan", "--platform", "b300", "--set", "speculative=eagle"], "error: speculative=eagle"),
    (["plan", "--platform", "mi355x", "--agents", "6"], "error: agents=6 is outside"),
    (["plan", "-i", "/nonexistent/hosts.ini"], "error: inventory /nonexistent/hosts.ini does not exist"),
    (["catalog", "--platform", "h300"], "error: platform=h300 is not valid"),
])
def test_cli_errors_are_one_line_and_exit_2(capsys, args, match):
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith(match) and err.count("\n") == 1


def test_plan_reads_ini_and_yaml_inventories(capsys):
    code, out, _ = run_cli(capsys, "plan", "-i", str(ROOT / "inventories/mi355x-1p1d/hosts.ini"), "--json")
    p = json.loads(out)
    assert code == 0 and p["topology"] == "pd" and p["router"]["host"] == "mi355x-a"
    assert p["servers"][0]["ranks"][0]["address"] == "mi355x-a.cluster.internal"
    code, out, _ = run_cli(capsys, "plan", "-i", str(ROOT / "inventories/gb300-pd/hosts.yml"), "--json")
    p = json.loads(out)
    assert [len(s["ranks"]) for s in p["servers"]] == [2, 2] and p["router"]["kind"] == "dynamo"


def test_catalog_lists_every_cell(capsys):
    code, out, _ = run_cli(capsys, "catalog", "--json")
    rows = json.loads(out)
    assert code == 0 and len(rows) == 27
    assert {"platform": "gb300", "role": "decode", "strategy": "(wide_ep=true)"}.items() <= next(
        r for r in rows if r["strategy"] == "(wide_ep=true)").items()


# -- the Ansible filter ----------------------------------------------------------------------------

def test_filter_plugin_gives_the_cli_plan(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("k31_filter", ROOT / "filter_plugins/k31.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    k31_plan = module.FilterModule().filters()["k31_plan"]
    groups = {"all": ["mi355x-a", "mi355x-b"], "k31_prefill": ["mi355x-a"], "k31_decode": ["mi355x-b"],
              "k31_router": ["mi355x-a"]}
    common = {"k31_platform": "mi355x", "k31_agents": "92", "k31_model_path": "/models/Kimi-K3.1-Pro",
              "k31_draft_model_path": "/models/Kimi-K3.1-Dflash2-Preview", "k31_image": "<K31_MI35X_IMAGE>",
              "inventory_hostname": "ignored"}
    hostvars = {h: {**common, "ansible_host": f"{h}.cluster.internal"} for h in groups["all"]}
    # `k31 plan -i` keeps names as written; a deploy's filter turns them into IPs (below)
    from_filter = k31_plan(groups, hostvars, resolve_names=False)
    _, out, _ = run_cli(capsys, "plan", "-i", str(ROOT / "inventories/mi355x-1p1d/hosts.ini"), "--json")
    assert from_filter == json.loads(out)
    assert k31_plan(groups, hostvars, {"transfer_backend": "nixl"}, on_error="return",
                    resolve_names=False)["error"].startswith("transfer_backend=nixl is rejected by DCP")


def test_a_deploy_binds_ips_its_names_resolve_to_and_refuses_one_that_does_not(monkeypatch):
    """etcd binds only to an IP and firewall rules match IPs: a deploy's plan (the validate play's filter,
    `k31 plan --deploy`) turns host names into addresses once, on the controller."""
    import socket

    from k31deploy.recipe import from_mapping

    names = {"gpu-a.cluster": "10.9.0.1", "gpu-b.cluster": "10.9.0.2", "edge.example": "192.0.2.7"}

    def fake(host, *args, **kwargs):
        if host not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (names[host], 0))]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    hosts = [from_mapping("a", ["k31_prefill"], {"ansible_host": "gpu-a.cluster"}),
             from_mapping("b", ["k31_decode"], {"ansible_host": "10.0.0.2", "k31_cluster_address": "gpu-b.cluster"}),
             from_mapping("r", ["k31_router"], {"ansible_host": "10.0.0.3", "k31_public_address": "edge.example"})]
    knobs = {"platform": "mi355x", "agents": 92}
    plan = resolve(knobs, hosts, resolve_names=True)
    assert [s["ranks"][0]["address"] for s in plan["servers"]] == ["10.9.0.1", "10.9.0.2"]
    assert (plan["router"]["address"], plan["router"]["public_address"]) == ("10.0.0.3", "192.0.2.7")
    argv = plan["router"]["argv"]
    assert argv[argv.index("--host") + 1] == "192.0.2.7" and argv[argv.index("--prometheus-host") + 1] == "10.0.0.3"
    assert "--prefill" in argv and argv[argv.index("--prefill") + 1] == "http://10.9.0.1:30000"
    as_written = resolve(knobs, hosts)
    assert as_written["servers"][0]["ranks"][0]["address"] == "gpu-a.cluster"
    hosts[0] = from_mapping("a", ["k31_prefill"], {"ansible_host": "gpu-a.nowhere"})
    with pytest.raises(K31Error, match=r"^ansible_host of host a is gpu-a.nowhere, which does not resolve on the "
                                       r"controller \(Name or service not known\); set ansible_host to the host's "
                                       r"IP address$"):
        resolve(knobs, hosts, resolve_names=True)


def test_public_address_is_for_the_router_host_only():
    from k31deploy.recipe import from_mapping

    hosts = [from_mapping("a", ["k31_prefill"], {"ansible_host": "10.0.0.1", "k31_public_address": "192.0.2.1"}),
             from_mapping("b", ["k31_decode"], {"ansible_host": "10.0.0.2"}),
             from_mapping("r", ["k31_router"], {"ansible_host": "10.0.0.3"})]
    with pytest.raises(K31Error, match="k31_public_address is set on host a, which is not in k31_router"):
        resolve({"platform": "mi355x", "agents": 92}, hosts)


# -- the command line's own refusals -----------------------------------------------------------------

def test_a_usage_error_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--agents", "abc"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: k31 plan: argument --agents: invalid int value: 'abc' (see k31 plan --help)\n"


def test_a_knob_given_by_flag_and_by_set_must_agree(capsys):
    code, out, err = run_cli(capsys, "plan", "--platform", "gb300", "--set", "platform=mi355x")
    assert (code, out) == (2, "")
    assert err == ("error: platform is given twice, --platform gb300 and --set platform=mi355x; valid: one of "
                   "them\n")
    assert run_cli(capsys, "plan", "--platform", "mi355x", "--agents", "4", "--set", "agents=4")[0] == 0


def test_a_mistyped_k31_group_and_an_unparsable_inventory_are_refused(tmp_path, capsys):
    typo = tmp_path / "typo.ini"
    typo.write_text("[k31_prefil]\np0 ansible_host=10.0.0.1\n[k31_decode]\nd0 ansible_host=10.0.0.2\n"
                    "[k31_router]\nr0 ansible_host=10.0.0.3\n[all:vars]\nk31_platform=mi355x\nk31_agents=92\n")
    code, _, err = run_cli(capsys, "plan", "-i", str(typo))
    assert code == 2 and err == (
        f"error: group k31_prefil of inventory {typo} is not a k31 group, so its hosts (p0) would be left out; did "
        f"you mean k31_prefill? valid groups: k31_unified, k31_prefill, k31_decode, k31_router, k31_mooncake_master, "
        f"k31_monitoring\n")
    broken = tmp_path / "broken.ini"
    broken.write_text("[k31_decode\nd0\n")
    code, _, err = run_cli(capsys, "plan", "-i", str(broken))
    assert code == 2 and err.splitlines()[-1].startswith(f"error: inventory {broken} could not be parsed as an "
                                                         f"Ansible inventory")


def test_a_vaulted_role_variable_is_left_to_its_role_not_a_traceback(tmp_path, capsys):
    from ansible.constants import DEFAULT_VAULT_ID_MATCH
    from ansible.parsing.vault import VaultLib, VaultSecret

    secret = VaultLib([(DEFAULT_VAULT_ID_MATCH, VaultSecret(b"pw"))]).encrypt("60").decode()
    block = "\n".join(f"        {line}" for line in secret.splitlines())
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all:\n  vars:\n    k31_platform: mi355x\n    k31_agents: 16\n"
                         f"    k31_engine_health_timeout: !vault |\n{block}\n"
                         "    k31_engine_extra_env:\n      A: !vault |\n"
                         + "\n".join(f"  {line}" for line in block.splitlines()) + "\n"
                         "  children:\n    k31_unified:\n      hosts:\n        u0: {ansible_host: 10.0.0.1}\n")
    code, out, err = run_cli(capsys, "plan", "-i", str(inventory), "--json")
    assert (code, err) == (0, ""), err
    assert json.loads(out)["servers"][0]["ranks"][0]["host"] == "u0"
