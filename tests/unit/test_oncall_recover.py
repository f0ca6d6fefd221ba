"""Recovering from an interrupted `k31 redeploy` (k31deploy.oncall.recover): the lock's verdict, what a repair
does and in which order, what `k31 status` reports, and the CLI around it (`k31 status --repair`, Ctrl-C)."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k31deploy.commands import ops
from k31deploy.commands import status as status_cmd
from k31deploy.errors import K31Error
from k31deploy.oncall import gather, probe, recover
from k31deploy.recipe import resolve
from k31deploy.recipe.hosts import from_mapping

ROOT = Path(__file__).resolve().parents[2]
NOW = 1_800_000_000.0
ROUTER = "http://10.0.0.9:8000"


def plan():
    hosts = [from_mapping("p0", ["k31_prefill"], {"ansible_host": "10.0.0.1"}),
             from_mapping("p1", ["k31_prefill"], {"ansible_host": "10.0.0.2"}),
             from_mapping("d0", ["k31_decode"], {"ansible_host": "10.0.0.3"}),
             from_mapping("d1", ["k31_decode"], {"ansible_host": "10.0.0.4"}),
             from_mapping("r0", ["k31_router"], {"ansible_host": "10.0.0.9"})]
    return resolve({"platform": "mi355x", "agents": 92, "monitoring": "none"}, hosts)


URL = {"p0": "http://10.0.0.1:30000", "p1": "http://10.0.0.2:30000", "d0": "http://10.0.0.3:30100",
       "d1": "http://10.0.0.4:30100"}


def fleet(started=None, out=(), health=None, active=None, held=(), lock=""):
    """Probe answers: every server started at NOW-1000 unless `started` says (epoch), in the router unless in
    `out`, healthy unless `health` says, active unless `active` says; holds on the hosts in `held`."""
    started, health, active = started or {}, health or {}, active or {}
    answers = {}
    for name in ("p0", "p1", "d0", "d1"):
        when = started.get(name, NOW - 1000)
        # Each host's monotonic clock differs: only the epoch derived from it is comparable.
        mono = 5000.0 + len(answers) * 777
        info = {"unit": f"k31-{name}-r0", "active": active.get(name, "active"), "sub": "running",
                "started_monotonic": mono - (NOW - when), "uptime_s": NOW - when, "health": health.get(name, 200)}
        answers[name] = {"units": {f"k31-{name}-r0": info}, "clock": {"time": NOW, "monotonic": mono}}
        if name in held:
            answers[name]["pd_follow_hold"] = {"until": NOW + 7000, "seconds": 8100}
    workers = [{"url": URL[n], "type": "prefill" if n[0] == "p" else "decode", "healthy": True}
               for n in ("p0", "p1", "d0", "d1") if n not in out]
    answers["r0"] = {"units": {"k31-router": {"unit": "k31-router", "active": "active", "sub": "running",
                                              "readiness": 200, "workers": workers}},
                     "clock": {"time": NOW, "monotonic": 1.0}, "redeploy_lock": lock}
    return answers


def interrupted():
    """A redeploy of d1 stopped after d1 restarted and before the prefills did: d1 held out, watchers held."""
    return fleet(started={"d1": NOW - 30}, out=("d1",), held=("p0", "p1"))


# -- what a repair does -----------------------------------------------------------------------------------

def test_a_whole_fleet_needs_nothing():
    todo = recover.decide(plan(), fleet(), now=NOW)
    assert todo["nothing"] is True
    assert (todo["start"], todo["wait"], todo["restart"], todo["readd"], todo["release"], todo["left"]) == \
        ([], [], [], [], [], [])
    assert todo["summary"][0].startswith("nothing to repair")


def test_a_held_decode_comes_back_only_after_its_prefills_restart():
    todo = recover.decide(plan(), interrupted(), now=NOW)
    # Both prefills started before d1 did: they keep d1's old mapping and restart, drained, first.
    assert todo["restart"] == ["p0", "p1"] and todo["stale"] == {"p0": ["d1"], "p1": ["d1"]}
    assert todo["readd"] == ["d1"] and todo["release"] == ["p0", "p1"] and not todo["nothing"]
    assert todo["summary"] == [
        "restart p0, drained: it started before d1 last started and keeps the old decode's Mooncake mapping "
        "(the PD rule)",
        "restart p1, drained: it started before d1 last started and keeps the old decode's Mooncake mapping "
        "(the PD rule)",
        "re-add d1 to the router (healthy, not listed)",
        "release the k31-pd-follow hold on p0, p1"]


def test_prefills_restarted_after_the_decode_let_it_back_at_once():
    # Interrupted after the PD-rule restarts, before finish re-added the held decode.
    answers = fleet(started={"d1": NOW - 60, "p0": NOW - 40, "p1": NOW - 20}, out=("d1",), held=("p1",))
    todo = recover.decide(plan(), answers, now=NOW)
    assert todo["restart"] == [] and todo["readd"] == ["d1"] and todo["release"] == ["p1"]


def test_a_drained_prefill_is_readded_before_any_decode():
    answers = fleet(started={"d1": NOW - 60, "p0": NOW - 40, "p1": NOW - 20}, out=("d1", "p1"))
    assert recover.decide(plan(), answers, now=NOW)["readd"] == ["p1", "d1"]


def test_a_stale_prefill_out_of_the_router_is_restarted_not_just_readded():
    answers = fleet(started={"d1": NOW - 60, "p0": NOW - 40}, out=("d1", "p1"))
    todo = recover.decide(plan(), answers, now=NOW)
    assert todo["restart"] == ["p1"] and todo["readd"] == ["d1"]


def test_clock_slack_errs_towards_a_restart_only_beyond_a_second():
    # All servers started together by a deploy: within the slack, no prefill counts as stale.
    fresh = fleet(started={"p0": NOW - 100.5, "p1": NOW - 100.4, "d0": NOW - 100, "d1": NOW - 100})
    assert recover.decide(plan(), fresh, now=NOW)["nothing"] is True
    late = fleet(started={"p0": NOW - 102, "p1": NOW - 99, "d1": NOW - 100})
    assert recover.decide(plan(), late, now=NOW)["restart"] == ["p0"]


def test_loading_and_stopped_servers_come_first_and_nothing_else_is_decided_meanwhile():
    answers = fleet(started={"d1": NOW - 5}, out=("d1", "p1"), health={"d1": 503}, held=("p0",))
    answers["d0"]["units"]["k31-d0-r0"]["active"] = "inactive"
    todo = recover.decide(plan(), answers, now=NOW)
    assert todo["start"] == ["d0"] and todo["wait"] == ["d1"]
    # A decode still loading makes no prefill stale yet (the rule restarts them once it is back); the
    # playbook looks again after the gate and takes restart and readd from that look.
    assert todo["restart"] == [] and todo["readd"] == ["p1"] and todo["release"] == ["p0"]
    # A redeploy's own targets: it starts and gates them itself.
    todo = recover.decide(plan(), answers, now=NOW, skip=["d0", "d1"])
    assert todo["start"] == [] and todo["wait"] == []


def test_the_repair_starts_every_rank_of_a_stopped_server_and_gates_the_loading_ones():
    from k31deploy.oncall.rollout import server_step
    steps = {s["name"]: server_step(s, "repair") for s in plan()["servers"]}
    gate = {"timeout": 900, "quick": 10, "interval": 2, "max_restarts": 3}
    answers = fleet(health={"p1": 503})
    answers["p1"]["units"]["k31-p1-r0"]["uptime_s"] = 5      # loading
    answers["d0"]["units"]["k31-d0-r0"]["active"] = "inactive"
    doc = recover.decide(plan(), answers, now=NOW)
    assert doc["start"] == ["d0"] and doc["wait"] == ["p1"]
    calls = recover.resume_calls(doc, steps, gate)
    assert [(host, spec["units"], starts) for host, spec, starts in calls] == [
        ("d0", ["k31-d0-r0"], True), ("p1", ["k31-p1-r0"], False)]
    assert all(spec["gate"][-1] == f"--watch={spec['units'][0]}" for _, spec, _ in calls)
    assert recover.resume_calls(recover.decide(plan(), fleet(), now=NOW), steps, gate) == []


def test_a_failed_prefill_restart_keeps_the_decodes_out_and_fails_the_repair_naming_it():
    todo = recover.decide(plan(), fleet(started={"d1": NOW - 60, "p0": NOW - 40, "p1": NOW - 20}, out=("d1", "p1")),
                          now=NOW)
    assert recover.readd_now(todo, []) == ["p1", "d1"]
    assert recover.readd_now(todo, ["p0: restart failed: boom"]) == ["p1"]
    assert recover.incomplete(todo, []) == ""
    assert recover.incomplete(todo, ["p0: restart failed: boom"]) == (
        "repair incomplete: p0: restart failed: boom; decodes left out of the router until their prefills restart. "
        "See k31 status -i INV.")
    left = recover.decide(plan(), fleet(health={"d0": 503}, out=("d0",)), now=NOW, health_timeout=600)
    assert recover.incomplete(left, []) == "repair incomplete: d0: rank 0 /health answers 503 after 1000 s. See " \
        "k31 status -i INV."


def test_the_repair_releases_the_holds_it_found_and_those_it_took_to_restart_prefills():
    todo = recover.decide(plan(), interrupted(), now=NOW)
    assert recover.release_now(todo, ["p0", "p1", "p2"]) == ["p0", "p1", "p2"]
    found_only = recover.decide(plan(), fleet(held=("p1",)), now=NOW)
    assert recover.release_now(found_only, ["p0", "p1"]) == ["p1"]


def test_broken_and_unreachable_servers_are_left_and_said_so():
    answers = fleet(out=("d0", "d1"), health={"d0": 503}, active={"p1": "failed"})
    answers["d1"] = {"unreachable": "no route to host"}
    todo = recover.decide(plan(), answers, now=NOW, health_timeout=600)
    assert todo["readd"] == [] and todo["restart"] == []
    assert {x["server"]: x["why"] for x in todo["left"]} == {
        "p1": "k31-p1-r0 failed", "d0": "rank 0 /health answers 503 after 1000 s",
        "d1": "a host of it is unreachable"}


def test_no_decode_goes_back_while_a_prefill_cannot_be_checked():
    answers = interrupted()
    answers["p1"] = {"unreachable": "no route to host"}
    todo = recover.decide(plan(), answers, now=NOW)
    assert todo["restart"] == ["p0"] and todo["readd"] == []
    assert {"server": "d1", "why": "kept out of the router: prefill p1 could not be checked for the decode's old "
                                   "mapping"} in todo["left"]


def test_an_unreadable_router_is_never_guessed_at():
    answers = interrupted()
    del answers["r0"]["units"]["k31-router"]["workers"]
    todo = recover.decide(plan(), answers, now=NOW)
    assert todo["readd"] == [] and {"server": "router", "why": "the router's worker list could not be read"} in \
        todo["left"]


def test_an_expired_hold_file_is_still_cleaned_up():
    answers = fleet(held=("p0",))
    answers["p0"]["pd_follow_hold"]["until"] = NOW - 1
    todo = recover.decide(plan(), answers, now=NOW)
    assert todo["release"] == ["p0"] and todo["holds"]["p0"]["live"] is False


# -- the lock ---------------------------------------------------------------------------------------------

ME = {"controller": "ctl", "boot": "b1"}


def owner(**extra):
    return {"id": "aa", "controller": "ctl", "boot": "b1", "pid": 4242, "pid_start": 7, "what": "k31 redeploy of d1",
            "started": NOW - 100, "expires": NOW + 1000, **extra}


@pytest.mark.parametrize(("record", "alive", "state", "words"), [
    (None, True, "free", "no redeploy holds the lock"),
    (owner(), True, "live", "still running on this controller"),
    (owner(), False, "stale", "its process is gone"),
    (owner(boot="b0"), True, "stale", "rebooted since"),
    (owner(expires=NOW - 1), True, "stale", "expired at"),
    (owner(controller="other"), False, "live", "ends by itself then"),
    (owner(controller="other", expires=NOW - 1), True, "stale", "expired at"),
    (owner(id="me"), True, "ours", "this run holds the lock"),
])
def test_lock_verdicts(record, alive, state, words):
    seen = []

    def is_alive(pid, start):
        seen.append((pid, start))
        return alive

    text = recover.lock_text(record) if record else ""
    verdict = recover.lock_verdict(text, "r0", {**ME, "id": "me"}, now=NOW, is_alive=is_alive)
    assert verdict["state"] == state and words in verdict["message"], verdict
    # Only a record of this controller and boot is judged by its process; another's only by its expiry.
    assert bool(seen) == (record is not None and record["controller"] == "ctl" and record["boot"] == "b1"
                          and record["expires"] > NOW and record["id"] != "me")


def test_a_garbled_lock_is_taken_over():
    assert recover.lock_verdict("{not json", "r0", ME, now=NOW)["state"] == "stale"


def test_the_live_message_is_one_line_naming_the_run_and_its_end():
    verdict = recover.lock_verdict(recover.lock_text(owner(controller="laptop")), "r0", ME, now=NOW)
    assert "\n" not in verdict["message"]
    assert verdict["message"].startswith("k31 redeploy of d1 from laptop (pid 4242, since ")
    assert recover.utc(NOW + 1000) in verdict["message"] and "/run/k31/redeploy.lock on r0" in verdict["message"]


def test_a_new_owner_names_this_process_and_renewing_moves_only_the_expiry():
    rec = recover.new_owner("k31 status --repair", 600, now=NOW)
    assert rec["pid"] == recover.playbook_pid() and rec["pid_start"] is not None
    assert rec["expires"] == NOW + 600 and rec["controller"] == recover.controller()["controller"]
    assert recover.alive(rec["pid"], rec["pid_start"]) and not recover.alive(rec["pid"], rec["pid_start"] + 1)
    later = json.loads(recover.lock_text(recover.renew(rec, 600, now=NOW + 50)))
    assert later == {**rec, "expires": NOW + 650}
    # This very process holds it: live as far as this controller can tell.
    assert recover.lock_verdict(recover.lock_text(rec), "r0", now=NOW)["state"] == "live"


def test_the_playbook_process_is_the_nearest_ansible_playbook_ancestor(tmp_path):
    # Ansible templates in workers forked from ansible-playbook: the lock names ansible-playbook, whose life
    # is the run's, not the short-lived worker's.
    script = tmp_path / "ansible-playbook"
    script.write_text("import os, subprocess, sys\nprint(os.getpid(), flush=True)\n"
                      "subprocess.run([sys.executable, '-c', 'from k31deploy.oncall import recover; "
                      "print(recover.playbook_pid())'], check=True)\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}).stdout.split()
    assert len(out) == 2 and out[0] == out[1]
    assert recover.playbook_pid() == os.getpid()   # none above pytest: this process


def test_the_lock_lives_on_the_router_host_else_the_first_server():
    assert recover.lock_host(plan()) == "r0"
    single = resolve({"platform": "mi355x", "agents": 8, "topology": "unified", "monitoring": "none"},
                     [from_mapping("u0", ["k31_unified"], {"ansible_host": "10.0.0.5"})])
    assert recover.lock_host(single) == "u0"


def test_the_lock_takes_only_what_was_judged_and_touches_only_its_own(tmp_path):
    """The host-side client's lock (probe.lock, `k31_probe.py --call lock` on the lock host)."""
    path = str(tmp_path / "run/redeploy.lock")
    lock = Path(path)

    def call(**spec):
        return probe.lock(spec, path)

    mine, theirs = recover.lock_text(owner(id="aa11")), recover.lock_text(owner(id="bb22"))
    assert call(op="take", expect="", new=mine) == ""
    assert lock.read_text() == mine + "\n" and lock.stat().st_mode & 0o777 == 0o644
    # What the controller reads back (cat, its newline stripped) is what it judged; the verdict reads the record.
    assert recover.lock_verdict(lock.read_text().rstrip("\n"), "r0", owner(id="aa11"))["state"] == "ours"
    # A second run that judged the lock free meanwhile loses: the record is no longer what it read.
    assert call(op="take", expect="", new=theirs) == "another run took the redeploy lock meanwhile: " + mine
    assert call(op="renew", id="bb22", new=theirs) == "the redeploy lock is no longer this run's: " + mine
    # an id that only starts like this run's is not this run's
    assert call(op="release", id="aa1").startswith("the redeploy lock is no longer this run's")
    renewed = recover.lock_text(owner(id="aa11", expires=NOW + 5000))
    assert call(op="renew", id="aa11", new=renewed) == ""
    assert lock.read_text() == renewed + "\n"
    # Taking over a stale lock: expect exactly its record.
    assert call(op="release", id="bb22") != "" and lock.exists()
    assert call(op="take", expect=renewed, new=theirs) == ""
    assert call(op="release", id="bb22") == "" and not lock.exists()
    assert call(op="release", id="bb22") == "the redeploy lock is no longer this run's: none"
    assert not list(tmp_path.glob("run/*.tmp"))


def test_the_roles_one_read_of_the_lock_host_gives_the_take_the_record_byte_for_byte(tmp_path):
    """recover_start.yml reads the lock host once (raw: the client's digest, then the lock record) and installs the
    client only where it is not this checkout's; lock.yml's record is what probe.lock compares a take against. Run
    through a real shell against tmp_path, with the roles' own Jinja."""
    import jinja2.nativetypes
    import yaml
    from ansible.plugins.filter.core import FilterModule as AnsibleCore

    tasks = ROOT / "roles/k31_redeploy/tasks"
    (read,) = [t for t in yaml.safe_load((tasks / "recover_start.yml").read_text())
               if t["name"].startswith("Read the redeploy lock")]
    (install,) = [t for t in yaml.safe_load((tasks / "recover_start.yml").read_text())
                  if t["name"].startswith("Make sure the lock host")]
    (parse,) = [t for t in yaml.safe_load((tasks / "lock.yml").read_text())
                if t["name"].startswith("Take the lock record")]
    assert (read["vars"]["ansible_ssh_use_tty"], read["check_mode"], read["changed_when"]) == (False, False, False)
    lib, run = tmp_path / "lib", tmp_path / "run"
    command = read["ansible.builtin.raw"].replace("/usr/local/lib/k31", str(lib)).replace("/run/k31", str(run))
    # the loop natively (a list), the record as text: Ansible keeps a string that reads as JSON a string
    native, text_env = jinja2.nativetypes.NativeEnvironment(undefined=jinja2.StrictUndefined), jinja2.Environment()
    for env in (native, text_env):
        env.filters.update(AnsibleCore().filters())
    client = Path(probe.__file__)

    def answer(router_host="r0", drain=True):
        stdout = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, check=True).stdout
        context = {"_k31_redeploy_lock_read": {"stdout": stdout}, "_k31_host_client": str(client),
                   "_k31_redeploy_rec_spec": {"lock_host": "r0"},
                   "_k31_redeploy_rollout": {"drain": drain, "router": {"host": router_host}},
                   "lookup": lambda kind, path, rstrip=True: Path(path).read_text()}
        text = text_env.from_string(parse["ansible.builtin.set_fact"]["_k31_redeploy_lock_text"]).render(**context)
        return text, native.from_string(install["loop"]).render(**context)

    assert answer() == ("", ["r0"])                                # a bare host: no lock, no client
    assert answer("r1") == ("", ["r0", "r1"])                      # a router host apart is not read: installed
    lib.mkdir()
    (lib / "k31_probe.py").write_text("an older client\n")
    assert answer(drain=False) == ("", ["r0"])
    (lib / "k31_probe.py").write_bytes(client.read_bytes())
    assert answer() == ("", [])                                    # this checkout's client: nothing written
    mine = recover.lock_text(owner(id="aa11"))
    assert probe.lock({"op": "take", "expect": "", "new": mine}, str(run / "redeploy.lock")) == ""
    text, _ = answer()
    assert text == mine
    assert recover.lock_verdict(text, "r0", owner(id="aa11"))["state"] == "ours"
    assert probe.lock({"op": "take", "expect": text, "new": mine}, str(run / "redeploy.lock")) == ""


def test_the_repairs_probe_of_a_host_runs_its_own_client_copy_only_where_it_is_this_checkouts(tmp_path):
    """observe_host.yml: one raw command runs the host's copy of the host-side client as k31 status's probe when its
    digest is this checkout's; otherwise it fails without output, and the script module ships the probe instead.
    Run through a real shell with the role's own Jinja; the answer is what the repair parses."""
    import jinja2.nativetypes
    import yaml
    from ansible.plugins.filter.core import FilterModule as AnsibleCore

    tasks = yaml.safe_load((ROOT / "roles/k31_redeploy/tasks/observe_host.yml").read_text())
    own, shipped, _ = tasks
    assert (own["vars"]["ansible_ssh_use_tty"], own["check_mode"], own["ignore_unreachable"]) == (False, False, True)
    assert "_k31_redeploy_rec_probe_own.rc | default(1) != 0" in shipped["when"]
    lib = tmp_path / "lib"
    env = jinja2.nativetypes.NativeEnvironment(undefined=jinja2.StrictUndefined)
    env.filters.update(AnsibleCore().filters())
    spec = role_filters()["k31_redeploy_recover_spec"](plan())    # with p0's units left out (not on this machine)
    spec["probe_args"]["p0"] = json.dumps({"mode": "status", "common": {}, "hosts": {"p0": {"units": {}}}})
    context = {"hostvars": {"localhost": {"_k31_redeploy_rec_spec": spec}}, "inventory_hostname": "p0",
               "_k31_redeploy_probe_python": sys.executable}
    command = env.from_string(own["ansible.builtin.raw"]).render(**context).replace("/usr/local/lib/k31", str(lib))

    def run():
        return subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True, check=False)

    assert (run().returncode, run().stdout) == (1, "")                  # no copy on the host: shipped instead
    lib.mkdir()
    (lib / "k31_probe.py").write_text(gather.PROBE.read_text() + "# another version\n")
    assert (run().returncode, run().stdout) == (1, "")
    (lib / "k31_probe.py").write_bytes(gather.PROBE.read_bytes())
    done = run()
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert set(answer) >= {"units", "clock"}


def test_the_lock_waits_for_a_run_inside_it_and_says_so_when_it_does_not_end(tmp_path):
    import fcntl
    path = str(tmp_path / "redeploy.lock")
    with open(path + ".flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert probe.lock({"op": "take", "expect": "", "new": "{}"}, path, wait=0.3) == \
            f"{path} stayed locked for 0.3 s"
    assert probe.lock({"op": "take", "expect": "", "new": "{}"}, path, wait=0.3) == ""


def test_the_lock_call_as_the_redeploy_runs_it(tmp_path, monkeypatch, capsys):
    """`k31_probe.py --call lock` (a call the client takes), the spec on stdin: it prints {"ok", "reason", "at"}
    and exits 1 when not ok."""
    assert "lock" in probe.CALLS
    monkeypatch.setattr(probe, "REDEPLOY_LOCK", str(tmp_path / "redeploy.lock"))
    assert probe.call_cli("lock", {"op": "take", "expect": "", "new": recover.lock_text(owner(id="aa11"))}) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True
    assert probe.call_cli("lock", {"op": "release", "id": "zz99"}) == 1
    answer = json.loads(capsys.readouterr().out)
    assert answer["ok"] is False and answer["reason"].startswith("the redeploy lock is no longer this run's")
    assert (tmp_path / "redeploy.lock").exists()


# -- k31 status -------------------------------------------------------------------------------------------

def test_status_names_a_drained_healthy_server_and_held_watchers_as_problems():
    doc = gather.build_status(plan(), interrupted())
    assert "d1: healthy but out of the router (no redeploy is running: k31 status --repair re-adds it)" in \
        doc["problems"]
    # The generic line is for servers that are out because they are unwell.
    assert "d1: not in the router's healthy workers" not in doc["problems"]
    held = [p for p in doc["problems"] if "k31-pd-follow held until" in p]
    assert held == [f"{h}: k31-pd-follow held until {recover.utc(NOW + 7000)} (left by an interrupted redeploy: "
                    "k31 status --repair releases it)" for h in ("p0", "p1")]
    assert doc["redeploy"]["lock"] == "free"


def test_held_watchers_are_listed_in_plan_order_whatever_order_the_hosts_answered_in():
    answers = interrupted()
    answers = {h: answers[h] for h in ("r0", "p1", "d1", "p0", "d0")}
    held = [p.split(":")[0] for p in gather.build_status(plan(), answers)["problems"] if "held until" in p]
    assert held == ["p0", "p1"]


def test_status_during_a_running_redeploy_says_so():
    answers = interrupted()
    answers["r0"]["redeploy_lock"] = recover.lock_text(owner(controller="laptop"))
    doc = gather.build_status(plan(), answers)
    assert doc["redeploy"]["lock"] == "live"
    assert any(p.startswith("d1: healthy but out of the router (a redeploy is running: k31 redeploy of d1")
               for p in doc["problems"])
    assert any(p.endswith("(by the running redeploy)") for p in doc["problems"])
    assert "redeploy lock: live: k31 redeploy of d1 from laptop" in gather.render(doc)


def test_status_of_an_unwell_server_out_of_the_router_is_unchanged():
    doc = gather.build_status(plan(), fleet(out=("d0",), health={"d0": 503}))
    assert "d0: not in the router's healthy workers" in doc["problems"]
    assert not any("healthy but out" in p for p in doc["problems"])


def test_the_lock_host_reads_the_lock_and_every_host_its_hold():
    specs = gather.host_specs(plan())
    assert specs["r0"].get("lock") is True and not any(s.get("lock") for h, s in specs.items() if h != "r0")


def test_the_probe_reads_a_hold_file_from_its_mtime(tmp_path):
    from k31deploy.oncall import probe

    hold = tmp_path / "pd-follow.hold"
    assert probe.hold_state(str(hold)) is None
    hold.write_text("8100\n")
    os.utime(hold, (NOW, NOW))
    assert probe.hold_state(str(hold)) == {"until": NOW + 8100, "seconds": 8100.0}
    hold.write_text("garbage")
    assert probe.hold_state(str(hold)) == {"until": 0.0, "seconds": 0.0}


# -- the CLI ----------------------------------------------------------------------------------------------

def status_args(tmp_path, *extra):
    inv = tmp_path / "inv.yml"
    inv.write_text("all: {}\n")
    parser = argparse.ArgumentParser()
    status_cmd.register(parser.add_subparsers())
    return parser.parse_args(["status", "-i", str(inv), *extra])


@pytest.fixture
def cli(monkeypatch):
    """k31 status with the plan above, canned probe answers and a recorded repair playbook run."""
    state = {"answers": [interrupted()], "runs": []}
    monkeypatch.setattr(status_cmd, "plan_from_args", lambda args: plan())

    def collect(p, inventories, become=True, runner=None):
        return state["answers"][0] if len(state["answers"]) == 1 else state["answers"].pop(0)

    monkeypatch.setattr(gather, "collect", collect)

    def run_repair(inventories, extra_vars, files, password, json_mode, out=None):
        state["runs"].append({"extra_vars": extra_vars, "files": files})
        return ops.RunOutcome(0, {}, "/runs/x")

    monkeypatch.setattr(ops, "run_repair", run_repair)    # the Ctrl-C path in ops
    monkeypatch.setattr(status_cmd, "run_repair", run_repair)    # k31 status --repair
    return state


def test_repair_with_nothing_to_do_runs_no_playbook_and_says_so(cli, tmp_path, capsys):
    cli["answers"] = [fleet()]
    assert status_cmd.cmd_status(status_args(tmp_path, "--repair")) == 0
    out = capsys.readouterr().out
    assert "repair: nothing to repair" in out and cli["runs"] == []


def test_a_stale_lock_alone_is_cleared_by_the_playbook(cli, tmp_path, capsys):
    cli["answers"] = [fleet(lock=recover.lock_text(owner(started=1000.0, expires=2000.0)))]
    status_cmd.cmd_status(status_args(tmp_path, "--repair"))
    assert len(cli["runs"]) == 1 and "repair: clear the stale redeploy lock" in capsys.readouterr().out


def test_repair_refuses_in_one_line_while_a_redeploy_runs(cli, tmp_path):
    cli["answers"][0]["r0"]["redeploy_lock"] = recover.lock_text(owner(controller="laptop"))
    with pytest.raises(K31Error) as err:
        status_cmd.cmd_status(status_args(tmp_path, "--repair"))
    assert str(err.value).startswith("k31 status --repair refused: k31 redeploy of d1 from laptop")
    assert "\n" not in str(err.value) and cli["runs"] == []


def test_repair_runs_the_playbook_then_shows_what_it_left(cli, tmp_path, capsys):
    cli["answers"] = [interrupted(), fleet(started={"p0": NOW - 5, "p1": NOW - 3, "d1": NOW - 30})]
    rc = status_cmd.cmd_status(status_args(tmp_path, "--repair", "-e", "@secrets.yml"))
    out = capsys.readouterr().out
    assert rc == 0 and cli["runs"] == [{"extra_vars": ["@secrets.yml"], "files": []}]
    assert out.index("repair: restart p0, drained") < out.index("no problems found") < out.index("repair: done")


def test_repair_that_leaves_a_problem_exits_1(cli, tmp_path, capsys):
    cli["answers"] = [interrupted(), interrupted()]
    assert status_cmd.cmd_status(status_args(tmp_path, "--repair")) == 1


def redeploy_args(tmp_path, *extra):
    inv = tmp_path / "inv.yml"
    inv.write_text("all: {}\n")
    parser = argparse.ArgumentParser()
    ops.register(parser.add_subparsers())
    return parser.parse_args(["redeploy", "-i", str(inv), "d1", *extra])


def test_ctrl_c_during_a_redeploy_runs_the_repair(tmp_path, monkeypatch, capsys):
    runs = []

    def run(request, view, cancel=None):
        runs.append(request.command)
        return ops.RunOutcome(130 if request.command == "redeploy" else 0, {}, tmp_path)

    monkeypatch.setattr(ops, "run", run)
    monkeypatch.setattr(ops, "playbook_for", lambda command, root: tmp_path / f"{command}.yml")
    assert ops.cmd_run(redeploy_args(tmp_path, "-e", "@s.yml")) == 130
    assert runs == ["redeploy", "repair"]
    err = capsys.readouterr().err
    assert f"(k31 status --repair -i {tmp_path}/inv.yml -e @s.yml)" in err
    assert "k31 redeploy: repaired" in err


@pytest.mark.parametrize("repair", ["fails", "interrupted"])
def test_a_repair_that_does_not_finish_names_the_command(tmp_path, monkeypatch, capsys, repair):
    def run(request, view, cancel=None):
        if request.command == "repair" and repair == "interrupted":
            raise KeyboardInterrupt
        return ops.RunOutcome(130 if request.command == "redeploy" else 2, {}, tmp_path)

    monkeypatch.setattr(ops, "run", run)
    monkeypatch.setattr(ops, "playbook_for", lambda command, root: tmp_path / f"{command}.yml")
    assert ops.cmd_run(redeploy_args(tmp_path)) == 130
    err = capsys.readouterr().err
    assert f"the repair did not finish; servers may be out of the router and k31-pd-follow held: run k31 status " \
           f"--repair -i {tmp_path}/inv.yml" in err


def test_a_finished_or_failed_redeploy_runs_no_repair(tmp_path, monkeypatch):
    runs = []

    def run(request, view, cancel=None):
        runs.append(request.command)
        return ops.RunOutcome(2, {}, tmp_path)

    monkeypatch.setattr(ops, "run", run)
    monkeypatch.setattr(ops, "playbook_for", lambda command, root: tmp_path / f"{command}.yml")
    assert ops.cmd_run(redeploy_args(tmp_path)) == 2 and runs == ["redeploy"]


# -- the role's filters -----------------------------------------------------------------------------------

def role_filters():
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "roles/k31_redeploy/filter_plugins/k31_redeploy.py"
    spec = importlib.util.spec_from_file_location("k31_redeploy_filters", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FilterModule().filters()


def test_the_probe_answers_reach_the_decision_from_a_loop_or_from_each_hosts_own_fact():
    f = role_filters()
    answers = interrupted()
    registered = {h: {"stdout": json.dumps(a), "rc": 0} for h, a in answers.items()}
    registered["d0"] = {"unreachable": True, "msg": "ssh: no route"}
    hostvars = {h: {"_k31_redeploy_rec_probe": r} for h, r in registered.items() if h != "p1"}
    from_facts = f["k31_redeploy_recover_answers"](list(answers), hostvars, "_k31_redeploy_rec_probe")
    from_loop = f["k31_redeploy_recover_answers"]([{**r, "item": h} for h, r in registered.items()])
    assert from_facts["d0"] == from_loop["d0"] == {"unreachable": "ssh: no route"}
    assert from_facts["p1"] == {"unreachable": "not probed (left out of the run)"}
    assert from_facts["r0"] == from_loop["r0"] == answers["r0"]
    # An unreachable decode is reported, and holds up nothing it cannot see.
    todo = f["k31_redeploy_recovery"](plan(), from_loop, 3600, ["d1"])
    assert todo["restart"] == ["p0", "p1"] and todo["readd"] == ["d1"]
    assert todo["left"] == [{"server": "d0", "why": "a host of it is unreachable"}]


def test_the_repair_spec_probes_every_plan_host_with_k31_status_own_probe():
    spec = role_filters()["k31_redeploy_recover_spec"](plan())
    assert spec["lock_host"] == "r0" and spec["hosts"] == ["p0", "p1", "d0", "d1", "r0"]
    assert spec["probe"] == str(gather.PROBE) and spec["prefill_hosts"] == ["p0", "p1"]
    arg = json.loads(spec["probe_args"]["r0"])
    assert arg["mode"] == "status" and arg["hosts"]["r0"]["lock"] is True
    assert spec["steps"]["d1"]["worker_url"] == URL["d1"]


# -- a stale prefill's restart: the redeploy's own host-side calls ------------------------------------------

GATE = {"timeout": 900, "quick": 10, "interval": 2, "max_restarts": 3}


def test_a_stale_prefill_restarts_through_the_host_side_clients_stop_and_start():
    from k31deploy.oncall.rollout import server_step
    step = server_step(next(s for s in plan()["servers"] if s["name"] == "p0"), "repair")
    idle = {"load_url": step["load_url"], "auth_file": step["auth_file"], "timeout": 30, "not_before": NOW + 1}
    calls = recover.restart_calls(step, {"timeout": "30", "not_before": NOW + 1}, GATE)
    plain = {"units": ["k31-p0-r0"], "files": [], "stage_dir": "", "rollout": False}
    # a prefill on one host: one call, the client's roll (stop, start, gate), nothing started after it
    assert calls == {
        "stop": [["p0", "roll", {**plain, "idle": idle, "start": True,
                                 "gate": ["--timeout", "900", "--quick", "10", "--interval", "2", "--max-restarts", "3",
                                          f"--target=k31-p0-r0={URL['p0']}/health", "--watch=k31-p0-r0"]}]],
        "start": []}
    # undrained (no router): the stop waits for nothing
    assert "idle" not in recover.restart_calls(step, None, GATE)["stop"][0][2]
    # the repair's resume starts and gates the same server with the client's start alone
    assert recover.resume_calls({"start": ["p0"], "wait": []}, {"p0": step}, GATE) == [
        ["p0", {**plain, "gate": calls["stop"][0][2]["gate"]}, True]]


def test_a_prefill_over_two_hosts_stops_rank0_first_and_starts_it_last_gated_there():
    step = {"name": "prefill0", "hosts": ["a", "b", "b"], "rank0_host": "a",
            "units": ["k31-prefill0-r0", "k31-prefill0-r1", "k31-prefill0-r2"],
            "health_url": "http://10.0.0.1:30000/health", "load_url": "http://10.0.0.1:30000/get_load"}
    calls = recover.restart_calls(step, {"timeout": 30}, GATE)
    assert [(h, c, s["units"], "idle" in s) for h, c, s in calls["stop"]] == [
        ("a", "stop", ["k31-prefill0-r0"], True), ("b", "stop", ["k31-prefill0-r1", "k31-prefill0-r2"], False)]
    assert [(h, c, s.get("gate", [])[-1:]) for h, c, s in calls["start"]] == [
        ("b", "start", []), ("a", "start", ["--watch=k31-prefill0-r0"])]
    # a plain restart: nothing kept as .prev, nothing staged put in place or removed
    assert all(s["files"] == [] and s["rollout"] is False for _, _, s in calls["stop"] + calls["start"])
    # the probe's step() runs exactly these: a stop with no rollout only stops the units
    assert probe.CALLS.count("stop") == 1 and probe.CALLS.count("start") == 1
