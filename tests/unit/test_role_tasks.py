"""The shape of the roles' task files where it costs every host: a `block` guarded by `when` is evaluated task by
task on every host, so a host it is not for still pays one skipped task (a forked worker) per task in it -- 43 per
fan-out host before the container runtime, the image, the NVLink tray and the weights staging became includes.
A larger conditional part is an `include_tasks` with that `when`: a host it is not for skips it as one task.
And what every HTTP call of a role asks: a cluster address, never through a proxy the host's environment names; and
how a role checks that a host answers: an SSH round trip (`raw`), not a module run."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
MOST_TASKS_IN_A_GUARDED_BLOCK = 4


def task_count(tasks: list[dict[str, Any]]) -> int:
    return sum(task_count(t["block"]) + task_count(t.get("rescue") or []) + task_count(t.get("always") or [])
               if "block" in t else 1 for t in tasks or [])


def guarded_blocks(tasks: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for task in tasks or []:
        if "block" in task:
            if "when" in task:
                yield task
            for part in ("block", "rescue", "always"):
                yield from guarded_blocks(task.get(part) or [])


def all_tasks(tasks: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for task in tasks or []:
        if "block" in task:
            for part in ("block", "rescue", "always"):
                yield from all_tasks(task.get(part) or [])
        else:
            yield task


def test_task_count_counts_nested_blocks_and_their_rescue():
    tasks = [{"block": [{"name": "a"}, {"block": [{"name": "b"}], "rescue": [{"name": "c"}]}]}, {"name": "d"}]
    assert task_count(tasks) == 4


def test_no_conditional_block_makes_every_host_skip_many_tasks():
    files = sorted(REPO.glob("roles/*/tasks/*.yml"))
    assert len(files) > 40
    large = [f"{path.relative_to(REPO)}: {block.get('name')!r} ({task_count(block['block'])} tasks)"
             for path in files for block in guarded_blocks(yaml.safe_load(path.read_text()))
             if task_count(block["block"]) > MOST_TASKS_IN_A_GUARDED_BLOCK]
    assert large == [], "make these includes (include_tasks with the when): " + "; ".join(large)


def test_every_http_call_of_a_role_goes_to_the_cluster_address_not_a_proxy():
    """A host (or /etc/environment) with https_proxy for its egress and no no_proxy for the cluster sends `uri`'s
    requests to that proxy: a readiness wait would then fail or hang on it. k31_probe.py and the health gate (the
    redeploy's and the repair's drain, re-add, silence and /health waits) and library/k31_files.py (its wait) ask
    without proxies too (test_host_client, test_engine_gate and test_k31_files_units pin them)."""
    calls = [(path.relative_to(REPO), task) for path in sorted(REPO.glob("roles/*/tasks/*.yml"))
             for task in all_tasks(yaml.safe_load(path.read_text())) if "ansible.builtin.uri" in task]
    assert len(calls) >= 2    # the router's and the Dynamo frontend's readiness waits
    through_proxy = [f"{path}: {task['name']}" for path, task in calls
                     if task["ansible.builtin.uri"].get("use_proxy") is not False]
    assert through_proxy == []


def test_a_host_read_or_reach_check_is_one_ssh_round_trip():
    """What only runs a command on a host -- whether it answers (the redeploy's checks before it drains through the
    router host, stops a server, or re-adds it), and the reads every deploy makes of every host (pre-flight's probe,
    the converge stamp's read and record, the engine's read, install and health gate, monitoring's read) -- is one
    SSH round trip (`raw`), not a module run on the host: on the sandbox the ping module took 0.3 s a call, `raw`
    0.05 s, and six commands on 16 hosts took 13.3 s as modules and 2.5 s raw. A raw command whose output is parsed
    runs without a tty (with one, stderr lands in stdout and lines end in CR LF). That none carries a secret is
    test_secret_tasks' to pin (raw_leaks)."""
    tasks = [(path.relative_to(REPO), task) for path in sorted(REPO.glob("roles/*/tasks/*.yml"))
             for task in all_tasks(yaml.safe_load(path.read_text()))]
    assert [f"{path}: {task['name']}" for path, task in tasks if "ansible.builtin.ping" in task] == []
    raw = {task["name"]: task for _, task in tasks if "ansible.builtin.raw" in task}
    reads = {"Probe the host (read-only, so it runs under --check too)",
             "Read the host's converge stamp and its state now",
             "Record the host's converge stamp (inputs and state; 0600)",
             "Read the host settings host preparation wrote, and what the runtime has on the host",
             "Unpack the bundle when it is new, and create the venv (Debian's python3-yaml visible to the stand-in)",
             "Wait for rank 0 to answer /health (fails at once on a crash loop)",
             "Read what the host has (packages, units, each file's digest, whether the certificate copies are current)"}
    reach = {"Reach the router host before draining through it",
             "Reach the host (an unreachable one stays drained and is reported)", "Reach the router host"}
    assert set(raw) >= reads | reach, sorted((reads | reach) - set(raw))
    assert [name for name in reads if raw[name].get("vars", {}).get("ansible_ssh_use_tty") is not False] == []


def test_a_drain_and_a_readd_ask_the_router_with_the_keys_it_holds_read_on_its_host():
    """The redeploy's and the repair's drains, and every re-add, name no key: the host-side client reads the key the
    running router checks from the router's env file on its host (rollout's router.auth, as k31 status does), and
    a re-add the key the router sends its workers from the same file, so each is a raw command, one SSH round trip,
    whose answer shows."""
    tasks = [task for path in sorted(REPO.glob("roles/k31_redeploy/tasks/*.yml"))
             for task in all_tasks(yaml.safe_load(path.read_text()))]
    calls = [t for t in tasks if "--call drain" in str(t.get("ansible.builtin.raw", ""))
             or "drain" in (t.get("ansible.builtin.command") or {}).get("argv", [])]
    assert len(calls) == 2 and all("ansible.builtin.raw" in t and "no_log" not in t for t in calls)
    assert all("'auth': _k31_redeploy_router_auth" in t["ansible.builtin.raw"] for t in calls)
    (rejoin,) = [t for t in tasks if "--call rejoin" in str(t.get("ansible.builtin.raw", ""))]
    assert "'auth': _k31_redeploy_router_auth" in rejoin["ansible.builtin.raw"] and "no_log" not in rejoin
    assert [t["name"] for t in tasks if "api_key" in json.dumps(t) and "follow" not in json.dumps(t)] == []
    assert [t["name"] for t in tasks if "no_log" in t and "follow" not in json.dumps(t)] == []
    # the env file is the one in the router's etc dir, a knob of k31_router (k31_router_etc_dir) an inventory may set
    import jinja2
    import jinja2.nativetypes
    from ansible.plugins.filter.core import FilterModule as AnsibleCore

    from k31deploy.oncall.rollout import router_auth
    env = jinja2.nativetypes.NativeEnvironment()
    env.filters.update(AnsibleCore().filters())
    role_vars = yaml.safe_load((REPO / "roles/k31_redeploy/vars/main.yml").read_text())
    defaults = yaml.safe_load((REPO / "roles/k31_redeploy/defaults/main.yml").read_text())
    rollout = {"router": {"auth": router_auth("k31-router")}}
    for inventory, env_file in (({}, "/etc/k31/k31-router.env"), ({"k31_router_etc_dir": "/srv/k31"},
                                                                   "/srv/k31/k31-router.env")):
        etc_dir = jinja2.Environment().from_string(defaults["k31_redeploy_router_etc_dir"]).render(**inventory)
        auth = env.from_string(role_vars["_k31_redeploy_router_auth"]).render(
            _k31_redeploy_rollout=rollout, k31_redeploy_router_etc_dir=etc_dir)
        assert auth == {"env_file": env_file, "var": "K31_ROUTER_CONTROL_PLANE_KEYS",
                        "worker_var": "K31_ROUTER_API_KEY"}


def test_a_client_answer_without_ok_fails_with_the_roles_own_message():
    """The host-side client answers {"ok", "reason", ...}; a call that timed out or crashed leaves no such answer.
    Ansible 2.19 refuses `.ok` on a dict without it ("object of type 'dict' has no attribute 'ok'"), which replaced
    the task's own message ("refused: ...", "the re-add did not answer within its timeout") with that error. Every
    task reads an answer through the k31_call filter, whose answer always has ok and, where ok is not true, a
    reason (test_host_client pins its cases); none parses stdout itself."""
    texts = {path.relative_to(REPO): path.read_text() for path in sorted(REPO.glob("roles/*/tasks/*.yml"))}
    assert sum(text.count("| k31_call") for text in texts.values()) >= 10
    assert [str(path) for path, text in texts.items() if re.search(r"from_json\)\.(ok|reason)\b", text)] == []
    spec = importlib.util.spec_from_file_location("k31_filters", REPO / "filter_plugins" / "k31.py")
    filters = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(filters)
    call = filters.FilterModule().filters()["k31_call"]
    for result in ({}, {"stdout": "{}"}, {"stdout": '{"reason": ""}'}, {"stdout": "[]"}, {"skipped": True}):
        answer = call(result, "the role's own message")
        assert answer["ok"] is False and answer["reason"], result
