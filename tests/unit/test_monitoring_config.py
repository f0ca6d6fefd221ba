"""What k31_monitoring writes, from the plan (k31deploy.monitoring.config): Prometheus scrapes the rules'
contract, everything listens on cluster addresses, and the web config really refuses clients without a
cluster-CA certificate (a real Debian node exporter on loopback)."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import time
import urllib.request

import pytest
import yaml
from loopback import free_port

from k31deploy import pki
from k31deploy.monitoring import config
from k31deploy.recipe import from_mapping, resolve


def plan(**knobs):
    hosts = [from_mapping("p0", ["k31_prefill"], {"ansible_host": "10.0.0.1"}),
             from_mapping("d0", ["k31_decode"], {"ansible_host": "10.0.0.2"}),
             from_mapping("r0", ["k31_router"], {"ansible_host": "10.0.0.9", "k31_public_address": "192.0.2.9"})]
    return resolve({"platform": "mi355x", "agents": 92, **knobs}, hosts)


def jobs(doc):
    return {job["job_name"]: job for job in doc["scrape_configs"]}


def test_prometheus_scrapes_the_rules_contract_on_cluster_addresses():
    p = plan()
    doc = config.prometheus(p, config.Settings(scrape_interval="5s"))
    found = jobs(doc)
    assert list(found) == ["k31-engine", "k31-router", "k31-node", "k31-health"]
    assert found["k31-engine"]["file_sd_configs"] == [{"files": ["/etc/k31/prometheus/k31-engines.json"]}]
    node = found["k31-node"]
    assert node["scheme"] == "https" and node["tls_config"]["cert_file"] == "/etc/k31/monitoring/tls/host.crt"
    assert [g["targets"] for g in node["static_configs"]] == [["10.0.0.9:9100"], ["10.0.0.1:9100"], ["10.0.0.2:9100"]]
    # the blackbox exporter answers on loopback only; the probed URL becomes the instance
    assert found["k31-health"]["relabel_configs"][-1]["replacement"] == "127.0.0.1:9115"
    assert doc["alerting"]["alertmanagers"][0]["static_configs"] == [{"targets": ["10.0.0.9:9093"]}]
    assert doc["global"]["scrape_interval"] == "5s" and doc["rule_files"] == ["/etc/k31/monitoring/rules/*.yml"]
    health = config.health_targets(p)
    assert health == [
        {"targets": ["http://10.0.0.1:30000/health"], "labels": {"k31_server": "p0", "k31_role": "prefill"}},
        {"targets": ["http://10.0.0.2:30100/health"], "labels": {"k31_server": "d0", "k31_role": "decode"}}]


def test_behind_dynamo_prometheus_presents_its_certificate_to_the_frontend_and_mooncake_is_scraped():
    p = resolve({"platform": "b300", "topology": "pd", "prefill_strategy": "high-throughput",
                 "decode_strategy": "balanced", "kv_offload": "mooncake", "router": "dynamo"})
    found = jobs(config.prometheus(p, config.Settings()))
    assert found["k31-router"]["scheme"] == "https" and "tls_config" in found["k31-router"]
    assert found["k31-mooncake"]["static_configs"][0]["targets"] == ["node0:9003"]


def test_every_unit_listens_on_the_cluster_address_and_alertmanager_gossip_is_off():
    p = plan()
    args = config.service_args(p, "r0", config.Settings(retention="30d"))
    assert sorted(args) == ["prometheus", "prometheus-alertmanager", "prometheus-blackbox-exporter",
                            "prometheus-node-exporter"]
    assert "--web.listen-address=10.0.0.9:9090" in args["prometheus"]      # not the public 192.0.2.9
    assert "--storage.tsdb.retention.time=30d" in args["prometheus"]
    assert "--web.listen-address=10.0.0.9:9093" in args["prometheus-alertmanager"]
    assert "--cluster.listen-address= " in args["prometheus-alertmanager"]
    assert "--web.listen-address=127.0.0.1:9115" in args["prometheus-blackbox-exporter"]
    assert config.service_args(p, "d0", config.Settings()) == {"prometheus-node-exporter": (
        "--web.listen-address=10.0.0.2:9100 --web.config.file=/etc/k31/monitoring/web.yml "
        "--collector.textfile.directory=/var/lib/k31/textfile")}
    assert all(" " not in a.split("=", 1)[0] for v in args.values() for a in v.split())
    assert config.ready_urls(p, "r0") == ["https://10.0.0.9:9100/metrics", "https://10.0.0.9:9090/-/ready",
                                          "https://10.0.0.9:9093/-/ready"]


def test_alertmanager_routes_per_server_and_a_down_server_inhibits_its_symptoms():
    doc = config.alertmanager(plan(), config.Settings(group_wait="2s"))
    assert doc["route"]["group_by"] == ["alertname", "k31_server"] and doc["route"]["group_wait"] == "2s"
    assert doc["receivers"] == [{"name": "k31-hold"}]
    assert doc["inhibit_rules"][0]["equal"] == ["k31_server"]
    hook = [{"name": "oncall", "webhook_configs": [{"url": "http://10.0.0.50:9000/hook"}]}]
    assert config.alertmanager(plan(), config.Settings(receivers=hook))["route"]["receiver"] == "oncall"


def test_files_per_host_and_monitoring_none():
    p = plan()
    mine = config.files(p, "r0", config.Settings(), {"engine_down_for": "30s"})
    assert "/etc/k31/monitoring/rules/k31.rules.yml" in mine and "/etc/k31/monitoring/consoles/k31.html" in mine
    assert "for: 30s" in mine["/etc/k31/monitoring/rules/k31.rules.yml"]
    assert json.loads(mine["/etc/k31/prometheus/k31-health.json"]) == config.health_targets(p)
    assert json.loads(mine["/etc/k31/monitoring/grafana/k31.json"])["panels"]
    assert config.files(p, "d0", config.Settings()) == {
        "/etc/default/prometheus-node-exporter": "# Written by k31 (k31_monitoring) from the plan: listen on the "
        "cluster address, k31's configuration.\nARGS=\"" + config.service_args(p, "d0", config.Settings())[
            "prometheus-node-exporter"] + "\"\n",
        "/etc/k31/monitoring/web.yml": config._yaml(config.web(p))}
    assert "/etc/grafana/provisioning/dashboards/k31.yaml" in config.files(p, "r0", config.Settings(), None, True)
    off = plan(monitoring="none")
    assert off["monitoring"] is None
    with pytest.raises(ValueError, match="monitoring=none"):
        config.files(off, "r0", config.Settings())


@pytest.mark.skipif(not (shutil.which("promtool") and shutil.which("amtool")), reason="CI installs promtool/amtool")
def test_promtool_and_amtool_accept_what_k31_writes(tmp_path):
    p = plan()
    files = config.files(p, "r0", config.Settings(receivers=[{"name": "hook", "webhook_configs": [
        {"url": "http://10.0.0.50:9000/hook"}]}]))
    for path, text in files.items():
        out = tmp_path / path.lstrip("/")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    etc = tmp_path / "etc/k31/monitoring"
    checks = [["promtool", "check", "config", "--syntax-only", str(etc / "prometheus.yml")],
              ["promtool", "check", "rules", str(etc / "rules/k31.rules.yml")],
              ["amtool", "check-config", str(etc / "alertmanager.yml")]]
    for argv in checks:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, (argv, proc.stdout, proc.stderr)
    bad = yaml.safe_load((etc / "alertmanager.yml").read_text())
    bad["route"]["receiver"] = "nobody"
    (etc / "alertmanager.yml").write_text(yaml.safe_dump(bad))
    proc = subprocess.run(["amtool", "check-config", str(etc / "alertmanager.yml")], capture_output=True, text=True)
    assert proc.returncode != 0    # the check can fail


@pytest.mark.skipif(not shutil.which("prometheus-node-exporter"), reason="Debian's prometheus-node-exporter")
def test_the_web_config_refuses_clients_without_a_cluster_certificate(tmp_path):
    ca = pki.new_ca()
    host = pki.issue(ca, "r0", ["127.0.0.1"])
    client = pki.issue(ca, "oncall", ["oncall"])
    stranger = pki.issue(pki.new_ca(), "stranger", ["stranger"])
    tls = tmp_path / "tls"
    tls.mkdir()
    for name, text in (("ca.crt", ca.cert), ("host.crt", host.cert), ("host.key", host.key),
                       ("client.crt", client.cert), ("client.key", client.key),
                       ("stranger.crt", stranger.cert), ("stranger.key", stranger.key)):
        (tls / name).write_text(text)
    web = config.web(plan())
    text = yaml.safe_dump(web).replace(config.TLS, str(tls))
    (tmp_path / "web.yml").write_text(text)
    port = free_port()
    proc = subprocess.Popen(["prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{port}",
                             f"--web.config.file={tmp_path / 'web.yml'}", "--collector.disable-defaults",
                             f"--collector.textfile.directory={tmp_path}", "--collector.textfile"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"https://127.0.0.1:{port}/metrics"

        def get(cert: str | None) -> int:
            ctx = ssl.create_default_context(cafile=str(tls / "ca.crt"))
            if cert:
                ctx.load_cert_chain(str(tls / f"{cert}.crt"), str(tls / f"{cert}.key"))
            with urllib.request.urlopen(url, timeout=3, context=ctx) as resp:
                return resp.status

        deadline = time.monotonic() + 10
        while True:
            try:
                assert get("client") == 200
                break
            except (OSError, ssl.SSLError):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        for cert in (None, "stranger"):
            with pytest.raises((ssl.SSLError, OSError)):
                get(cert)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


BINARIES = {"prometheus": "prometheus", "alertmanager": "prometheus-alertmanager",
            "node_exporter": "prometheus-node-exporter", "blackbox_exporter": "prometheus-blackbox-exporter"}


@pytest.mark.parametrize("section", sorted(BINARIES))
def test_every_registered_monitoring_flag_is_one_the_packaged_binary_takes(section):
    from k31deploy.catalog import flag_registry

    binary = shutil.which(BINARIES[section])
    if binary is None:
        pytest.skip(f"{BINARIES[section]} (Debian's package) is not installed here")
    offered = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    text = offered.stdout + offered.stderr
    for flag in flag_registry()[section]:
        assert f"{flag}=" in text or f"{flag} " in text, f"{binary} --help does not list {flag}"


def test_an_unregistered_monitoring_flag_is_refused(monkeypatch):
    from k31deploy.catalog import flag_registry

    registry = {**flag_registry(), "blackbox_exporter": {"--config.file": {}}}
    monkeypatch.setattr(config, "flag_registry", lambda: registry)
    with pytest.raises(AssertionError, match=r"--web.listen-address=127.0.0.1:9115 is not registered.*blackbox"):
        config.service_args(plan(), "r0", config.Settings())
