"""`k31 status -i INV [--json] [--repair]`, `k31 alerts -i INV [--json]` and `k31 logs -i INV [SERVER]`: what
runs where and what fires, read over SSH in one parallel Ansible ad-hoc run (k31deploy.oncall.gather);
--repair brings back what an interrupted redeploy left (k31deploy.oncall.recover, playbooks/repair.yml)."""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from datetime import datetime
from pathlib import Path

from k31deploy.commands.ops import positive_int, run_repair
from k31deploy.commands.recipe import add_plan_args, plan_from_args
from k31deploy.errors import K31Error
from k31deploy.oncall import gather, recover
from k31deploy.paths import state_dir


def _inventories(args: argparse.Namespace) -> list[str]:
    if not args.inventory:
        raise K31Error(f"k31 {args.command} needs -i INVENTORY: the deployed inventory names the hosts to read")
    path = Path(args.inventory)
    if not path.exists():
        raise K31Error(f"inventory {args.inventory} does not exist; pass -i with the deployed inventory file")
    return [str(path.resolve())]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="every server, rank, router and Dynamo process: unit state, health, image",
                       description="Every server rank, the router and every other k31 process: systemd state, "
                                   "rank-0 /health, router readiness and workers, image or runtime, uptime, "
                                   "restarts. Exit 0 when nothing is wrong, 1 when a problem is listed.")
    add_plan_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-become", dest="become", action="store_false",
                   help="do not become root on the hosts (journal and container reads may then fail)")
    p.add_argument("--repair", action="store_true",
                   help="bring back what an interrupted redeploy left: re-add healthy servers missing from the "
                        "router (decodes once their prefills restarted, drained, as the PD rule wants) and release "
                        "held k31-pd-follow watchers; refused while a redeploy is running")
    p.add_argument("-e", "--extra-vars", action="append", default=[], metavar="VARS",
                   help="with --repair: extra vars for its playbook (e.g. @secrets.yml with the router's keys)")
    p.add_argument("--vault-password-file", action="append", default=[], metavar="FILE",
                   help="with --repair: file (or executable) giving the vault password; repeatable")
    p.add_argument("--ask-vault-pass", action="store_true", help="with --repair: prompt for the vault password")
    p.set_defaults(func=cmd_status, command="status")

    p = sub.add_parser("alerts", help="the alerts Alertmanager holds: firing, silenced or inhibited",
                       description="Alertmanager's alerts (monitoring=prometheus), read on the monitoring host with "
                                   "its cluster certificate: name, severity, server, state, since, summary. Exit 0 "
                                   "when none fires, 1 when one does.")
    add_plan_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output (with each alert's runbook)")
    p.add_argument("--no-become", dest="become", action="store_false", help="do not become root on the host")
    p.set_defaults(func=cmd_alerts, command="alerts")

    p = sub.add_parser("logs", help="recent journal lines of each rank, fetched into a local folder",
                       description="Fetch the last journal lines of every k31 unit (or one server's ranks, or "
                                   "'router') into DEST, one file per unit; prints DEST.")
    add_plan_args(p)
    p.add_argument("server", nargs="?", metavar="SERVER", help="one server name (or 'router'); all when omitted")
    p.add_argument("--lines", type=positive_int, default=200, metavar="N", help="journal lines per unit (default 200)")
    p.add_argument("--dest", type=Path, metavar="DIR",
                   help="folder to write into (default: <state dir>/logs/<timestamp>)")
    p.add_argument("--no-become", dest="become", action="store_false", help="do not become root on the hosts")
    p.set_defaults(func=cmd_logs, command="logs")


def cmd_status(args: argparse.Namespace) -> int:
    inventories = _inventories(args)
    plan = plan_from_args(args)
    if args.repair:
        return repair(args, plan, inventories)
    doc = gather.status(plan, inventories, become=args.become)
    print(json.dumps(doc, indent=2) if args.json else gather.render(doc))
    return 1 if doc["problems"] else 0


def repair(args: argparse.Namespace, plan: dict, inventories: list[str]) -> int:
    """Look first (one probe): refuse while a redeploy runs, change nothing when there is nothing to do; else run
    playbooks/repair.yml, which takes the lock and decides again, and show the status it leaves."""
    answers = gather.collect(plan, inventories, become=args.become)
    host = recover.lock_host(plan)
    verdict = recover.lock_verdict(answers.get(host, {}).get("redeploy_lock"), host)
    if verdict["state"] == "live":
        raise K31Error(f"k31 status --repair refused: {verdict['message']}")
    todo = recover.decide(plan, answers)
    say = sys.stderr if args.json else sys.stdout
    if verdict["state"] == "stale":    # the playbook takes it over and releases it
        todo["summary"].append(f"clear the stale redeploy lock ({verdict['message']})")
    if todo["nothing"] and verdict["state"] != "stale":
        doc = gather.build_status(plan, answers)
        print(json.dumps(doc, indent=2) if args.json else gather.render(doc))
        print("repair: " + "; ".join(todo["summary"]), file=say)
        return 1 if doc["problems"] else 0
    for line in todo["summary"]:
        print(f"repair: {line}", file=say)
    password = getpass.getpass("Vault password: ") if args.ask_vault_pass else None
    outcome = run_repair(inventories, args.extra_vars, args.vault_password_file, password, json_mode=False, out=say)
    doc = gather.status(plan, inventories, become=args.become)
    print(json.dumps(doc, indent=2) if args.json else gather.render(doc))
    print(f"repair: {'done' if outcome.exit_code == 0 else 'incomplete (rc ' + str(outcome.exit_code) + ')'}; "
          f"run record {outcome.run_dir}", file=say)
    return 1 if doc["problems"] or outcome.exit_code else 0


def cmd_alerts(args: argparse.Namespace) -> int:
    inventories = _inventories(args)
    doc = gather.alerts(plan_from_args(args), inventories, become=args.become)
    print(json.dumps(doc, indent=2) if args.json else gather.render_alerts(doc))
    return 1 if any(a["state"] == "active" for a in doc["alerts"]) else 0


def cmd_logs(args: argparse.Namespace) -> int:
    inventories = _inventories(args)
    plan = plan_from_args(args)
    dest = args.dest or state_dir() / "logs" / datetime.now().strftime("%Y%m%d-%H%M%S")
    out = gather.logs(plan, inventories, args.server, args.lines, dest.resolve(), become=args.become)
    for host, why in out["missed"].items():
        print(f"k31 logs: {host}: no logs: {why}", file=sys.stderr)
    print(out["dest"])
    return 1 if out["missed"] else 0
