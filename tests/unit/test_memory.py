"""The memory planner (k31deploy/memory.py): each formula, the seed's own figures, every catalog cell."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
from recipe_helpers import cell_knobs

from k31deploy.errors import K31Error
from k31deploy.memory import GB, GIB, Options, annotate_plan, calc, constants, host_memory_need, server_memory
from k31deploy.recipe import Host, iter_cells, resolve

CELLS = list(iter_cells())
KDA_TP8 = 52_000_000      # seed Tuning notes: ~52 MB per request per rank at TP8
KV_TOKEN = 18_900         # seed Tuning notes: ~18.9 KB per token


def server(plan: dict, role: str) -> dict:
    (found,) = [s for s in plan["servers"] if s["role"] == role]
    return found


def memory(role: str = "unified", opts: Options | None = None, **knobs) -> dict:
    plan = resolve(knobs)
    return server_memory(plan, server(plan, role), opts)


def sparse_checkpoint(root: Path, sizes: list[int]) -> Path:
    """Shards of the given sizes that take no disk space (sizes are what the planner reads)."""
    root.mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(sizes):
        with (root / f"model-{i:05d}.safetensors").open("wb") as fh:
            fh.truncate(size)
    (root / "config.json").write_text("{}")
    return root


# -- the per-unit formulas ---------------------------------------------------------------------------

@pytest.mark.parametrize("knobs,role,expected", [
    ({"platform": "mi355x", "agents": 4}, "unified", KDA_TP8),                       # TP8
    ({"platform": "mi355x", "agents": 16}, "unified", KDA_TP8),                      # TP8 · DCP8: not by DCP
    ({"platform": "b200", "max_running_requests": 8}, "unified", KDA_TP8 * 8 / 16),  # TP16 · DCP16
    ({"platform": "h100", "max_running_requests": 8}, "unified", KDA_TP8 * 8 / 32),  # TP32
    # WideEP: TP16 with attention DP2 -> attention TP8
    ({"platform": "gb300", "topology": "pd", "wide_ep": True, "max_running_requests": 8}, "decode", KDA_TP8),
    # PP4 × PCP2 with TP2: attention TP2 / PCP2 = 1 holds every head, each PP stage a quarter of the layers
    ({"platform": "b300", "topology": "pd", "prefill_strategy": "high-throughput", "speculative": "none",
      "max_running_requests": 8}, "prefill", KDA_TP8 * 8 / 1 / 4),
])
def test_kda_state_shards_over_attention_tp_and_pp_not_dcp(knobs, role, expected):
    assert memory(role, **knobs)["kda_bytes_per_request"] == round(expected)


@pytest.mark.parametrize("knobs,role,expected", [
    ({"platform": "mi355x", "agents": 4, "speculative": "none"}, "unified", KV_TOKEN),        # TP replicates
    ({"platform": "mi355x", "agents": 16, "speculative": "none"}, "unified", KV_TOKEN / 8),   # DCP8 shards
    ({"platform": "mi355x", "agents": 16}, "unified", KV_TOKEN / 8 * 1.15),                   # + DFLASH ring
    ({"platform": "b200", "max_running_requests": 8}, "unified", KV_TOKEN / 16),              # DCP16
    ({"platform": "b300", "topology": "pd", "prefill_strategy": "high-throughput", "speculative": "none",
      "max_running_requests": 8}, "prefill", KV_TOKEN / 4),                                   # PCP2 · PP4
])
def test_mla_kv_per_token_is_sharded_by_dcp_only(knobs, role, expected):
    assert memory(role, **knobs)["kv_bytes_per_token"] == pytest.approx(expected)


def test_seed_dcp8_divides_the_per_rank_kv_by_8():
    tp8 = memory(platform="mi355x", agents=4, speculative="none")
    dcp8 = memory(platform="mi355x", agents=16, speculative="none")
    assert tp8["kv_bytes_per_token"] / dcp8["kv_bytes_per_token"] == 8
    # the same pool holds 8 times the tokens
    opts = Options(weights_gb_per_gpu=200)
    m = memory(opts=opts, platform="mi355x", agents=16, speculative="none", kda_state_slots=192)
    assert m["kv_tokens"] == (m["pool_bytes"] - m["kda_pool_bytes"]) // (KV_TOKEN / 8)


def test_pool_is_static_share_less_weights_reserve_and_workspace():
    m = memory(opts=Options(weights_gb_per_gpu=200), platform="mi355x", agents=16, mem_fraction_static=0.85)
    gpu = 288 * GIB
    assert m["gpu_bytes"] == gpu
    assert m["static_bytes"] == int(0.85 * gpu)
    assert m["runtime_reserve_bytes"] == 10 * GIB          # seed: 10 at DCP8
    assert m["pool_bytes"] == int(0.85 * gpu) - 200 * GB - 10 * GIB
    assert memory(platform="mi355x", agents=4)["runtime_reserve_bytes"] == 6 * GIB   # 6 at TP8
    assert memory(platform="b300", max_running_requests=8)["runtime_reserve_bytes"] == 0


def test_megamoe_workspace_grows_with_ep_times_the_token_cap():
    per = constants()["megamoe"]["workspace_bytes_per_token_per_ep_rank"]
    prefill = memory("prefill", platform="b300", topology="pd", prefill_strategy="high-throughput",
                     speculative="none", max_running_requests=8)
    assert prefill["megamoe_workspace_bytes"] == 2 * 16384 * per        # MegaMoE EP2, cap 16384
    wide = memory("decode", platform="gb300", topology="pd", wide_ep=True, max_running_requests=8)
    assert wide["megamoe_workspace_bytes"] == 16 * 4096 * per           # EP16, decode cap 4096
    capped = memory("decode", platform="gb300", topology="pd", wide_ep=True, max_running_requests=8,
                    megamoe_token_cap=1024)
    assert capped["megamoe_workspace_bytes"] == wide["megamoe_workspace_bytes"] // 4
    assert memory(platform="b300", max_running_requests=8)["megamoe_workspace_bytes"] == 0


def upstream_auto_fraction(gpu_mib, chunk, bs, tp, pp=1, dp=1, spec=False):
    """server_args.py _handle_gpu_memory_settings, written out independently."""
    reserved = 512 + max(chunk, 2048) * 1.5 + bs * 2 + tp * pp / 8 * 1024
    if dp > 1:
        reserved += bs * dp * 3 + (bs * dp * 1.5 if bs > 300 else 0)
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    reserved += 2048 if spec else 0
    return round((gpu_mib - reserved) / gpu_mib, 3)


@pytest.mark.parametrize("knobs,role,expected", [
    ({"platform": "h100", "max_running_requests": 8}, "unified",
     upstream_auto_fraction(80 * 1024, 8192, 512, 32)),
    ({"platform": "h200", "max_running_requests": 8}, "unified",
     upstream_auto_fraction(141 * 1024, 8192, 512, 16)),
    ({"platform": "gb300", "topology": "pd", "wide_ep": True, "max_running_requests": 8}, "decode",
     upstream_auto_fraction(288 * 1024, 16384, 512, 16, dp=2, spec=True)),
])
def test_default_mem_fraction_is_upstreams_automatic_value(knobs, role, expected):
    assert memory(role, **knobs)["mem_fraction_static"] == expected


def test_mi35x_single_node_plans_emit_the_fraction_below_the_gtt_overflow():
    # upstream's automatic value there (~0.90) is above the 0.87 / 0.88 that overflowed GTT (seed)
    assert upstream_auto_fraction(288 * 1024, 16384, 64, 8, spec=True) > 0.87
    assert memory("unified", platform="mi355x", agents=56)["mem_fraction_static"] == 0.86


def test_the_plans_mem_fraction_wins_and_mi35x_single_node_above_086_is_noted():
    m = memory(platform="mi355x", agents=56, mem_fraction_static=0.8)
    assert m["mem_fraction_static"] == 0.8 and not m["notes"]
    auto = memory(platform="mi355x", agents=56)    # the plan emits 0.86 there (seed AMD Memory)
    assert auto["mem_fraction_static"] == 0.86 and not any("overflowed GTT" in n for n in auto["notes"])


# -- the split between KDA slots and KV ----------------------------------------------------------------

def test_default_split_follows_upstream_mamba_full_memory_ratio():
    m = memory(opts=Options(weights_gb_per_gpu=200), platform="mi355x", agents=56)
    pool, k, c = m["pool_bytes"], m["kda_bytes_per_request"], m["kv_bytes_per_token"]
    slots = int(pool * 0.9 / 1.9 // k)
    assert m["kda_slots"] == slots and m["kda_pool_bytes"] == slots * k
    assert m["kv_tokens"] == int((pool - slots * k) // c)
    assert m["kda_slots_per_request"] == 3                       # radix cache on
    assert m["max_concurrency"] == min(slots // 3, m["kv_tokens"] // 2)
    assert m["fits"] is True


def test_explicit_slot_count_is_split_over_dp_workers():
    opts = Options(weights_gb_per_gpu=100)
    m = memory("decode", opts, platform="gb300", topology="pd", wide_ep=True, max_running_requests=64,
               kda_state_slots=300)
    assert m["kda_slots"] == 300 and m["kda_pool_bytes"] == 150 * m["kda_bytes_per_request"]
    per_worker = (m["pool_bytes"] - m["kda_pool_bytes"]) // m["kv_bytes_per_token"]
    assert m["kv_tokens"] == 2 * per_worker


def test_pd_decode_keeps_one_kda_slot_per_request():
    m = memory("decode", Options(weights_gb_per_gpu=200), platform="mi355x", agents=92)
    assert m["kda_slots_per_request"] == 1
    assert m["kda_slots"] == 92 and m["kda_pool_bytes"] == 92 * KDA_TP8
    # radix cache off: the pool must hold one KDA state and the context's KV for each request
    long = memory("decode", Options(context_length=100_000), platform="mi355x", agents=92)
    avail = long["static_bytes"] - long["runtime_reserve_bytes"]
    need = 92 * (KDA_TP8 + 100_000 * long["kv_bytes_per_token"])
    assert long["weights_headroom_bytes"] == int(avail - need)
    radix = memory("decode", Options(weights_gb_per_gpu=200), platform="b300", topology="pd",
                   max_running_requests=64, decode_radix_cache=True)
    assert radix["kda_slots_per_request"] == 1 and radix["kda_slots"] > 64   # ratio split, 1 slot a request


def test_seed_52_mb_times_the_mi355x_64_request_cell():
    # seed: --max-running-requests follows the agent count, 64 at 56 agents
    m = memory(platform="mi355x", agents=56, opts=Options(weights_gb_per_gpu=200))
    assert m["max_running_requests"] == 64
    assert m["kda_bytes_per_request"] * 64 == 3_328_000_000                  # 52 MB x 64 = 3.33 GB per GPU
    assert m["recommended_max_mamba_cache_size"] == 64 * 3                    # radix: 3 slots a request
    pd = memory("decode", Options(weights_gb_per_gpu=200), platform="mi355x", agents=92,
                max_running_requests=64)
    assert pd["kda_pool_bytes"] == 64 * KDA_TP8 == 3_328_000_000


def test_recommended_settings_round_trip():
    opts = Options(weights_gb_per_gpu=200)
    m = memory(opts=opts, platform="mi355x", agents=56)
    ratio, slots = m["recommended_mamba_full_memory_ratio"], m["recommended_max_mamba_cache_size"]
    by_ratio = memory(opts=opts, platform="mi355x", agents=56, mamba_full_memory_ratio=ratio)
    assert by_ratio["kda_slots"] >= slots and by_ratio["fits"] is True
    assert by_ratio["kv_tokens"] > m["kv_tokens"]                            # the rest goes to KV
    by_slots = memory(opts=opts, platform="mi355x", agents=56, kda_state_slots=slots)
    assert by_slots["kda_slots"] == slots and by_slots["max_concurrency"] == 64 and by_slots["fits"] is True
    with pytest.raises(K31Error, match="too few KDA slots"):    # the resolver refuses what cannot fit
        memory(opts=opts, platform="mi355x", agents=56, kda_state_slots=slots - 1)


def test_context_length_bounds_the_concurrency():
    opts = dict(weights_gb_per_gpu=200)
    short = memory(opts=Options(context_length=32_000, **opts), platform="mi355x", agents=56)
    long = memory(opts=Options(context_length=1_000_000, **opts), platform="mi355x", agents=56)
    assert long["max_concurrency"] < short["max_concurrency"]
    assert long["max_concurrency"] == min(long["kda_slots"] // 3, long["kv_tokens"] // 1_000_000)
    pool, k, c = long["pool_bytes"], long["kda_bytes_per_request"], long["kv_bytes_per_token"]
    assert long["max_concurrency_best_split"] == int(pool // (3 * k + 1_000_000 * c))


def test_concurrency_option_sizes_as_if_max_running_requests():
    m = memory(opts=Options(weights_gb_per_gpu=200, concurrency=10), platform="mi355x", agents=56)
    assert m["max_running_requests"] == 10 and m["recommended_max_mamba_cache_size"] == 30


# -- weights from a checkpoint ---------------------------------------------------------------------------

def test_checkpoint_weights_are_divided_by_tp_times_pp(tmp_path):
    ckpt = sparse_checkpoint(tmp_path / "model", [400 * GB, 400 * GB, 200 * GB])
    draft = sparse_checkpoint(tmp_path / "draft", [8 * GB])
    m = memory(opts=Options(checkpoint=str(ckpt)), platform="b300", max_running_requests=8)
    assert m["weights_bytes"] == 1000 * GB // 8
    pp = memory("prefill", Options(checkpoint=str(ckpt)), platform="b300", topology="pd",
                prefill_strategy="high-throughput", speculative="none", max_running_requests=8)
    assert pp["weights_bytes"] == 1000 * GB // (2 * 4)                      # TP2 x PP4
    both = memory(opts=Options(checkpoint=str(ckpt), draft_checkpoint=str(draft)), platform="b300",
                  max_running_requests=8)
    assert both["weights_bytes"] == 1000 * GB // 8 + 8 * GB // 8


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_checkpoint_without_safetensors_is_refused(tmp_path, make):
    path = tmp_path / "ckpt"
    if make == "empty":
        path.mkdir()
        (path / "model.bin").write_text("x")
    with pytest.raises(K31Error, match="--checkpoint"):
        memory(opts=Options(checkpoint=str(path)), platform="b300", max_running_requests=8)


# -- host tier -----------------------------------------------------------------------------------------

def test_host_pools_follow_hicache_ratio_and_mamba_host_ratio():
    plan = resolve({"platform": "mi355x", "agents": 92})
    annotate_plan(plan, Options(weights_gb_per_gpu=220))
    pre, dec = server(plan, "prefill")["memory"], server(plan, "decode")["memory"]
    target_kv = pre["kv_tokens"] * KV_TOKEN / 8                              # without the draft ring
    kda = pre["kda_slots"] * KDA_TP8
    assert pre["host_pinned_bytes_per_gpu"] == int(2.5 * target_kv + 8 * kda)   # PD prefill: host ratio 8
    assert pre["host_pinned_bytes_per_node"] == 8 * pre["host_pinned_bytes_per_gpu"]
    assert pre["host_needed_bytes_per_node"] == pre["host_pinned_bytes_per_node"] + 10 * GIB
    assert dec["host_pinned_bytes_per_gpu"] == 0                   # the PD decode runs without HiCache
    unified = memory(opts=Options(weights_gb_per_gpu=220), platform="mi355x", agents=56)
    expect = 2.5 * unified["kv_tokens"] * KV_TOKEN / 8 + 12 * unified["kda_slots"] * KDA_TP8
    assert unified["host_pinned_bytes_per_gpu"] == int(expect)                # unified: host ratio 12


def test_seed_190_gb_per_gpu_is_about_1_5_tb_per_node():
    """Find the weights at which the MI355X DCP8 recipe pins the seed's ~190 GB per GPU; the node then
    pins about the seed's 1.5 TB."""
    seed = constants()["hicache"]
    lo, hi = 1.0, 270.0
    for _ in range(60):
        mid = (lo + hi) / 2
        pinned = memory(opts=Options(weights_gb_per_gpu=mid), platform="mi355x", agents=56)
        if pinned["host_pinned_bytes_per_gpu"] > seed["seed_pinned_per_gpu_bytes"]:
            lo = mid
        else:
            hi = mid
    assert pinned["host_pinned_bytes_per_gpu"] == pytest.approx(seed["seed_pinned_per_gpu_bytes"], rel=0.01)
    assert pinned["host_pinned_bytes_per_node"] == 8 * pinned["host_pinned_bytes_per_gpu"]
    assert pinned["host_pinned_bytes_per_node"] == pytest.approx(seed["seed_pinned_per_node_bytes"], rel=0.05)
    assert pinned["weights_bytes"] < pinned["static_bytes"]


def test_mooncake_store_segment_adds_host_memory():
    opts = Options(weights_gb_per_gpu=100)
    l2 = memory(opts=opts, platform="b300", max_running_requests=64, kv_offload="hicache")
    l3 = memory(opts=opts, platform="b300", max_running_requests=64, kv_offload="mooncake")
    assert l3["host_pinned_bytes_per_gpu"] - l2["host_pinned_bytes_per_gpu"] == 16 * GIB   # "16gb" segment
    upstream_ratio = 2.0    # CUDA cells emit no --hicache-ratio; the KDA host pool follows it too
    expect = upstream_ratio * l2["kv_tokens"] * KV_TOKEN + upstream_ratio * l2["kda_pool_bytes"]
    assert l2["host_pinned_bytes_per_gpu"] == int(expect)


def test_host_memory_need_per_host_for_preflight():
    plan = resolve({"platform": "mi355x", "agents": 92})
    with pytest.raises(K31Error, match="weights per GPU"):
        host_memory_need(plan, "node0")
    assert host_memory_need(plan, "node1") == 0                       # decode: no host tier
    opts = Options(weights_gb_per_gpu=220)
    need = host_memory_need(plan, Host("node0", "node0", ()), opts)
    annotate_plan(plan, opts)
    assert need == server(plan, "prefill")["memory"]["host_needed_bytes_per_node"] > 0
    assert host_memory_need(plan, "node0") == need                      # from the annotated sections
    assert host_memory_need(plan, "elsewhere") == 0


def test_host_dram_default_and_override():
    m = memory(opts=Options(weights_gb_per_gpu=220), platform="mi355x", agents=56)
    assert m["host_dram_bytes_per_node"] == 3072 * GIB
    small = memory(opts=Options(weights_gb_per_gpu=220, host_dram_gb=1000), platform="mi355x", agents=56)
    assert small["host_dram_bytes_per_node"] == 1000 * GB
    assert small["host_fits"] is (small["host_needed_bytes_per_node"] <= 1000 * GB)
    assert memory(platform="vera-rubin", max_running_requests=8)["host_dram_bytes_per_node"] is None


# -- annotate_plan: refusals and the contract ---------------------------------------------------------------

def test_plan_that_cannot_fit_even_without_weights_is_refused_with_numbers():
    with pytest.raises(K31Error) as info:
        resolve({"platform": "mi355x", "max_running_requests": 100_000})
    message = str(info.value)
    assert "max_running_requests=100000" in message and "GB" in message and "\n" not in message


def test_a_refusal_without_weights_names_the_setting_out_of_range():
    with pytest.raises(K31Error, match=r"; lower kda_state_slots: its KDA states alone need [0-9.e+]+ TB$"):
        resolve({"platform": "gb300", "kda_state_slots": 2**31 - 1, "max_running_requests": 8})
    with pytest.raises(K31Error, match=r"; the static memory fraction came out at or below 0: lower "
                                       r"cuda_graph_max_bs_decode or set mem_fraction_static$"):
        resolve({"platform": "gb300", "cuda_graph_max_bs_decode": 999_999_999, "max_running_requests": 8})
    with pytest.raises(K31Error) as info:    # max_running_requests itself too high: no other setting named
        resolve({"platform": "mi355x", "max_running_requests": 100_000})
    assert str(info.value).endswith("it needs")


def test_weights_past_the_headroom_are_refused():
    head = memory(platform="mi355x", agents=56)["weights_headroom_bytes"]
    fits = resolve({"platform": "mi355x", "agents": 56})
    annotate_plan(fits, Options(weights_gb_per_gpu=(head - 5 * GB) / GB))
    assert server(fits, "unified")["memory"]["fits"] is True
    heavy = Options(weights_gb_per_gpu=(head + 5 * GB) / GB)
    with pytest.raises(K31Error, match=r"max_running_requests=64 .*at most \d+"):
        annotate_plan(resolve({"platform": "mi355x", "agents": 56}), heavy)


def test_too_few_explicit_kda_slots_are_refused_without_weights():
    with pytest.raises(K31Error, match="too few KDA slots"):
        annotate_plan(resolve({"platform": "mi355x", "agents": 56, "kda_state_slots": 10}))


def test_weights_filling_the_static_share_cannot_load():
    _, refusals = calc(resolve({"platform": "mi355x", "agents": 56}), Options(weights_gb_per_gpu=290))
    assert refusals and "cannot load" in refusals[0]


@pytest.mark.parametrize("field,value", [
    ("weights_gb_per_gpu", 0), ("weights_gb_per_gpu", -1), ("context_length", 0), ("concurrency", -5),
    ("host_dram_gb", 0), ("weights_gb_per_gpu", math.nan),
])
def test_bad_sizes_are_refused(field, value):
    with pytest.raises(K31Error, match=field.replace("_", "-")):
        Options(**{field: value})


def test_weights_larger_than_the_gpu_are_refused():
    with pytest.raises(K31Error, match="larger than"):
        memory(opts=Options(weights_gb_per_gpu=400), platform="mi355x", agents=56)


@pytest.mark.parametrize("platform,role,strategy,cell", CELLS, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CELLS])
def test_every_cell_default_plan_passes_and_only_gains_memory(platform, role, strategy, cell):
    plan = resolve(cell_knobs(platform, role, strategy, cell))    # the resolver annotates every plan
    again = copy.deepcopy(plan)
    annotate_plan(again)
    assert again == plan                                          # annotating is idempotent
    for s in plan["servers"]:
        m = s.pop("memory")
        assert m["fits"] is None and m["kda_bytes_per_request"] > 0 and m["derivation"]
    assert all("memory" not in key for key in plan)               # nothing else of the plan changed


@pytest.mark.parametrize("agents", [1, 4, 8, 16, 48, 56, 57, 92, 200])
@pytest.mark.parametrize("platform", ["mi355x", "mi350x"])
def test_every_amd_agent_recipe_passes(platform, agents):
    annotate_plan(resolve({"platform": platform, "agents": agents}))


@pytest.mark.parametrize("platform,role,strategy,cell", CELLS, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CELLS])
def test_every_cell_through_calc_with_measured_weights(tmp_path, platform, role, strategy, cell):
    ckpt = sparse_checkpoint(tmp_path / "ckpt", [500 * GB, 500 * GB])    # a 1 TB checkpoint
    plan = resolve(cell_knobs(platform, role, strategy, cell))
    report, refusals = calc(plan, Options(checkpoint=str(ckpt), context_length=4096))
    assert not refusals
    for s in report["servers"]:
        m, lay = s["memory"], s["layout"]
        assert m["weights_bytes"] == 1000 * GB // (lay["tp"] * lay["pp"])
        assert m["kv_tokens"] > 0 and m["kda_slots"] > 0 and m["max_concurrency"] >= 0
        assert set(m["derivation"]) >= {"gpu_bytes", "mem_fraction_static", "pool_bytes", "kv_tokens",
                                        "kda_slots", "max_concurrency"}
    assert [h["host"] for h in report["hosts"]] == [r["host"] for s in plan["servers"] for r in s["ranks"]]
