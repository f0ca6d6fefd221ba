"""The Grafana dashboard and the Prometheus console page generated for real plans."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
from loopback import free_port
from recipe_helpers import plan as resolve_plan

from k31deploy.monitoring.dashboard import grafana_dashboard
from k31deploy.monitoring.rules import rules

PLANS = {
    "mi355x-1p1d-sglang": {"platform": "mi355x", "agents": 92},
    "gb300-pd-dynamo": {"platform": "gb300", "topology": "pd", "prefill_strategy": "high-throughput",
                        "decode_strategy": "balanced"},
    "mi355x-unified-none": {"platform": "mi355x", "agents": 48},
    "b300-pd-mooncake": {"platform": "b300", "topology": "pd", "prefill_strategy": "high-throughput",
                         "decode_strategy": "balanced", "kv_offload": "mooncake"},
}
# What the scrape contract provides besides the recording rules.
CONTRACT = {"up", "probe_success", "k31_unit_start_time_seconds"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                "offset", "le", "inf", "nan"}
DATA = Path(__file__).resolve().parents[2] / "k31deploy" / "data" / "monitoring"


def metric_names(expr: str) -> set[str]:
    """Series names an expression reads: identifiers outside label matchers that are not functions,
    aggregations or keywords."""
    bare = re.sub(r"label_values\(([^,]+),[^)]*\)", r"\1", expr)  # Grafana's variable query: its metric
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", bare)
    bare = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare):
        rest = bare[m.end():].lstrip()
        if rest.startswith("(") or m.group().lower() in PROMQL_WORDS:
            continue
        names.add(m.group())
    return names


def all_panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"]] + [c for p in dashboard["panels"] for c in p.get("panels", [])]


@pytest.mark.parametrize("label", sorted(PLANS))
def test_dashboard_is_json_and_reads_only_recorded_series(label):
    plan = resolve_plan(**PLANS[label])
    dashboard = json.loads(json.dumps(grafana_dashboard(plan)))
    assert dashboard["schemaVersion"] == 38
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["k31_server"]["type"] == "query"
    ids = [p["id"] for p in all_panels(dashboard)]
    assert len(ids) == len(set(ids))
    recorded = {r["record"] for g in rules(plan)["groups"] for r in g["rules"] if "record" in r}
    exprs = [t["expr"] for p in all_panels(dashboard) for t in p.get("targets", [])]
    exprs.append(variables["k31_server"]["definition"])
    assert exprs
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        assert names <= recorded | CONTRACT, (expr, names - recorded - CONTRACT)
    for p in all_panels(dashboard):
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}"
    titles = " ".join(p["title"] for p in all_panels(dashboard))
    for role in {s["role"] for s in plan["servers"]}:
        assert f"{role} servers" in titles


def test_metric_name_extraction_can_fail():
    assert metric_names('max by (k31_server) (k31:foo{a="b"}) or sum(rate(bar_total[5m]))') == {"k31:foo", "bar_total"}


def test_hicache_and_ceiling_panels_follow_the_plan():
    pd = json.dumps(grafana_dashboard(resolve_plan(**PLANS["mi355x-1p1d-sglang"])))
    dynamo = json.dumps(grafana_dashboard(resolve_plan(**PLANS["gb300-pd-dynamo"])))
    assert "k31:hicache_host_pool_usage:max" in pd and "k31:max_running_requests" in pd
    assert "k31:hicache_host_pool_usage:max" not in dynamo and "k31:max_running_requests" not in dynamo


# -- console template on a real Prometheus 2.42 ---------------------------------------------------------


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus (Debian's package) is not installed "
                                                              "here; CI installs it")
def test_console_page_renders_on_prometheus(tmp_path):
    plan = resolve_plan(**PLANS["mi355x-1p1d-sglang"])
    (tmp_path / "rules.yml").write_text(json.dumps(rules(plan)))  # JSON is YAML
    (tmp_path / "prometheus.yml").write_text("global: {evaluation_interval: 1s}\nrule_files: [rules.yml]\n")
    port = free_port()
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             f"--web.console.templates={DATA / 'consoles'}",
                             f"--web.console.libraries={DATA / 'console_libraries'}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                if _get(f"{base}/-/ready")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "prometheus did not start"
            time.sleep(0.1)
        time.sleep(1.2)  # one rule evaluation: the page lists servers from k31:server_up:min
        status, body = _get(f"{base}/consoles/k31.html")
        assert status == 200, body[-2000:]
        assert "error executing template" not in body and "template:" not in body
        assert "PromConsole.Graph" in body and "/classic/static/js/prom_console.js" in body
        for server in plan["servers"]:
            assert server["name"] in body
        rules_page = _get(f"{base}/api/v1/rules")[1]
        assert '"health":"ok"' in rules_page and '"health":"err"' not in rules_page
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
