#!/usr/bin/env python3
"""Deploy benchmark on the sandbox: fresh deploy, no-op re-run (the converge stamp's short path, and the whole
deploy with --full), one-decode redeploy, and fan-out over 2, 8 and 16 hosts.

    .venv/bin/python bench/deploy.py [--sizes 2 8 16] [--json]

Reports wall times and the ratios that matter on a noisy machine: no-op / fresh (how cheap a
re-run is) and N hosts / 2 hosts (1.0 would be perfect fan-out: servers start concurrently and
health gates wait in parallel) with a line fitted through the fan-out sizes (fanout_fixed_s,
fanout_per_host_s), and the tool's own cost per server of `k31 redeploy decode0` on the 1P1D
(it restarts decode0, then prefill0 by the seed's PD rule): its wall time less each engine's own
restart-to-healthy time (systemctl restart until /health answers, timed on the node), divided by the two
servers. Sandboxes are named bench-* and removed afterwards.

--staging adds bench/staging.py's measurement (a synthetic model staged to 2, 4 and 8 hosts over rate-limited
links, naive versus tree fan-out): its seconds and ratios (staging_tree_over_naive_N) join this report's;
--staging-only runs just that.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


STRATEGY: dict[str, str] = {}    # --mitogen: Ansible's strategy and where its plugin lives


def run(*argv: str) -> str:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"),
           **STRATEGY}
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


def deploy(inventory: str, *args: str) -> float:
    seconds = timed(str(BIN / "ansible-playbook"), "deploy.yml", "-i", inventory, *args)
    print(f"bench: deploy {' '.join(args)} of {Path(inventory).parent.name} took {seconds} s", file=sys.stderr,
          flush=True)
    return seconds


# On a node: restart one engine unit and time it until its /health answers (the engine's own restart cost).
RESTART = """
import subprocess, sys, time, urllib.request
unit, url = sys.argv[1], sys.argv[2]
began = time.monotonic()
subprocess.run(["systemctl", "restart", unit], check=True)
while True:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            if resp.status == 200:
                break
    except OSError:
        pass
    time.sleep(0.05)
print(round(time.monotonic() - began, 2))
"""


def engine_restart_s(sandbox_name: str, host: str, unit: str, url: str) -> float:
    out = run("podman", "exec", f"k31-{sandbox_name}-{host}", "python3", "-c", RESTART, unit, url)
    return float(out.strip())


def redeploy_overhead(sandbox_name: str, inventory: str) -> dict[str, float]:
    """`k31 redeploy decode0` wall time and the engines' own restart-to-healthy times (prefill first: a decode's
    restart makes the watcher restart the prefill, which must be over before the redeploy starts)."""
    nodes = yaml.safe_load(Path(inventory).read_text())["all"]["children"]
    address = {h: v["ansible_host"] for g in nodes.values() for h, v in (g or {}).get("hosts", {}).items()}
    engines = {"prefill0": 30000, "decode0": 30100}
    own = {}
    for host, port in engines.items():
        own[host] = engine_restart_s(sandbox_name, host, f"k31-{host}-r0", f"http://{address[host]}:{port}/health")
    time.sleep(15)    # the watcher's prefill restart after decode0's, and the router's health checks, settle
    wall = timed(str(BIN / "k31"), "redeploy", "decode0", "-i", inventory)
    print(f"bench: k31 redeploy decode0 took {wall} s; engines' own restarts: {own}", file=sys.stderr, flush=True)
    return {"redeploy_1p1d_s": wall, "engine_restart_s": round(sum(own.values()), 2),
            "redeploy_overhead_s": round((wall - sum(own.values())) / len(own), 1)}


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares over (hosts, seconds): the part of a deploy that does not grow with the hosts, and what each
    host adds. The N/2 ratio is (fixed + N * per_host) / (fixed + 2 * per_host), so a cheaper fixed part alone
    worsens it: the two say which one moved."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in points)
             / sum((x - mean_x) ** 2 for x, _ in points))
    return mean_y - slope * mean_x, slope


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 16])
    p.add_argument("--json", action="store_true")
    p.add_argument("--mitogen", action="store_true", help="run every playbook under Mitogen's linear strategy")
    p.add_argument("--skip", nargs="*", default=[], choices=["pd", "fanout"], help="parts not to run")
    p.add_argument("--staging", action="store_true", help="also measure model staging, naive vs tree")
    p.add_argument("--staging-only", action="store_true", help="measure model staging only")
    p.add_argument("--staging-sizes", type=int, nargs="+", default=[2, 4, 8])
    args = p.parse_args()
    if args.mitogen:
        from k31deploy.runner.driver import mitogen_env

        STRATEGY.update(mitogen_env())
    if args.staging_only:
        return report(*staging_report(args.staging_sizes), args.json)
    run(str(BIN / "k31"), "wheelhouse", "build", "--set", "all")
    results: dict[str, float] = {}
    ratios: dict[str, float] = {}
    try:
        if "pd" not in args.skip:
            inventory = sandbox("bench-pd", "--shape", "mi355x-1p1d")
            results["fresh_1p1d_s"] = deploy(inventory)
            results["noop_1p1d_s"] = deploy(inventory)
            # The same re-run without the converge stamp's short path (k31 deploy --full): every host play runs.
            results["noop_full_1p1d_s"] = deploy(inventory, "-e", "k31_stamp_check=false")
            overhead = redeploy_overhead("bench-pd", inventory)
            down("bench-pd")
            results.update({k: v for k, v in overhead.items() if k != "redeploy_overhead_s"})
            ratios.update({"noop_over_fresh": round(results["noop_1p1d_s"] / results["fresh_1p1d_s"], 2),
                           "noop_full_over_fresh": round(results["noop_full_1p1d_s"] / results["fresh_1p1d_s"], 2),
                           "redeploy_overhead_s": overhead["redeploy_overhead_s"]})
        if "fanout" not in args.skip:
            for n in args.sizes:
                inventory = sandbox(f"bench-{n}", "--nodes", str(n))
                results[f"fanout_{n}_s"] = deploy(inventory)
                down(f"bench-{n}")
            base = results[f"fanout_{args.sizes[0]}_s"]
            ratios.update({f"fanout_{n}_over_{args.sizes[0]}": round(results[f"fanout_{n}_s"] / base, 2)
                           for n in args.sizes[1:]})
            if len(set(args.sizes)) > 1:
                fixed, per_host = fit_line([(n, results[f"fanout_{n}_s"]) for n in args.sizes])
                results.update({"fanout_fixed_s": round(fixed, 1), "fanout_per_host_s": round(per_host, 2)})
    finally:
        for name in ["bench-pd", *(f"bench-{n}" for n in args.sizes)]:
            subprocess.run([str(BIN / "k31"), "sandbox", "down", "--name", name], cwd=ROOT, capture_output=True,
                           check=False)
    if args.staging:
        seconds, more = staging_report(args.staging_sizes)
        results.update(seconds)
        ratios.update(more)
    return report(results, ratios, args.json)


def staging_report(sizes: list[int]) -> tuple[dict, dict]:
    """bench/staging.py's seconds, and its ratios with each re-run's changed count (0: idempotent)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import staging

    got = staging.measure(sizes, mb=512, rate="100mbit")
    return got["seconds"], {**got["ratios"], **{f"staging_rerun_changed_{k}": v
                                                for k, v in got["rerun_changed"].items()}}


def report(results: dict, ratios: dict, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"seconds": results, "ratios": ratios}, indent=2))
    else:
        for key, value in {**results, **ratios}.items():
            print(f"{key:24} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
