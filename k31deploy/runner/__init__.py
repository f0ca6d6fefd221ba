"""The `k31 deploy` family's engine: playbooks through ansible-runner, events to a live view or JSON lines,
and a run record (artifacts + summary.json) per run under `<state dir>/runs/`."""

from k31deploy.runner.driver import COMMANDS, RunOutcome, RunRequest, playbook_for, repo_root, run
from k31deploy.runner.view import JsonView, LiveView, PlainView, make_view

__all__ = ["COMMANDS", "JsonView", "LiveView", "PlainView", "RunOutcome", "RunRequest", "make_view", "playbook_for",
           "repo_root", "run"]
