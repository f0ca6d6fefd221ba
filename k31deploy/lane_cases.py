"""The engine lane's case list, and taking its results back into data/engine/<build>.lane.json.

A case is a set of knobs k31 plans: every catalog cell as its canonical plan, the same cell with each
Advanced Features knob value the cell takes, the MI350X / MI355X agent counts the seed names, and every
one of those again with each released engine_build where that changes the command. The lane runs each
distinct normalised rank-0 command once (cases share a digest where their commands agree).
Layer: a driver (docs/architecture.md): it resolves every case, so it sits above the resolver, apart from
engine/ (the build's CLI dump and the lane's record), which the resolver reads.

    python -m k31deploy.lane_cases write CASES.json          # what the lane machine runs
    python -m k31deploy.lane_cases ingest CASES.json LANE.json CLI.json  # its results -> data/engine/
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

from k31deploy.catalog import cell_knobs
from k31deploy.engine import lane
from k31deploy.engine.cli import ENGINE_DIR
from k31deploy.errors import K31Error
from k31deploy.recipe import catalog, iter_cells, knob_specs, resolve

# One value per knob that changes an engine command beyond its cell's default (knobs.yaml). Choice
# knobs take every choice; the others one value inside their range.
VALUED = {
    "dflash_block": 4, "hicache_ratio": 2.0, "hicache_mamba_host_ratio": 6, "megamoe_token_cap": 8192,
    "shared_experts_tp_size": 2, "kda_state_slots": 256, "kda_states_per_path": 1,
    "mamba_full_memory_ratio": 0.5, "pp_layer_partition": "23,24,24,22", "max_running_requests": 32,
    "cuda_graph_max_bs_decode": 32, "mem_fraction_static": 0.8, "prefill_decode_interval": 16,
    "disaggregation_ib_device": "mlx5_0",
}
# Knobs that never reach an engine's command or env, or that pick the cell itself.
NOT_ENGINE = {"platform", "agents", "topology", "unified_strategy", "prefill_strategy", "decode_strategy",
              "wide_ep", "router_dialect", "image", "model_path", "draft_model_path", "weights_gb_per_gpu",
              "dynamo_session_affinity_ttl", "router_worker_startup_timeout", "dist_init_port",
              "engine_build"}
AGENTS = (1, 4, 8, 16, 48, 56, 92)    # seed AMD: the measured agent counts and the 1P1D past 56


def knob_values() -> Iterator[tuple[str, Any]]:
    for name, spec in knob_specs().items():
        if name in NOT_ENGINE:
            continue
        if spec["type"] == "choice":
            yield from ((name, c) for c in spec["choices"])
        elif spec["type"] == "bool":
            yield from ((name, v) for v in (True, False))
        else:
            yield name, VALUED[name]


def _suffix(knobs: dict[str, Any]) -> str:
    return "".join(f"+{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in knobs.items())


def case_knobs() -> Iterator[tuple[str, dict[str, Any]]]:
    """(case id, knobs) for every case, the catalog's default engine_build; ids are cell[+knob=value]."""
    for platform, role, strategy, cell in iter_cells():
        base = cell_knobs(platform, role, strategy, cell)
        cell_id = f"{platform}/{role}/{strategy}"
        yield cell_id, base
        if platform == "tpu7x":
            continue
        for name, value in knob_values():
            if base.get(name) != value:
                yield cell_id + _suffix({name: value}), {**base, name: value}
    for platform, info in catalog()["platforms"].items():
        if info["family"] == "rocm":
            for agents in AGENTS:
                yield f"{platform}/agents={agents}", {"platform": platform, "agents": agents}


def plans() -> Iterator[tuple[str, dict[str, Any]]]:
    """(case id, plan) for every case k31 plans (the ones k31 itself refuses are left out), each again
    with every released engine_build."""
    builds = [b for b, cfg in catalog()["engine_builds"].items() if not cfg.get("default")]
    for case_id, knobs in case_knobs():
        for build, suffix in ((None, ""), *((b, f"+engine_build={b}") for b in builds)):
            if build and knobs["platform"] == "tpu7x":
                continue
            try:
                plan = resolve({**knobs, **({"engine_build": build} if build else {})}, engine_check=False)
            except K31Error:
                continue
            yield case_id + suffix, plan


def build_cases() -> dict[str, Any]:
    """The lane's input: distinct normalised commands, each with the case labels that plan it."""
    by_digest: dict[str, dict[str, Any]] = {}
    labels: dict[str, str] = {}
    reference = None
    for case_id, plan in plans():
        if plan["platform"] == "tpu7x":
            continue
        reference = plan["engine"]["reference"]
        platform = catalog()["platforms"][plan["platform"]]
        group, capability = lane.group_of(platform, catalog()["families"][platform["family"]])
        for server in plan["servers"]:
            argv, env = lane.normalise(plan, server)
            key = lane.digest(argv, env, group)
            entry = by_digest.setdefault(key, {"hash": key, "group": group, "capability": capability,
                                               "family": platform["family"], "argv": argv, "env": env,
                                               "labels": []})
            entry["labels"].append(lane.label(case_id, server["name"]))
            labels[lane.label(case_id, server["name"])] = key
    return {"build": reference, "labels": labels, "cases": sorted(by_digest.values(), key=lambda c: c["labels"][0])}


def ingest(cases: dict[str, Any], out: dict[str, Any]) -> dict[str, Any]:
    """The committed record: the run's machine and date, every label's digest, each digest's verdict."""
    build = cases["build"]
    version = catalog()["engine_builds"][build]["version"]
    if out["machine"].get("sglang") != version:
        raise K31Error(f"the lane ran SGLang {out['machine'].get('sglang')}, not {build}'s {version}")
    if out["machine"].get("emulated_cuda") or "gpu" not in out["machine"]:
        raise K31Error("these results come from a trial run without a GPU (emulated CUDA): run the lane on a "
                       "GPU machine (scripts/engine-lane device) before recording its verdicts")
    results = {}
    for case in cases["cases"]:
        found = dict(out["results"].get(case["hash"]) or {"result": "not-reached", "message": "not in the run"})
        found.pop("seconds", None)
        found["group"] = case["group"]
        if case["family"] == "rocm":    # the lane machine is NVIDIA: see lane_compute_capability
            found["note"] = ("a ROCm cell checked on SGLang's CUDA path at SM100: HIP-only checks (prefill CP "
                             "on HIP, AITER, the monokernel's GPU ISA) are not reached")
        results[case["hash"]] = found
    return {"build": build, "version": version, "date": out["date"], "machine": out["machine"],
            "stubbed": out["stubbed"], "labels": cases["labels"], "results": results}


def main(argv: list[str]) -> int:
    if argv[:1] == ["write"] and len(argv) == 2:
        doc = build_cases()
        with open(argv[1], "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
        print(f"engine lane: {len(doc['cases'])} distinct commands from {len(doc['labels'])} planned servers",
              file=sys.stderr)
        return 0
    if argv[:1] == ["ingest"] and len(argv) == 4:
        docs = []
        for path in argv[1:]:
            with open(path, encoding="utf-8") as fh:
                docs.append(json.load(fh))
        cases, out, cli = docs
        doc = ingest(cases, out)
        if cli["version"] != doc["version"]:
            raise K31Error(f"the CLI dump is of SGLang {cli['version']}, not {doc['version']}")
        for kind, content in (("lane", doc), ("cli", cli)):
            path = ENGINE_DIR / f"{doc['build']}.{kind}.json"
            path.write_text(json.dumps(content, indent=1, sort_keys=kind == "lane") + "\n", encoding="utf-8")
            print(f"engine lane: wrote {path}", file=sys.stderr)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
