"""Prometheus, Alertmanager, blackbox exporter and node exporter configuration from the plan.

Every file k31_monitoring writes on the monitoring host comes from here, so what is scraped, how, and what
authenticates whom is decided once, in tested Python:

- Prometheus and Alertmanager listen on the monitoring host's cluster address, node exporters on each host's,
  all with TLS and cluster-CA client certificates (`web.yml`, the exporter-toolkit web config these Debian
  packages read with --web.config.file); Prometheus presents its host certificate to each of them.
- Engines' /metrics and the router's metrics listener have no authentication upstream (cluster address and
  firewall only) and are scraped over plain HTTP; the Dynamo frontend takes only clients with a cluster-CA
  certificate, so Prometheus presents its own.
- The blackbox exporter listens on loopback: only Prometheus on the same host asks it to probe each server's
  rank-0 /health (the engine is up but not healthy: hung scheduler, model still loading).

Labels follow the rules' contract (k31deploy.monitoring.rules): job k31-engine / k31-router / k31-mooncake /
k31-node / k31-health, target labels k31_server, k31_role, k31_strategy, k31_router, k31_host.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib.resources import files as package_files
from typing import Any

import yaml

from k31deploy import address as addr
from k31deploy.catalog import flag_registry
from k31deploy.launch import metrics_targets
from k31deploy.monitoring import dashboard, rules
from k31deploy.plan import Monitoring, Plan

# Where k31_monitoring puts its files on the monitoring host (root:prometheus, 0750/0640: the Debian units
# run as user prometheus).
ETC = "/etc/k31/monitoring"
TLS = f"{ETC}/tls"
SD_DIR = "/etc/k31/prometheus"    # the file_sd target files (also written where monitoring=none)
# Each host's engine units write their start time here (k31-unit-started); the node exporter's textfile
# collector publishes it as k31_unit_start_time_seconds.
TEXTFILE_DIR = "/var/lib/k31/textfile"
# Each Debian unit -> its section of data/flags.yaml.
UNIT_FLAGS = {"prometheus": "prometheus", "prometheus-alertmanager": "alertmanager",
              "prometheus-node-exporter": "node_exporter", "prometheus-blackbox-exporter": "blackbox_exporter"}
CLIENT_TLS = {"ca_file": f"{TLS}/ca.crt", "cert_file": f"{TLS}/host.crt", "key_file": f"{TLS}/host.key"}


@dataclass
class Settings:
    """The k31_monitoring_* role variables that shape the files."""

    scrape_interval: str = "15s"
    evaluation_interval: str = "15s"
    retention: str = "15d"
    # Alertmanager routing: how long to gather a group before the first notification, and how often to repeat.
    group_wait: str = "30s"
    group_interval: str = "5m"
    repeat_interval: str = "4h"
    # Site receivers (Alertmanager `receivers` entries, e.g. a webhook or PagerDuty); the route sends every
    # alert to the first one. None: alerts are kept in Alertmanager (its API, `k31 alerts`) and not sent.
    receivers: list[dict[str, Any]] = field(default_factory=list)


def _tls(server_name: str | None = None) -> dict[str, Any]:
    tls = dict(CLIENT_TLS)
    if server_name:
        tls["server_name"] = server_name
    return tls


def monitoring_of(plan: Plan) -> Monitoring:
    if not plan.monitoring:
        raise ValueError("the plan has no monitoring section (monitoring=none)")
    return plan.monitoring


def health_targets(doc: Plan | dict[str, Any]) -> list[dict[str, Any]]:
    """Blackbox probe target groups: each server's rank-0 /health where its engine (or Dynamo worker) binds."""
    return [{"targets": [addr.url("http", s.ranks[0].address, s.port, "/health")],
             "labels": {"k31_server": s.name, "k31_role": s.role}} for s in Plan.of(doc).servers]


def prometheus(doc: Plan | dict[str, Any], settings: Settings) -> dict[str, Any]:
    plan = Plan.of(doc)
    mon = monitoring_of(plan)
    scrape: list[dict[str, Any]] = [
        {"job_name": "k31-engine", "file_sd_configs": [{"files": [f"{SD_DIR}/k31-engines.json"]}]},
    ]
    if plan.router:
        job: dict[str, Any] = {"job_name": "k31-router", "file_sd_configs": [{"files": [f"{SD_DIR}/k31-router.json"]}]}
        if plan.router.kind == "dynamo":    # the frontend's port is mutual TLS, /metrics included
            job.update(scheme="https", tls_config=_tls())
        scrape.append(job)
    master = plan.mooncake_master
    if master:
        scrape.append({"job_name": "k31-mooncake", "static_configs": [
            {"targets": [addr.host_port(master.address, master.metrics_port)],
             "labels": {"k31_host": master.host}}]})
    scrape.append({"job_name": "k31-node", "scheme": "https", "tls_config": _tls(), "static_configs": [
        {"targets": [addr.host_port(n.address, mon.node_exporter_port)], "labels": {"k31_host": n.host}}
        for n in mon.nodes]})
    scrape.append({
        "job_name": "k31-health", "metrics_path": "/probe", "params": {"module": ["http_2xx"]},
        "file_sd_configs": [{"files": [f"{SD_DIR}/k31-health.json"]}],
        # the probed URL becomes the instance; the scrape goes to the blackbox exporter on loopback
        "relabel_configs": [
            {"source_labels": ["__address__"], "target_label": "__param_target"},
            {"source_labels": ["__param_target"], "target_label": "instance"},
            {"target_label": "__address__", "replacement": addr.host_port("127.0.0.1", mon.blackbox_port)},
        ]})
    return {
        "global": {"scrape_interval": settings.scrape_interval, "evaluation_interval": settings.evaluation_interval,
                   "external_labels": {"k31_monitor": mon.host}},
        "rule_files": [f"{ETC}/rules/*.yml"],
        "alerting": {"alertmanagers": [{"scheme": "https", "tls_config": _tls(), "static_configs": [
            {"targets": [addr.host_port(mon.address, mon.alertmanager_port)]}]}]},
        "scrape_configs": scrape,
    }


def alertmanager(plan: Plan | dict[str, Any], settings: Settings) -> dict[str, Any]:
    monitoring_of(Plan.of(plan))
    receivers = settings.receivers or [{"name": "k31-hold"}]    # no notifier: alerts wait in the API
    return {
        "route": {"receiver": receivers[0]["name"], "group_by": ["alertname", "k31_server"],
                  "group_wait": settings.group_wait, "group_interval": settings.group_interval,
                  "repeat_interval": settings.repeat_interval},
        "receivers": receivers,
        # A server that is down explains its other symptoms (no TTFT, no throughput, pools): page once.
        "inhibit_rules": [{"source_matchers": ['alertname="K31EngineDown"'],
                           "target_matchers": ['alertname!="K31EngineDown"'], "equal": ["k31_server"]}],
    }


def web(plan: Plan | dict[str, Any]) -> dict[str, Any]:
    """exporter-toolkit web config: TLS with the host's certificate, clients need one from the cluster CA."""
    monitoring_of(Plan.of(plan))
    return {"tls_server_config": {"cert_file": f"{TLS}/host.crt", "key_file": f"{TLS}/host.key",
                                  "client_ca_file": f"{TLS}/ca.crt",
                                  "client_auth_type": "RequireAndVerifyClientCert", "min_version": "TLS12"}}


def blackbox(plan: Plan | dict[str, Any]) -> dict[str, Any]:
    monitoring_of(Plan.of(plan))
    return {"modules": {"http_2xx": {"prober": "http", "timeout": "5s",
                                     "http": {"valid_status_codes": [200], "method": "GET",
                                              "preferred_ip_protocol": "ip4", "ip_protocol_fallback": True}}}}


def service_args(plan: Plan | dict[str, Any], host: str, settings: Settings) -> dict[str, str]:
    """ARGS of each Debian unit this host runs (its /etc/default/<package>): unit -> command-line arguments."""
    mon = monitoring_of(Plan.of(plan))
    node = next((n for n in mon.nodes if n.host == host), None)
    args: dict[str, list[str]] = {}
    if node is not None:
        args["prometheus-node-exporter"] = [
            f"--web.listen-address={addr.host_port(node.address, mon.node_exporter_port)}",
            f"--web.config.file={ETC}/web.yml", f"--collector.textfile.directory={TEXTFILE_DIR}"]
    if host == mon.host:
        args["prometheus"] = [
            f"--config.file={ETC}/prometheus.yml",
            f"--web.listen-address={addr.host_port(mon.address, mon.prometheus_port)}",
            f"--web.config.file={ETC}/web.yml",
            f"--web.console.templates={ETC}/consoles", f"--web.console.libraries={ETC}/console_libraries",
            "--storage.tsdb.path=/var/lib/prometheus/metrics2/",
            f"--storage.tsdb.retention.time={settings.retention}"]
        args["prometheus-alertmanager"] = [
            f"--config.file={ETC}/alertmanager.yml",
            f"--web.listen-address={addr.host_port(mon.address, mon.alertmanager_port)}",
            f"--web.config.file={ETC}/web.yml",
            # one Alertmanager: no gossip listener (upstream opens 9094 on every interface by default)
            "--cluster.listen-address=", "--storage.path=/var/lib/prometheus/alertmanager/"]
        args["prometheus-blackbox-exporter"] = [
            f"--config.file={ETC}/blackbox.yml",
            f"--web.listen-address={addr.host_port('127.0.0.1', mon.blackbox_port)}"]
    for unit, flags in args.items():    # every flag k31 emits is registered with its source (data/flags.yaml)
        known = flag_registry()[UNIT_FLAGS[unit]]
        unknown = [f for f in flags if f.split("=", 1)[0] not in known]
        if unknown:
            raise AssertionError(f"flag {unknown[0]} is not registered in data/flags.yaml [{UNIT_FLAGS[unit]}]")
    return {unit: " ".join(flags) for unit, flags in args.items()}


def api_url(plan: Plan | dict[str, Any], service: str) -> str:
    """Base URL of Prometheus (`prometheus`) or Alertmanager (`alertmanager`) on the cluster address."""
    mon = monitoring_of(Plan.of(plan))
    ports = {"prometheus": mon.prometheus_port, "alertmanager": mon.alertmanager_port}
    if service not in ports:
        raise ValueError(f"monitoring service {service} is not valid; valid: {', '.join(ports)}")
    return addr.url("https", mon.address, ports[service])


def _yaml(doc: dict[str, Any]) -> str:
    return "# Written by k31 (k31_monitoring) from the plan; replaced on each deploy.\n" + yaml.safe_dump(
        doc, sort_keys=False, default_flow_style=False, width=120)


def files(doc: Plan | dict[str, Any], host: str, settings: Settings, rule_settings: dict[str, Any] | None = None,
          grafana_provisioning: bool = False) -> dict[str, str]:
    """Every file k31_monitoring writes on `host`: path -> content. Each unit the host runs gets its arguments
    (/etc/default/<unit>, where Debian's units read ARGS); nodes get their exporter's web config; the monitoring
    host also Prometheus', Alertmanager's and the blackbox exporter's configuration, the alert rules generated
    from the plan, the console pages and the Grafana dashboard."""
    plan = Plan.of(doc)
    mon = monitoring_of(plan)
    out = {f"/etc/default/{unit}": "# Written by k31 (k31_monitoring) from the plan: listen on the cluster address, "
                                   f"k31's configuration.\nARGS=\"{args}\"\n"
           for unit, args in service_args(plan, host, settings).items()}
    if any(n.host == host for n in mon.nodes) or host == mon.host:
        out[f"{ETC}/web.yml"] = _yaml(web(plan))
    if host != mon.host:
        return out
    out[f"{ETC}/prometheus.yml"] = _yaml(prometheus(plan, settings))
    out[f"{ETC}/alertmanager.yml"] = _yaml(alertmanager(plan, settings))
    out[f"{ETC}/blackbox.yml"] = _yaml(blackbox(plan))
    out[f"{ETC}/rules/k31.rules.yml"] = rules.rules_yaml(plan, rule_settings or {})
    # the file_sd targets: engines and router (what monitoring=none leaves for a site's Prometheus), health probes
    for name, groups in metrics_targets(plan).items():
        out[f"{SD_DIR}/{name}.json"] = json.dumps(groups, indent=2) + "\n"
    out[f"{SD_DIR}/k31-health.json"] = json.dumps(health_targets(plan), indent=2) + "\n"
    data = package_files("k31deploy") / "data" / "monitoring"
    for folder in ("consoles", "console_libraries"):
        for item in sorted(data.joinpath(folder).iterdir(), key=lambda p: p.name):
            if item.is_file():
                out[f"{ETC}/{folder}/{item.name}"] = item.read_text(encoding="utf-8")
    out[f"{ETC}/grafana/k31.json"] = json.dumps(dashboard.grafana_dashboard(plan), indent=2) + "\n"
    if grafana_provisioning:    # a Grafana on this host loads the dashboard from the folder above
        out["/etc/grafana/provisioning/dashboards/k31.yaml"] = _yaml({"apiVersion": 1, "providers": [
            {"name": "k31", "folder": "k31", "type": "file", "disableDeletion": True,
             "options": {"path": f"{ETC}/grafana"}}]})
    return out


def ready_urls(doc: Plan | dict[str, Any], host: str) -> list[str]:
    """What the role waits for on `host` after a (re)start: its node exporter, and Prometheus' and
    Alertmanager's readiness on the monitoring host (the blackbox exporter answers only on loopback)."""
    plan = Plan.of(doc)
    mon = monitoring_of(plan)
    urls = [addr.url("https", n.address, mon.node_exporter_port, "/metrics")
            for n in mon.nodes if n.host == host]
    if host == mon.host:
        urls += [f"{api_url(plan, 'prometheus')}/-/ready", f"{api_url(plan, 'alertmanager')}/-/ready"]
    return urls
