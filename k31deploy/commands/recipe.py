"""`k31 catalog` (every cell of the recipe) and `k31 plan` (what will run on each host)."""

from __future__ import annotations

import argparse
import json
import shlex
from typing import Any

from k31deploy.catalog import STRATEGY_KNOB, cell_layout
from k31deploy.engine import lane
from k31deploy.errors import K31Error
from k31deploy.inventory import load_hosts
from k31deploy.recipe import catalog, iter_cells, knob_specs, layout_text, parse_sets, resolve
from k31deploy.recipe.knobs import coerce
from k31deploy.recipe.resolver import cell_digest


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("catalog", help="every recipe cell with its layout and verification status")
    p.add_argument("--platform", help="only this platform")
    p.add_argument("--knobs", action="store_true", help="the knob table (markdown) instead of the cells")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_catalog)

    p = sub.add_parser("plan", help="resolve the recipe for an inventory (or placeholders) and print it")
    add_plan_args(p)
    p.add_argument("--json", action="store_true", help="the plan as JSON (the contract in docs/architecture.md)")
    p.add_argument("--deploy", action="store_true", help="check as a deploy would (refuses placeholder images)")
    p.set_defaults(func=cmd_plan)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """The knob options every plan-consuming command shares."""
    p.add_argument("-i", "--inventory", help="Ansible inventory (INI or YAML); placeholders when omitted")
    p.add_argument("--platform")
    p.add_argument("--agents", type=int)
    p.add_argument("--topology")
    for knob in STRATEGY_KNOB.values():
        p.add_argument(f"--{knob.replace('_', '-')}", dest=knob)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KNOB=VALUE",
                   help="any recipe knob (same as inventory var k31_<knob>); repeatable")


def knobs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    knobs = parse_sets(args.sets)
    for name in ("platform", "agents", "topology", *STRATEGY_KNOB.values()):
        if getattr(args, name) is not None:
            flag = f"--{name.replace('_', '-')}"
            value = coerce(name, getattr(args, name), flag)
            if name in knobs and knobs[name] != value:
                raise K31Error(f"{name} is given twice, {flag} {value} and --set {name}={knobs[name]}; valid: one "
                               f"of them")
            knobs[name] = value
    return knobs


def plan_from_args(args: argparse.Namespace, *, require_image: bool = False) -> dict[str, Any]:
    hosts = None
    if args.inventory:
        hosts = load_hosts(args.inventory)
    return resolve(knobs_from_args(args), hosts, require_image=require_image, resolve_names=require_image)


def cmd_plan(args: argparse.Namespace) -> int:
    plan = plan_from_args(args, require_image=args.deploy)
    if args.json:
        print(json.dumps(plan, indent=2))
    else:
        print(render_plan(plan))
    return 0


def render_plan(plan: dict[str, Any]) -> str:
    lines = [f"{plan['model']} on {plan['platform']} ({plan['topology']}), image {plan['image']}"]
    for s in plan["servers"]:
        lines.append("")
        lines.append(f"{s['name']}: {s['role']} {s['strategy']} {layout_text(s['layout'])} on "
                     f"{s['layout']['nnodes']} node(s), {s['verification']}, port {s['port']}"
                     + (f", bootstrap {s['bootstrap_port']}" if s["bootstrap_port"] else ""))
        for rank in s["ranks"]:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in rank["env"].items())
            lines.append(f"  rank {rank['node_rank']} on {rank['host']}:")
            lines.append(f"    {env + ' ' if env else ''}{shlex.join(rank['argv'])}")
    router = plan["router"]
    lines.append("")
    if router:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in router["env"].items())
        lines.append(f"router ({router['kind']}) on {router['host']}, port {router['port']}:")
        lines.append(f"    {env + ' ' if env else ''}{shlex.join(router['argv'])}")
    else:
        lines.append("router: none (clients talk to the server directly)")
    mon = plan.get("monitoring")
    lines.append("")
    lines.append(f"monitoring: Prometheus and Alertmanager on {mon['host']}, node exporters on "
                 f"{', '.join(n['host'] for n in mon['nodes'])} (alerts: k31 alerts -i INV)" if mon else
                 "monitoring: none (file_sd target files only, for the site's Prometheus)")
    lines += ["", "ports (every port each host listens on):", *port_lines(plan["ports"])]
    for warning in plan["warnings"]:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


def port_lines(ports: list[dict[str, Any]]) -> list[str]:
    rows = [(p["host"], f"{p['port']}{'-' + str(p['port_last']) if p.get('port_last') else ''}/{p['proto']}",
             p["service"], p["purpose"]) for p in ports]
    widths = [max((len(r[i]) for r in rows), default=0) for i in range(3)]
    return ["  " + "  ".join([*(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)), r[3]]) for r in rows]


def engine_verdict(plat: str, role: str, strategy: str) -> tuple[str, dict[str, Any]]:
    """The engine lane's verdict on a cell, as the catalog's column shows it (and the row's JSON)."""
    reference = catalog()["engine_builds"][default_build()]["reference"]
    verdict = lane.cell_verdict(reference, plat, role, strategy, cell_digest(plat, role, strategy))
    text = verdict["result"]
    if text == "refused":
        feature = next((name for name, f in catalog()["branch_features"].items()
                        if " ".join(f["refusal"].split()) == verdict["message"]), None)
        text = f"refused: {feature} (branch-only)" if feature else f"refused: {verdict['message'][:70]}"
    return text, verdict


def default_build() -> str:
    return next(name for name, b in catalog()["engine_builds"].items() if b.get("default"))


def catalog_rows(platform: str | None = None) -> list[dict[str, Any]]:
    cat = catalog()
    reference = cat["engine_builds"][default_build()]["reference"]
    rows = []
    for plat, role, strategy, cell in iter_cells():
        if platform and plat != platform:
            continue
        shape = {"tp": 1, "pp": 1, **cat["shapes"][cell["shape"]]}
        gpus = shape["tp"] * shape["pp"]
        rows.append({
            "platform": plat, "role": role,
            "strategy": f"({cell['knob']}=true)" if cell.get("knob") else strategy,
            "layout": layout_text(shape) + (" MegaMoE" if cell.get("moe_runner") == "megamoe" else ""),
            "nodes": cell_layout(plat, cell, None)["nnodes"], "gpus": gpus,
            "verification": cell["verification"], "default": bool(cell.get("default")),
        })
        rows[-1]["engine"], rows[-1]["engine_check"] = engine_verdict(plat, role, strategy)
        rows[-1]["engine_check"]["build"] = reference
    return rows


def cmd_catalog(args: argparse.Namespace) -> int:
    if args.knobs:
        print(knob_table())
        return 0
    if args.platform and args.platform not in catalog()["platforms"]:
        raise K31Error(f"platform={args.platform} is not valid; valid platforms: {', '.join(catalog()['platforms'])}")
    rows = catalog_rows(args.platform)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    head = ("platform", "role", "strategy", "layout", "nodes", "gpus", "verification", "engine")
    table = [(*head[:-1], f"SGLang {rows[0]['engine_check']['build'].removeprefix('sglang-')}")] + [
        tuple(str(r[h]) + ("*" if h == "strategy" and r["default"] else "") for h in head) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    images = (f"{name} image {fam['image'] or 'none (source checkout)'}" for name, fam in catalog()["families"].items())
    print("\n* default strategy for the role; families: " + ", ".join(images))
    record = lane.record(rows[0]["engine_check"]["build"])
    if record:
        print(f"SGLang column: the engine lane's verdict on each cell's command ({record['machine'].get('gpu')}, "
              f"{record['date']}); branch-only: needs the recipe's kimi-k31-pro branch (`k31 plan` warns)")
    return 0


def knob_table() -> str:
    lines = ["| knob | values | what it sets |", "| --- | --- | --- |"]
    for name, spec in knob_specs().items():
        values = " \\| ".join(spec["choices"]) if "choices" in spec else spec["type"]
        lines.append(f"| `{name}` | {values} | {spec['doc']} |")
    return "\n".join(lines)
