"""Prometheus recording and alerting rules generated from a resolved plan.

The rules read the scrape contract of k31's Prometheus (the scrape config matches it):

- job `k31-engine`: each server's rank-0 /metrics, target labels k31_server, k31_role, k31_strategy;
- job `k31-router`: sglang-router's metrics listener or the Dynamo frontend's /metrics, label k31_router;
- job `k31-mooncake`: the Mooncake master; job `k31-node`: node exporters (label k31_host), whose textfile
  collector carries `k31_unit_start_time_seconds{unit, k31_server, k31_role, k31_rank}` (written by each engine
  unit at start);
- job `k31-health`: blackbox http probes of each server's rank-0 /health (k31_server, k31_role) and of the
  router (k31_server="router", k31_role="router"): `probe_success`.

Settings (all optional; `rules(plan, settings)`):

- `ttft_p90_seconds`: K31TTFTHigh's threshold, a number or {server: number}. Default per server from the
  seed's measurements (MI355X, 48 agents): p90 TTFT 5.2 s with --prefill-decode-interval 8, 10.4 s with 16.
  A server whose argv sets an interval >= 16 gets 10.4 s, every other server 5.2 s (PD servers never take
  the flag; the smaller measured operating point is the one a healthy server stays under).
- `ttft_for` (10m): how long p90 TTFT stays over the threshold before a ticket.
- `ceiling_for` (5m): how long running requests sit at the plan's --max-running-requests before a ticket.
- `pool_usage_ratio` (0.9) and `pool_for` (10m): KV, KDA-state and HiCache host pools.
- `engine_down_for` (20m): K31EngineDown. Model load on real hardware takes many minutes, and the PD rule
  restarts every prefill after a decode restart (k31-pd-follow, without a person or a silence), so a
  shorter window would page on every routine restart.
- `no_worker_for` (5m): K31RouterNoHealthyWorker, a whole role out of service.
- `pd_restart_for` (10m): K31PrefillNotRestartedAfterDecode, counted only once every decode is healthy.
- `restart_window` (15m): K31EngineCrashed fires at once when systemd restarted a rank after its process died
  (Restart=on-failure) within the window, and clears when the window has passed: a ticket, so a crash that
  recovered by itself is still seen. Restarts by k31 (redeploy, the PD rule's watcher) and by hand do not count.
- `rate_window` (5m): the window of every rate() and histogram quantile.
- `inventory` ("cluster.ini"): the inventory the runbooks' commands name.

Redeploys and silences: `k31 redeploy` silences a server in Alertmanager for its redeploy (matcher
k31_server="<name>"). Every per-server alert carries k31_server, and a role alert whose role has a single
server carries that server's k31_server too, so the silence covers the outage the redeploy itself causes in
a 1P1D. The `for:` windows cover what no silence does: crash restarts and the prefill restarts that the PD
rule triggers. A role alert of a role with several servers carries no k31_server: a rolling redeploy
leaves the others serving, so it does not fire unless the role really is out.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from k31deploy.errors import K31Error
from k31deploy.plan import Plan, Server

# -- upstream metric names --------------------------------------------------------------------------------
# SGLang: sgl-project/sglang python/sglang/srt/observability/metrics_collector.py (commit 44cedc2b; the same
# names at python/sglang/srt/metrics/collector.py, commit 00ae9c15). Scheduler gauges carry model_name,
# engine_type (prefill|decode|unified), tp_rank, pp_rank, moe_ep_rank[, dp_rank] (observability/
# scheduler_metrics_mixin.py init_metrics); tokenizer histograms and counters carry model_name.
TTFT = "sglang:time_to_first_token_seconds"         # TokenizerMetricsCollector, Histogram
ITL = "sglang:inter_token_latency_seconds"          # TokenizerMetricsCollector, Histogram
E2E = "sglang:e2e_request_latency_seconds"          # TokenizerMetricsCollector, Histogram
GEN_TOKENS = "sglang:generation_tokens_total"       # TokenizerMetricsCollector, Counter
GEN_THROUGHPUT = "sglang:gen_throughput"            # SchedulerMetricsCollector, Gauge (token/s)
RUNNING = "sglang:num_running_reqs"                 # SchedulerMetricsCollector, Gauge
QUEUED = "sglang:num_queue_reqs"                    # SchedulerMetricsCollector, Gauge
TOKEN_USAGE = "sglang:token_usage"                  # SchedulerMetricsCollector, Gauge (KV pool, 0-1)
# Newer upstream splits the KV pool out as full_token_usage (token_usage becomes max(full, swa, mamba));
# seen in a later metrics_collector.py, not at 44cedc2b: preferred when present, token_usage otherwise.
FULL_TOKEN_USAGE = "sglang:full_token_usage"
# Kimi-K3's KDA (linear attention) states live in SGLang's mamba pool: is_hybrid_ssm -> _get_mamba_token_info
# -> mamba_usage (scheduler_metrics_mixin.py log_prefill_stats / log_decode_stats).
MAMBA_USAGE = "sglang:mamba_usage"                  # SchedulerMetricsCollector, Gauge (0-1)
# HiCache host pool: SchedulerMetricsCollector creates these only with enable_hierarchical_cache. Read in a
# later upstream metrics_collector.py than the commits above; not verified against 0.5.23.
HICACHE_USED = "sglang:hicache_host_used_tokens"    # Gauge
HICACHE_TOTAL = "sglang:hicache_host_total_tokens"  # Gauge
TRANSFER_FAILED = "sglang:num_transfer_failed_reqs_total"    # SchedulerMetricsCollector, Counter (PD)
BOOTSTRAP_FAILED = "sglang:num_bootstrap_failed_reqs_total"  # SchedulerMetricsCollector, Counter (PD)
# No max-running-requests gauge upstream (only max_running_requests_under_SLO, set with an SLO only), so
# K31AgentCeiling takes the ceiling from the plan and skips servers whose plan leaves it to the engine.

# sglang-router 0.3.2 (sgl-project/sglang sgl-model-gateway/src/observability/metrics.rs; read off the
# wheel's exposition): smg_worker_health{worker="<url as passed on the command line>"} 1|0. It lags (the
# router's health checks fail several times before it flips), so the engines' own /health probes count too.
ROUTER_WORKER_HEALTH = "smg_worker_health"
# Dynamo's frontend exports no per-worker health (ai-dynamo/dynamo lib/runtime/src/metrics/prometheus_names.rs,
# frontend_service): behind Dynamo a role's health comes from the engines' probes alone.

# k31's contract (scrape config and the units' ExecStartPost writer).
UNIT_START = "k31_unit_start_time_seconds"
UNIT_CRASH = "k31_unit_crash_restart_time_seconds"    # set only by systemd's automatic restarts (NRestarts > 0)
SERVER_LABELS = "k31_server, k31_role, k31_strategy"
PER_RANK = "tp_rank, pp_rank, moe_ep_rank"

DEFAULTS: dict[str, Any] = {
    "ttft_p90_seconds": None,
    "ttft_for": "10m",
    "ceiling_for": "5m",
    "pool_usage_ratio": 0.9,
    "pool_for": "10m",
    "engine_down_for": "20m",
    "no_worker_for": "5m",
    "pd_restart_for": "10m",
    "restart_window": "15m",
    "rate_window": "5m",
    "inventory": "cluster.ini",
}
# Seed, AMD MI350X / MI355X: "At 48 agents ... p90 TTFT rose from 5.2 s to 10.4 s" (interval 8 -> 16).
SEED_TTFT_P90 = {8: 5.2, 16: 10.4}
DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")


def _settings(settings: dict[str, Any] | None) -> dict[str, Any]:
    merged = {**DEFAULTS, **(settings or {})}
    unknown = sorted(set(merged) - set(DEFAULTS))
    if unknown:
        raise K31Error(f"monitoring setting {unknown[0]} is not valid; valid settings: {', '.join(DEFAULTS)}")
    for key in ("ttft_for", "ceiling_for", "pool_for", "engine_down_for", "no_worker_for", "pd_restart_for",
                "restart_window", "rate_window"):
        if not isinstance(merged[key], str) or not DURATION.match(merged[key]):
            raise K31Error(f"monitoring setting {key} is {merged[key]!r}; it takes a Prometheus duration (5m, 1h30m)")
    ratio = merged["pool_usage_ratio"]
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0 < ratio <= 1:
        raise K31Error(f"monitoring setting pool_usage_ratio is {ratio!r}; it takes a number in (0, 1]")
    return merged


def ttft_threshold(doc: Server | dict[str, Any], settings: dict[str, Any]) -> float:
    """K31TTFTHigh's p90 threshold for a server: the setting, else the seed's measurement for its interval."""
    server = Server.of(doc)
    given = settings["ttft_p90_seconds"]
    if isinstance(given, dict) and server.name in given:
        given = given[server.name]
    if isinstance(given, int | float) and not isinstance(given, bool):
        if given <= 0:
            raise K31Error(f"monitoring setting ttft_p90_seconds is {given}; it takes a positive number")
        return float(given)
    if given is not None and not isinstance(given, dict):
        raise K31Error(f"monitoring setting ttft_p90_seconds is {given!r}; it takes a number or {{server: number}}")
    interval = server.settings.prefill_decode_interval if server.settings else None
    return SEED_TTFT_P90[16] if interval is not None and int(interval) >= 16 else SEED_TTFT_P90[8]


def _re2(text: str) -> str:
    """A literal for a PromQL regex matcher, escaped for RE2 and for the PromQL string it sits in."""
    return re.sub(r"([\\.^$*+?()\[\]{}|])", r"\\\\\1", text)


def _alternatives(names: list[str]) -> str:
    return "|".join(_re2(n) for n in names)


def router_worker_urls(doc: Plan | dict[str, Any]) -> dict[str, list[str]]:
    """Worker URLs per role as the SGLang router is given them (its smg_worker_health `worker` label): each
    server's URL (recipe/argv.router_plan hands the router the same)."""
    plan = Plan.of(doc)
    if plan.router_kind != "sglang":
        return {}
    urls: dict[str, list[str]] = {}
    for server in plan.servers:
        urls.setdefault(server.role, []).append(server.url)
    return urls


def _runbook(inv: str, *steps: str) -> str:
    return " ".join(f"{i}. {step}" for i, step in enumerate(steps, 1)).replace("INV", inv)


def _recording(plan: Plan, s: dict[str, Any]) -> list[dict[str, Any]]:
    w = s["rate_window"]
    eng = 'job="k31-engine"'
    rules_: list[dict[str, Any]] = []

    def rec(name: str, expr: str, labels: dict[str, str] | None = None) -> None:
        rules_.append({"record": name, "expr": expr, **({"labels": labels} if labels else {})})

    for metric, short, quantiles in ((TTFT, "ttft_seconds", (0.5, 0.9, 0.99)), (ITL, "itl_seconds", (0.5, 0.9)),
                                     (E2E, "e2e_seconds", (0.9,))):
        for q in quantiles:
            rec(f"k31:{short}:p{round(q * 100)}",
                f"histogram_quantile({q}, sum by ({SERVER_LABELS}, le) (rate({metric}_bucket{{{eng}}}[{w}])))")
    # A gauge per scheduler: tp/pp/ep ranks of one DP group report the same batch, DP groups add up.
    for metric, name in ((GEN_THROUGHPUT, "k31:gen_throughput_tokens_per_second:sum"),
                         (RUNNING, "k31:num_running_reqs:sum"), (QUEUED, "k31:num_queue_reqs:sum")):
        rec(name, f"sum by ({SERVER_LABELS}) (max without ({PER_RANK}) ({metric}{{{eng}}}))")
    rec("k31:generation_tokens:rate", f"sum by ({SERVER_LABELS}) (rate({GEN_TOKENS}{{{eng}}}[{w}]))")
    # The fullest rank bounds the server.
    rec("k31:kv_pool_usage:max", f"max by ({SERVER_LABELS}) ({FULL_TOKEN_USAGE}{{{eng}}}) "
                                 f"or max by ({SERVER_LABELS}) ({TOKEN_USAGE}{{{eng}}})")
    rec("k31:state_pool_usage:max", f"max by ({SERVER_LABELS}) ({MAMBA_USAGE}{{{eng}}})")
    offload = [x.name for x in plan.servers if x.offloads_kv]
    if offload:
        sel = f'{eng}, k31_server=~"{_alternatives(offload)}"'
        rec("k31:hicache_host_pool_usage:max",
            f"max by ({SERVER_LABELS}) ({HICACHE_USED}{{{sel}}} / {HICACHE_TOTAL}{{{sel}}})")
    if any(x.role in ("prefill", "decode") for x in plan.servers):
        sel = f'{eng}, k31_role=~"prefill|decode"'
        rec("k31:transfer_failed_reqs:rate", f"sum by ({SERVER_LABELS}) (rate({TRANSFER_FAILED}{{{sel}}}[{w}]))")
        rec("k31:bootstrap_failed_reqs:rate", f"sum by ({SERVER_LABELS}) (rate({BOOTSTRAP_FAILED}{{{sel}}}[{w}]))")
    for x in plan.servers:
        ceiling = x.memory.get("max_running_requests")
        if ceiling:
            rec("k31:max_running_requests", f"vector({int(ceiling)})", {"k31_server": x.name, "k31_role": x.role})
    return rules_


def _health_records(plan: Plan, s: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for x in plan.servers:
        name = x.name
        # Either view down is down; no series at all (target gone from the scrape) is down too.
        out.append({"record": "k31:server_up:min",
                    "expr": f'min(up{{job="k31-engine", k31_server="{name}"}} '
                            f'or probe_success{{job="k31-health", k31_server="{name}"}}) or vector(0)',
                    "labels": {"k31_server": name, "k31_role": x.role}})
    for role in sorted({x.role for x in plan.servers}):
        out.append({"record": "k31:healthy_servers:count",
                    "expr": f'count(k31:server_up:min{{k31_role="{role}"}} == 1) or vector(0)',
                    "labels": {"k31_role": role}})
    for role, urls in sorted(router_worker_urls(plan).items()):
        out.append({"record": "k31:router_healthy_workers:sum",
                    "expr": f'sum({ROUTER_WORKER_HEALTH}{{job="k31-router", worker=~"{_alternatives(urls)}"}}) '
                            f'or vector(0)',
                    "labels": {"k31_role": role}})
    out.append({"record": "k31:unit_start_time_seconds:min",
                "expr": f'min by (k31_server, k31_role) ({UNIT_START}{{job="k31-node"}})'})
    out.append({"record": "k31:unit_restarts:changes1h",
                "expr": f'sum by (k31_server, k31_role) (changes({UNIT_START}{{job="k31-node"}}[1h]))'})
    return out


def _alert(name: str, expr: str, for_: str, severity: str, labels: dict[str, str], summary: str,
           description: str, runbook: str) -> dict[str, Any]:
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity, **labels},
            "annotations": {"summary": summary, "description": description, "runbook": runbook}}


def _alerts(plan: Plan, s: dict[str, Any]) -> list[dict[str, Any]]:
    inv = s["inventory"]
    servers = plan.servers
    pd = any(x.role == "prefill" for x in servers) and any(x.role == "decode" for x in servers)
    pd_note = (" If it is a decode: once it is healthy every prefill restarts (the PD rule: a prefill keeps the "
               "old decode's Mooncake mapping); check they did (K31PrefillNotRestartedAfterDecode).") if pd else ""
    out: list[dict[str, Any]] = []
    for x in servers:
        name, role = x.name, x.role
        who = {"k31_server": name, "k31_role": role}
        sel = f'k31_server="{name}"'
        out.append(_alert(
            "K31EngineDown", f"k31:server_up:min{{{sel}}} == 0", s["engine_down_for"], "page", who,
            f"{name} ({role}) is down",
            f"{name}'s rank-0 /metrics scrape or /health probe has failed for {s['engine_down_for']}, longer than "
            "a model load; a redeploy silences it (k31_server).",
            _runbook(inv, f"k31 status -i INV: unit state, /health and restarts of {name}'s ranks.",
                     f"k31 logs -i INV {name}: the journal of each rank (OOM, NCCL/RCCL, a crash loop).",
                     f"k31 redeploy -i INV {name}: re-render, health-gate and re-add it (a failed gate restores the "
                     "saved files)." + pd_note)))
        out.append(_alert(
            "K31EngineCrashed",
            f'max by (k31_server, k31_role) '
            f'(changes({UNIT_CRASH}{{job="k31-node", {sel}}}[{s["restart_window"]}])) > 0',
            "0m", "ticket", who, f"{name} ({role}) crashed and was restarted",
            f"A rank of {name} died within the last {s['restart_window']} and systemd started it again "
            "(Restart=on-failure); restarts by k31 redeploy, the PD rule's watcher or by hand do not count.",
            _runbook(inv, f"k31 logs -i INV {name}: why the process died (OOM, NCCL/RCCL, a signal).",
                     f"k31 status -i INV: RESTARTS of {name}'s ranks; a count that keeps growing is a crash loop."
                     + pd_note)))
        ceiling = x.memory.get("max_running_requests")
        if ceiling:
            out.append(_alert(
                "K31AgentCeiling",
                f"max by (k31_server, k31_role) (k31:num_running_reqs:sum{{{sel}}}) >= {int(ceiling)}",
                s["ceiling_for"], "ticket", who,
                f"{name} runs at its --max-running-requests ceiling ({int(ceiling)})",
                f"{name} has run {int(ceiling)} requests (the plan's --max-running-requests) for {s['ceiling_for']}; "
                "further agents queue (k31:num_queue_reqs:sum).",
                _runbook(inv, f"k31 status -i INV: confirm every server is in the router; a missing one pushes its "
                              f"load onto {name}.",
                         "Compare the agent count with the plan (k31 plan -i INV): past the recipe's range the next "
                         "layout (k31 plan --agents N) is the fix, not a higher ceiling.")))
        threshold = ttft_threshold(x, s)
        out.append(_alert(
            "K31TTFTHigh", f"max by (k31_server, k31_role) (k31:ttft_seconds:p90{{{sel}}}) > {threshold:g}",
            s["ttft_for"], "ticket", who,
            f"{name} p90 time to first token is over {threshold:g} s",
            f"{name}'s p90 TTFT has been over {threshold:g} s for {s['ttft_for']} (the seed measured 5.2 s at "
            "48 agents with --prefill-decode-interval 8, 10.4 s with 16).",
            _runbook(inv, f"Check k31:num_queue_reqs:sum and k31:kv_pool_usage:max of {name}: queueing or a full "
                          "pool explains it.",
                     f"k31 status -i INV: a server out of the router loads the rest; k31 logs -i INV {name} for "
                     "retractions.")))
        pools = [("K31KVPoolFull", "k31:kv_pool_usage:max", "KV token pool"),
                 ("K31StatePoolFull", "k31:state_pool_usage:max", "KDA state (mamba) pool")]
        if x.offloads_kv:
            pools.append(("K31HiCacheHostPoolFull", "k31:hicache_host_pool_usage:max", "HiCache host pool"))
        for alert, record, pool in pools:
            out.append(_alert(
                alert, f"max by (k31_server, k31_role) ({record}{{{sel}}}) > {s['pool_usage_ratio']:g}",
                s["pool_for"], "ticket", who,
                f"{name} {pool} is over {s['pool_usage_ratio']:.0%} full",
                f"{name}'s {pool} has been over {s['pool_usage_ratio']:.0%} for {s['pool_for']}: requests are "
                "retracted or wait for memory.",
                _runbook(inv, f"k31 logs -i INV {name}: look for retractions and KV/state allocation failures.",
                         "Compare running requests with the plan's ceiling (k31 plan -i INV); a sustained full pool "
                         "needs fewer agents per server or the next layout.")))
    router = plan.router
    if router:
        urls = router_worker_urls(plan)
        for role in sorted({x.role for x in servers}):
            members = [x.name for x in servers if x.role == role]
            labels = {"k31_role": role, **({"k31_server": members[0]} if len(members) == 1 else {})}
            expr = f'k31:healthy_servers:count{{k31_role="{role}"}} == 0'
            if role in urls:
                expr = f'(k31:router_healthy_workers:sum{{k31_role="{role}"}} == 0) or ({expr})'
            out.append(_alert(
                "K31RouterNoHealthyWorker", expr, s["no_worker_for"], "page", labels,
                f"no healthy {role} server behind the {router.kind} router",
                f"Every {role} server ({', '.join(members)}) has been unhealthy"
                + (" or out of the router's healthy set" if role in urls else "")
                + f" for {s['no_worker_for']}: requests needing a {role} fail.",
                _runbook(inv, "k31 status -i INV: which servers are down and whether they are in the router.",
                         f"k31 logs -i INV {members[0]} (and the router: k31 logs -i INV router).",
                         f"k31 redeploy -i INV {' '.join(members)}." + pd_note)))
    if pd:
        for x in servers:
            if x.role != "prefill":
                continue
            name = x.name
            out.append(_alert(
                "K31PrefillNotRestartedAfterDecode",
                f'(k31:unit_start_time_seconds:min{{k31_server="{name}"}} < on() group_left() '
                f'max(k31:unit_start_time_seconds:min{{k31_role="decode"}})) '
                f'and on() (min(k31:server_up:min{{k31_role="decode"}}) == 1)',
                s["pd_restart_for"], "page", {"k31_server": name, "k31_role": "prefill"},
                f"{name} has not restarted since a decode restarted",
                f"A decode restarted after {name} last started, and every decode has been healthy for "
                f"{s['pd_restart_for']}: {name} still holds the old decode's Mooncake mapping (the PD rule), so "
                "its transfers fail.",
                _runbook(inv, f"k31 redeploy -i INV {name}: restart it now that the decodes are healthy.",
                         "k31 status -i INV: check k31-pd-follow on the prefill hosts; reinstall it with "
                         "k31 redeploy -i INV --tags k31_pd_follow.")))
    return out


def rules(doc: Plan | dict[str, Any], settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """The Prometheus rule file (recording rules `k31:*`, alerts `K31*`) for `plan`; see the module doc."""
    plan = Plan.of(doc)
    s = _settings(settings)
    return {"groups": [
        {"name": "k31-engine-records", "rules": _recording(plan, s)},
        {"name": "k31-health-records", "rules": _health_records(plan, s)},
        {"name": "k31-alerts", "rules": _alerts(plan, s)},
    ]}


def rules_yaml(plan: Plan | dict[str, Any], settings: dict[str, Any] | None = None) -> str:
    header = "# Generated by k31deploy.monitoring.rules from the resolved plan; do not edit.\n"
    return header + yaml.safe_dump(rules(plan, settings), sort_keys=False, width=1000)


def write_rules(plan: Plan | dict[str, Any], path: str | Path, settings: dict[str, Any] | None = None) -> Path:
    """Write the rule file (0644: it holds no secret) and return its path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(rules_yaml(plan, settings))
    path.chmod(0o644)
    return path


def alert_catalog(plan: Plan | dict[str, Any], settings: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One row per alert name (README table): name, severity, for, summary, runbook of its first rule."""
    seen: dict[str, dict[str, Any]] = {}
    for rule in rules(plan, settings)["groups"][2]["rules"]:
        seen.setdefault(rule["alert"], {"name": rule["alert"], "severity": rule["labels"]["severity"],
                                        "for": rule["for"], "summary": rule["annotations"]["summary"],
                                        "runbook": rule["annotations"]["runbook"]})
    return list(seen.values())
