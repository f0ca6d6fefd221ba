"""`k31 calc`: the memory planner on any plan cell (the seed's "Mamba ratio calculator")."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from k31deploy import memory
from k31deploy.commands.recipe import add_plan_args, plan_from_args
from k31deploy.errors import K31Error
from k31deploy.recipe import layout_text

# memory-section key -> (label, how to show the value)
FIGURES = (
    ("gpu_bytes", "GPU memory", "bytes"),
    ("mem_fraction_static", "mem_fraction_static", "plain"),
    ("static_bytes", "static share", "bytes"),
    ("weights_bytes", "weights per GPU", "bytes"),
    ("runtime_reserve_bytes", "ROCm runtime reserve", "bytes"),
    ("megamoe_workspace_bytes", "MegaMoE workspace", "bytes"),
    ("pool_bytes", "KDA + KV pool per GPU", "bytes"),
    ("kda_bytes_per_request", "KDA state per request", "bytes"),
    ("kv_bytes_per_token", "KV per token per GPU", "bytes"),
    ("kda_slots_per_request", "KDA slots per request", "count"),
    ("max_running_requests", "max running requests", "count"),
    ("weights_headroom_bytes", "weights that still fit", "bytes"),
    ("kda_slots", "KDA state slots", "count"),
    ("kda_pool_bytes", "KDA pool per GPU", "bytes"),
    ("kv_tokens", "KV tokens per server", "count"),
    ("tokens_per_request", "KV tokens per request", "count"),
    ("context_length", "context length", "count"),
    ("max_concurrency", "largest concurrency", "count"),
    ("max_concurrency_best_split", "largest concurrency, sized", "count"),
    ("recommended_max_mamba_cache_size", "--max-mamba-cache-size", "count"),
    ("recommended_mamba_full_memory_ratio", "--mamba-full-memory-ratio", "plain"),
    ("fits", "fits", "plain"),
    ("host_pinned_bytes_per_gpu", "host pinned per GPU", "bytes"),
    ("host_pinned_bytes_per_node", "host pinned per node", "bytes"),
    ("host_needed_bytes_per_node", "host memory needed per node", "bytes"),
    ("host_dram_bytes_per_node", "host DRAM per node", "bytes"),
    ("host_fits", "host tier fits", "plain"),
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calc", help="GPU and host memory of a plan: KV tokens, KDA slots, concurrency, "
                                    "host pools")
    add_plan_args(p)
    p.add_argument("--mem-fraction-static", type=float, metavar="F",
                   help="in (0, 1]; default: the plan's, else SGLang's automatic value")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--weights-gb-per-gpu", type=float, metavar="GB",
                         help="target + draft weights per GPU in GB (10^9 bytes)")
    weights.add_argument("--checkpoint", metavar="DIR",
                         help="measure the weights: *.safetensors in DIR divided by TP x PP")
    p.add_argument("--draft-checkpoint", metavar="DIR",
                   help="with --checkpoint: the DFLASH draft, divided by TP")
    p.add_argument("--context-length", type=int, metavar="TOKENS",
                   help="tokens each concurrent request holds")
    p.add_argument("--concurrency", type=int, metavar="N",
                   help="size for N concurrent requests (default: the plan's --max-running-requests)")
    p.add_argument("--host-dram-gb", type=float, metavar="GB",
                   help="host DRAM per node in GB (default: per platform, see k31deploy/data/memory.yaml)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_calc)


def cmd_calc(args: argparse.Namespace) -> int:
    opts = memory.Options(weights_gb_per_gpu=args.weights_gb_per_gpu, checkpoint=args.checkpoint,
                          draft_checkpoint=args.draft_checkpoint, context_length=args.context_length,
                          concurrency=args.concurrency, host_dram_gb=args.host_dram_gb)
    mfs = args.mem_fraction_static
    if mfs is not None:
        if not (math.isfinite(mfs) and 0 < mfs <= 1):
            raise K31Error(f"--mem-fraction-static={mfs} is not valid; it must be in (0, 1]")
        args.sets = [*args.sets, f"mem_fraction_static={mfs}"]   # through the plan, so its rules apply
    report, refusals = memory.calc(plan_from_args(args), opts)
    print(json.dumps(report, indent=2) if args.json else render(report))
    if refusals:
        raise K31Error(refusals[0])
    return 0


def _show(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "bytes":
        return memory.fmt_bytes(value)
    if kind == "count":
        return f"{value:,}"
    return str(value).lower() if isinstance(value, bool) else str(value)


def render(report: dict[str, Any]) -> str:
    lines = [f"{report['platform']} {report['topology']}: sizes in decimal units (GB = 10^9 bytes)"]
    for s in report["servers"]:
        m = s["memory"]
        lines += ["", f"{s['name']}: {s['role']} {s['strategy']} {layout_text(s['layout'])}, "
                      f"{s['layout']['nnodes']} node(s)"]
        rows = [(label, _show(m[key], kind), m["derivation"].get(key, ""))
                for key, label, kind in FIGURES if key in m]
        width = [max(len(r[i]) for r in rows) for i in (0, 1)]
        lines += [f"  {label.ljust(width[0])}  {value.rjust(width[1])}  {why}".rstrip()
                  for label, value, why in rows]
        lines += [f"  note: {note}" for note in m["notes"]]
    lines.append("")
    for h in report["hosts"]:
        if h["needed_bytes"] is None:
            lines.append(f"host {h['host']}: its HiCache host tier follows the GPU pools; give the weights "
                         f"per GPU to size it")
            continue
        verdict = {True: "fits", False: "DOES NOT FIT", None: "unchecked (DRAM unknown)"}[h["fits"]]
        lines.append(f"host {h['host']}: needs {_show(h['needed_bytes'], 'bytes')} of host memory for "
                     f"HiCache, has {_show(h['dram_bytes'], 'bytes')}: {verdict}")
    return "\n".join(lines)
