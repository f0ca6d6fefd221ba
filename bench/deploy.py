#!/usr/bin/env python3
"""Deploy benchmark on the sandbox: fresh deploy, no-op re-run, and fan-out over 2, 8 and 16 hosts.

    .venv/bin/python bench/deploy.py [--sizes 2 8 16] [--json]

Reports wall times and the ratios that matter on a noisy machine: no-op / fresh (how cheap a
re-run is) and N hosts / 2 hosts (1.0 would be perfect fan-out: servers start concurrently and
health gates wait in parallel). Sandboxes are named bench-* and removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(*argv: str) -> str:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def timed(*argv: str) -> float:
    began = time.monotonic()
    run(*argv)
    return round(time.monotonic() - began, 1)


def sandbox(name: str, *shape: str) -> str:
    return run(str(BIN / "k31"), "sandbox", "up", "--name", name, *shape).strip().splitlines()[-1]


def down(name: str) -> None:
    run(str(BIN / "k31"), "sandbox", "down", "--name", name)


def deploy(inventory: str) -> float:
    seconds = timed(str(BIN / "ansible-playbook"), "deploy.yml", "-i", inventory)
    print(f"bench: deploy of {Path(inventory).parent.name} took {seconds} s", file=sys.stderr, flush=True)
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 16])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    run(str(BIN / "k31"), "wheelhouse", "build", "--set", "all")
    results: dict[str, float] = {}
    try:
        inventory = sandbox("bench-pd", "--shape", "mi355x-1p1d")
        results["fresh_1p1d_s"] = deploy(inventory)
        results["noop_1p1d_s"] = deploy(inventory)
        down("bench-pd")
        for n in args.sizes:
            inventory = sandbox(f"bench-{n}", "--nodes", str(n))
            results[f"fanout_{n}_s"] = deploy(inventory)
            down(f"bench-{n}")
    finally:
        for name in ["bench-pd", *(f"bench-{n}" for n in args.sizes)]:
            subprocess.run([str(BIN / "k31"), "sandbox", "down", "--name", name], cwd=ROOT, capture_output=True,
                           check=False)
    base = results[f"fanout_{args.sizes[0]}_s"]
    ratios = {"noop_over_fresh": round(results["noop_1p1d_s"] / results["fresh_1p1d_s"], 2),
              **{f"fanout_{n}_over_{args.sizes[0]}": round(results[f"fanout_{n}_s"] / base, 2)
                 for n in args.sizes[1:]}}
    if args.json:
        print(json.dumps({"seconds": results, "ratios": ratios}, indent=2))
    else:
        for key, value in {**results, **ratios}.items():
            print(f"{key:24} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
