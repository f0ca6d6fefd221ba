"""Engine acceptance: every planned command against real SGLang's own parser (the CLI dump) and against
what real SGLang's argument resolution said of it on a GPU machine (the engine lane's record).

The dump (data/engine/sglang-0.5.23.cli.json) is scripts/upstream-cli's output; the record
(data/engine/sglang-0.5.23.lane.json) is scripts/engine-lane's. Neither is written by hand.
"""

from __future__ import annotations

import json
import time

import pytest

from k31deploy import lane_cases as cases
from k31deploy.engine import cli, lane
from k31deploy.errors import K31Error
from k31deploy.recipe import catalog, flag_registry, resolve
from k31deploy.recipe.resolver import cell_digest

BUILD = "sglang-0.5.23"
RECORD = lane.record(BUILD)
BRANCH_VALUES = {flag: set(spec.get("branch_choices", {})) for flag, spec in flag_registry()["engine"].items()}


def engine_flags(server: dict) -> list[str]:
    argv = server["ranks"][0]["argv"]
    return argv[next(i for i, t in enumerate(argv) if t.startswith("--")):]


# -- the dump: every cell and every Advanced Features knob value, offline -----------------------------


def test_every_planned_command_parses_with_the_engine_build_it_is_planned_for():
    """Every case of the lane (catalog cells x knob values x engine builds) through k31's resolver, each
    engine command checked flag by flag against the dump: flag known, value of its type, among its
    choices. Branch-only values pass only on the branch build, flagged in the plan and warned about."""
    started = time.monotonic()
    planned = branch_uses = 0
    for case_id, plan in cases.plans():
        if plan["platform"] == "tpu7x":
            continue
        branch = plan["engine"]["branch"]
        for server in plan["servers"]:
            planned += 1
            argv = engine_flags(server)
            assert cli.check(BUILD, argv, BRANCH_VALUES if branch else None) == [], (case_id, server["name"])
            for refusal in cli.check(BUILD, argv):
                branch_uses += 1
                assert branch, (case_id, refusal)
                assert refusal.value in BRANCH_VALUES[refusal.flag]
                setting = flag_registry()["engine"][refusal.flag]["branch_choices"][refusal.value]
                assert {"server": server["name"], "feature": setting} in [
                    {k: b[k] for k in ("server", "feature")} for b in plan["engine"]["branch_only"]], case_id
                assert any(w.startswith(f"{server['name']}: {setting} (") for w in plan["warnings"]), case_id
    assert planned > 2000 and branch_uses > 0
    assert time.monotonic() - started < 10


def test_a_release_build_refuses_branch_only_values_in_argparse_words():
    with pytest.raises(K31Error) as info:
        resolve({"platform": "b300", "attention_backend": "prims-ts", "max_running_requests": 8,
                 "engine_build": BUILD})
    message = str(info.value)
    assert message.startswith("attention_backend=prims-ts is not accepted by engine_build=sglang-0.5.23: "
                              "argument --dsa-prefill-backend: invalid choice: 'prims_ts' (choose from")
    assert message.endswith("valid: attention_backend=flashmla|trtllm, or engine_build=kimi-k31-pro "
                            "(the recipe's branch)")
    with pytest.raises(K31Error, match="prefill_cuda_graph=tc_piecewise is not accepted"):
        resolve({"platform": "b300", "prefill_cuda_graph": "tc_piecewise", "max_running_requests": 8,
                 "engine_build": BUILD})


def test_engine_build_is_a_knob_with_the_catalogs_choices():
    with pytest.raises(K31Error, match=r"engine_build=0.5.22 .* valid choices: kimi-k31-pro, sglang-0.5.23"):
        resolve({"platform": "b300", "engine_build": "0.5.22"})
    with pytest.raises(K31Error, match="engine_build does not apply to tpu7x"):
        resolve({"platform": "tpu7x", "engine_build": BUILD})


@pytest.mark.parametrize(("argv", "message"), [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--tp"], "unrecognized arguments: --tp"),                          # no abbreviations, as k31 emits
    (["--tp-size", "eight"], "argument --tp-size: invalid int value: 'eight'"),
    (["--hicache-ratio", "lots"], "argument --hicache-ratio: invalid float value: 'lots'"),
    (["--dcp-comm-backend", "nccl"], "argument --dcp-comm-backend: invalid choice: 'nccl' (choose from ag_rs, "
                                     "a2a, fi_a2a)"),
    (["--tp-size"], "argument --tp-size: expected one argument"),
])
def test_the_dump_refuses_what_argparse_refuses(argv, message):
    (refusal,) = cli.check(BUILD, argv)
    assert refusal.message == message


def test_the_dump_knows_aliases_bare_switches_and_inline_values():
    assert cli.check(BUILD, ["--attention-data-parallel-size", "2", "--enable-metrics", "--tp-size=8"]) == []
    assert cli.deprecations(BUILD, ["--enable-dp-attention"]) == [
        "--enable-dp-attention (deprecated in sglang-0.5.23; use --attn-dp-size <dp-size>)"]


def test_the_dump_is_the_engines_own_parser():
    doc = cli.load(BUILD)
    assert doc["engine"] == "sglang" and doc["version"] == "0.5.23" and len(doc["flags"]) > 500
    # facts the recipe's cells hinge on, as SGLang 0.5.23 has them
    flags = doc["flags"]
    assert flags["--cp-strategy"]["choices"] == ["zigzag", "interleave"]
    assert flags["--enable-dp-attention"]["deprecated"] == "--attn-dp-size <dp-size>"
    assert "prims_ts" not in flags["--dsa-prefill-backend"]["choices"]
    assert flags["--cuda-graph-backend-prefill"]["choices"] == ["full", "breakable", "disabled"]


def test_every_flag_k31_emits_is_in_the_dump_and_traced_to_a_source():
    for flag, entry in flag_registry()["engine"].items():
        assert cli.spec(BUILD, flag) is not None, flag
        assert entry["source"].startswith(("seed:", "upstream:")), flag
        assert set(entry) <= {"source", "branch_choices"}, flag    # types come from the dump only


# -- the fixed cells ------------------------------------------------------------------------------


def test_the_pcp_prefill_sets_the_cp_strategy_sglang_requires():
    plan = resolve({"platform": "gb300", "topology": "pd", "prefill_strategy": "high-throughput",
                    "max_running_requests": 64})
    (prefill,) = [s for s in plan["servers"] if s["role"] == "prefill"]
    argv = engine_flags(prefill)
    i = argv.index("--enable-prefill-cp")
    assert argv[i:i + 5] == ["--enable-prefill-cp", "--cp-strategy", "interleave", "--attn-cp-size", "2"]


@pytest.mark.parametrize(("build", "dp_flags"), [
    ("kimi-k31-pro", ["--dp-size", "2", "--enable-dp-attention"]),
    (BUILD, ["--attn-dp-size", "2"]),
])
def test_wide_ep_decode_with_dflash_gets_the_dp_lm_head_and_the_coordination_off(build, dp_flags):
    plan = resolve({"platform": "gb300", "topology": "pd", "wide_ep": True, "max_running_requests": 64,
                    "engine_build": build})
    (decode,) = [s for s in plan["servers"] if s["role"] == "decode"]
    argv = engine_flags(decode)
    i = argv.index("--tp-size")
    assert argv[i:i + 2 + len(dp_flags)] == ["--tp-size", "16", *dp_flags]
    assert "--enable-dp-lm-head" in argv
    assert decode["ranks"][0]["env"]["SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION"] == "0"
    nodflash = resolve({"platform": "gb300", "topology": "pd", "wide_ep": True, "max_running_requests": 64,
                        "speculative": "none", "engine_build": build})
    (decode,) = [s for s in nodflash["servers"] if s["role"] == "decode"]
    assert "--enable-dp-lm-head" not in engine_flags(decode)
    assert "SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION" not in decode["ranks"][0]["env"]


@pytest.mark.parametrize(("knobs", "feature"), [
    ({"platform": "mi355x", "agents": 16}, "hicache-dcp-dflash"),
    ({"platform": "mi355x", "agents": 4}, "amd-monokernel"),
    ({"platform": "b300", "unified_strategy": "high-concurrency", "kv_offload": "mooncake",
      "max_running_requests": 8}, "hicache-dcp-dflash"),
    ({"platform": "b300", "topology": "pd", "decode_radix_cache": True, "max_running_requests": 8},
     "decode-radix-dflash"),
])
def test_branch_features_warn_on_the_branch_and_are_refused_by_a_release(knobs, feature):
    cfg = catalog()["branch_features"][feature]
    plan = resolve(knobs)
    assert feature in {b["feature"] for b in plan["engine"]["branch_only"]}
    assert any(f"{feature} runs only on the recipe's kimi-k31-pro branch" in w and cfg["recipe"] in w
               for w in plan["warnings"])
    if cfg.get("plugin"):
        assert plan["engine"]["plugins"] == [cfg["plugin"]]
    with pytest.raises(K31Error) as info:
        resolve({**knobs, "engine_build": BUILD})
    assert " ".join(cfg["refusal"].split()) in str(info.value)
    assert f"valid: {cfg['valid']}" in str(info.value)


# -- the lane's record: real SGLang on a GPU machine ------------------------------------------------


def test_the_record_comes_from_a_gpu_run_of_the_build():
    assert RECORD["version"] == "0.5.23" and RECORD["machine"]["sglang"] == "0.5.23"
    assert RECORD["machine"]["gpu"].startswith("NVIDIA") and not RECORD["machine"].get("emulated_cuda")
    assert set(RECORD["stubbed"]).isdisjoint({"flashinfer", "sglang", "transformers", "torch"})


def test_every_refusal_in_the_record_is_a_branch_only_feature_the_plan_names():
    """Nothing real SGLang refused is a surprise: each refusal is a catalog branch feature (with the
    engine's own message) or a branch-only flag value, which the branch plan warns about and a
    release build refuses in k31 plan; and every command planned for the release was accepted."""
    refusals = {" ".join(f["refusal"].split()) for f in catalog()["branch_features"].values()}
    values = {v for vs in BRANCH_VALUES.values() for v in vs}
    by_digest: dict[str, list[str]] = {}
    for name, key in RECORD["labels"].items():
        by_digest.setdefault(key, []).append(name)
    seen = set()
    for key, verdict in RECORD["results"].items():
        if verdict["result"] == "accepted":
            continue
        assert verdict["result"] == "refused", (by_digest[key], verdict)
        message = verdict["message"]
        assert message in refusals or any(f"'{v}'" in message or f" {v} " in message for v in values), message
        seen.add(message)
        assert not any("+engine_build=" in name for name in by_digest[key]), (by_digest[key], message)
    assert refusals <= seen, "a branch feature's refusal text differs from what the engine printed"


def test_the_record_is_fresh_for_every_cell():
    stale = [(p, r, s) for p, r, s, _ in _cells() if p != "tpu7x"
             and RECORD["labels"].get(lane.label(f"{p}/{r}/{s}", f"{r}0")) != cell_digest(p, r, s)]
    assert stale == [], "re-run scripts/engine-lane for these cells (README: Engine acceptance)"


def test_plan_servers_carry_the_verdict_and_a_refusal_or_stale_record_warns(monkeypatch):
    plan = resolve({"platform": "b300", "max_running_requests": 64})
    assert plan["servers"][0]["engine_check"] == {"build": BUILD, "checked": RECORD["date"],
                                                  "result": "accepted", "message": None}
    custom = resolve({"platform": "b300", "max_running_requests": 48})     # a command no case planned
    assert custom["servers"][0]["engine_check"]["result"] == "unchecked"
    assert custom["servers"][0]["engine_check"]["nearest"] == {"case": "b300/unified/low-latency#unified0",
                                                               "result": "accepted"}
    stale = json.loads(json.dumps(RECORD))
    stale["labels"]["b300/unified/low-latency#unified0"] = "0" * 16
    monkeypatch.setattr(lane, "record", lambda build: stale)
    plan = resolve({"platform": "b300", "max_running_requests": 48})
    assert plan["servers"][0]["engine_check"]["result"] == "stale"
    assert any("verdict on this cell is stale" in w for w in plan["warnings"])
    refused = json.loads(json.dumps(RECORD))
    key = lane.server_digest(custom, custom["servers"][0], catalog()["platforms"]["b300"],
                             catalog()["families"]["cuda"])
    refused["results"][key] = {"result": "refused", "message": "ValueError: something new"}
    monkeypatch.setattr(lane, "record", lambda build: refused)
    plan = resolve({"platform": "b300", "max_running_requests": 48})
    assert f"unified0: SGLang 0.5.23 refused this command in the engine lane ({RECORD['date']}): ValueError: " \
           "something new" in plan["warnings"]


def test_the_digest_ignores_hosts_model_paths_and_nics_only():
    base = {"platform": "gb300", "topology": "pd", "max_running_requests": 64}
    a = resolve({**base, "model_path": "/models/a", "disaggregation_ib_device": "mlx5_0"})
    b = resolve({**base, "model_path": "/srv/b", "disaggregation_ib_device": "mlx5_3,mlx5_4"})
    info = (catalog()["platforms"]["gb300"], catalog()["families"]["cuda"])
    digests = [[lane.server_digest(p, s, *info) for s in p["servers"]] for p in (a, b)]
    assert digests[0] == digests[1]
    argv, _env = lane.normalise(a, a["servers"][0])
    assert "<model>" in argv and "<ib>" in argv and "<addr>:20000" in argv
    c = resolve({**base, "max_running_requests": 32})
    assert lane.server_digest(c, c["servers"][1], *info) != digests[0][1]


def test_catalog_shows_each_cells_verdict(capsys):
    from k31deploy.commands.recipe import catalog_rows

    rows = {(r["platform"], r["role"], r["strategy"]): r for r in catalog_rows()}
    assert rows[("gb300", "prefill", "high-throughput")]["engine"] == "accepted"
    assert rows[("mi355x", "unified", "high-throughput")]["engine"] == "refused: hicache-dcp-dflash (branch-only)"
    assert rows[("tpu7x", "unified", "balanced")]["engine"] == "not-reached"


def _cells():
    from k31deploy.recipe import iter_cells

    return list(iter_cells())
