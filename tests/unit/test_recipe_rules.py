"""One test (or a parametrised family) per rule of the seed. Section names follow the seed."""

from __future__ import annotations

import pytest
from recipe_helpers import argv, env, flag, plan, refused, server

from k31deploy.recipe import catalog

AITER = {"SGLANG_USE_AITER": "1", "SGLANG_AITER_K3_OPT": "1", "AITER_FLYDSL_FORCE": "1", "AITER_SITUV2_A8W4": "1"}


# -- Recipe shapes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("role,strategy", [
    ("unified", "low-latency"), ("unified", "high-concurrency"), ("prefill", "low-latency"),
    ("prefill", "high-throughput"), ("decode", "balanced"), ("decode", "high-throughput"),
])
def test_gb300_every_recipe_runs_on_two_trays_with_multinode_flags(role, strategy):
    topology = "unified" if role == "unified" else "pd"
    p = plan(platform="gb300", topology=topology, **{f"{role}_strategy": strategy},
             max_running_requests=64, speculative="none")
    s = server(p, role)
    assert s["layout"]["nnodes"] == 2 and len(s["ranks"]) == 2
    head = s["ranks"][0]["address"]
    for rank, r in enumerate(s["ranks"]):
        assert flag(r["argv"], "--nnodes") == "2"
        assert flag(r["argv"], "--node-rank") == str(rank)
        assert flag(r["argv"], "--dist-init-addr") == f"{head}:20000"
        assert r["env"]["NCCL_MNNVL_ENABLE"] == "1" and r["env"]["NCCL_CUMEM_ENABLE"] == "1"


def test_b300_and_mi355x_servers_are_one_node_without_multinode_flags():
    for knobs in ({"platform": "b300", "max_running_requests": 8}, {"platform": "mi355x", "agents": 16}):
        args = argv(plan(**knobs), "unified")
        assert "--nnodes" not in args and "--dist-init-addr" not in args


@pytest.mark.parametrize("platform,strategy,layout", [
    ("b300", "low-latency", {"tp": 8}),
    ("b300", "high-concurrency", {"tp": 8, "dcp": 8, "ep": 2}),
    ("mi355x", "low-latency", {"tp": 8}),
    ("mi355x", "high-throughput", {"tp": 8, "dcp": 8}),
    ("vera-rubin", "balanced", {"tp": 8}),
    ("b200", "balanced", {"tp": 16, "dcp": 16}),
    ("gb200", "balanced", {"tp": 16, "dcp": 16}),
    ("h200", "balanced", {"tp": 16, "ep": 16}),
    ("h100", "balanced", {"tp": 32, "ep": 32}),
])
def test_unified_strategy_layouts(platform, strategy, layout):
    s = server(plan(platform=platform, unified_strategy=strategy, max_running_requests=8), "unified")
    for key, size in layout.items():
        assert s["layout"][key] == size
        assert flag(s["ranks"][0]["argv"], f"--{key}-size") == str(size)
    assert s["strategy"] == strategy


def test_mi355x_high_throughput_runs_dcp8_over_a2a():
    assert flag(argv(plan(platform="mi355x", agents=16), "unified"), "--dcp-comm-backend") == "a2a"


def test_prefill_high_throughput_is_pp4_pcp2_with_megamoe_ep2():
    s = server(plan(platform="b300", topology="pd", prefill_strategy="high-throughput"), "prefill")
    assert {k: s["layout"][k] for k in ("tp", "pp", "pcp", "ep")} == {"tp": 2, "pp": 4, "pcp": 2, "ep": 2}
    args = s["ranks"][0]["argv"]
    assert flag(args, "--pp-size") == "4" and flag(args, "--attn-cp-size") == "2"
    assert flag(args, "--enable-prefill-cp") is True and flag(args, "--disable-overlap-schedule") is True
    assert flag(args, "--moe-a2a-backend") == "megamoe" and "--ep-size" not in args
    assert s["moe_runner"] == "megamoe"


def test_decode_balanced_and_high_throughput_layouts():
    p = plan(platform="b300", topology="pd", decode_strategy="balanced", max_running_requests=32)
    assert {k: server(p, "decode")["layout"][k] for k in ("tp", "dcp", "ep")} == {"tp": 8, "dcp": 8, "ep": 2}
    p = plan(platform="b300", topology="pd", decode_strategy="high-throughput", max_running_requests=32)
    assert {k: server(p, "decode")["layout"][k] for k in ("tp", "dcp", "ep")} == {"tp": 8, "dcp": 8, "ep": 1}


def test_mi35x_both_pd_roles_offer_high_throughput_dcp8_only():
    for platform in ("mi350x", "mi355x"):
        refused("prefill_strategy=low-latency is not offered on .*valid choices: high-throughput",
                platform=platform, topology="pd", prefill_strategy="low-latency")
        refused("decode_strategy=balanced is not offered", platform=platform, topology="pd",
                decode_strategy="balanced")


def test_other_platforms_offer_unified_balanced_only():
    refused("topology=pd is not offered on h200; valid topologies: unified", platform="h200", topology="pd")
    refused("unified_strategy=low-latency is not offered on b200; valid choices: balanced",
            platform="b200", unified_strategy="low-latency")


def test_wide_ep_decode_is_four_trays_dp2_dcp8_megamoe_ep16():
    p = plan(platform="gb300", topology="pd", wide_ep=True, max_running_requests=64)
    s = server(p, "decode")
    assert s["layout"] == {"tp": 16, "dcp": 8, "pp": 1, "pcp": 1, "ep": 16, "dp": 2, "nnodes": 4}
    args = s["ranks"][3]["argv"]
    assert flag(args, "--enable-dp-attention") is True and flag(args, "--dp-size") == "2"
    assert flag(args, "--moe-a2a-backend") == "megamoe" and flag(args, "--node-rank") == "3"
    assert s["verification"] == "not-verified"
    assert any("Not Verified" in w for w in p["warnings"])
    refused("wide_ep=true is a GB300 decode cell", platform="b300", topology="pd", wide_ep=True)
    refused("wide_ep=true is a PD decode server", platform="gb300", wide_ep=True)
    refused("moe_runner=trtllm contradicts wide_ep", platform="gb300", topology="pd", wide_ep=True,
            moe_runner="trtllm", max_running_requests=8)


# -- Configuration Tips: attention backend, MoE runner, spec decode, HiCache ----------------------

def test_attention_backend_flashmla_default_adds_nothing_and_trtllm_sets_both_dsa_flags():
    args = argv(plan(platform="b300", max_running_requests=8), "unified")
    assert "--dsa-prefill-backend" not in args and "--dsa-decode-backend" not in args
    p = plan(platform="gb300", topology="pd", attention_backend="trtllm", max_running_requests=8)
    for role in ("prefill", "decode"):    # same backend on both PD roles
        assert flag(argv(p, role), "--dsa-prefill-backend") == "trtllm"
        assert flag(argv(p, role), "--dsa-decode-backend") == "trtllm"
    assert any("numerics differ slightly" in w for w in p["warnings"])
    refused("attention_backend=trtllm is offered on b300, gb300, b200, gb200 only", platform="mi355x",
            attention_backend="trtllm", agents=16)


def test_megamoe_sets_ep_to_tp_and_adds_flat_tp_flags_and_token_caps():
    p = plan(platform="b300", moe_runner="megamoe", max_running_requests=16)
    s = server(p, "unified")
    assert s["layout"]["ep"] == 8 and "--ep-size" not in s["ranks"][0]["argv"]
    assert flag(s["ranks"][0]["argv"], "--shared-experts-tp-size") == "1"
    assert s["ranks"][0]["env"]["SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK"] == "16384"
    p = plan(platform="b300", topology="pd", prefill_strategy="low-latency", moe_runner="megamoe",
             max_running_requests=16)
    assert env(p, "prefill")["SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK"] == "16384"
    assert env(p, "decode")["SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK"] == "4096"
    assert "--shared-experts-tp-size" not in argv(p, "decode")      # DCP cell: not flat TP
    assert server(p, "decode")["layout"]["ep"] == 8
    assert any("only been measured on the High-Throughput" in w for w in p["warnings"])


def test_megamoe_refuses_symm_mem_and_needs_max_running_requests_off_prefill():
    refused("enable_symm_mem=true deadlocks with moe_runner=megamoe", platform="b300", moe_runner="megamoe",
            enable_symm_mem=True, max_running_requests=8)
    refused("max_running_requests is not set.*MegaMoE on a non-prefill role", platform="b300",
            moe_runner="megamoe", speculative="none")
    args = argv(plan(platform="b300", enable_symm_mem=True, max_running_requests=8), "unified")
    assert flag(args, "--enable-symm-mem") is True      # fine with the TRT-LLM runner


def test_moe_runner_only_on_blackwell_platforms():
    refused("moe_runner=megamoe is offered on", platform="h200", moe_runner="megamoe")


def test_dflash_blocks_replayssm_and_both_pd_roles():
    p = plan(platform="b300", max_running_requests=8)
    args = argv(p, "unified")
    assert flag(args, "--speculative-algorithm") == "DFLASH"
    assert flag(args, "--speculative-dflash-block-size") == "8"
    assert flag(args, "--enable-linear-replayssm-spec") is True
    assert flag(args, "--speculative-draft-model-path") == catalog()["model"]["draft"]
    p = plan(platform="b300", topology="pd", decode_strategy="high-throughput", max_running_requests=8)
    assert flag(argv(p, "decode"), "--speculative-dflash-block-size") == "6"
    assert flag(argv(p, "prefill"), "--speculative-algorithm") == "DFLASH"     # prefill writes the ring
    assert "--enable-linear-replayssm-spec" not in argv(p, "prefill")
    assert flag(argv(p, "decode"), "--enable-linear-replayssm-spec") is True
    assert any("without speculation" in w for w in p["warnings"])


def test_dflash_needs_explicit_max_running_requests():
    msg = refused("max_running_requests is not set", platform="gb300")
    assert "DFLASH" in msg and "max_running_requests=N" in msg


def test_dflash_is_refused_with_the_pp_prefill_and_off_by_default_there():
    refused("speculative=dflash cannot run with the PP4 × PCP2 prefill", platform="gb300", topology="pd",
            prefill_strategy="high-throughput", speculative="dflash", max_running_requests=8)
    p = plan(platform="gb300", topology="pd", prefill_strategy="high-throughput")
    assert all(s["speculative"] == "none" for s in p["servers"])
    assert any("DFLASH is off" in w for w in p["warnings"])


def test_dflash_is_off_by_default_on_the_placeholder_shapes_and_the_plan_says_so():
    p = plan(platform="h200")
    assert server(p, "unified")["speculative"] == "none"
    assert ("DFLASH is off: the seed gives the h200 placeholder shape as a layout only (Recipe shapes); "
            "speculative=dflash adds it, derived") in p["warnings"]
    p = plan(platform="h200", speculative="dflash", max_running_requests=8)
    assert server(p, "unified")["speculative"] == "dflash" and not [w for w in p["warnings"] if "DFLASH is off" in w]
    assert not [w for w in plan(platform="h200", speculative="none")["warnings"] if "DFLASH is off" in w]


def test_mi35x_dflash_proposes_five_tokens_on_triton_with_replayssm_except_pd_prefill():
    p = plan(platform="mi355x", agents=92)
    for role in ("prefill", "decode"):
        assert flag(argv(p, role), "--speculative-dflash-block-size") == "6"
        assert flag(argv(p, role), "--speculative-draft-attention-backend") == "triton"
    assert "--enable-linear-replayssm-spec" not in argv(p, "prefill")
    assert flag(argv(p, "decode"), "--enable-linear-replayssm-spec") is True


def test_hicache_is_off_by_default_on_nvidia():
    args = argv(plan(platform="b300", max_running_requests=8), "unified")
    assert "--enable-hierarchical-cache" not in args


def test_nvidia_hicache_overlay_flags_and_decode_radix_cache():
    p = plan(platform="b300", topology="pd", kv_offload="hicache", max_running_requests=8)
    for role in ("prefill", "decode"):
        args = argv(p, role)
        assert flag(args, "--enable-hierarchical-cache") is True
        assert flag(args, "--hicache-io-backend") == "direct"
        assert flag(args, "--hicache-mem-layout") == "page_first_direct"
        assert flag(args, "--mamba-max-states-per-path") == "1"
        assert flag(args, "--dcp-size") == "8" or role == "prefill"     # L2 keeps DCP on K3.1 Pro
    assert flag(argv(p, "decode"), "--disaggregation-decode-enable-radix-cache") is True
    assert "--disaggregation-decode-enable-radix-cache" not in argv(p, "prefill")


def test_mi35x_hicache_is_write_back_with_host_ratios_and_keeps_every_kda_state():
    p = plan(platform="mi355x", agents=32)
    args, e = argv(p, "unified"), env(p, "unified")
    assert flag(args, "--hicache-write-policy") == "write_back"
    assert flag(args, "--hicache-ratio") == "2.5"
    assert "--mamba-max-states-per-path" not in args
    assert e["SGLANG_HICACHE_MAMBA_HOST_RATIO"] == "12" and e["HSA_USERPTR_FOR_PAGED_MEM"] == "0"
    p = plan(platform="mi355x", agents=92)
    assert env(p, "prefill")["SGLANG_HICACHE_MAMBA_HOST_RATIO"] == "8"
    assert "--enable-hierarchical-cache" not in argv(p, "decode")       # PD decode runs without it
    assert "SGLANG_HICACHE_MAMBA_HOST_RATIO" not in env(p, "decode")


def test_mi35x_low_latency_runs_without_hicache():
    refused("kv_offload=hicache: mi355x unified low-latency runs without HiCache", platform="mi355x",
            unified_strategy="low-latency", kv_offload="hicache", max_running_requests=4)
    # the 1P1D's prefill takes an explicit hicache; its decode runs without, and the plan says so
    p = plan(platform="mi355x", agents=92, kv_offload="hicache")
    assert server(p, "decode")["kv_offload"] == "none"
    assert "decode0: kv_offload=hicache does not reach this decode server: the mi355x decode high-throughput runs " \
           "without HiCache (seed AMD HiCache)" in p["warnings"]


def derived_tiers(p: dict) -> list[str]:
    return [w for w in p["warnings"] if "is derived; the seed measured" in w]


@pytest.mark.parametrize("knobs,derived", [
    # seed Agentic KV offload: NVIDIA's PD prefill was measured with HiCache, aggregated servers without
    ({"platform": "b300", "max_running_requests": 8}, []),
    ({"platform": "b300", "max_running_requests": 8, "kv_offload": "hicache"},
     ["unified0: kv_offload=hicache on a unified server is derived; the seed measured unified servers with "
      "kv_offload=none"]),
    ({"platform": "b300", "topology": "pd", "max_running_requests": 8},
     ["prefill0: kv_offload=none on a prefill server is derived; the seed measured prefill servers with "
      "kv_offload=hicache"]),
    # MI355X: "From 16 agents, HiCache in host DRAM (write-back), with the no-offload tier derived"
    ({"platform": "mi355x", "agents": 16}, []),
    ({"platform": "mi355x", "agents": 4}, []),
    ({"platform": "mi355x", "agents": 16, "kv_offload": "none"},
     ["unified0: kv_offload=none on a unified server is derived; the seed measured unified servers with "
      "kv_offload=hicache"]),
    ({"platform": "mi355x", "agents": 92}, []),
    ({"platform": "mi355x", "agents": 92, "kv_offload": "none"},
     ["prefill0: kv_offload=none on a prefill server is derived; the seed measured prefill servers with "
      "kv_offload=hicache"]),
])
def test_a_kv_offload_tier_the_seed_did_not_measure_is_called_derived(knobs, derived):
    assert derived_tiers(plan(**knobs)) == derived


# -- Tuning notes ----------------------------------------------------------------------------------

def test_pp_prefill_env():
    e = env(plan(platform="b300", topology="pd", prefill_strategy="high-throughput"), "prefill")
    assert e["SGLANG_PP_LAYER_PARTITION"] == "24,24,24,21" and e["CUDA_MODULE_LOADING"] == "EAGER"
    e = env(plan(platform="b300", topology="pd", prefill_strategy="high-throughput",
                 pp_layer_partition="23,24,24,22"), "prefill")
    assert e["SGLANG_PP_LAYER_PARTITION"] == "23,24,24,22"
    refused("pp_layer_partition=24,24,24 must be 4 positive layer counts summing to 93", platform="b300",
            topology="pd", prefill_strategy="high-throughput", pp_layer_partition="24,24,24")
    refused("pp_layer_partition=.*applies to the PP4 × PCP2 prefill only", platform="b300",
            pp_layer_partition="24,24,24,21", max_running_requests=8)


def test_kda_tuning_knobs_reach_the_engine():
    args = argv(plan(platform="b300", kda_state_slots=96, kda_states_per_path=2, max_running_requests=8),
                "unified")
    assert flag(args, "--max-mamba-cache-size") == "96" and flag(args, "--mamba-max-states-per-path") == "2"


# -- AMD MI350X / MI355X ---------------------------------------------------------------------------

@pytest.mark.parametrize("platform", ["mi350x", "mi355x"])
@pytest.mark.parametrize("agents", [1, 4, 8, 16, 56, 92])
def test_every_mi35x_cell_sets_the_four_aiter_variables(platform, agents):
    for s in plan(platform=platform, agents=agents)["servers"]:
        for rank in s["ranks"]:
            assert AITER.items() <= rank["env"].items()


def test_the_monokernel_without_dflash_is_called_derived():
    assert not [w for w in plan(platform="mi355x", agents=4)["warnings"] if "monokernel without DFLASH" in w]
    p = plan(platform="mi355x", agents=4, speculative="none")
    assert flag(argv(p, "unified"), "--enable-amd-monokernel") is True
    assert ("unified0: the monokernel without DFLASH is derived: the seed runs it with DFLASH (decode and verify "
            "steps), and SGLang stops at startup where it does not support a setup") in p["warnings"]


@pytest.mark.parametrize("agents,strategy,mono,hicache,mrr", [
    (1, "low-latency", True, False, 1),
    (4, "low-latency", True, False, 4),
    (8, "high-throughput", True, False, 8),
    (16, "high-throughput", False, True, 16),
    (48, "high-throughput", False, True, 48),
    (56, "high-throughput", False, True, 64),     # "64 at 56"
])
def test_mi355x_picks_the_single_node_recipe_by_agent_count(agents, strategy, mono, hicache, mrr):
    p = plan(platform="mi355x", agents=agents)
    assert p["topology"] == "unified" and p["router"] is None
    s = server(p, "unified")
    args, e = s["ranks"][0]["argv"], s["ranks"][0]["env"]
    assert s["strategy"] == strategy
    assert (flag(args, "--enable-amd-monokernel") is True) is mono
    assert (e.get("SGLANG_AMD_MONO_K31_WIDE") == "1") is mono
    assert (flag(args, "--enable-hierarchical-cache") is True) is hicache
    assert flag(args, "--max-running-requests") == str(mrr)
    assert flag(args, "--cuda-graph-max-bs-decode") == str(mrr)
    assert e["SGLANG_ROCM_RUNTIME_RESERVE_GB"] == ("6" if strategy == "low-latency" else "10")


def test_mi355x_past_56_agents_is_the_1p1d_behind_the_sglang_router():
    p = plan(platform="mi355x", agents=92)
    assert p["topology"] == "pd" and [s["role"] for s in p["servers"]] == ["prefill", "decode"]
    assert p["router"]["kind"] == "sglang" and p["router"]["argv"][:3] == ["python3", "-m",
                                                                          "sglang_router.launch_router"]
    assert flag(argv(p, "decode"), "--max-running-requests") == "92"


@pytest.mark.parametrize("agents", [0, 5, 6, 7, -3])
def test_mi355x_agent_counts_outside_the_seed_ranges_are_refused(agents):
    refused(r"agents=.*(outside the seed's measured ranges|out of range)", platform="mi355x", agents=agents)


def test_agents_contradicting_explicit_strategy_or_topology_are_refused():
    refused("unified_strategy=high-throughput contradicts agents=4", platform="mi355x", agents=4,
            unified_strategy="high-throughput")
    refused("topology=unified contradicts agents=92", platform="mi355x", agents=92, topology="unified")


def test_monokernel_limits():
    refused("monokernel=true is the MI350X / MI355X decode monokernel", platform="b300", monokernel=True,
            max_running_requests=8)
    refused("monokernel=true does not accept KV offload", platform="mi355x", agents=16, monokernel=True)
    p = plan(platform="mi355x", agents=16, monokernel=True, kv_offload="none")
    assert flag(argv(p, "unified"), "--enable-amd-monokernel") is True
    p = plan(platform="mi355x", agents=92, monokernel=True, kv_offload="none")
    assert "--enable-amd-monokernel" not in argv(p, "prefill")          # no decode steps there
    assert flag(argv(p, "decode"), "--enable-amd-monokernel") is True


def test_mi35x_mem_fraction_static_that_overflowed_gtt_is_refused():
    refused("mem_fraction_static=0.87 is too high on the mi355x single-node recipe", platform="mi355x",
            agents=16, mem_fraction_static=0.87)
    args = argv(plan(platform="mi355x", agents=16, mem_fraction_static=0.85), "unified")
    assert flag(args, "--mem-fraction-static") == "0.85"


def test_prefill_decode_interval_on_unified_only():
    assert flag(argv(plan(platform="mi355x", agents=48, prefill_decode_interval=16), "unified"),
                "--prefill-decode-interval") == "16"
    refused("prefill_decode_interval=16 applies to unified servers only", platform="mi355x", agents=92,
            prefill_decode_interval=16)


@pytest.mark.parametrize("knobs,rdma", [
    ({"agents": 92}, True),                                  # the 1P1D: Mooncake moves the KV over RDMA
    ({"agents": 16, "kv_offload": "mooncake"}, True),        # a Mooncake store
    ({"agents": 16}, False),                                 # one node, nothing leaves it
    ({"agents": 4}, False),
])
def test_mi35x_containers_map_the_rdma_devices_where_kv_moves_between_nodes(knobs, rdma):
    # seed "On AMD MI355X" (PD): add --device=/dev/infiniband --cap-add=IPC_LOCK --ulimit memlock=-1
    # --network=host; a single node without RDMA devices must still start (a missing --device fails the run)
    flags = plan(platform="mi355x", **knobs)["container_flags"]
    for needed in ("memlock=-1", "--network=host"):
        assert needed in flags
    assert ("--device=/dev/infiniband" in flags) is rdma and ("--cap-add=IPC_LOCK" in flags) is rdma


# -- 3.3 PD Disaggregation ---------------------------------------------------------------------------

def test_pd_ports_bootstrap_and_mooncake():
    p = plan(platform="mi355x", agents=92)
    pre, dec = server(p, "prefill"), server(p, "decode")
    assert (pre["port"], pre["bootstrap_port"], dec["port"], dec["bootstrap_port"]) == (30000, 8998, 30100, None)
    assert flag(argv(p, "prefill"), "--disaggregation-bootstrap-port") == "8998"
    assert flag(argv(p, "prefill"), "--disaggregation-mode") == "prefill"
    assert flag(argv(p, "decode"), "--disaggregation-mode") == "decode"
    for role in ("prefill", "decode"):
        assert flag(argv(p, role), "--disaggregation-transfer-backend") == "mooncake"
    r = p["router"]["argv"]
    i = r.index("--prefill")
    assert r[i + 1:i + 3] == [f"http://{pre['ranks'][0]['address']}:30000", "8998"]
    assert flag(r, "--decode") == f"http://{dec['ranks'][0]['address']}:30100"


def test_dcp_rejects_other_transfer_backends():
    refused("transfer_backend=nixl is rejected by DCP", platform="mi355x", agents=92, transfer_backend="nixl")


def test_seed_sgl_router_command():
    p = plan(platform="gb300", topology="pd", router="sglang", speculative="none",
             model_path="/models/Kimi-K3.1-Pro")
    r = p["router"]
    assert r["dialect"] == "sgl-router" and r["env"] == {"SGLANG_ROUTER_STREAM_IDLE_TIMEOUT_SECS": "3600"}
    args = r["argv"]
    assert args[:2] == ["sgl-router", "--pd-disaggregation"]
    # the seed binds 0.0.0.0; k31 the router host's public address (here its placeholder name)
    assert flag(args, "--host") == "node0" and flag(args, "--port") == "8000"
    assert flag(args, "--policy") == "power_of_two" and flag(args, "--request-timeout-secs") == "540"
    assert flag(args, "--model-id") == "moonshotai/Kimi-K3.1-Pro"
    assert flag(args, "--tokenizer-path") == "/models/Kimi-K3.1-Pro/tokenizer.json"
    assert r["mounts"] == ["/models/Kimi-K3.1-Pro"]      # read-only in the router's container, on engine host node0
    assert "--prometheus-host" not in args            # not a flag of that CLI
    assert "--worker-startup-timeout-secs" not in args    # nor this one (catalog: startup_timeout false)
    assert any("router=sglang is derived" in w for w in p["warnings"])


def test_pypi_launch_router_dialect_sets_metrics_listener_explicitly():
    r = plan(platform="mi355x", agents=92)["router"]
    assert r["dialect"] == "launch_router"
    assert flag(r["argv"], "--prometheus-host") == "node0" and flag(r["argv"], "--prometheus-port") == "29000"
    assert "--model-id" not in r["argv"] and "--tokenizer-path" not in r["argv"]
    # the engine (its CLI) decides, and the plan says where it departs from the seed's command
    assert ("router_dialect=launch_router takes no --model-id (PyPI sglang-router 0.3.2): k31 leaves out seed 3.3's "
            "--model-id, and its --tokenizer-path with it (power_of_two routing reads no tokens)"
            in plan(platform="mi355x", agents=92)["warnings"])
    unified = plan(platform="mi355x", agents=16, router="sglang")["warnings"]    # the seed's command is PD's
    assert not [w for w in unified if "--model-id" in w]


def test_launch_router_command_is_complete_in_the_plan_with_its_startup_timeout():
    # The exact command the router unit runs (its role adds only the keys, through k31-secret-exec); the
    # startup timeout comes last, where router.sh.j2 appended it before it moved into the plan.
    assert plan(platform="mi355x", agents=92)["router"]["argv"] == [
        "python3", "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", "http://node0:30000", "8998", "--decode", "http://node1:30100",
        "--host", "node0", "--port", "8000", "--policy", "power_of_two", "--request-timeout-secs", "540",
        "--prometheus-host", "node0", "--prometheus-port", "29000", "--worker-startup-timeout-secs", "7200"]
    unified = plan(platform="mi355x", agents=16, router="sglang", router_worker_startup_timeout=900)["router"]
    assert unified["argv"][-4:] == ["--prometheus-port", "29000", "--worker-startup-timeout-secs", "900"]
    assert unified["argv"].count("--worker-startup-timeout-secs") == 1
    assert plan(platform="mi355x", agents=92, public_tls=True)["router"]["argv"][-6:] == [
        "--tls-cert-path", "/etc/k31/tls/public.crt", "--tls-key-path", "/etc/k31/tls/public.key",
        "--worker-startup-timeout-secs", "7200"]


@pytest.mark.parametrize("knobs", [
    {"platform": "gb300", "topology": "pd", "router": "sglang", "speculative": "none"},    # sgl-router
    {"platform": "gb300", "topology": "pd"},                                                # dynamo
    {"platform": "mi355x", "agents": 16},                                                   # no router
])
def test_router_startup_timeout_knob_is_refused_where_no_router_takes_it(knobs):
    refused("router_worker_startup_timeout=60 applies to router=sglang with router_dialect=launch_router only",
            **knobs, router_worker_startup_timeout=60)


def test_pd_needs_a_router():
    refused("router=none cannot serve topology=pd", platform="mi355x", agents=92, router="none")


# -- Agentic Long-Context Deployment: Dynamo ---------------------------------------------------------

def test_nvidia_defaults_to_dynamo_with_kv_router_and_session_affinity():
    p = plan(platform="gb300", topology="pd", max_running_requests=32)
    r = p["router"]
    assert r["kind"] == "dynamo"
    assert r["argv"][:3] == ["python3", "-m", "dynamo.frontend"]
    assert flag(r["argv"], "--router-mode") == "kv"
    assert int(flag(r["argv"], "--router-session-affinity-ttl-secs")) > 0
    # a redeploy's SIGTERM takes a worker out of discovery; the frontend resends what it cancelled there
    assert int(flag(r["argv"], "--migration-limit")) >= 1
    for s in p["servers"]:
        args = s["ranks"][0]["argv"]
        assert args[:3] == ["python3", "-m", "dynamo.sglang"]
        assert "--port" not in args and "--host" not in args
        assert s["ranks"][0]["env"]["DYN_SYSTEM_PORT"] == str(s["port"])


# -- 3.1 / 3.2 parsers, 3.4 TPU7x --------------------------------------------------------------------

def test_every_server_runs_the_kimi_parsers_and_metrics():
    for s in plan(platform="mi355x", agents=92)["servers"]:
        args = s["ranks"][0]["argv"]
        assert flag(args, "--reasoning-parser") == "kimi_k3" and flag(args, "--tool-call-parser") == "kimi_k3"
        assert flag(args, "--enable-metrics") is True
        assert flag(args, "--served-model-name") == "moonshotai/Kimi-K3.1-Pro"


def test_tpu7x_runs_the_tpu_launcher_on_every_host():
    p = plan(platform="tpu7x")
    s = server(p, "unified")
    assert s["layout"]["tp"] == 32 and s["layout"]["ep"] == 8 and s["layout"]["nnodes"] == 8
    for rank in s["ranks"]:
        assert rank["argv"] == ["python3", "-m", "benchmark.tpu.launch_server", "--config",
                                "recipe/configs/kimi_k3_1/server.py"]
    assert p["image"] is None
    refused("speculative does not apply to tpu7x", platform="tpu7x", speculative="dflash")
    message = refused("agents does not apply to tpu7x", platform="tpu7x", agents=4)
    assert message.endswith("valid knobs there: platform, topology, unified_strategy, image, router, router_dialect")
    # the TPU launcher is no dynamo.sglang worker: a Dynamo frontend would wait for workers that never register
    refused(r"router=dynamo needs dynamo.sglang workers.*valid choices there: none, sglang", platform="tpu7x",
            router="dynamo")
    assert plan(platform="tpu7x", router="sglang")["router"]["kind"] == "sglang"


def test_verification_warnings_for_unmeasured_cells():
    p = plan(platform="h100")
    assert any("placeholder shape" in w and "Not Verified" in w for w in p["warnings"])
    p = plan(platform="mi350x", agents=16)
    assert server(p, "unified")["verification"] == "in-progress"
    assert any("Final Verification In Progress" in w for w in p["warnings"])
    # the measured MI355X cell warns only that its HiCache + DCP + DFLASH needs the recipe's branch
    (only,) = plan(platform="mi355x", agents=16, draft_model_path="/models/draft")["warnings"]
    assert only.startswith("unified0: hicache-dcp-dflash runs only on the recipe's kimi-k31-pro branch")
