#!/usr/bin/env python3
"""Staging benchmark on the sandbox: a synthetic model (random shards and their SHA256SUMS) staged from the seed
node to 2, 4 and 8 sandbox hosts over links rate-limited on every node (tc tbf, egress), every host pulling from
the seed at once (k31_model_fanout=seed, "naive") versus the tree fan-out (k31_model_fanout=tree).

    .venv/bin/python bench/staging.py [--sizes 2 4 8] [--mb 512] [--rate 100mbit] [--json]

Each case is `playbooks/prepare.yml --tags k31_model` from empty destinations, then the same run again, which must
change nothing. seconds: staging_{naive,tree}_N_s is the staging run's wall time less the re-run's (what moving
and verifying the bytes adds to the checks every run makes; the raw wall times are the *_wall_s and *_rerun_s
entries). ratios: staging_tree_over_naive_N; rerun_changed: each re-run's changed count (0 is idempotent).
One sandbox (bench-stage) of max(--sizes) hosts serves every case (--limit); it is removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(ROOT))

from k31deploy import staging_sandbox  # noqa: E402

SEED_DIR = "/srv/k31-src/synth"
DEST = "/opt/k31/models/synth"
RECAP = re.compile(r"^(\S+)\s+:\s+ok=\d+\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


def env() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
            "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}


def run(*argv: str) -> str:
    done = subprocess.run(argv, cwd=ROOT, env=env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def stage_vars(fanout: str, seed: str) -> str:
    return json.dumps({"k31_model_path": DEST, "k31_model_source": "rsync", "k31_model_source_dir": SEED_DIR,
                       "k31_model_seed_host": seed, "k31_model_verify": "sha256", "k31_model_poll": 1,
                       "k31_model_fanout": fanout})


def stage(inventory: str, hosts: list[str], fanout: str) -> tuple[float, dict[str, int]]:
    """One staging run: wall seconds and each host's changed count."""
    began = time.monotonic()
    out = run(str(BIN / "ansible-playbook"), "-i", inventory, "playbooks/prepare.yml", "--tags", "k31_model",
              "--limit", ",".join(["localhost", *hosts]), "-e", stage_vars(fanout, hosts[0]))
    seconds = round(time.monotonic() - began, 1)
    recap = {host: int(changed) for host, changed, unreachable, failed in RECAP.findall(out)}
    return seconds, recap


def reset(containers: list[str]) -> None:
    """Empty destinations and forget the verified manifests, so the next case copies everything."""
    staging_sandbox.cluster._parallel(
        lambda ctr: staging_sandbox.node_sh(ctr, f"rm -rf {DEST} /var/lib/k31/verified"), containers)


def measure(sizes: list[int], mb: int, rate: str, name: str = "bench-stage") -> dict:
    """{seconds, ratios, rerun_changed, setup} for naive and tree staging to each of `sizes` hosts."""
    results: dict[str, float] = {}
    changed: dict[str, int] = {}
    try:
        inventory = run(str(BIN / "k31"), "sandbox", "up", "--name", name, "--nodes",
                        str(max(sizes))).strip().splitlines()[-1]
        containers = staging_sandbox.nodes(name)
        hosts = [c.removeprefix(f"k31-{name}-") for c in containers]
        staging_sandbox.peer_ssh(name)
        staging_sandbox.make_model(containers[0], SEED_DIR, mb)
        staging_sandbox.shape_links(name, rate)
        for n in sizes:
            for fanout, label in (("seed", "naive"), ("tree", "tree")):
                reset(containers)
                wall, _ = stage(inventory, hosts[:n], fanout)
                rerun, recap = stage(inventory, hosts[:n], fanout)
                key = f"{label}_{n}"
                results.update({f"staging_{key}_wall_s": wall, f"staging_{key}_rerun_s": rerun,
                                f"staging_{key}_s": round(wall - rerun, 1)})
                changed[key] = sum(recap.values())
                print(f"bench: staging {key}: {wall} s, re-run {rerun} s (changed={changed[key]})",
                      file=sys.stderr, flush=True)
    finally:
        subprocess.run([str(BIN / "k31"), "sandbox", "down", "--name", name], cwd=ROOT, env=env(),
                       capture_output=True, check=False)
    ratios = {f"staging_tree_over_naive_{n}": round(results[f"staging_tree_{n}_s"] / results[f"staging_naive_{n}_s"], 2)
              for n in sizes}
    return {"seconds": results, "ratios": ratios, "rerun_changed": changed,
            "setup": {"mb": mb, "rate": rate, "sizes": sizes}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--mb", type=int, default=512, help="synthetic model size in MiB")
    p.add_argument("--rate", default="100mbit", help="tc tbf rate on every node's eth0")
    p.add_argument("--name", default="bench-stage")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    report = measure(args.sizes, args.mb, args.rate, args.name)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        rows = {**report["seconds"], **report["ratios"],
                **{f"rerun_changed_{k}": v for k, v in report["rerun_changed"].items()}}
        for key, value in rows.items():
            print(f"{key:32} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
