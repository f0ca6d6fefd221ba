"""`k31 status` and `k31 logs` on the controller: one Ansible ad-hoc run (ansible-runner, the repo's
ansible.cfg, the inventory's own SSH settings and known_hosts, every host in parallel) ships probe.py to
each host, and the answers are folded into one report against the resolved plan."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

from k31deploy import address
from k31deploy.errors import K31Error
from k31deploy.monitoring.config import api_url
from k31deploy.oncall import recover
from k31deploy.oncall.rollout import http, router_auth, router_url, server_step
from k31deploy.plan import Plan, Rank
from k31deploy.runner import driver, records

PROBE = Path(__file__).with_name("probe.py")
TASK_TIMEOUT_S = 20
# (inventory, probe source, hosts, become) -> {host: answer}; ansible_probe, or a fake in unit tests.
Runner = Callable[[list[str], str, list[str], bool], dict[str, dict[str, Any]]]


def plan_hosts(doc: Plan | dict[str, Any]) -> list[str]:
    plan = Plan.of(doc)
    hosts = plan.engine_hosts + [other.host for other in (plan.router, plan.monitoring) if other]
    return list(dict.fromkeys(hosts))


def _pki(plan: Plan) -> dict[str, str]:
    if not plan.pki:
        raise K31Error("the plan names no cluster CA (pki) for a control plane that authenticates by certificate")
    return asdict(plan.pki)


def alerts_spec(plan: Plan) -> dict[str, Any] | None:
    """Where the probe on the monitoring host reads Alertmanager's alerts (with that host's certificate)."""
    if not plan.monitoring:
        return None
    return {"url": f"{api_url(plan, 'alertmanager')}/api/v2/alerts", "auth": _pki(plan)}


def host_specs(doc: Plan | dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per host: the planned units and the URLs to probe for each, on the address each unit binds (where
    the gates probe): an engine's cluster address, the router's public one."""
    plan = Plan.of(doc)
    specs: dict[str, dict[str, Any]] = {h: {"units": {}} for h in plan_hosts(plan)}
    for server in plan.servers:
        for rank in server.ranks:
            specs[rank.host]["units"][rank.unit] = {"health": http(rank.address, server.port, "/health")}
    router = plan.router
    if router:
        if router.kind == "sglang":    # its worker API wants the control-plane key, in its own env file
            base = router_url(router)
            urls = {"readiness": f"{base}/readiness", "workers": f"{base}/workers", "auth": router_auth(router.unit)}
        else:    # the Dynamo frontend takes clients with a cluster-CA certificate: the host's own
            base = address.url("https", router.public_address, router.port)
            urls = {"models": f"{base}/v1/models", "auth": _pki(plan)}
        if router.tls:    # the site's certificate, for the name clients use
            urls["auth"]["own_tls"] = True
        specs[router.host]["units"][router.unit] = urls
    where = alerts_spec(plan)
    if where and plan.monitoring:
        specs[plan.monitoring.host]["alerts"] = where
    specs[recover.lock_host(plan)]["lock"] = True
    return specs


def repair_spec(doc: Plan | dict[str, Any]) -> dict[str, Any]:
    """Where the repair (roles/k31_redeploy) looks: the lock host, the probe (k31 status's own; its sha256, which a
    host's installed copy must have to be run instead) and its argument for each host, one rollout-style step per
    server (drain, restart and re-add use the same fields), and the prefill hosts whose watchers it holds."""
    plan = Plan.of(doc)
    specs = host_specs(plan)
    return {"lock_host": recover.lock_host(plan), "probe": str(PROBE),
            "probe_sha256": hashlib.sha256(PROBE.read_bytes()).hexdigest(),
            "probe_args": {h: json.dumps({"mode": "status", "common": {}, "hosts": {h: spec}})
                           for h, spec in specs.items()},
            "hosts": list(specs), "steps": {s.name: server_step(s, "repair") for s in plan.servers},
            "prefill_hosts": sorted({h for s in plan.servers if s.role == "prefill" for h in s.hosts})}


def probe_source(spec: dict[str, Any]) -> str:
    return ("#!/usr/bin/env python3\n" + PROBE.read_text()
            + f"\n\nraise SystemExit(cli(json.loads({json.dumps(json.dumps(spec))})))\n")


def ansible_probe(inventory: list[str], source: str, hosts: list[str], become: bool) -> dict[str, dict[str, Any]]:
    """Run the probe on `hosts` in one ad-hoc run; {host: parsed JSON | {"unreachable"|"failed": message}}."""
    with tempfile.TemporaryDirectory(prefix="k31-probe-") as tmp:
        script = Path(tmp) / "k31-probe.py"
        script.write_text(source)
        events, rc = driver.adhoc(inventory, hosts, "ansible.builtin.script", f"{script} {{{{ inventory_hostname }}}}",
                                  become=become, task_timeout=TASK_TIMEOUT_S)
    results: dict[str, dict[str, Any]] = {}
    for event in events:
        data = event.get("event_data") or {}
        host, res = data.get("host"), data.get("res") or {}
        if not host:
            continue
        if event["event"] == "runner_on_ok":
            try:
                results[host] = json.loads(res.get("stdout") or "")
            except ValueError:
                results[host] = {"failed": f"the probe printed no JSON: {(res.get('stdout') or '')[:200]}"}
        elif event["event"] == "runner_on_unreachable":
            results[host] = {"unreachable": str(res.get("msg", "unreachable")).strip()}
        elif event["event"] == "runner_on_failed":
            message = " ".join(str(res.get(k) or "").strip() for k in ("msg", "stderr")).strip()
            # The task timeout: the host hung behind an open SSH connection.
            hung = "Timed out after" in message or "expected time frame" in message
            results[host] = {"unreachable" if hung else "failed": message}
    for host in hosts:
        results.setdefault(host, {"failed": f"ansible returned nothing for {host} (rc {rc})"})
    return results


def _rank_row(rank: Rank, answer: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"host": rank.host, "node_rank": rank.node_rank, "unit": rank.unit}
    if "units" not in answer:
        row["reachable"] = False
        row["error"] = answer.get("unreachable") or answer.get("failed")
        return row
    row["reachable"] = True
    row.update({k: v for k, v in answer["units"].get(rank.unit, {"active": "absent"}).items() if k != "unit"})
    return row


def build_status(doc: Plan | dict[str, Any], answers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The report: servers with their ranks, the router, every other k31 process, and the problems."""
    plan = Plan.of(doc)
    problems: list[str] = []
    for host, answer in answers.items():
        if "units" not in answer:
            problems.append(f"{host}: {'unreachable' if 'unreachable' in answer else 'probe failed'}: "
                            f"{answer.get('unreachable') or answer.get('failed')}")
    router = plan.router
    router_doc = None
    listed: set[str] | None = None
    if router:
        answer = answers.get(router.host, {})
        unit = dict(answer.get("units", {}).get(router.unit, {"active": "unknown" if "units" not in answer
                                                              else "absent"}))
        router_doc = {"kind": router.kind, "host": router.host, "port": router.port, **unit}
        if "units" in answer:
            if unit.get("active") != "active":
                problems.append(f"{router.unit} on {router.host}: {unit.get('active')}/{unit.get('sub', '-')}")
            if router.kind == "sglang":
                if unit.get("readiness") != 200:
                    problems.append(f"router /readiness answers {unit.get('readiness')}")
                if isinstance(unit.get("workers"), list):
                    listed = {w["url"] for w in unit["workers"] if w.get("healthy") is not False}
            elif plan.model not in (unit.get("models") or []):
                problems.append(f"the Dynamo frontend does not list {plan.model}")
    servers = []
    for server in plan.servers:
        ranks = [_rank_row(r, answers.get(r.host, {})) for r in server.ranks]
        entry = {"name": server.name, "role": server.role, "port": server.port,
                 "health": ranks[0].get("health"), "ranks": ranks,
                 "in_router": (server.url in listed) if listed is not None else None}
        for row in ranks:
            if row["reachable"] and row.get("active") != "active":
                problems.append(f"{row['unit']} on {row['host']}: {row.get('active')}/{row.get('sub', '-')}")
        if ranks[0]["reachable"] and entry["health"] != 200:
            problems.append(f"{server.name}: rank 0 /health answers {entry['health']}")
        if entry["in_router"] is False and not (ranks[0].get("health") == 200
                                                and all(r.get("active") == "active" for r in ranks)):
            problems.append(f"{server.name}: not in the router's healthy workers")
        servers.append(entry)
    # What an interrupted redeploy leaves: healthy servers out of the router, held watchers (and the lock).
    lock_answer = answers.get(recover.lock_host(plan), {})
    verdict = recover.lock_verdict(lock_answer.get("redeploy_lock"), recover.lock_host(plan))
    problems += recover.problems(plan, answers, verdict)
    alert_list, alert_error = _alerts(plan, answers)
    if alert_error:
        problems.append(f"alerts unknown: {alert_error}")
    for a in alert_list:
        if a["state"] == "active":
            problems.append(f"alert {a['alert']} ({a['severity']}) firing"
                            + (f" for {a['server']}" if a["server"] else "") + f": {a['summary']}")
    for entry in servers:
        entry["alerts"] = [a["alert"] for a in alert_list if a["server"] == entry["name"] and a["state"] == "active"]
    planned = {r.unit for s in plan.servers for r in s.ranks} | ({router.unit} if router else set())
    processes = []
    order = plan_hosts(plan)
    for host, answer in sorted(answers.items(), key=lambda item: order.index(item[0])):
        for unit, info in answer.get("units", {}).items():
            if unit not in planned:
                row = {"host": host, **info}
                if unit == "k31-pd-follow" and "pd_follow" in answer:
                    row["pd_follow"] = answer["pd_follow"]
                    if answer["pd_follow"].get("pending"):
                        problems.append(f"{host}: prefill restart pending after decode "
                                        f"{', '.join(answer['pd_follow'].get('because') or [])} restarted"
                                        + (" (held by a redeploy)" if answer["pd_follow"].get("held") else ""))
                if info.get("active") not in ("active", "inactive") or info.get("load") == "not-found":
                    problems.append(f"{unit} on {host}: {info.get('active')}/{info.get('sub', '-')}")
                processes.append(row)
    return {"model": plan.model, "topology": plan.topology,
            "generated": datetime.now().isoformat(timespec="seconds"),
            "servers": servers, "router": router_doc, "processes": processes, "alerts": alert_list,
            "redeploy": {"lock": verdict["state"] if "redeploy_lock" in lock_answer else "unknown",
                         "message": verdict["message"],
                         "holds": recover.holds(answers, datetime.now().timestamp())},
            "hosts": {h: ("ok" if "units" in a else "unreachable" if "unreachable" in a else "probe failed")
                      for h, a in answers.items()},
            "problems": problems}


def _alerts(plan: Plan, answers: dict[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
    """Alertmanager's alerts as the monitoring host's probe read them; (alerts, why unknown)."""
    if not plan.monitoring:
        return [], None
    answer = answers.get(plan.monitoring.host, {})
    if "units" not in answer and "alerts" not in answer:
        return [], None    # the host itself is reported unreachable
    found = answer.get("alerts") or {"error": "the probe read no alerts"}
    return (found.get("list") or []), found.get("error")


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    days, rest = divmod(int(seconds), 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _image(row: dict[str, Any]) -> str:
    if row.get("runtime") == "container":
        return row.get("image") or "container (image unknown)"
    return row.get("runtime") or "-"


def render(doc: dict[str, Any]) -> str:
    header = ("SERVER", "ROLE", "RANK", "HOST", "UNIT", "STATE", "HEALTH", "ROUTER", "IMAGE/RUNTIME", "UPTIME",
              "RESTARTS", "STARTED", "ALERTS")
    rows: list[tuple[str, ...]] = [header]
    for s in doc["servers"]:
        for r in s["ranks"]:
            in_router = {True: "in", False: "OUT", None: "-"}[s["in_router"]] if r["node_rank"] == 0 else ""
            firing = ",".join(s.get("alerts") or []) if r["node_rank"] == 0 else ""
            if not r["reachable"]:
                rows.append((s["name"], s["role"], str(r["node_rank"]), r["host"], r["unit"], "UNREACHABLE", "-",
                             in_router, "-", "-", "-", "-", firing))
                continue
            rows.append((s["name"], s["role"], str(r["node_rank"]), r["host"], r["unit"],
                         f"{r.get('active')}/{r.get('sub', '-')}", str(r.get("health", "-")), in_router, _image(r),
                         duration(r.get("uptime_s")), str(r.get("restarts", "-")), r.get("started") or "-", firing))
    router = doc["router"]
    if router:
        state = f"{router.get('active')}/{router.get('sub', '-')}" if "sub" in router else str(router.get("active"))
        check = str(router.get("readiness", len(router.get("models") or []) if router["kind"] == "dynamo" else "-"))
        rows.append((f"router ({router['kind']})", "router", "-", router["host"], router.get("unit") or "-",
                     state, check, "", _image(router), duration(router.get("uptime_s")),
                     str(router.get("restarts", "-")), router.get("started") or "-", ""))
    for p in doc["processes"]:
        rows.append(("-", "process", "-", p["host"], p["unit"], f"{p.get('active')}/{p.get('sub', '-')}", "-", "",
                     _image(p), duration(p.get("uptime_s")), str(p.get("restarts", "-")), p.get("started") or "-", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    if router and isinstance(router.get("workers"), list):
        workers = router["workers"]
        lines.append(f"router workers: {len(workers)} ("
                     + ", ".join(f"{w['url']} {w.get('type')}{'' if w.get('healthy') else ' UNHEALTHY'}"
                                 for w in workers) + ")")
    held = [a for a in doc.get("alerts", []) if a["state"] != "active"]
    if held:
        lines.append("alerts held back: " + ", ".join(
            f"{a['alert']}{' ' + a['server'] if a['server'] else ''} "
            f"({'silenced' if a['silenced_by'] else 'inhibited'})" for a in held))
    redeploy = doc.get("redeploy") or {}
    if redeploy.get("lock") in ("live", "stale"):
        lines.append(f"redeploy lock: {redeploy['lock']}: {redeploy['message']}")
    lines += [f"problem: {p}" for p in doc["problems"]] or ["no problems found"]
    return "\n".join(lines)


def alerts(doc: Plan | dict[str, Any], inventory: list[str], become: bool = True,
           runner: Runner = ansible_probe) -> dict[str, Any]:
    """`k31 alerts`: Alertmanager's alerts, read on the monitoring host."""
    plan = Plan.of(doc)
    where = alerts_spec(plan)
    if where is None or not plan.monitoring:
        raise K31Error("monitoring=none: this plan deploys no Alertmanager to read alerts from; deploy with "
                       "monitoring=prometheus, or ask the site's own Alertmanager")
    host = plan.monitoring.host
    spec = {"mode": "alerts", "common": {}, "hosts": {host: {"alerts": where}}}
    answer = runner(inventory, probe_source(spec), [host], become).get(host, {})
    if "alerts" not in answer:
        raise K31Error(f"monitoring host {host}: {answer.get('unreachable') or answer.get('failed') or 'no answer'}")
    found = answer["alerts"]
    if found.get("error"):
        raise K31Error(f"Alertmanager on {host}: {found['error']}")
    return {"host": host, "alerts": found.get("list") or []}


def render_alerts(doc: dict[str, Any]) -> str:
    header = ("ALERT", "SEVERITY", "SERVER", "STATE", "SINCE", "SUMMARY")
    rows = [header] + [(a["alert"] or "-", a["severity"] or "-", a["server"] or "-",
                        "firing" if a["state"] == "active" else "silenced" if a["silenced_by"] else "inhibited",
                        (a["since"] or "-")[:19], a["summary"] or "") for a in doc["alerts"]]
    if len(rows) == 1:
        return f"no alerts (Alertmanager on {doc['host']})"
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def collect(plan: Plan | dict[str, Any], inventory: list[str], become: bool = True,
            runner: Runner = ansible_probe) -> dict[str, dict[str, Any]]:
    """Every plan host's probe answer (what build_status and recover.decide read)."""
    spec = {"mode": "status", "common": {}, "hosts": host_specs(plan)}
    return runner(inventory, probe_source(spec), plan_hosts(plan), become)


def status(plan: Plan | dict[str, Any], inventory: list[str], become: bool = True,
           runner: Runner = ansible_probe) -> dict[str, Any]:
    return build_status(plan, collect(plan, inventory, become, runner))


def log_units(doc: Plan | dict[str, Any], server: str | None) -> dict[str, list[str]] | None:
    """{host: units} for one server (or 'router'); None for every k31 unit of every host."""
    if server is None:
        return None
    plan = Plan.of(doc)
    for s in plan.servers:
        if s.name == server:
            out: dict[str, list[str]] = {}
            for r in s.ranks:
                out.setdefault(r.host, []).append(r.unit)
            return out
    router = plan.router
    if server == "router" and router:
        return {router.host: [router.unit]}
    valid = [s.name for s in plan.servers] + (["router"] if router else [])
    raise K31Error(f"server {server!r} is not in this inventory's plan; valid choices: {', '.join(valid)}")


def logs(plan: Plan | dict[str, Any], inventory: list[str], server: str | None, lines: int, dest: Path,
         become: bool = True, runner: Runner = ansible_probe) -> dict[str, Any]:
    """Fetch the journal of each unit into `dest` (one file per unit); returns what was written and missed."""
    wanted = log_units(plan, server)
    hosts = list(wanted) if wanted is not None else plan_hosts(plan)
    spec = {"mode": "logs", "common": {"lines": lines},
            "hosts": {h: {"units": {u: {} for u in units}} for h, units in (wanted or {}).items()}}
    answers = runner(inventory, probe_source(spec), hosts, become)
    fetched: dict[str, dict[str, str]] = {}
    for host, answer in answers.items():
        for unit, text in answer.get("logs", {}).items():
            if wanted is None or unit in wanted.get(host, []):
                fetched.setdefault(unit, {})[host] = text
    # Journals can hold what a process printed: root-only, as on the host.
    records.private_dir(dest)
    files = []
    for unit, by_host in sorted(fetched.items()):
        for host, text in sorted(by_host.items()):
            path = dest / (f"{unit}.log" if len(by_host) == 1 else f"{unit}.{host}.log")
            records.write_private(path, text)
            files.append(str(path))
    missed = {h: a.get("unreachable") or a.get("failed") for h, a in answers.items() if "logs" not in a}
    return {"dest": str(dest), "files": files, "missed": missed}
