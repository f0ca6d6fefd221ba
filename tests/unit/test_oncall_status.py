"""`k31 status` / `k31 logs` on the controller (k31deploy.oncall.gather) with a fake ad-hoc runner: what is
probed where, how answers become the report and its problems, and where logs land."""

import argparse
import ast
import builtins
import json

import pytest

from k31deploy.commands import status as status_cmd
from k31deploy.errors import K31Error
from k31deploy.oncall import gather
from k31deploy.recipe import resolve
from k31deploy.recipe.hosts import from_mapping


def plan():
    hosts = [from_mapping("p0", ["k31_prefill"], {"ansible_host": "10.0.0.1"}),
             from_mapping("d0", ["k31_decode"], {"ansible_host": "10.0.0.2"}),
             from_mapping("d1", ["k31_decode"], {"ansible_host": "10.0.0.3"}),
             from_mapping("r0", ["k31_router"], {"ansible_host": "10.0.0.9"})]
    return resolve({"platform": "mi355x", "agents": 92}, hosts)


def unit(name, active="active", **extra):
    return {"unit": name, "active": active, "sub": "running" if active == "active" else "failed", "load": "loaded",
            "started": "Sun 2026-11-29 18:00:00 UTC", "uptime_s": 125.0, "restarts": 0, "runtime": "standin",
            **extra}


def healthy_answers():
    workers = [{"url": u, "type": t, "healthy": True} for u, t in
               (("http://10.0.0.1:30000", "prefill"), ("http://10.0.0.2:30100", "decode"),
                ("http://10.0.0.3:30100", "decode"))]
    return {
        "p0": {"units": {"k31-p0-r0": unit("k31-p0-r0", health=200),
                         "k31-pd-follow": unit("k31-pd-follow", runtime=None)},
               "pd_follow": {"pending": False, "because": [], "held": False}},
        "d0": {"units": {"k31-d0-r0": unit("k31-d0-r0", health=200, restarts=1)}},
        "d1": {"units": {"k31-d1-r0": unit("k31-d1-r0", health=200)}},
        "r0": {"units": {"k31-router": unit("k31-router", runtime="venv", readiness=200, workers=workers)},
               "alerts": {"list": []}},
    }


def fake_runner(answers, seen):
    def run(inventory, source, hosts, become):
        seen.update(inventory=inventory, source=source, hosts=hosts, become=become)
        return {h: answers[h] for h in hosts}
    return run


def test_each_host_probes_its_own_units_where_they_bind():
    p = plan()
    d0 = next(s for s in p["servers"] if s["name"] == "d0")["ranks"][0]["address"]
    specs = gather.host_specs(p)
    assert specs["d0"]["units"] == {"k31-d0-r0": {"health": f"http://{d0}:30100/health"}}
    public = p["router"]["public_address"]
    assert specs["r0"]["units"]["k31-router"] == {
        "readiness": f"http://{public}:8000/readiness", "workers": f"http://{public}:8000/workers",
        # the worker API wants the router's control-plane key: the probe reads it from the router's env file
        "auth": {"env_file": "/etc/k31/k31-router.env", "var": "K31_ROUTER_CONTROL_PLANE_KEYS",
                 "worker_var": "K31_ROUTER_API_KEY"}}
    assert gather.plan_hosts(plan()) == ["p0", "d0", "d1", "r0"]


def test_probe_source_is_the_probe_plus_a_call_with_its_spec():
    from k31deploy.oncall import probe

    source = gather.probe_source({"mode": "status", "hosts": {"x": {"units": {}}}})
    assert source.startswith("#!/usr/bin/env python3\n")
    compile(source, "probe", "exec")
    tail = source.split(gather.PROBE.read_text())[1]
    assert '\\"x\\"' in tail
    # Every name the appended call uses is defined by the probe itself (it runs with nothing else).
    used = {node.id for node in ast.walk(ast.parse(tail)) if isinstance(node, ast.Name)}
    assert used and used <= set(vars(probe)) | set(dir(builtins))


def test_a_healthy_cluster_has_no_problems():
    seen = {}
    doc = gather.status(plan(), ["inv.yml"], runner=fake_runner(healthy_answers(), seen))
    assert seen["hosts"] == ["p0", "d0", "d1", "r0"] and seen["become"] is True
    assert doc["problems"] == []
    assert [(s["name"], s["health"], s["in_router"]) for s in doc["servers"]] == [
        ("p0", 200, True), ("d0", 200, True), ("d1", 200, True)]
    assert doc["router"]["readiness"] == 200 and doc["router"]["kind"] == "sglang"
    assert [p["unit"] for p in doc["processes"]] == ["k31-pd-follow"]
    text = gather.render(doc)
    assert "k31-d0-r0" in text and "2m05s" in text and "no problems found" in text


def test_unreachable_down_unhealthy_and_drained_servers_are_problems():
    answers = healthy_answers()
    answers["d1"] = {"unreachable": "Connection timed out during banner exchange"}
    answers["d0"]["units"]["k31-d0-r0"] = unit("k31-d0-r0", active="failed", health=0)
    answers["r0"]["units"]["k31-router"]["workers"] = answers["r0"]["units"]["k31-router"]["workers"][:1]
    answers["p0"]["pd_follow"] = {"pending": True, "because": ["d0"], "held": True}
    doc = gather.status(plan(), ["inv.yml"], runner=fake_runner(answers, {}))
    problems = "\n".join(doc["problems"])
    assert "d1: unreachable: Connection timed out during banner exchange" in problems
    assert "k31-d0-r0 on d0: failed/failed" in problems and "d0: rank 0 /health answers 0" in problems
    assert "d0: not in the router's healthy workers" in problems
    assert "p0: prefill restart pending after decode d0 restarted (held by a redeploy)" in problems
    assert doc["hosts"]["d1"] == "unreachable"
    d1 = next(s for s in doc["servers"] if s["name"] == "d1")
    assert d1["ranks"][0]["reachable"] is False
    assert "UNREACHABLE" in gather.render(doc)


@pytest.mark.parametrize(("seconds", "text"), [(None, "-"), (5, "5s"), (125, "2m05s"), (3725, "1h02m"),
                                               (90061, "1d01h")])
def test_durations(seconds, text):
    assert gather.duration(seconds) == text


def test_logs_one_file_per_unit(tmp_path):
    answers = {"p0": {"logs": {"k31-p0-r0": "p0 lines\n", "k31-pd-follow": "w0\n"}},
               "d0": {"logs": {"k31-d0-r0": "d0 lines\n"}}, "d1": {"unreachable": "gone"},
               "r0": {"logs": {"k31-router": "r\n", "k31-pd-follow": "w1\n"}}}
    seen = {}
    out = gather.logs(plan(), ["inv.yml"], None, 50, tmp_path / "logs", runner=fake_runner(answers, seen))
    names = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert names == ["k31-d0-r0.log", "k31-p0-r0.log", "k31-pd-follow.p0.log", "k31-pd-follow.r0.log",
                     "k31-router.log"]
    assert (tmp_path / "logs" / "k31-d0-r0.log").read_text() == "d0 lines\n"
    assert out["missed"] == {"d1": "gone"}
    assert '\\"lines\\": 50' in seen["source"]


def test_logs_of_one_server_only(tmp_path):
    answers = {"d0": {"logs": {"k31-d0-r0": "x\n", "k31-other": "y\n"}}}
    seen = {}
    gather.logs(plan(), ["inv.yml"], "d0", 10, tmp_path, runner=fake_runner(answers, seen))
    assert seen["hosts"] == ["d0"] and [p.name for p in tmp_path.iterdir()] == ["k31-d0-r0.log"]
    assert gather.log_units(plan(), "router") == {"r0": ["k31-router"]}
    with pytest.raises(K31Error, match="valid choices: p0, d0, d1, router"):
        gather.log_units(plan(), "nope")


def test_commands_register_and_need_an_inventory():
    parser = argparse.ArgumentParser(prog="k31")
    status_cmd.register(parser.add_subparsers(required=True))
    args = parser.parse_args(["logs", "-i", "x.yml", "d0", "--lines", "7"])
    assert (args.server, args.lines, args.become) == ("d0", 7, True)
    assert parser.parse_args(["status", "-i", "x.yml", "--json"]).json
    with pytest.raises(K31Error, match="needs -i INVENTORY"):
        status_cmd.cmd_status(parser.parse_args(["status"]))
    with pytest.raises(K31Error, match="does not exist"):
        status_cmd.cmd_status(parser.parse_args(["status", "-i", "/nonexistent/inv.yml"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["logs", "-i", "x.yml", "--lines", "0"])


def test_the_probe_reads_systemd_and_health(monkeypatch):
    """probe.py's own logic with systemctl and HTTP faked (it runs on the hosts)."""
    from k31deploy.oncall import probe

    shown = ("LoadState=loaded\nActiveState=active\nSubState=running\nExecMainStartTimestamp=Sun 2026-11-29\n"
             "ExecMainStartTimestampMonotonic=1000000\nNRestarts=2\nMainPID=42\nResult=success\n")

    def fake_run(argv):
        if argv[:2] == ["systemctl", "show"]:
            return 0, shown
        if argv[:2] == ["systemctl", "list-units"]:
            return 0, "k31-d0-r0.service loaded active running x\nk31-ssh-host-keys.service loaded active exited y\n"
        return 0, ""

    monkeypatch.setattr(probe, "run", fake_run)
    monkeypatch.setattr(probe, "http", lambda url, timeout=3.0, auth=None: {"status": 200 if "health" in url else 503})
    monkeypatch.setattr(probe.time, "monotonic", lambda: 11.0)
    monkeypatch.setattr(probe.os.path, "exists", lambda p: p.endswith("k31-d0-r0.sh"))
    out = probe.status({"units": {"k31-d0-r0": {"health": "http://127.0.0.1:30100/health"}}})
    assert list(out["units"]) == ["k31-d0-r0"]  # the sandbox's own k31-ssh-host-keys is not k31's
    row = out["units"]["k31-d0-r0"]
    assert (row["active"], row["restarts"], row["pid"], row["uptime_s"], row["health"]) == ("active", 2, 42, 10.0, 200)
    json.dumps(out)


def test_the_probe_authenticates_as_the_unit_it_checks(tmp_path):
    """The router's worker API with the control-plane key from the router's own env file (the probe runs as
    root on that host); the Dynamo frontend with the host's cluster certificate."""
    import http.server
    import threading

    from k31deploy.oncall import probe

    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.headers.get("Authorization"))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"workers": []}')

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = tmp_path / "k31-router.env"
    env.write_text('SGLANG_ROUTER_STREAM_IDLE_TIMEOUT_SECS=3600\nK31_ROUTER_CONTROL_PLANE_KEYS="k31:k31:admin:cp-9"\n')
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/workers"
        answer = probe.http(url, auth={"env_file": str(env), "var": "K31_ROUTER_CONTROL_PLANE_KEYS"})
        assert answer["status"] == 200 and seen == ["Bearer cp-9"]
        probe.http(url, auth={"env_file": str(tmp_path / "missing.env"), "var": "K31_ROUTER_CONTROL_PLANE_KEYS"})
        assert seen[-1] is None
    finally:
        server.shutdown()
    dynamo = gather.host_specs(resolve({"platform": "gb300", "topology": "pd", "max_running_requests": 8}))
    (frontend,) = [units for units in (s["units"] for s in dynamo.values()) if "k31-dynamo-frontend" in units]
    spec = frontend["k31-dynamo-frontend"]
    assert spec["models"].startswith("https://") and spec["auth"]["cert"] == "/etc/k31/pki/host.crt"


# -- alerts: Alertmanager on the monitoring host (the router host by default) ------------------------------


def alert(name, server, state="active", **extra):
    return {"alert": name, "severity": "page", "server": server, "role": "decode", "state": state,
            "silenced_by": [], "inhibited_by": [], "since": "2026-11-30T23:00:05.123Z",
            "summary": f"{server} is down", "runbook": "k31 status -i INV", **extra}


def test_the_monitoring_host_reads_alertmanager_with_its_certificate():
    p = plan()
    spec = gather.host_specs(p)["r0"]["alerts"]
    assert spec == {"url": "https://10.0.0.9:9093/api/v2/alerts", "auth": p["pki"]}
    off = resolve({"platform": "mi355x", "agents": 92, "monitoring": "none"})
    assert all("alerts" not in s for s in gather.host_specs(off).values())
    with pytest.raises(K31Error, match="monitoring=none: this plan deploys no Alertmanager"):
        gather.alerts(off, ["inv.yml"], runner=fake_runner({}, {}))


def test_firing_alerts_are_problems_next_to_their_server_and_silenced_ones_are_held():
    answers = healthy_answers()
    answers["r0"]["alerts"] = {"list": [alert("K31EngineDown", "d0"),
                                        alert("K31EngineRestarted", "d1", state="suppressed", silenced_by=["s-1"])]}
    doc = gather.status(plan(), ["inv.yml"], runner=fake_runner(answers, {}))
    assert doc["problems"] == ["alert K31EngineDown (page) firing for d0: d0 is down"]
    assert [(s["name"], s["alerts"]) for s in doc["servers"]] == [("p0", []), ("d0", ["K31EngineDown"]), ("d1", [])]
    text = gather.render(doc)
    d0_row = next(line for line in text.splitlines() if line.startswith("d0 "))
    assert d0_row.endswith("K31EngineDown")
    assert "alerts held back: K31EngineRestarted d1 (silenced)" in text
    answers["r0"]["alerts"] = {"error": "Alertmanager answered 0"}
    doc = gather.status(plan(), ["inv.yml"], runner=fake_runner(answers, {}))
    assert doc["problems"] == ["alerts unknown: Alertmanager answered 0"]


def test_k31_alerts_lists_them_and_exits_1_while_one_fires(capsys, monkeypatch):
    answers = {"r0": {"alerts": {"list": [alert("K31EngineDown", "d0")]}}}
    seen = {}
    doc = gather.alerts(plan(), ["inv.yml"], runner=fake_runner(answers, seen))
    assert seen["hosts"] == ["r0"] and '\\"mode\\": \\"alerts\\"' in seen["source"]
    text = gather.render_alerts(doc)
    assert text.splitlines()[0].split() == ["ALERT", "SEVERITY", "SERVER", "STATE", "SINCE", "SUMMARY"]
    assert "K31EngineDown  page      d0      firing  2026-11-30T23:00:05  d0 is down" in text
    assert gather.render_alerts({"host": "r0", "alerts": []}) == "no alerts (Alertmanager on r0)"
    original = gather.alerts
    monkeypatch.setattr(gather, "alerts", lambda *a, **kw: original(*a, **kw, runner=fake_runner(answers, {})))
    monkeypatch.setattr(status_cmd, "plan_from_args", lambda args: plan())
    monkeypatch.setattr(status_cmd, "_inventories", lambda args: ["inv.yml"])
    args = argparse.Namespace(json=True, become=True)
    assert status_cmd.cmd_alerts(args) == 1
    assert json.loads(capsys.readouterr().out)["alerts"][0]["runbook"] == "k31 status -i INV"
    answers["r0"]["alerts"] = {"list": []}
    assert status_cmd.cmd_alerts(argparse.Namespace(json=False, become=True)) == 0
