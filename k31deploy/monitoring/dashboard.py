"""A Grafana dashboard for a resolved plan: one row per server role, every panel on the `k31:` recording rules
of `k31deploy.monitoring.rules` (so Grafana and the alerts read the same numbers)."""

from __future__ import annotations

from typing import Any

from k31deploy.monitoring.rules import router_worker_urls, rules
from k31deploy.plan import Plan

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'k31_server=~"$k31_server"'
ROLE_ORDER = ("unified", "prefill", "decode")


def _panel(pid: int, title: str, targets: list[tuple[str, str]], unit: str, x: int, y: int,
           w: int = 8, max_: float | None = None) -> dict[str, Any]:
    defaults: dict[str, Any] = {"unit": unit}
    if max_ is not None:
        defaults.update({"min": 0, "max": max_})
    return {"id": pid, "type": "timeseries", "title": title, "datasource": DS,
            "gridPos": {"h": 8, "w": w, "x": x, "y": y},
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend}
                        for i, (expr, legend) in enumerate(targets)]}


def _role_panels(role: str, recorded: set[str], sel: str) -> list[tuple[str, list[tuple[str, str]], str, float | None]]:
    """(title, [(expr, legend)], unit, max) for one role's row; only what the rules record for this plan."""
    panels: list[tuple[str, list[tuple[str, str]], str, float | None]] = [
        ("Time to first token", [(f"k31:ttft_seconds:p{q}{{{sel}}}", f"{{{{k31_server}}}} p{q}") for q in (50, 90, 99)],
         "s", None),
        ("Inter-token latency", [(f"k31:itl_seconds:p{q}{{{sel}}}", f"{{{{k31_server}}}} p{q}") for q in (50, 90)],
         "s", None),
        ("Generation throughput", [(f"k31:gen_throughput_tokens_per_second:sum{{{sel}}}", "{{k31_server}} engine"),
                                   (f"k31:generation_tokens:rate{{{sel}}}", "{{k31_server}} finished")],
         "short", None),
        ("Running vs ceiling", [(f"k31:num_running_reqs:sum{{{sel}}}", "{{k31_server}} running"),
                                (f"k31:num_queue_reqs:sum{{{sel}}}", "{{k31_server}} queued")]
         + ([(f"k31:max_running_requests{{{sel}}}", "{{k31_server}} ceiling")]
            if "k31:max_running_requests" in recorded else []), "short", None),
        ("Pool usage", [(f"k31:kv_pool_usage:max{{{sel}}}", "{{k31_server}} KV"),
                        (f"k31:state_pool_usage:max{{{sel}}}", "{{k31_server}} KDA state")]
         + ([(f"k31:hicache_host_pool_usage:max{{{sel}}}", "{{k31_server}} HiCache host")]
            if "k31:hicache_host_pool_usage:max" in recorded else []), "percentunit", 1.0),
        ("Health and restarts", [(f"k31:server_up:min{{{sel}}}", "{{k31_server}} up"),
                                 (f"k31:unit_restarts:changes1h{{{sel}}}", "{{k31_server}} restarts / 1h")],
         "short", None),
    ]
    if role in ("prefill", "decode") and "k31:transfer_failed_reqs:rate" in recorded:
        failures = [(f"k31:transfer_failed_reqs:rate{{{sel}}}", "{{k31_server}} transfer"),
                    (f"k31:bootstrap_failed_reqs:rate{{{sel}}}", "{{k31_server}} bootstrap")]
        panels.append(("PD transfer failures", failures, "reqps", None))
    return panels


def grafana_dashboard(doc: Plan | dict[str, Any], settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Grafana dashboard JSON (schemaVersion 38) with `datasource` and `k31_server` template variables."""
    plan = Plan.of(doc)
    recorded = {r["record"] for g in rules(plan, settings)["groups"] for r in g["rules"] if "record" in r}
    roles = [r for r in ROLE_ORDER if any(s.role == r for s in plan.servers)]
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    if plan.router:
        panels.append({"id": pid, "type": "row", "title": "Router", "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        targets = [(f'k31:healthy_servers:count{{k31_role="{r}"}}', f"{r} healthy servers") for r in roles]
        targets += [(f'k31:router_healthy_workers:sum{{k31_role="{r}"}}', f"{r} healthy in router") for r in roles
                    if r in router_worker_urls(plan)]
        panels.append(_panel(pid, "Healthy workers per role", targets, "short", 0, y, w=24))
        pid, y = pid + 1, y + 8
    for role in roles:
        sel = f'k31_role="{role}", {SEL}'
        panels.append({"id": pid, "type": "row", "title": f"{role} servers", "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid, y = pid + 1, y + 1
        for i, (title, targets, unit, max_) in enumerate(_role_panels(role, recorded, sel)):
            panels.append(_panel(pid, f"{role}: {title}", targets, unit, (i % 3) * 8, y + (i // 3) * 8, max_=max_))
            pid += 1
        y += ((len(_role_panels(role, recorded, sel)) + 2) // 3) * 8
    return {
        "title": f"k31 {plan.model} ({plan.platform}, {plan.topology})",
        "uid": f"k31-{plan.platform}-{plan.topology}",
        "tags": ["k31", "sglang"], "timezone": "browser", "editable": True, "schemaVersion": 38,
        "time": {"from": "now-6h", "to": "now"}, "refresh": "30s", "graphTooltip": 1,
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus",
             "current": {}, "hide": 0, "refresh": 1, "options": []},
            {"name": "k31_server", "type": "query", "label": "Server", "datasource": DS,
             "query": {"query": "label_values(k31:server_up:min, k31_server)", "refId": "k31_server"},
             "definition": "label_values(k31:server_up:min, k31_server)", "refresh": 2, "includeAll": True,
             "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "options": [],
             "sort": 1},
        ]},
        "annotations": {"list": []},
        "panels": panels,
    }

