"""The redeploy's rollout order (k31deploy.oncall.rollout): targets, canary and batches, the seed's PD
restart rule, when decodes wait out of the router, the k31-pd-follow watcher's config, and what the run
reports per step and at its end."""

import importlib.util
from pathlib import Path

import pytest

from k31deploy.errors import K31Error
from k31deploy.oncall.rollout import (
    follow_config,
    held,
    hold_now,
    incomplete,
    outcomes,
    report,
    rollout,
    step_files,
    step_mode,
    step_report,
    step_status,
)
from k31deploy.recipe import resolve
from k31deploy.recipe.hosts import from_mapping


def pd_plan(prefills=2, decodes=2, router="sglang"):
    hosts = [from_mapping(f"p{i}", ["k31_prefill"], {"ansible_host": f"10.0.0.{i + 1}"}) for i in range(prefills)]
    hosts += [from_mapping(f"d{i}", ["k31_decode"], {"ansible_host": f"10.0.1.{i + 1}"}) for i in range(decodes)]
    hosts.append(from_mapping("r0", ["k31_router"], {"ansible_host": "10.0.9.1"}))
    return resolve({"platform": "mi355x", "agents": 92, "router": router}, hosts)


def gb300_plan():
    """GB300 PD as the sandbox's gb300-pd shape: two-tray servers behind a Dynamo frontend."""
    hosts = [from_mapping(f"{s}-t{t}", [f"k31_{s[:-1]}"], {"k31_server": s})
             for s in ("prefill0", "decode0") for t in range(2)]
    hosts.append(from_mapping("r0", ["k31_router"], {}))
    return resolve({"platform": "gb300", "topology": "pd", "router": "dynamo", "prefill_strategy": "low-latency",
                    "decode_strategy": "balanced", "speculative": "dflash", "max_running_requests": 64}, hosts)


def unified_plan(n=3):
    hosts = [from_mapping(f"u{i}", ["k31_unified"], {}) for i in range(n)] + [from_mapping("r0", ["k31_router"], {})]
    return resolve({"platform": "mi355x", "topology": "unified", "agents": 16}, hosts)


def test_one_decode_brings_every_paired_prefill_after_it_and_says_why():
    r = rollout(pd_plan(), ["d1"])
    assert r["order"] == ["d1", "p0", "p1"]
    assert r["followers"] == ["p0", "p1"]
    assert [r["steps"][n]["reason"] for n in r["order"]] == ["target", "pd-rule", "pd-rule"]
    assert r["hosts"] == ["d1", "p0", "p1"] and r["serial"] == [1, 1, 1]
    assert "Mooncake mapping" in r["notes"][0] and "p0, p1" in r["notes"][0]
    # d0 keeps serving, so the restarted d1 waits out of the router until p0 and p1 restarted.
    assert r["hold_decodes"] is True and r["hold_hosts"] == ["p0", "p1"]


def test_every_decode_rejoins_after_its_gate_when_none_is_left_to_serve():
    r = rollout(pd_plan(), ["decode"])
    assert r["order"] == ["d0", "d1", "p0", "p1"]
    assert r["hold_decodes"] is False
    assert "stale mapping" in r["notes"][1]


def test_prefill_alone_restarts_no_decode_and_holds_nothing():
    r = rollout(pd_plan(), ["prefill"])
    assert r["order"] == ["p0", "p1"] and r["followers"] == [] and r["hold_hosts"] == [] and r["notes"] == []


def test_named_prefill_and_decode_restart_once_decode_first():
    r = rollout(pd_plan(), ["p1", "d0"])
    assert r["order"] == ["d0", "p0", "p1"]
    assert [r["steps"][n]["reason"] for n in r["order"]] == ["target", "pd-rule", "target"]


def test_everything_when_no_target():
    assert rollout(pd_plan(), [])["order"] == ["d0", "d1", "p0", "p1"]
    assert rollout(pd_plan(), "d0, p1")["order"] == ["d0", "p0", "p1"]


def test_canary_then_batches_per_role():
    r = rollout(unified_plan(5), None, batch=2)
    assert r["serial"] == [1, 2, 2]
    r = rollout(pd_plan(prefills=3, decodes=3), ["decode"], batch=2)
    assert r["serial"] == [1, 2, 1, 2]  # d0 | d1 d2 | p0 | p1 p2


def test_multinode_servers_move_in_one_batch():
    r = rollout(gb300_plan(), ["decode0"])
    decode = r["steps"]["decode0"]
    assert decode["hosts"] == ["decode0-t0", "decode0-t1"] and decode["rank0_host"] == "decode0-t0"
    assert decode["one_host"] is False    # stops on both trays before either starts: no one-call roll
    assert r["order"] == ["decode0", "prefill0"] and r["serial"] == [2, 2]
    assert r["drain"] is False and r["hold_decodes"] is False
    # no worker API to drain through: each Dynamo worker drains itself on SIGTERM, rank 0 first
    assert [n for n in r["notes"] if n.startswith("router kind dynamo: each worker drains itself")]


def test_steps_carry_the_url_the_router_knows_the_server_by():
    plan = pd_plan()
    router_argv = plan["router"]["argv"]
    r = rollout(plan, ["d0"])
    d0, p0 = r["steps"]["d0"], r["steps"]["p0"]
    assert d0["worker_url"] in router_argv and p0["worker_url"] in router_argv
    # the router's entry a re-add posts: a PD worker's type, a prefill's bootstrap port, a unified server neither
    assert d0["worker"] == {"url": d0["worker_url"], "worker_type": "decode"}
    assert p0["worker"] == {"url": p0["worker_url"], "worker_type": "prefill", "bootstrap_port": 8998}
    u0 = next(iter(rollout(unified_plan())["steps"].values()))
    assert u0["worker"] == {"url": u0["worker_url"]}
    # probed where each binds: the engine's cluster address, the router's public one
    d0_addr = next(s for s in plan["servers"] if s["name"] == "d0")["ranks"][0]["address"]
    assert d0["health_url"] == f"http://{d0_addr}:30100/health" and d0["units"] == ["k31-d0-r0"]
    assert d0["one_host"] is True and p0["one_host"] is True
    assert r["router"]["host"] == "r0" and r["router"]["url"] == f"http://{plan['router']['public_address']}:8000"


@pytest.mark.parametrize(("targets", "batch", "match"), [
    (["nope"], 1, "redeploy target 'nope' is neither a server nor a role.*valid choices: decode, prefill"),
    (["unified"], 1, "valid choices: decode, prefill, p0"),
    (["d0"], 0, "k31_redeploy_batch must be a whole number of 1 or more"),
    (["d0"], "two", "k31_redeploy_batch"),
])
def test_bad_input_is_one_sentence(targets, batch, match):
    with pytest.raises(K31Error, match=match) as info:
        rollout(pd_plan(), targets, batch)
    assert "\n" not in str(info.value)


def test_follow_config_only_on_prefill_hosts():
    plan = pd_plan()
    assert follow_config(plan, "d0") is None and follow_config(plan, "r0") is None
    assert follow_config(unified_plan(), "u0") is None
    cfg = follow_config(plan, "p1", poll_seconds=1)
    assert cfg["units"] == ["k31-p1-r0"] and cfg["index"] == 1 and cfg["poll_seconds"] == 1
    assert [d["health"] for d in cfg["decodes"]] == ["http://10.0.1.1:30100/health", "http://10.0.1.2:30100/health"]
    (drain,) = cfg["drains"]
    assert drain["router"] == "http://10.0.9.1:8000" and drain["worker_url"] == "http://10.0.0.2:30000"
    assert drain["worker"] == {"url": drain["worker_url"], "worker_type": "prefill", "bootstrap_port": 8998}
    assert cfg["peers"] == ["http://10.0.0.1:30000"]


def test_follow_config_without_sglang_router_does_not_drain():
    plan = gb300_plan()
    rank1 = follow_config(plan, "prefill0-t1")
    assert rank1["units"] == ["k31-prefill0-r1"] and rank1["drains"] == [] and rank1["peers"] == []
    assert follow_config(plan, "prefill0-t0")["drains"] == []


# -- one server step (roles/k31_redeploy/tasks/server.yml through the k31_redeploy_step_* filters) ------------

def test_a_step_rolls_out_while_every_earlier_server_took_the_change():
    decode = {"role": "decode"}
    prefill = {"role": "prefill"}
    assert step_mode(decode, []) == "rollout"
    assert step_mode(prefill, [{"role": "decode", "status": "ok", "restarted": True}]) == "rollout"


def test_after_a_failure_only_a_prefill_the_pd_rule_owes_restarts_as_it_is():
    rolled_back = {"role": "decode", "status": "rolled_back", "restarted": True}
    not_stopped = {"role": "decode", "status": "failed", "restarted": False}
    assert step_mode({"role": "prefill"}, [rolled_back]) == "restart"
    assert step_mode({"role": "decode"}, [rolled_back]) == "skip"
    # a decode that failed before its stop restarted nothing: its prefills keep a valid mapping
    assert step_mode({"role": "prefill"}, [not_stopped]) == "skip"
    assert step_mode({"role": "unified"}, [{"role": "unified", "status": "unreachable", "restarted": False}]) == "skip"
    # a flag Ansible handed over as text
    assert step_mode({"role": "prefill"}, [{**not_stopped, "restarted": "False"}]) == "skip"
    assert step_mode({"role": "prefill"}, [{**rolled_back, "restarted": "True"}]) == "restart"


def test_a_steps_files_are_each_ranks_env_script_unit_and_key_staged_and_kept():
    files = step_files([{"unit": "k31-d0-r0", "auth_file": "/etc/k31/k31-d0-r0.auth.yaml"},
                        {"unit": "k31-d0-r1", "auth_file": None}], "/etc/k31", "/var/lib/k31/next")
    assert [f["live"] for f in files] == [
        "/etc/k31/k31-d0-r0.env", "/etc/k31/k31-d0-r0.sh", "/etc/systemd/system/k31-d0-r0.service",
        "/etc/k31/k31-d0-r0.auth.yaml",
        "/etc/k31/k31-d0-r1.env", "/etc/k31/k31-d0-r1.sh", "/etc/systemd/system/k31-d0-r1.service"]
    assert files[2] == {"live": "/etc/systemd/system/k31-d0-r0.service",
                        "staged": "/var/lib/k31/next/etc/systemd/system/k31-d0-r0.service",
                        "prev": "/etc/k31/k31-d0-r0.service.prev"}
    assert files[3]["prev"] == "/etc/k31/k31-d0-r0.auth.yaml.prev"


@pytest.mark.parametrize(("mode", "reachable", "went", "failed", "rollback_failed", "status"), [
    ("skip", False, False, False, False, "skipped"),
    ("rollout", False, False, False, False, "unreachable"),
    ("rollout", True, False, True, False, "failed"),        # not drained or not prepared: never stopped
    ("rollout", True, True, False, False, "ok"),
    ("rollout", True, True, True, False, "rolled_back"),
    ("rollout", True, True, True, True, "failed"),          # the roll-back failed too
    ("restart", True, True, True, False, "failed"),         # nothing to roll back to
    ("restart", True, True, False, False, "ok"),
])
def test_a_steps_status(mode, reachable, went, failed, rollback_failed, status):
    assert step_status(mode, reachable, went, failed, rollback_failed) == status


def filters():
    path = Path(__file__).resolve().parents[2] / "roles/k31_redeploy/filter_plugins/k31_redeploy.py"
    spec = importlib.util.spec_from_file_location("k31_redeploy_filters", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_status_filter_reads_booleans_set_fact_handed_over_as_text():
    mod = filters()
    assert mod.k31_redeploy_step_status("rollout", "True", "False", "True", []) == "failed"
    assert mod.k31_redeploy_step_status("rollout", "True", "True", "False", []) == "ok"
    assert mod.k31_redeploy_step_status("rollout", True, True, True, ["it failed too"]) == "failed"


def result(rollout_, name, status="ok", **extra):
    step = rollout_["steps"][name]
    return {"host": step["rank0_host"], "server": name, "role": step["role"], "reason": step["reason"],
            "status": status, "restarted": status in ("ok", "rolled_back"), "held": False, "error": "",
            "rollback_error": "", "seconds": 4.6, **extra}


def test_a_step_holds_the_watchers_of_prefills_not_yet_restarted_and_only_in_pd():
    r = rollout(pd_plan(), ["d0"])
    assert hold_now(r, []) == ["p0", "p1"]
    done = [result(r, "d0"), result(r, "p0")]
    assert hold_now(r, done) == ["p1"]
    assert hold_now(r, [{**done[1], "restarted": "False"}]) == ["p0", "p1"]    # set_fact's text for False
    assert hold_now(rollout(unified_plan()), []) == []


def test_decodes_wait_out_of_the_router_only_when_they_came_back_and_prefills_follow():
    r = rollout(pd_plan(), ["d0"])
    decode = r["steps"]["d0"]
    assert held(decode, r, "ok") and held(decode, r, "rolled_back")
    assert not held(decode, r, "failed") and not held(r["steps"]["p0"], r, "ok")
    assert not held(decode, {**r, "hold_decodes": False}, "ok")


@pytest.mark.parametrize("status, extra, line", [
    ("ok", {}, "d0: ok in 4.6 s"),
    ("ok", {"held": True}, "d0: ok in 4.6 s (held out of the router until its prefills restarted)"),
    ("rolled_back", {"error": "k31-d0-r0 did not answer /health within 10 s"},
     "d0: rolled_back in 4.6 s; rolled back to the previous unit, env file and launch script, which serve "
     "again. Why: k31-d0-r0 did not answer /health within 10 s"),
    ("failed", {"error": "the gate failed.", "rollback_error": "the rollback failed."},
     "d0: failed in 4.6 s; the gate failed. the rollback failed."),
    ("unreachable", {}, "d0: unreachable in 4.6 s; unreachable: left out of the router, every other server "
                        "keeps serving"),
    ("skipped", {}, "d0: skipped in 4.6 s"),
])
def test_each_step_reports_one_line(status, extra, line):
    r = rollout(pd_plan(), ["d0"])
    assert step_report(result(r, "d0", status, **extra)) == line
    assert filters().k31_redeploy_step_report(result(r, "d0", status, **extra)) == line


def test_the_end_of_the_run_reports_every_server_in_order_and_what_to_do_next():
    r = rollout(pd_plan(), ["d0"])
    ok = {"d0": result(r, "d0", held=True), "p0": result(r, "p0")}
    got = outcomes(r, ok)
    assert [o["server"] for o in got] == ["d0", "p0", "p1"]
    assert [o["status"] for o in got] == ["ok", "ok", "not reached"]
    assert report(got) == ["d0: ok (4.6 s)", "p0: ok (4.6 s, restarted for the PD rule)",
                           "p1: not reached (0 s)"]
    assert incomplete(got) == "redeploy incomplete: p1 not reached. See k31 status -i INV."
    every = {**ok, "p1": result(r, "p1")}
    assert incomplete(outcomes(r, every)) == ""
    # a held decode the router did not take back at the end failed, and the message says what re-adds it
    got = outcomes(r, every, ["d0: POST /workers answered 503", "p9: never mind"])
    assert got[0]["status"] == "failed"
    assert got[0]["error"] == ("restarted and answers /health, but was not re-added to the router: "
                               "POST /workers answered 503")
    assert incomplete(got) == (
        "redeploy incomplete: d0 failed (restarted and answers /health, but was not re-added to the router: "
        "POST /workers answered 503). Servers restarted but not re-added wait out of the router; k31 status -i INV "
        "--repair re-adds them (restarting their prefills first where the PD rule owes it) once the router answers. "
        "See k31 status -i INV.")
    # an unreachable host, and a rolled-back server whose journal is left out of the summary
    bad = {**every, "d0": result(r, "d0", "unreachable"),
           "p0": result(r, "p0", "rolled_back", error="gate failed. Last log lines: boom")}
    assert incomplete(outcomes(r, bad)) == (
        "redeploy incomplete: d0 unreachable; p0 rolled_back (gate failed.). Unreachable servers stay out "
        "of the router; every other server keeps serving. See k31 status -i INV.")


def test_the_results_filter_reads_each_hosts_step_result_in_rollout_order():
    r = rollout(pd_plan(), ["d0"])
    hostvars = {"p0": {"_k31_redeploy_result": result(r, "p0")}, "d0": {"_k31_redeploy_result": result(
        r, "d0")}, "p1": {}}
    assert list(filters().k31_redeploy_results(r, hostvars)) == ["d0", "p0"]
