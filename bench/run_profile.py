#!/usr/bin/env python3
"""Where a recorded run's time went (k31deploy/runner/profile.py), from its run record's job events.

    .venv/bin/python bench/run_profile.py RUN [--top 25] [--json]
    .venv/bin/python bench/run_profile.py SMALL LARGE [--top 25] [--json]

RUN is a run record of `k31 deploy`, `k31 redeploy`, ... (`.k31/runs/ID`, or just its ID): its wall time, the
seconds spent on module tasks, controller-only tasks and tasks every host skipped, and the slowest tasks. Two
runs of the same playbook (a 2-host and a 16-host fan-out sandbox, say) are lined up task by task, largest
growth first: what the host count costs, and where.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k31deploy.runner import profile, records  # noqa: E402


def run_record(given: str) -> Path:
    path = Path(given)
    if path.is_dir():
        return path
    named = records.runs_dir() / given
    if named.is_dir():
        return named
    raise FileNotFoundError(f"RUN {given} is neither a folder nor a run ID under {records.runs_dir()}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN", help="one run record, or two to compare")
    p.add_argument("--top", type=int, default=25, help="tasks to list (default 25)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if len(args.runs) > 2:
        p.error("give one run record, or two to compare")
    try:
        runs = [profile.profile(profile.load_events(run_record(r))) for r in args.runs]
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if len(runs) == 1:
        rep = profile.report(runs[0], args.top)
        print(json.dumps(rep, indent=2) if args.json else profile.render(rep))
    else:
        rep = profile.compare_report(*runs, args.top)
        print(json.dumps(rep, indent=2) if args.json else profile.render_compare(rep))
    return 0


if __name__ == "__main__":
    sys.exit(main())
