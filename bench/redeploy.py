#!/usr/bin/env python3
"""Redeploy-under-load benchmark on the sandbox: what a client sees while `k31 redeploy` rolls servers.

    .venv/bin/python bench/redeploy.py [--targets decode1] [--sessions 6] [--baseline 20] [--json]

Starts a 2P2D sandbox (stand-ins with a timing model: 300 ms + 200 ms per 1k prompt tokens to the first
token, 25 ms per token), deploys it, runs k31deploy.loadgen's streaming multi-turn sessions through the
router for --baseline seconds, then again while `k31 redeploy TARGETS` runs. Reports the redeploy's wall
time, every request's outcome (complete / truncated / refused / error) and TTFT p50/p90 at rest and during
the redeploy (the ratio is the cost a client pays). The sandbox is named bench-redeploy-* and removed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import yaml

# bench/ is this script's directory, so its sibling's helpers import directly
from deploy import BIN, ROOT, down, run, sandbox

sys.path.insert(0, str(ROOT))

from k31deploy.loadgen import LoadGen, Report

TIMING = {"k31_engine_standin_ttft_base_ms": 300, "k31_engine_standin_ttft_per_1k_prompt_tokens_ms": 200,
          "k31_engine_standin_token_ms": 25}


def figures(report: Report) -> dict:
    return {"requests": len(report.records), **report.counts,
            "ttft_p50_s": report.ttft_percentile(50), "ttft_p90_s": report.ttft_percentile(90)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", nargs="*", default=["decode1"], help="servers or roles (none: every server)")
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--baseline", type=float, default=20.0, help="seconds of load before the redeploy")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    name = f"bench-redeploy-{os.getpid()}"
    run(str(BIN / "k31"), "wheelhouse", "build", "--set", "router")
    inventory = Path(sandbox(name, "--shape", "mi355x-2p2d"))
    try:
        (inventory.parent / "group_vars").mkdir(exist_ok=True)
        (inventory.parent / "group_vars" / "all.yml").write_text(yaml.safe_dump(TIMING))
        run(str(BIN / "ansible-playbook"), "deploy.yml", "-i", str(inventory))
        hosts = yaml.safe_load(inventory.read_text())["all"]["children"]["k31_router"]["hosts"]
        router = f"http://{next(iter(hosts.values()))['ansible_host']}:8000"
        key = (inventory.parent / "router-api-key").read_text().strip()

        def load() -> LoadGen:
            return LoadGen(router, sessions=args.sessions, turns=4, max_requests=100_000, deadline=3600,
                           max_tokens=160, timeout=120, api_key=key)

        with load() as rest:
            time.sleep(args.baseline)
        with load() as during:
            began = time.monotonic()
            run(str(BIN / "k31"), "redeploy", *args.targets, "-i", str(inventory))
            seconds = round(time.monotonic() - began, 1)
        at_rest, under = figures(rest.report()), figures(during.report())
    finally:
        down(name)
    ratio = (round(under["ttft_p90_s"] / at_rest["ttft_p90_s"], 2)
             if under["ttft_p90_s"] and at_rest["ttft_p90_s"] else None)
    result = {"targets": args.targets or ["every server"], "redeploy_seconds": seconds, "at_rest": at_rest,
              "during_redeploy": under, "ratios": {"ttft_p90_during_over_rest": ratio}}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"redeploy {' '.join(args.targets) or '(every server)'}: {seconds} s; during it {under}; "
              f"at rest {at_rest}; TTFT p90 during/rest {ratio}")
    return 0 if under["complete"] == under["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
