"""Run records: one directory per run under `<state dir>/runs/`, its summary.json, rotation, and the
scrub that keeps secrets out of what ansible-runner writes there -- also for a run whose driver was killed
before it could scrub (the next run scrubs it first). And the private files other commands write
(`k31 logs`): 0600 in directories k31 creates 0700."""

from __future__ import annotations

import json
import os
import re
import shlex
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
# Files ansible-runner may write into a private data dir's env/ that hold extra vars, passwords or keys.
ENV_FILES = ("extravars", "passwords", "ssh_key", "envvars", "cmdline")
# Marks a run directory whose record has been scrubbed.
SCRUBBED = ".scrubbed"
# Shorter values are not searched for across the record (they would match ordinary text).
MIN_SECRET_LEN = 6


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
    return write_private(run_dir / "summary.json", json.dumps(summary, indent=2, default=str) + "\n")


def private_dir(path: Path) -> Path:
    """`path` as a directory; the ones created here (parents too) are 0700. An existing one is left as it is."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for directory in reversed(missing):
        directory.mkdir(mode=0o700)
        directory.chmod(0o700)  # whatever the umask
    return path


def write_private(path: Path, text: str) -> Path:
    """Write `text` to `path`, 0600 from the moment it exists (an existing file is made 0600 first)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
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


def inline_secrets(argv: list[str]) -> set[str]:
    """Values an inline `-e` gave to variables named like secrets (`-e k31_router_api_key=...`, JSON too)."""
    values: set[str] = set()
    for i, arg in enumerate(argv):
        if arg in ("-e", "--extra-vars") and i + 1 < len(argv):
            text = argv[i + 1]
        elif arg.startswith("--extra-vars="):
            text = arg.split("=", 1)[1]
        else:
            continue
        if text.startswith("@"):
            continue
        try:
            pairs = json.loads(text).items() if text.lstrip().startswith("{") else None
        except (ValueError, AttributeError):
            pairs = None
        if pairs is None:
            pairs = [tuple(t.split("=", 1)) for t in shlex.split(text) if "=" in t]
        values |= {str(v) for k, v in pairs if SECRET_NAME.search(str(k)) and isinstance(v, str | int)}
    return {v for v in values if len(v.strip()) >= MIN_SECRET_LEN}


def scrub_command_file(artifact_dir: Path, keep_env: set[str]) -> set[str]:
    """ansible-runner records the full command line and the whole environment of the run (HF tokens
    included, when an operator exported one) in `artifacts/<ident>/command`. Keep the command with inline
    extra vars redacted, the variables in `keep_env` and Ansible's own, and only the names of the rest.
    Returns the secret values it took out (to look for elsewhere in the record); idempotent."""
    path = artifact_dir / "command"
    if not path.is_file():
        return set()
    try:
        recorded = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError):
        # Cut short by a kill while the runner wrote it: nothing in it can be trusted to be harmless.
        write_private(path, json.dumps({"scrubbed": True, "note": "unreadable command record removed"}, indent=2))
        return set()
    if recorded.get("scrubbed"):
        return set()
    env = recorded.get("env") or {}
    secrets = {v for k, v in env.items() if SECRET_NAME.search(k) and isinstance(v, str)
               and len(v.strip()) >= MIN_SECRET_LEN}
    secrets |= inline_secrets(recorded.get("command") or [])
    kept = {k: (REDACTED if SECRET_NAME.search(k) else v) for k, v in env.items()
            if k in keep_env or k.startswith(KEEP_ENV_PREFIXES)}
    recorded.update(command=redact_command(recorded.get("command") or []), env=kept,
                    env_names=sorted(k for k in env if k not in kept), scrubbed=True)
    write_private(path, json.dumps(recorded, indent=2))
    return secrets


def redact_values(root: Path, secrets: set[str]) -> list[Path]:
    """Replace each of `secrets` (raw and JSON-escaped) in every file under `root`; the files changed."""
    needles: dict[bytes, bytes] = {}
    for secret in secrets:
        for form in {secret, json.dumps(secret)[1:-1]}:
            needles[form.encode()] = REDACTED.encode()
    changed = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        new = data
        for needle, replacement in needles.items():
            new = new.replace(needle, replacement)
        if new != data:
            mode = path.stat().st_mode & 0o777
            path.write_bytes(new)
            path.chmod(mode & 0o700)
            changed.append(path)
    return changed


def scrub_run(run_dir: Path, keep_env: set[str]) -> None:
    """Scrub one run's record: the runner's command files, any env/ file with extra vars or passwords, and
    every secret value those held wherever else the record repeats it. Marks the run scrubbed."""
    secrets: set[str] = set()
    for command in sorted(run_dir.glob("artifacts/*/command")):
        secrets |= scrub_command_file(command.parent, keep_env)
    for name in ENV_FILES:
        (run_dir / "env" / name).unlink(missing_ok=True)
    if secrets and (run_dir / "artifacts").is_dir():
        redact_values(run_dir / "artifacts", secrets)
    write_private(run_dir / SCRUBBED, "")


def scrub_leftovers(root: Path, keep_env: set[str]) -> list[Path]:
    """Scrub the runs whose driver was killed before its own scrub (SIGKILL, power loss); the runs scrubbed."""
    if not root.is_dir():
        return []
    left = sorted(p for p in root.iterdir() if p.is_dir() and RUN_NAME.match(p.name) and not (p / SCRUBBED).exists())
    for run_dir in left:
        scrub_run(run_dir, keep_env)
    return left
