"""Run records: one directory per run under `<state dir>/runs/`, its summary.json, rotation, and the
scrub that keeps secrets out of what ansible-runner writes there."""

from __future__ import annotations

import json
import os
import re
import shutil
from datetime import datetime
from pathlib import Path
from typing import Any

from k31deploy.errors import K31Error
from k31deploy.paths import state_dir

DEFAULT_KEEP = 20
RUN_NAME = re.compile(r"^\d{8}-\d{6}-\d{6}-[a-z]+$")
# Environment names whose values never go into a run record, whatever else is kept.
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|(API|ACCESS|PRIVATE)_?KEY", re.IGNORECASE)
REDACTED = "<redacted>"
# Environment a run record keeps with values: Ansible's and the runner's own settings.
KEEP_ENV_PREFIXES = ("ANSIBLE_", "RUNNER_", "AWX_")


def runs_dir() -> Path:
    return state_dir() / "runs"


def keep_runs() -> int:
    raw = os.environ.get("K31_KEEP_RUNS", str(DEFAULT_KEEP))
    try:
        keep = int(raw)
    except ValueError:
        keep = 0
    if keep < 1:
        raise K31Error(f"K31_KEEP_RUNS={raw!r} is not valid; set it to a whole number of runs to keep, 1 or more")
    return keep


def new_run_dir(command: str, root: Path | None = None, now: datetime | None = None) -> Path:
    """`<timestamp>-<command>`: names sort by start time, which rotation relies on."""
    root = root or runs_dir()
    root.mkdir(parents=True, exist_ok=True)
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S-%f")
    path = root / f"{stamp}-{command}"
    path.mkdir(mode=0o700)
    return path


def rotate(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` run directories; anything not named like a run is left alone."""
    runs = sorted(p for p in root.iterdir() if p.is_dir() and RUN_NAME.match(p.name))
    old = runs[:-keep] if keep else runs
    for path in old:
        shutil.rmtree(path, ignore_errors=True)
    return old


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    path = run_dir / "summary.json"
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return path


def redact_command(argv: list[str]) -> list[str]:
    """Inline extra vars may carry secrets; `@file` references are only paths and stay."""
    out: list[str] = []
    redact_next = False
    for arg in argv:
        if redact_next:
            out.append(arg if arg.startswith("@") else REDACTED)
            redact_next = False
        elif arg in ("-e", "--extra-vars"):
            out.append(arg)
            redact_next = True
        elif arg.startswith("--extra-vars="):
            value = arg.split("=", 1)[1]
            out.append(arg if value.startswith("@") else f"--extra-vars={REDACTED}")
        else:
            out.append(arg)
    return out


def scrub_command_file(artifact_dir: Path, keep_env: set[str]) -> None:
    """ansible-runner records the full command line and the whole environment of the run (HF tokens
    included, when an operator exported one) in `artifacts/<ident>/command`. Keep the command with inline
    extra vars redacted, the variables in `keep_env` and Ansible's own, and only the names of the rest."""
    path = artifact_dir / "command"
    if not path.is_file():
        return
    recorded = json.loads(path.read_text())
    env = recorded.get("env") or {}
    kept = {k: (REDACTED if SECRET_NAME.search(k) else v) for k, v in env.items()
            if k in keep_env or k.startswith(KEEP_ENV_PREFIXES)}
    recorded.update(command=redact_command(recorded.get("command") or []), env=kept,
                    env_names=sorted(k for k in env if k not in kept))
    path.write_text(json.dumps(recorded, indent=2))
