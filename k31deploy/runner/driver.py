"""Run one k31 playbook through ansible-runner: a private data dir per run (the run record), the repo's
ansible.cfg, events to a view, Ctrl-C through the runner's cancel callback, and nothing secret left on disk.
"""

from __future__ import annotations

import configparser
import json
import os
import shlex
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import ansible_runner

import k31deploy
from k31deploy.errors import K31Error
from k31deploy.runner import records
from k31deploy.runner.view import View

COMMANDS = ("deploy", "redeploy", "teardown", "preflight")
# ansible-playbook --ask-vault-pass prompts this; the runner answers it from memory (pexpect), never a file.
VAULT_PROMPT = r"^Vault password:\s*?$"
# How often (s) the runner polls the cancel callback; its default of 5 s makes Ctrl-C feel ignored.
CANCEL_POLL_S = 1
# How long ansible-playbook gets to stop its workers after an interrupt before the runner kills it.
CANCEL_GRACE_S = 10.0
EXIT_CANCELLED = 130


def repo_root() -> Path:
    """The checkout the package runs from: its playbooks, roles and ansible.cfg sit next to k31deploy/."""
    root = Path(k31deploy.__file__).resolve().parents[1]
    if not (root / "deploy.yml").is_file():
        raise K31Error(f"k31's playbooks are not next to the installed package ({root} has no deploy.yml); "
                       "install k31 from its checkout with pip install -e")
    return root


def playbook_for(command: str, root: Path) -> Path:
    """deploy runs the root deploy.yml (as `ansible-playbook deploy.yml` does); the others playbooks/<command>.yml."""
    path = root / "deploy.yml" if command == "deploy" else root / "playbooks" / f"{command}.yml"
    if not path.is_file():
        present = [c for c in COMMANDS if c == "deploy" or (root / "playbooks" / f"{c}.yml").is_file()]
        raise K31Error(f"k31 {command} needs the playbook {path.relative_to(root)}, which this checkout does not "
                       f"have yet; commands available: {', '.join(present)}")
    return path


@dataclass
class RunRequest:
    command: str
    playbook: Path
    inventories: list[str]
    limit: str | None = None
    tags: str | None = None
    skip_tags: str | None = None
    check: bool = False
    diff: bool = False
    extra_vars: list[str] = field(default_factory=list)   # as on the command line: k=v, @file or JSON
    k31_vars: dict[str, Any] = field(default_factory=dict)  # what a k31 subcommand adds (redeploy targets ...)
    forks: int | None = None
    verbosity: int = 0
    vault_password_files: list[str] = field(default_factory=list)
    vault_password: str | None = field(default=None, repr=False)
    mitogen: bool = False    # Mitogen's linear strategy (mitogen_env)


@dataclass
class RunOutcome:
    exit_code: int
    summary: dict[str, Any]
    run_dir: Path


def _existing(path: str, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise K31Error(f"{what} {path} does not exist; give the path to an existing file")
    return p.resolve()


def inventory_paths(values: list[str]) -> list[str]:
    """Absolute paths: ansible-runner runs Ansible from the repo root, not from where k31 was started."""
    if not values:
        raise K31Error("-i/--inventory is required; give the inventory file or directory of the cluster")
    return [str(_existing(v, "inventory")) for v in values]


def cmdline_args(req: RunRequest) -> list[str]:
    """The ansible-playbook options ansible-runner has no parameter for."""
    args: list[str] = []
    if req.check:
        args.append("--check")
    if req.diff:
        args.append("--diff")
    for value in req.extra_vars:
        if value.startswith("@"):
            value = "@" + str(_existing(value[1:], "extra vars file"))
        args += ["-e", value]
    for path in req.vault_password_files:
        args += ["--vault-password-file", str(_existing(path, "vault password file"))]
    if req.vault_password is not None:
        args.append("--ask-vault-pass")
    return args


def _host_key_checking(cfg: Path) -> str:
    # ansible-runner turns host key checking off unless told otherwise; keep what ansible-playbook would do.
    if "ANSIBLE_HOST_KEY_CHECKING" in os.environ:
        return os.environ["ANSIBLE_HOST_KEY_CHECKING"]
    parser = configparser.ConfigParser()
    parser.read(cfg)
    return parser.get("defaults", "host_key_checking", fallback="True")


def mitogen_env() -> dict[str, str]:
    """Ansible settings that run a playbook under Mitogen's linear strategy (PyPI mitogen): one persistent
    interpreter per host instead of a Python start and module upload per task. Same plays, same results; on the
    sandbox a fresh 4-host deploy took about 0.4x the time (README, Deploy)."""
    try:
        import ansible_mitogen
    except ImportError:
        raise K31Error("--mitogen needs the mitogen package in k31's venv (pip install -e '.[mitogen]'); "
                       "without it, leave --mitogen out") from None
    return {"ANSIBLE_STRATEGY_PLUGINS": str(Path(ansible_mitogen.__file__).parent / "plugins" / "strategy"),
            "ANSIBLE_STRATEGY": "mitogen_linear"}


def runner_env(root: Path) -> dict[str, str]:
    cfg = root / "ansible.cfg"
    python_path = [str(root), *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(root))]
    return {
        "ANSIBLE_CONFIG": str(cfg),
        # The k31_plan filter imports k31deploy: the same checkout this driver runs from.
        "PYTHONPATH": os.pathsep.join(python_path),
        # The ansible-playbook installed with this Python, even when its venv is not activated.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "ANSIBLE_HOST_KEY_CHECKING": _host_key_checking(cfg),
        # ansible-runner names its own callback folder in this variable, which hides ansible.cfg's callback_plugins:
        # k31's (callback_plugins/k31_warm.py) goes first and the runner appends its own.
        "ANSIBLE_CALLBACK_PLUGINS": str(root / "callback_plugins"),
    }


@contextmanager
def sigint_cancels(cancel: threading.Event, view: View) -> Iterator[None]:
    """The first Ctrl-C (or a SIGTERM, as CI timeouts and systemd send) asks the runner to stop the playbook;
    the run still ends with its record written and scrubbed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: Any) -> None:
        if not cancel.is_set():
            view.note("cancelling: stopping the playbook; the run record will list what was left undone")
        cancel.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _parent_pid(pid: int) -> int | None:
    try:
        # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may contain spaces, so split after ")".
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


class Canceller:
    """The runner's cancel_callback. The runner's own cancel SIGKILLs ansible-playbook's process group, but
    Ansible's workers run in sessions of their own and would finish their tasks orphaned. So a cancel first
    interrupts ansible-playbook as Ctrl-C would (it stops its workers and their tasks), and asks the runner to
    kill it only if it is still running CANCEL_GRACE_S later."""

    def __init__(self, flag: threading.Event, grace_s: float = CANCEL_GRACE_S) -> None:
        self.flag = flag
        self.grace_s = grace_s
        self.pid: int | None = None  # ansible-playbook's, from the events its callback sends
        self.since: float | None = None

    def saw(self, event: dict[str, Any]) -> None:
        self.pid = self.pid or event.get("pid")

    def __call__(self) -> bool:
        if not self.flag.is_set():
            return False
        if self.since is None:
            self.since = time.monotonic()
            # Only a process this one started: the runner spawns ansible-playbook as our direct child.
            if self.pid and _parent_pid(self.pid) == os.getpid():
                os.kill(self.pid, signal.SIGINT)
                return False
            return True
        return time.monotonic() - self.since > self.grace_s


def exit_code(status: str, rc: int | None) -> int:
    if status == "successful":
        return 0
    if status == "cancelled":
        return EXIT_CANCELLED
    return rc if rc else 1


def run(req: RunRequest, view: View, cancel: threading.Event | None = None) -> RunOutcome:
    """Run the playbook to the end (or until `cancel` is set), write summary.json, return the exit code."""
    root = repo_root()
    inventories = inventory_paths(req.inventories)
    args = cmdline_args(req)
    keep = records.keep_runs()
    env = {**runner_env(root), **(mitogen_env() if req.mitogen else {})}
    # Runs whose driver was killed (SIGKILL) before its own scrub are scrubbed before anything else.
    records.scrub_leftovers(records.runs_dir(), set(env))
    run_dir = records.new_run_dir(req.command)
    records.rotate(run_dir.parent, keep)
    # Only runner settings go in env/: with suppress_env_files the runner writes no extravars or passwords.
    (run_dir / "env").mkdir()
    (run_dir / "env" / "settings").write_text(json.dumps({"pexpect_timeout": CANCEL_POLL_S}))
    cancel = cancel or threading.Event()
    started = datetime.now(UTC)
    t0 = time.monotonic()
    meta: dict[str, Any] = {
        "command": req.command, "playbook": str(req.playbook), "inventory": inventories, "limit": req.limit,
        "tags": req.tags, "skip_tags": req.skip_tags, "check": req.check, "diff": req.diff,
        "run_dir": str(run_dir), "started": started.isoformat(),
    }
    view.start(meta)
    view_faults: list[str] = []

    canceller = Canceller(cancel)

    def on_event(event: dict[str, Any]) -> bool:
        canceller.saw(event)
        try:
            view.feed(event)
        except Exception as exc:  # a display fault must not abort a rollout halfway
            view_faults.append(f"k31 could not show event {event.get('counter')}: {exc!r}")
        return True

    try:
        with sigint_cancels(cancel, view):
            thread, runner = ansible_runner.run_async(
                private_data_dir=str(run_dir), ident=run_dir.name, playbook=str(req.playbook),
                inventory=inventories, project_dir=str(root), envvars=env, extravars=req.k31_vars or None,
                passwords={VAULT_PROMPT: req.vault_password} if req.vault_password is not None else None,
                cmdline=shlex.join(args) if args else None, limit=req.limit, tags=req.tags, skip_tags=req.skip_tags,
                forks=req.forks, verbosity=req.verbosity or None, suppress_env_files=True, quiet=True,
                # Leave fact caching to ansible.cfg (the shared cache), as ansible-playbook would.
                fact_cache_type=None,
                event_handler=on_event, cancel_callback=canceller,
            )
            while thread.is_alive():
                thread.join(0.2)
    finally:
        # Whatever ended the run, an exception in the driver included; a SIGKILL is caught up with by the
        # next run's scrub_leftovers.
        records.scrub_run(run_dir, set(env))
    # An interrupted ansible-playbook exits on its own, so the runner may call it failed, not canceled.
    status = "successful" if runner.status == "successful" else "cancelled" if cancel.is_set() else "failed"
    meta.update(finished=datetime.now(UTC).isoformat(), duration=round(time.monotonic() - t0, 3),
                runner_status=runner.status)
    summary = view.state.summary(meta, rc=runner.rc, status=status)
    summary["errors"] += view_faults
    records.write_summary(run_dir, summary)
    view.finish(summary, run_dir)
    return RunOutcome(exit_code(status, runner.rc), summary, run_dir)


def adhoc(inventory: list[str], hosts: list[str], module: str, module_args: str, *, become: bool,
          task_timeout: int) -> tuple[list[dict[str, Any]], int | None]:
    """One module on `hosts` in one ad-hoc run (k31 status / k31 logs ship their probe this way): the runner's
    events and its rc. The same environment and repo as playbook runs; nothing is written under the run records."""
    root = repo_root()
    with tempfile.TemporaryDirectory(prefix="k31-adhoc-") as tmp:
        runner = ansible_runner.run(
            private_data_dir=tmp, project_dir=str(root), inventory=inventory, host_pattern=",".join(hosts),
            module=module, module_args=module_args, envvars=runner_env(root),
            # A host that froze behind an open SSH control connection hangs instead of failing the connect.
            cmdline=f"--task-timeout {task_timeout}" + (" --become" if become else ""), quiet=True,
            suppress_env_files=True,
        )
        return list(runner.events), runner.rc

