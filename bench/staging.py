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

    .venv/bin/python bench/staging.py --image [--sizes 2 4 8] [--rate 200mbit] [--json]

--image measures the serving image's archive instead (the stand-in image's `podman save`, about 190 MB): the
controller copies it to every host (k31_image_fanout=controller, "naive") versus to one host, then host to host
(k31_image_fanout=tree), on nested podman nodes (shape fanout-container, sandbox bench-imgtree). The controller's
side of the sandbox's network is rate-limited too (its bridge, on this machine), so every copy it sends shares one
link. Each case is `playbooks/prepare.yml --tags k31_image` (copy, check, load) from hosts without the image or a
copy, then again; keys image_{naive,tree}_N_s as above.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
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


def prepare(inventory: str, hosts: list[str], tag: str, extra: str) -> tuple[float, dict[str, int]]:
    """One run of playbooks/prepare.yml's `tag` on `hosts`: wall seconds and each host's changed count."""
    began = time.monotonic()
    out = run(str(BIN / "ansible-playbook"), "-i", inventory, "playbooks/prepare.yml", "--tags", tag,
              "--limit", ",".join(["localhost", *hosts]), "-e", extra)
    seconds = round(time.monotonic() - began, 1)
    return seconds, {host: int(changed) for host, changed, unreachable, failed in RECAP.findall(out)}


def stage(inventory: str, hosts: list[str], fanout: str) -> tuple[float, dict[str, int]]:
    """One staging run: wall seconds and each host's changed count."""
    return prepare(inventory, hosts, "k31_model", stage_vars(fanout, hosts[0]))


def naive_vs_tree(what: str, sizes: list[int], naive: str, reset: Callable[[], None],
                  once: Callable[[list[str], str], tuple[float, dict[str, int]]],
                  hosts: list[str]) -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
    """For each size, the `naive` fanout then tree, each from scratch (`reset`) and then re-run: seconds (the run
    less its re-run, the no-op cost), each re-run's changed count, and tree over naive per size."""
    results: dict[str, float] = {}
    changed: dict[str, int] = {}
    for n in sizes:
        for fanout, label in ((naive, "naive"), ("tree", "tree")):
            reset()
            wall, _ = once(hosts[:n], fanout)
            rerun, recap = once(hosts[:n], fanout)
            key = f"{label}_{n}"
            results.update({f"{what}_{key}_wall_s": wall, f"{what}_{key}_rerun_s": rerun,
                            f"{what}_{key}_s": round(wall - rerun, 1)})
            changed[key] = sum(recap.values())
            print(f"bench: {what} {key}: {wall} s, re-run {rerun} s (changed={changed[key]})",
                  file=sys.stderr, flush=True)
    ratios = {f"{what}_tree_over_naive_{n}": round(results[f"{what}_tree_{n}_s"] / results[f"{what}_naive_{n}_s"], 2)
              for n in sizes}
    return results, changed, ratios


def reset(containers: list[str]) -> None:
    """Empty destinations and forget the verified manifests, so the next case copies everything."""
    staging_sandbox.cluster._parallel(
        lambda ctr: staging_sandbox.node_sh(ctr, f"rm -rf {DEST} /var/lib/k31/verified"), containers)


def measure(sizes: list[int], mb: int, rate: str, name: str = "bench-stage") -> dict:
    """{seconds, ratios, rerun_changed, setup} for naive and tree staging to each of `sizes` hosts."""
    try:
        inventory = run(str(BIN / "k31"), "sandbox", "up", "--name", name, "--nodes",
                        str(max(sizes))).strip().splitlines()[-1]
        containers = staging_sandbox.nodes(name)
        hosts = [c.removeprefix(f"k31-{name}-") for c in containers]
        staging_sandbox.peer_ssh(name)
        staging_sandbox.make_model(containers[0], SEED_DIR, mb)
        staging_sandbox.shape_links(name, rate)
        results, changed, ratios = naive_vs_tree(
            "staging", sizes, "seed", lambda: reset(containers),
            lambda some, fanout: stage(inventory, some, fanout), hosts)
    finally:
        subprocess.run([str(BIN / "k31"), "sandbox", "down", "--name", name], cwd=ROOT, env=env(),
                       capture_output=True, check=False)
    return {"seconds": results, "ratios": ratios, "rerun_changed": changed,
            "setup": {"mb": mb, "rate": rate, "sizes": sizes}}


IMAGE = "sandbox.k31.internal/standin/sglang-serving:r1"    # k31deploy.sandbox.cluster.TARBALL_IMAGE
IMAGE_COPY = "/var/tmp/k31-image.tar"


def load_image(inventory: str, hosts: list[str], fanout: str) -> tuple[float, dict[str, int]]:
    """One image run: wall seconds and each host's changed count."""
    extra = {"k31_image_fanout": fanout, "k31_image_tree_poll": 1, "k31_image_check_engine": False}
    return prepare(inventory, hosts, "k31_image", json.dumps(extra))


def measure_image(sizes: list[int], rate: str, name: str = "bench-imgtree") -> dict:
    """{seconds, ratios, rerun_changed, setup} for the image archive, naive and tree, to each of `sizes` hosts."""
    try:
        inventory = run(str(BIN / "k31"), "sandbox", "up", "--name", name, "--shape", "fanout-container",
                        "--nodes", str(max(sizes))).strip().splitlines()[-1]
        containers = staging_sandbox.nodes(name)
        hosts = [c.removeprefix(f"k31-{name}-") for c in containers]
        staging_sandbox.peer_ssh(name)
        staging_sandbox.shape_links(name, rate)
        staging_sandbox.shape_controller_link(name, rate)
        results, changed, ratios = naive_vs_tree(
            "image", sizes, "controller",
            lambda: staging_sandbox.cluster._parallel(lambda ctr: staging_sandbox.node_sh(
                ctr, f"podman rmi --force {IMAGE} >/dev/null 2>&1; rm -f {IMAGE_COPY}"), containers),
            lambda some, fanout: load_image(inventory, some, fanout), hosts)
    finally:
        subprocess.run([str(BIN / "k31"), "sandbox", "down", "--name", name], cwd=ROOT, env=env(),
                       capture_output=True, check=False)
    return {"seconds": results, "ratios": ratios, "rerun_changed": changed, "setup": {"rate": rate, "sizes": sizes}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--mb", type=int, default=512, help="synthetic model size in MiB")
    p.add_argument("--rate", help="tc tbf rate on every node's eth0 (default 100mbit, --image 200mbit)")
    p.add_argument("--name", help="sandbox name (default bench-stage, --image bench-imgtree)")
    p.add_argument("--image", action="store_true", help="the serving image's archive instead of a model")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.image:
        report = measure_image(args.sizes, args.rate or "200mbit", args.name or "bench-imgtree")
    else:
        report = measure(args.sizes, args.mb, args.rate or "100mbit", args.name or "bench-stage")
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
