"""What k31_monitoring changes on a host from its one read-only probe (k31deploy.monitoring.converge): a re-run
that finds everything in place changes nothing, a file edited by hand is written back, new arguments or
certificates restart, new configuration reloads."""

import hashlib
import importlib.util
from pathlib import Path

from recipe_helpers import plan as resolve_plan
from test_k31_files_units import k31_units

from k31deploy.monitoring.converge import TLS_COPIES, folders, host_state, run, unit_actions, writes

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("k31_filters", ROOT / "filter_plugins" / "k31.py")
_plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_plugin)
K31_FILTERS = _plugin.FilterModule().filters()

FILES = {
    "/etc/k31/monitoring/prometheus.yml": "global: {}\n",
    "/etc/k31/monitoring/rules/k31.yml": "groups: []\n",
    "/etc/default/prometheus": 'ARGS="--config.file=/etc/k31/monitoring/prometheus.yml"\n',
}
UNITS = {"prometheus": "--config.file=...", "prometheus-node-exporter": "--web.listen-address=..."}


def digest(text):
    return hashlib.sha256(text.encode()).hexdigest()


def probe(files=FILES, units=("prometheus", "prometheus-node-exporter"), states=None, extra=()):
    lines = []
    for u in units:
        lines += [f"installed {u}", f"unit {u} {(states or {}).get(u, 'enabled active')}"]
    lines += [f"{digest(text)}  {path}" for path, text in files.items()]
    return [*lines, "pki-present", *extra]


def test_a_host_that_has_everything_changes_nothing():
    assert host_state(probe(), FILES, UNITS) == {"stale": [], "missing": [], "idle": [], "tls_stale": False,
                                                 "pki_present": True}


def test_a_fresh_host_gets_every_file_package_and_unit():
    state = host_state(["unit prometheus disabled inactive", "unit prometheus-node-exporter  "], FILES, UNITS)
    assert state == {"stale": list(FILES), "missing": list(UNITS),
                     "idle": ["prometheus", "prometheus-node-exporter"], "tls_stale": False, "pki_present": False}


def test_a_file_edited_by_hand_or_gone_is_written_again_and_a_stopped_unit_is_noticed():
    edited = {**FILES, "/etc/k31/monitoring/prometheus.yml": "global: {scrape_interval: 1h}\n"}
    del edited["/etc/default/prometheus"]
    state = host_state(probe(edited, states={"prometheus": "enabled failed"}, extra=["tls-stale host.key"]),
                       FILES, UNITS)
    assert state["stale"] == ["/etc/k31/monitoring/prometheus.yml", "/etc/default/prometheus"]
    assert state["idle"] == ["prometheus"] and state["tls_stale"] and state["missing"] == []


def test_k31s_configuration_is_for_group_prometheus_only_and_the_arguments_are_the_distributions():
    assert folders(FILES) == [
        {"path": "/etc/k31/monitoring", "mode": "0750", "group": "prometheus"},
        {"path": "/etc/k31/monitoring/rules", "mode": "0750", "group": "prometheus"},
        {"path": "/etc/k31/monitoring/tls", "mode": "0750", "group": "prometheus"},
        {"path": "/var/lib/k31/textfile", "mode": "0755", "group": "root"},
    ]
    assert writes(["/etc/default/prometheus", "/etc/k31/monitoring/prometheus.yml"], FILES) == [
        {"dest": "/etc/default/prometheus", "content": FILES["/etc/default/prometheus"], "group": "root",
         "mode": "0644"},
        {"dest": "/etc/k31/monitoring/prometheus.yml", "content": "global: {}\n", "group": "prometheus",
         "mode": "0640"},
    ]


def test_arguments_or_certificates_restart_configuration_reloads_and_otherwise_units_only_start(tmp_path):
    """Each unit is handed the files that restart it (every unit's arguments, the certificate copies) and those that
    reload it (k31's configuration; none for the node exporter); library/k31_files.py decides from what changed,
    run here through it with a stand-in systemctl."""
    actions = unit_actions(UNITS, FILES)
    assert [a["name"] for a in actions] == list(UNITS) and {a["state"] for a in actions} == {"started"}
    args = [p for p in FILES if p.startswith("/etc/default/")]
    assert args and all(a["restart_on"] == [*args, *TLS_COPIES] for a in actions)

    def calls(*changed: str) -> list[str]:
        return k31_units(tmp_path, actions, {u: ("enabled", "active") for u in UNITS}, changed=list(changed))[1]

    assert calls() == []
    assert calls("/etc/k31/monitoring/prometheus.yml") == ["reload -- prometheus.service"]
    assert calls("/etc/default/prometheus") == ["restart -- prometheus.service",
                                                "restart -- prometheus-node-exporter.service"]
    assert calls("/etc/k31/monitoring/tls/host.crt") == ["restart -- prometheus.service",
                                                         "restart -- prometheus-node-exporter.service"]
    assert calls("/etc/k31/monitoring/tls") == []    # the folder, not a copy


def test_the_role_reaches_these_through_filters_each_with_its_doc_file():
    assert K31_FILTERS["k31_monitoring_host_state"](probe(), FILES, UNITS) == host_state(probe(), FILES, UNITS)
    have = host_state(probe(), FILES, UNITS)
    assert K31_FILTERS["k31_monitoring_run"](have, PLAN, MON, FILES, UNITS, "False", "False", "120") == run(
        PLAN, MON, have, FILES, UNITS, False, False, 120)
    # every filter of filter_plugins/k31.py, these included: `ansible-doc -t filter NAME` documents it
    for name in K31_FILTERS:
        assert (ROOT / "filter_plugins" / f"{name}.yml").is_file(), name


PLAN = resolve_plan(platform="mi355x", agents=48, monitoring="prometheus")
MON = PLAN["monitoring"]["host"]


def test_a_settled_host_writes_nothing_and_waits_for_nothing():
    done = run(PLAN, MON, host_state(probe(), FILES, UNITS), FILES, UNITS, False, False, 120)
    assert (done["writing"], done["dirs"], done["files"], done["secret"], done["wait"]["urls"]) == (
        False, [], [], [], [])
    assert done["checked"] and done["checks"][0][:3] == ["promtool", "check", "config"]
    assert done["units"] == unit_actions(UNITS, list(FILES))


def test_a_stale_file_is_written_with_the_folders_and_the_units_are_waited_for():
    edited = {**FILES, "/etc/k31/monitoring/prometheus.yml": "global: {scrape_interval: 1m}\n"}
    todo = run(PLAN, MON, host_state(probe(files=edited), FILES, UNITS), FILES, UNITS, False, False, 120)
    assert todo["writing"] and todo["dirs"] == folders(FILES)
    assert [f["dest"] for f in todo["files"]] == ["/etc/k31/monitoring/prometheus.yml"]
    assert todo["wait"]["urls"] and todo["wait"]["ca"] == PLAN["pki"]["ca"] and todo["wait"]["timeout"] == 120


def test_alertmanagers_configuration_with_receivers_keys_is_written_apart():
    files = {**FILES, "/etc/k31/monitoring/alertmanager.yml": "receivers: [{name: pager}]\n"}
    fresh = host_state(probe(files={}), files, UNITS)
    quiet = run(PLAN, MON, fresh, files, UNITS, True, False, 120)
    assert [f["dest"] for f in quiet["secret"]] == ["/etc/k31/monitoring/alertmanager.yml"]
    assert "/etc/k31/monitoring/alertmanager.yml" not in [f["dest"] for f in quiet["files"]]
    plain = run(PLAN, MON, fresh, files, UNITS, False, False, 120)
    assert plain["secret"] == [] and "/etc/k31/monitoring/alertmanager.yml" in [f["dest"] for f in plain["files"]]


def test_stale_certificate_copies_are_copied_but_not_in_a_dry_run_before_the_certificate_exists():
    have = host_state([line for line in probe() if line != "pki-present"] + ["tls-stale host.crt"], FILES, UNITS)
    copies = run(PLAN, MON, have, FILES, UNITS, False, False, 120)["files"]
    assert [(c["src"], c["dest"], c["mode"]) for c in copies] == [
        (PLAN["pki"]["ca"], TLS_COPIES[0], "0644"), (PLAN["pki"]["cert"], TLS_COPIES[1], "0644"),
        (PLAN["pki"]["key"], TLS_COPIES[2], "0640")]
    assert all(c["group"] == "prometheus" for c in copies)
    assert run(PLAN, MON, have, FILES, UNITS, False, True, 120)["files"] == []    # --check, no certificate yet
    node = {"prometheus-node-exporter": "--web.listen-address=..."}
    exporter = run(PLAN, MON, host_state(probe(units=list(node)), FILES, node), FILES, node, False, False, 120)
    assert not exporter["checked"] and exporter["checks"] == []
