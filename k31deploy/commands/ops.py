"""`k31 deploy | redeploy | teardown | preflight`: the playbooks through ansible-runner, with a live view
(or --json lines), a run record per run, and Ctrl-C that stops cleanly. (`k31 status` is
k31deploy.commands.status: one ad-hoc probe, no playbook.)"""

from __future__ import annotations

import argparse
import getpass
import shlex
import sys
from typing import TextIO

from k31deploy.errors import K31Error
from k31deploy.runner import RunOutcome, RunRequest, make_view, playbook_for, repo_root, run
from k31deploy.runner.driver import EXIT_CANCELLED, inventory_paths

HELP = {
    "deploy": "deploy the inventory's serving stack (deploy.yml)",
    "redeploy": "roll new settings onto running servers (playbooks/redeploy.yml)",
    "teardown": "stop and remove what k31 deployed (playbooks/teardown.yml)",
    "preflight": "check hosts are ready before a deploy (playbooks/preflight.yml)",
}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of 1 or more")
    return value


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The ansible-playbook options every playbook command passes through."""
    p.add_argument("-i", "--inventory", action="append", required=True, metavar="INV",
                   help="Ansible inventory file or directory; repeatable")
    p.add_argument("-l", "--limit", help="only these hosts or groups (Ansible pattern)")
    p.add_argument("-t", "--tags", help="only tasks with these tags (comma-separated)")
    p.add_argument("--skip-tags", help="skip tasks with these tags (comma-separated)")
    p.add_argument("-C", "--check", action="store_true", help="dry run: report what would change")
    p.add_argument("-D", "--diff", action="store_true", help="show file and template differences")
    p.add_argument("-e", "--extra-vars", action="append", default=[], metavar="VARS",
                   help="key=value, @file or JSON, as ansible-playbook takes them; repeatable")
    p.add_argument("-f", "--forks", type=positive_int, help="hosts worked on in parallel (default: ansible.cfg)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="Ansible verbosity; repeat for more")
    p.add_argument("--json", action="store_true", help="one JSON event per line on stdout, a summary line last")
    p.add_argument("--vault-password-file", action="append", default=[], metavar="FILE",
                   help="file (or executable) giving the vault password; repeatable")
    p.add_argument("--ask-vault-pass", action="store_true", help="prompt for the vault password (not echoed)")
    p.add_argument("--mitogen", action="store_true",
                   help="run the playbook under Mitogen's linear strategy (faster per task; pip extra 'mitogen')")


# --full: the converge stamp left unread (roles/k31_stamp), so the run does all of its work.
FULL_HELP = {
    "deploy": "run every host play even when every host is as its last deploy left it",
    "redeploy": "render the new version on every host of the rollout even where its converge stamp shows it is the "
                "one running",
}


def register(sub: argparse._SubParsersAction) -> None:
    for command, text in HELP.items():
        p = sub.add_parser(command, help=text, description=text)
        add_run_args(p)
        if command == "redeploy":
            p.add_argument("targets", nargs="*", metavar="TARGET",
                           help="role or server names to redeploy (passed as k31_redeploy_targets; all when omitted)")
            p.add_argument("--batch", type=positive_int, metavar="N",
                           help="servers restarted at a time (passed as k31_redeploy_batch)")
        if command in FULL_HELP:
            p.add_argument("--full", action="store_true", help=FULL_HELP[command] + " (k31_stamp_check=false)")
        if command == "teardown":
            p.add_argument("--yes", action="store_true", help="confirm the teardown (k31_teardown_confirm=true)")
        p.set_defaults(func=cmd_run, k31_command=command)


def k31_vars(args: argparse.Namespace) -> dict[str, object]:
    """What a subcommand adds to the playbook's extra vars; only what the operator asked for."""
    out: dict[str, object] = {}
    if getattr(args, "targets", None):
        out["k31_redeploy_targets"] = list(args.targets)
    if getattr(args, "batch", None):
        out["k31_redeploy_batch"] = args.batch
    if getattr(args, "yes", False):
        out["k31_teardown_confirm"] = True
    if getattr(args, "full", False):
        out["k31_stamp_check"] = False
    return out


def confirm_teardown(args: argparse.Namespace) -> None:
    """The runner cannot pass the playbook's own prompt through, so the controller asks."""
    if args.k31_command != "teardown" or args.yes or args.check:
        return
    if not sys.stdin.isatty():
        raise K31Error("teardown stops and removes every k31 unit; confirm with --yes (no terminal to ask on)")
    answer = input(f"Stop and remove every k31 unit of {', '.join(args.inventory)}? Type 'teardown' to go on: ")
    if answer.strip() != "teardown":
        raise K31Error("teardown not confirmed; nothing was changed")
    args.yes = True


def cmd_run(args: argparse.Namespace) -> int:
    playbook = playbook_for(args.k31_command, repo_root())
    inventories = inventory_paths(args.inventory)  # before the prompt: a typo should not cost a password
    confirm_teardown(args)
    password = getpass.getpass("Vault password: ") if args.ask_vault_pass else None
    request = RunRequest(
        command=args.k31_command, playbook=playbook, inventories=inventories, limit=args.limit, tags=args.tags,
        skip_tags=args.skip_tags, check=args.check, diff=args.diff, extra_vars=args.extra_vars,
        k31_vars=k31_vars(args), forks=args.forks, verbosity=args.verbose,
        vault_password_files=args.vault_password_file, vault_password=password, mitogen=args.mitogen,
    )
    outcome = run(request, make_view(args.json))
    if args.k31_command == "redeploy" and outcome.exit_code == EXIT_CANCELLED and not args.check:
        after_interrupted_redeploy(args, inventories, password)
    return outcome.exit_code


def repair_command(args: argparse.Namespace) -> str:
    """The command that repairs what an interrupted redeploy left, as the operator would type it."""
    words = ["k31", "status", "--repair"]
    for inv in args.inventory:
        words += ["-i", inv]
    for value in args.extra_vars:
        words += ["-e", value]
    for path in args.vault_password_file:
        words += ["--vault-password-file", path]
    if args.ask_vault_pass:
        words.append("--ask-vault-pass")
    return shlex.join(words)


def run_repair(inventories: list[str], extra_vars: list[str], vault_password_files: list[str],
               vault_password: str | None, json_mode: bool, out: TextIO | None = None) -> RunOutcome:
    """playbooks/repair.yml: what an interrupted redeploy left, brought back (k31deploy.oncall.recover)."""
    request = RunRequest(command="repair", playbook=playbook_for("repair", repo_root()), inventories=inventories,
                         extra_vars=extra_vars, vault_password_files=vault_password_files,
                         vault_password=vault_password)
    return run(request, make_view(json_mode, out))


def after_interrupted_redeploy(args: argparse.Namespace, inventories: list[str], password: str | None) -> None:
    """Ctrl-C stopped the rollout: servers may be drained and watchers held. Repair at once (the rollout's
    process is gone, so its lock is stale), or say exactly what to run when this is interrupted too."""
    command = repair_command(args)
    print(f"k31 redeploy: interrupted; bringing back what it left ({command}); Ctrl-C again to skip",
          file=sys.stderr)
    try:
        outcome = run_repair(inventories, args.extra_vars, args.vault_password_file, password, args.json)
    except KeyboardInterrupt:
        outcome = None
    if outcome is None or outcome.exit_code != 0:
        print(f"k31 redeploy: the repair did not finish; servers may be out of the router and k31-pd-follow "
              f"held: run {command}", file=sys.stderr)
    else:
        print("k31 redeploy: repaired: every healthy server is back in the router and no watcher is held; "
              "the rollout itself did not finish (run k31 redeploy again)", file=sys.stderr)
