"""Rules generated from real plans, checked and unit-tested by the real promtool: each alert fires on a
synthetic bad series and stays quiet on a healthy one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from recipe_helpers import plan as resolve_plan

from k31deploy.errors import K31Error
from k31deploy.monitoring import rules as monitoring

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian's prometheus package) is not "
                                                              "installed here; CI installs it")

PLANS: dict[str, dict[str, Any]] = {
    "mi355x-1p1d-sglang": {"platform": "mi355x", "agents": 92},
    "gb300-pd-dynamo": {"platform": "gb300", "topology": "pd", "prefill_strategy": "high-throughput",
                        "decode_strategy": "balanced"},
    "mi355x-unified-none": {"platform": "mi355x", "agents": 48, "prefill_decode_interval": 16},
    "mi355x-unified-sglang": {"platform": "mi355x", "agents": 48, "router": "sglang"},
    "b300-pd-mooncake": {"platform": "b300", "topology": "pd", "prefill_strategy": "high-throughput",
                         "decode_strategy": "balanced", "kv_offload": "mooncake"},
}
MINUTES = 60
TTFT_LE = ("1", "4", "8", "10", "20", "+Inf")


@pytest.fixture(scope="module", params=sorted(PLANS))
def case(request) -> tuple[str, dict[str, Any]]:
    return request.param, resolve_plan(**PLANS[request.param])


def _series(metric: str, labels: dict[str, str]) -> str:
    return metric + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


class Synthetic:
    """A healthy fleet for `plan` as k31's scrape config sees it; scenarios override single series."""

    def __init__(self, plan: dict[str, Any]):
        self.plan = plan
        self.series: dict[tuple[str, str | None, str], str] = {}  # (metric, server, key) -> values
        self.labels: dict[tuple[str, str | None, str], dict[str, str]] = {}
        flat = lambda v: f"{v}x{MINUTES}"  # noqa: E731
        for s in plan["servers"]:
            name, role = s["name"], s["role"]
            target = {"instance": f"{s['ranks'][0]['address']}:{s['port']}", "k31_server": name, "k31_role": role}
            engine = {**target, "job": "k31-engine", "k31_strategy": s["strategy"]}
            rank = {**engine, "model_name": "moonshotai/Kimi-K3.1-Pro", "engine_type": role,
                    "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
            tokenizer = {**engine, "model_name": "moonshotai/Kimi-K3.1-Pro"}
            self.add("up", name, engine, flat(1))
            self.add("probe_success", name, {**target, "job": "k31-health"}, flat(1))
            for metric, value in (("sglang:num_running_reqs", 10), ("sglang:num_queue_reqs", 0),
                                  ("sglang:token_usage", 0.5), ("sglang:mamba_usage", 0.4),
                                  ("sglang:gen_throughput", 900)):
                self.add(metric, name, rank, flat(value))
            if s["kv_offload"] in ("hicache", "mooncake"):
                self.add("sglang:hicache_host_used_tokens", name, rank, flat(500))
                self.add("sglang:hicache_host_total_tokens", name, rank, flat(1000))
            if role in ("prefill", "decode"):
                self.add("sglang:num_transfer_failed_reqs_total", name, rank, flat(0))
            self.add("sglang:generation_tokens_total", name, tokenizer, f"0+600x{MINUTES}")
            self.ttft(name, "1")
            for i, r in enumerate(s["ranks"]):
                for metric in ("k31_unit_start_time_seconds", "k31_unit_crash_restart_time_seconds"):
                    self.add(metric, name,
                             {"job": "k31-node", "instance": f"{r['address']}:9100", "k31_host": r["host"],
                              "unit": r["unit"], "k31_server": name, "k31_role": role, "k31_rank": str(i)}, flat(0),
                             key=str(i))
        for role, urls in monitoring.router_worker_urls(plan).items():
            for url in urls:
                self.add("smg_worker_health", None, {"job": "k31-router", "worker": url}, flat(1), key=url)
                self.labels[("smg_worker_health", None, url)]["k31_router"] = "sglang"
                self.series[("smg_worker_health", role, url)] = self.series.pop(("smg_worker_health", None, url))
                self.labels[("smg_worker_health", role, url)] = self.labels.pop(("smg_worker_health", None, url))

    def add(self, metric: str, server: str | None, labels: dict[str, str], values: str, key: str = "") -> None:
        self.series[(metric, server, key)] = values
        self.labels[(metric, server, key)] = dict(labels)

    def set(self, metric: str, server: str, values: str) -> None:
        keys = [k for k in self.series if k[0] == metric and k[1] == server]
        assert keys, f"no {metric} series for {server}"
        for k in keys:
            self.series[k] = values

    def drop(self, metric: str, server: str) -> None:
        for k in [k for k in self.series if k[0] == metric and k[1] == server]:
            del self.series[k], self.labels[k]

    def ttft(self, server: str, bucket: str) -> None:
        """Every request of `server` answers within `bucket` (and no faster bucket): 60 a minute."""
        s = next(x for x in self.plan["servers"] if x["name"] == server)
        base = {"instance": f"{s['ranks'][0]['address']}:{s['port']}", "job": "k31-engine", "k31_server": server,
                "k31_role": s["role"], "k31_strategy": s["strategy"], "model_name": "moonshotai/Kimi-K3.1-Pro"}
        for le in TTFT_LE:
            hit = TTFT_LE.index(le) >= TTFT_LE.index(bucket)
            self.add("sglang:time_to_first_token_seconds_bucket", server, {**base, "le": le},
                     f"0+60x{MINUTES}" if hit else f"0x{MINUTES}", key=le)

    def input_series(self) -> list[dict[str, str]]:
        return [{"series": _series(k[0], self.labels[k]), "values": v} for k, v in sorted(self.series.items())]


def _expected(doc: dict[str, Any], alertname: str, **match: str) -> list[dict[str, Any]]:
    """The alerts promtool should report: each matching rule's labels and annotations (every expression ends
    in a label set that the rule's own labels already name)."""
    found = [r for r in doc["groups"][2]["rules"] if r["alert"] == alertname
             and all(r["labels"].get(k) == v for k, v in match.items())]
    assert found, (alertname, match)
    return [{"exp_labels": r["labels"], "exp_annotations": r["annotations"]} for r in found]


def _alert_names(doc: dict[str, Any]) -> list[str]:
    return sorted({r["alert"] for r in doc["groups"][2]["rules"]})


def _scenarios(plan: dict[str, Any], doc: dict[str, Any]) -> list[tuple[str, Synthetic, list[dict[str, Any]]]]:
    """(name, series, alert_rule_test entries)."""
    out = []
    servers = plan["servers"]
    names = _alert_names(doc)
    quiet = lambda t, *alerts: [{"eval_time": t, "alertname": a, "exp_alerts": []} for a in alerts]  # noqa: E731
    fires = lambda t, a, **m: [{"eval_time": t, "alertname": a, "exp_alerts": _expected(doc, a, **m)}]  # noqa: E731

    out.append(("healthy fleet", Synthetic(plan), [*quiet("10m", *names), *quiet("45m", *names)]))
    target = servers[-1]
    name, role = target["name"], target["role"]

    down = Synthetic(plan)
    down.set("up", name, "1x5 0x55")
    crashed = Synthetic(plan)
    crashed.set("k31_unit_start_time_seconds", name, "0x10 600x50")
    crashed.set("k31_unit_crash_restart_time_seconds", name, "0x10 600x50")
    out.append(("a rank crashed and systemd restarted it", crashed,
                [*quiet("5m", "K31EngineCrashed"), *fires("12m", "K31EngineCrashed", k31_server=name),
                 *quiet("40m", "K31EngineCrashed")]))
    planned = Synthetic(plan)
    planned.set("k31_unit_start_time_seconds", name, "0x10 600x50")    # a redeploy: no crash time
    out.append(("a planned restart is no crash", planned, quiet("12m", "K31EngineCrashed")))
    out.append(("engine down past the window", down,
                [*quiet("20m", "K31EngineDown"), *fires("30m", "K31EngineDown", k31_server=name)]))
    brief = Synthetic(plan)
    brief.set("probe_success", name, "1x5 0x10 1x45")
    out.append(("engine down for less than the window (a restart)", brief, quiet("15m", "K31EngineDown")
                + quiet("30m", "K31EngineDown") + quiet("55m", "K31EngineDown")))
    gone = Synthetic(plan)
    gone.drop("up", name)
    gone.drop("probe_success", name)
    out.append(("server missing from the scrape", gone, fires("30m", "K31EngineDown", k31_server=name)))

    if plan.get("router"):
        role_down = Synthetic(plan)
        for s in servers:
            if s["role"] == role:
                role_down.set("probe_success", s["name"], "1x5 0x55")
        out.append(("every server of a role down", role_down,
                    [*quiet("8m", "K31RouterNoHealthyWorker"),
                     *fires("12m", "K31RouterNoHealthyWorker", k31_role=role)]))
        urls = monitoring.router_worker_urls(plan)
        if role in urls:
            router_view = Synthetic(plan)
            for url in urls[role]:
                router_view.series[("smg_worker_health", role, url)] = "1x5 0x55"
            out.append(("the router holds no healthy worker of a role", router_view,
                        [*quiet("8m", "K31RouterNoHealthyWorker"),
                         *fires("12m", "K31RouterNoHealthyWorker", k31_role=role)]))

    ceilings = [s for s in servers if s["memory"]["max_running_requests"]]
    for s in ceilings:
        at = Synthetic(plan)
        at.set("sglang:num_running_reqs", s["name"], f"10x5 {s['memory']['max_running_requests']}x55")
        out.append((f"{s['name']} at its ceiling", at,
                    [*quiet("8m", "K31AgentCeiling"), *fires("12m", "K31AgentCeiling", k31_server=s["name"])]))
        below = Synthetic(plan)
        below.set("sglang:num_running_reqs", s["name"], f"{s['memory']['max_running_requests'] - 1}x{MINUTES}")
        out.append((f"{s['name']} one below its ceiling", below, quiet("30m", "K31AgentCeiling")))

    slow = Synthetic(plan)
    slow.ttft(name, "20")  # p90 between 10 and 20 s: over every default threshold
    out.append(("TTFT over every threshold", slow, fires("30m", "K31TTFTHigh", k31_server=name)))
    middling = Synthetic(plan)
    for s in servers:
        middling.ttft(s["name"], "8")  # p90 = 4 + 0.9 * 4 = 7.6 s: over 5.2, under 10.4
    over = [s["name"] for s in servers if monitoring.ttft_threshold(s, monitoring._settings(None)) < 7.6]
    out.append(("TTFT p90 7.6 s against each server's own threshold", middling,
                [{"eval_time": "30m", "alertname": "K31TTFTHigh",
                  "exp_alerts": [e for n in over for e in _expected(doc, "K31TTFTHigh", k31_server=n)]}]))

    for alert, metrics in (("K31KVPoolFull", {"sglang:token_usage": "0.95"}),
                           ("K31StatePoolFull", {"sglang:mamba_usage": "0.95"}),
                           ("K31HiCacheHostPoolFull", {"sglang:hicache_host_used_tokens": "950"})):
        for s in servers:
            if alert == "K31HiCacheHostPoolFull" and s["kv_offload"] not in ("hicache", "mooncake"):
                continue
            full = Synthetic(plan)
            for metric, value in metrics.items():
                healthy = next(v for k, v in full.series.items() if k[:2] == (metric, s["name"])).split("x")[0]
                full.set(metric, s["name"], f"{healthy}x5 {value}x55")
            out.append((f"{s['name']} {alert}", full,
                        [*quiet("12m", alert), *fires("20m", alert, k31_server=s["name"])]))
    if not any(s["kv_offload"] in ("hicache", "mooncake") for s in servers):
        assert "K31HiCacheHostPoolFull" not in names

    prefills = [s["name"] for s in servers if s["role"] == "prefill"]
    decodes = [s["name"] for s in servers if s["role"] == "decode"]
    if prefills and decodes:
        stale = Synthetic(plan)
        for d in decodes[:1]:
            stale.set("k31_unit_start_time_seconds", d, "0x10 600x50")
        out.append(("decode restarted, prefills did not", stale,
                    [*quiet("15m", "K31PrefillNotRestartedAfterDecode"),
                     {"eval_time": "30m", "alertname": "K31PrefillNotRestartedAfterDecode",
                      "exp_alerts": [e for p in prefills
                                     for e in _expected(doc, "K31PrefillNotRestartedAfterDecode", k31_server=p)]}]))
        followed = Synthetic(plan)
        followed.set("k31_unit_start_time_seconds", decodes[0], "0x10 600x50")
        for p in prefills:
            followed.set("k31_unit_start_time_seconds", p, "0x12 780x48")
        out.append(("decode restarted, prefills followed within the window", followed,
                    [*quiet("15m", "K31PrefillNotRestartedAfterDecode"),
                     *quiet("40m", "K31PrefillNotRestartedAfterDecode")]))
        loading = Synthetic(plan)
        loading.set("k31_unit_start_time_seconds", decodes[0], "0x10 600x50")
        loading.set("probe_success", decodes[0], "1x10 0x50")
        out.append(("decode restarted and still loading: prefills wait", loading,
                    quiet("40m", "K31PrefillNotRestartedAfterDecode")))
    else:
        assert "K31PrefillNotRestartedAfterDecode" not in names
    return out


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def _write_tests(tmp_path: Path, doc: dict[str, Any], scenarios) -> Path:
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(doc, sort_keys=False, width=1000))
    tests = {"rule_files": ["rules.yml"], "evaluation_interval": "1m",
             "tests": [{"name": name, "interval": "1m", "input_series": synthetic.input_series(),
                        "alert_rule_test": checks} for name, synthetic, checks in scenarios]}
    path = tmp_path / "tests.yml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False, width=1000))
    return path


# -- generation -------------------------------------------------------------------------------------------


def test_rules_are_deterministic_and_yaml(case):
    _, plan = case
    text = monitoring.rules_yaml(plan)
    assert text == monitoring.rules_yaml(plan)
    assert yaml.safe_load(text) == monitoring.rules(plan)


def test_every_per_server_alert_carries_k31_server_for_the_redeploy_silence(case):
    _, plan = case
    doc = monitoring.rules(plan)
    single = {s["role"] for s in plan["servers"]} - {
        s["role"] for s in plan["servers"] if sum(t["role"] == s["role"] for t in plan["servers"]) > 1}
    for rule in doc["groups"][2]["rules"]:
        labels = rule["labels"]
        assert labels["severity"] in ("page", "ticket")
        assert set(rule["annotations"]) == {"summary", "description", "runbook"}
        assert "k31 " in rule["annotations"]["runbook"]
        if rule["alert"] != "K31RouterNoHealthyWorker" or labels["k31_role"] in single:
            assert labels.get("k31_server") in {s["name"] for s in plan["servers"]}, rule["alert"]


def test_plan_shapes_which_rules_exist():
    pd = resolve_plan(**PLANS["mi355x-1p1d-sglang"])
    doc = monitoring.rules(pd)
    records = {r["record"] for g in doc["groups"] for r in g["rules"] if "record" in r}
    assert {"k31:transfer_failed_reqs:rate", "k31:hicache_host_pool_usage:max",
            "k31:router_healthy_workers:sum"} <= records
    ceilings = {r["alert"]: r for r in doc["groups"][2]["rules"] if r["alert"] == "K31AgentCeiling"}
    decode = next(s for s in pd["servers"] if s["role"] == "decode")
    assert ceilings["K31AgentCeiling"]["labels"]["k31_server"] == decode["name"]
    assert f">= {decode['memory']['max_running_requests']}" in ceilings["K31AgentCeiling"]["expr"]
    unified = monitoring.rules(resolve_plan(**PLANS["mi355x-unified-none"]))
    names = {r.get("alert") for r in unified["groups"][2]["rules"]}
    records = {r["record"] for g in unified["groups"] for r in g["rules"] if "record" in r}
    assert "K31RouterNoHealthyWorker" not in names and "K31PrefillNotRestartedAfterDecode" not in names
    assert "k31:transfer_failed_reqs:rate" not in records
    dynamo = monitoring.rules(resolve_plan(**PLANS["gb300-pd-dynamo"]))
    records = {r["record"] for g in dynamo["groups"] for r in g["rules"] if "record" in r}
    assert "k31:router_healthy_workers:sum" not in records  # Dynamo exports no per-worker health
    assert "K31AgentCeiling" not in {r.get("alert") for r in dynamo["groups"][2]["rules"]}  # the engine decides


def test_ttft_threshold_follows_the_interval_flag_and_settings():
    unified = resolve_plan(**PLANS["mi355x-unified-none"])
    server = unified["servers"][0]
    defaults = monitoring._settings(None)
    assert monitoring.ttft_threshold(server, defaults) == monitoring.SEED_TTFT_P90[16]
    plain = resolve_plan(platform="mi355x", agents=48)["servers"][0]
    assert monitoring.ttft_threshold(plain, defaults) == monitoring.SEED_TTFT_P90[8]
    assert monitoring.ttft_threshold(server, monitoring._settings({"ttft_p90_seconds": 3})) == 3
    per = monitoring._settings({"ttft_p90_seconds": {server["name"]: 7.5}})
    assert monitoring.ttft_threshold(server, per) == 7.5
    assert "> 7.5" in next(r["expr"] for r in monitoring.rules(unified, {"ttft_p90_seconds": {server["name"]: 7.5}})
                           ["groups"][2]["rules"] if r["alert"] == "K31TTFTHigh")


@pytest.mark.parametrize("settings, match", [
    ({"ceiling_for": "five minutes"}, "ceiling_for"),
    ({"pool_usage_ratio": 1.5}, "pool_usage_ratio"),
    ({"engine_down_four": "5m"}, "engine_down_four"),
    ({"ttft_p90_seconds": -1}, "ttft_p90_seconds"),
])
def test_bad_settings_are_refused(settings, match):
    with pytest.raises(K31Error, match=match):
        monitoring.rules(resolve_plan(**PLANS["mi355x-unified-none"]), settings)


def test_catalog_has_one_row_per_alert(case):
    _, plan = case
    catalog = monitoring.alert_catalog(plan)
    assert [row["name"] for row in catalog] == list(dict.fromkeys(r["alert"] for r in
                                                                  monitoring.rules(plan)["groups"][2]["rules"]))
    for row in catalog:
        assert set(row) == {"name", "severity", "for", "summary", "runbook"}


def test_write_rules(tmp_path):
    plan = resolve_plan(**PLANS["mi355x-unified-none"])
    path = monitoring.write_rules(plan, tmp_path / "sub" / "k31.rules.yml")
    assert yaml.safe_load(path.read_text()) == monitoring.rules(plan)
    assert path.stat().st_mode & 0o777 == 0o644


# -- promtool ---------------------------------------------------------------------------------------------


@needs_promtool
def test_promtool_checks_the_rules(case, tmp_path):
    _, plan = case
    (tmp_path / "rules.yml").write_text(monitoring.rules_yaml(plan))
    result = _promtool("check", "rules", "rules.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_unit_tests_each_alert(case, tmp_path):
    label, plan = case
    doc = monitoring.rules(plan)
    scenarios = _scenarios(plan, doc)
    tested = {c["alertname"] for _, _, checks in scenarios for c in checks if c["exp_alerts"]}
    assert tested == set(_alert_names(doc)), f"{label}: alerts without a firing test"
    path = _write_tests(tmp_path, doc, scenarios)
    result = _promtool("test", "rules", path.name, cwd=tmp_path)
    assert result.returncode == 0, f"{label}\n{result.stdout}\n{result.stderr}"
    assert "SUCCESS" in result.stdout + result.stderr


@needs_promtool
def test_promtool_harness_catches_a_wrong_expectation(tmp_path):
    """The same harness fails when an expectation is wrong: an engine down for less than the window is
    expected to page, and promtool must say it did not."""
    plan = resolve_plan(**PLANS["mi355x-1p1d-sglang"])
    doc = monitoring.rules(plan)
    name = plan["servers"][-1]["name"]
    brief = Synthetic(plan)
    brief.set("probe_success", name, "1x5 0x10 1x45")
    path = _write_tests(tmp_path, doc, [("wrong on purpose", brief,
                                          [{"eval_time": "15m", "alertname": "K31EngineDown",
                                            "exp_alerts": _expected(doc, "K31EngineDown", k31_server=name)}])])
    result = _promtool("test", "rules", path.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "K31EngineDown" in result.stdout + result.stderr


def test_the_readme_lists_every_alert_with_its_severity(case):
    """The README's on-call table is what on-call reads first: every alert a plan can raise is in it."""
    _, plan = case
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("### Monitoring and alerts")[1].split("\n\n| alert |")[1].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in cells[0].replace("`", "").split(","):
            rows[name.strip()] = cells[1]
    for alert in monitoring.alert_catalog(plan):
        assert rows.get(alert["name"]) == alert["severity"], alert["name"]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_router_worker_urls_are_the_urls_the_router_is_given(name):
    """The rules name each worker as the SGLang router's `worker` label does: the URL after --prefill,
    --decode or --worker-urls in its argv. The rules build them from the servers; this reads the argv."""
    plan = resolve_plan(**PLANS[name])
    router = plan["router"]
    given: dict[str, list[str]] = {}
    if router and router["kind"] == "sglang":
        roles, role = {"--prefill": "prefill", "--decode": "decode", "--worker-urls": "unified"}, None
        for token in router["argv"]:
            role = roles.get(token, role if not token.startswith("--") else None)
            if role and token.startswith("http"):
                given.setdefault(role, []).append(token)
    assert monitoring.router_worker_urls(plan) == given
