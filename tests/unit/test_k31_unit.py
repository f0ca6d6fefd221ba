"""roles/k31_unit runs every role's systemd units, the engines' ranks included: one include per host, one unit per
item of k31_unit_contexts. Pinned here: an engine rank's unit is byte for byte the one k31_engine's own template
wrote before (a changed unit restarts every engine on the next deploy), decodes start first, a staged render
writes below the stage root."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from ansible.plugins.filter.core import FilterModule as CoreFilters
from ansible.plugins.filter.mathstuff import FilterModule as MathFilters
from test_k31_files_units import k31_units as k31_files_units
from unit_render import native, render_units, unit_include

from k31deploy import launch
from k31deploy.recipe import resolve

ROOT = Path(__file__).resolve().parents[2]
ENGINE_UNITS = ROOT / "roles/k31_engine/tasks/units.yml"
UNIT_TASKS = ROOT / "roles/k31_unit/tasks/main.yml"
_spec = importlib.util.spec_from_file_location("k31_unit_filters", ROOT / "roles/k31_unit/filter_plugins/k31_unit.py")
_plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_plugin)
UNIT_FILTERS = _plugin.FilterModule().filters()    # the role's own filters (k31deploy.units)
PLAN = resolve({"platform": "mi355x", "topology": "pd", "agents": 92})    # prefill0 on node0, decode0 on node1

# What roles/k31_engine/templates/engine.service.j2 rendered for k31-prefill0-r0 before the engine's units moved to
# k31_unit's service template: in a docker container, and in a venv behind Dynamo (no container lines; a Dynamo
# worker's stop is the drain's 630 s).
CONTAINER = """\
# Ansible managed
[Unit]
Description=k31 prefill server prefill0 rank 0
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
EnvironmentFile=/etc/k31/k31-prefill0-r0.env
ExecStart=/etc/k31/k31-prefill0-r0.sh
ExecStartPost=-/usr/local/lib/k31/k31-unit-started k31-prefill0-r0 prefill0 prefill 0
ExecStop=-docker stop --time 30 k31-prefill0-r0
# A container of this name left by a crash or an interrupted --rm cleanup (podman leaves it "Removing"
# when its `run` is stopped) would fail every start with "name already in use" (seen in the sandbox).
ExecStartPre=-docker rm --force k31-prefill0-r0
Restart=on-failure
RestartSec=5
TimeoutStopSec=60
LimitMEMLOCK=infinity
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target"""
CONTAINER_LINES = CONTAINER.splitlines()[11:15]
BEFORE = {
    ("container", False): CONTAINER,
    ("venv", True): "\n".join(line for line in CONTAINER.splitlines() if line not in CONTAINER_LINES)
                    .replace("TimeoutStopSec=60", "TimeoutStopSec=630"),
}


def engine_context(host: str, runtime: str = "container", dynamo: bool = False, stage: str = "") -> dict:
    """The engine include's variables, its stop timeout worked out by k31_engine's own "Look up this host's ranks"."""
    (lookup,) = [t for t in yaml.safe_load((ROOT / "roles/k31_engine/tasks/main.yml").read_text())
                 if t["name"] == "Look up this host's ranks in the plan"]
    scope = {"_k31_engine_behind_dynamo": dynamo, "k31_engine_stop_timeout": 60, "k31_engine_dynamo_stop_timeout": 630}
    stop = int(native(lookup["ansible.builtin.set_fact"]["_k31_engine_stop_timeout"].strip(), scope, {}))
    return {"_k31_engine_ranks": launch.host_ranks(PLAN, host), "_k31_engine_dynamo": dynamo,
            "_k31_engine_stop_timeout": stop, "k31_engine_runtime": runtime, "k31_engine_container_cli": "docker",
            "k31_engine_etc_dir": "/etc/k31", "k31_engine_stage_dir": stage, "k31_engine_hf_token": "",
            "k31_engine_nats_token": ""}


@pytest.mark.parametrize(("runtime", "dynamo"), list(BEFORE))
def test_an_engine_ranks_unit_is_the_one_before_the_move(runtime, dynamo):
    units = render_units(ENGINE_UNITS, **engine_context("node0", runtime, dynamo))
    assert units == {"k31-prefill0-r0": BEFORE[(runtime, dynamo)]}


def _unit_task(name: str) -> dict:
    (task,) = [t for t in yaml.safe_load(UNIT_TASKS.read_text()) if t["name"] == name]
    return task


def _settings(host: str, key: str, stage: str = "") -> list:
    task_vars = unit_include(ENGINE_UNITS)["vars"]
    scope = {**engine_context(host, stage=stage), **{k: v for k, v in task_vars.items() if k.startswith("_")},
             "_k31_plan": PLAN}
    return [native(task_vars[key], {**scope, "k31_unit_context": rank}, {}) for rank in scope["_k31_engine_ranks"]]


def test_decode_ranks_start_first_and_the_others_after():
    """Where the plan has decodes, the write run starts only the first group (an engine's decodes) and the next
    task, on every host once all of them ran it, the others: a prefill host starts nothing in its write run, so no
    prefill starts before every decode did. Without decodes, the write run starts every unit of its host."""
    assert _settings("node1", "k31_unit_first") == [True]
    assert _settings("node0", "k31_unit_first") == [False]
    assert _settings("node0", "k31_unit_first_in_play") == [True]
    block = _unit_task("Write the units' files and unit files, then start them")
    write, after = _starters(block)
    units = [{"name": "k31-decode0-r0", "first": True, "restart": False, "path": "/d"},
             {"name": "k31-prefill0-r0", "first": False, "restart": False, "path": "/p"}]
    scope = {"_k31_unit_list": units, "_k31_unit_all_files": [], "k31_unit_stage_dir": "",
             "_k31_unit_secret_files": {"skipped": True}, "_k31_unit_written": {"changed_files": []},
             "k31_unit_first_in_play": True, "_k31_unit_in_place": False}

    def runs(**change) -> list[list[str]]:
        here = {**scope, **change}
        after_runs = native("{{ " + " and ".join(f"({w})" for w in after["when"]) + " }}", here, _filters())
        return [[u["name"] for u in _handed(block, here, t)["units"]] for t in ([write, after] if after_runs
                                                                                 else [write])]

    assert runs() == [["k31-decode0-r0"], ["k31-prefill0-r0"]]
    # the write run reloads systemd for every unit file it wrote, the prefills' too (the next task only restarts)
    assert _handed(block, scope, write)["unit_files"] == ["/d", "/p"]
    assert "unit_files" not in after["k31_files"]
    assert _handed(block, {**scope, "k31_unit_stage_dir": "/stage"}, write)["unit_files"] == []
    assert runs(_k31_unit_list=units[1:]) == [[], ["k31-prefill0-r0"]]    # a prefill host waits for the task after
    assert runs(_k31_unit_list=units[:1]) == [["k31-decode0-r0"]]
    assert runs(k31_unit_first_in_play=False) == [["k31-decode0-r0", "k31-prefill0-r0"]]


def test_a_staged_render_writes_below_the_stage_root_and_the_unit_still_names_the_live_paths():
    (files,) = _settings("node0", "k31_unit_files", stage="/var/lib/k31/redeploy-next")
    dests = [f["dest"] for f in files if f["dest"]]
    assert "/var/lib/k31/redeploy-next/etc/k31/k31-prefill0-r0.env" in dests
    assert "/var/lib/k31/redeploy-next/etc/k31/k31-prefill0-r0.sh" in dests
    assert all(d.startswith("/var/lib/k31/redeploy-next/") for d in dests)
    units = render_units(ENGINE_UNITS, **engine_context("node0", stage="/var/lib/k31/redeploy-next"))
    assert "ExecStart=/etc/k31/k31-prefill0-r0.sh\n" in units["k31-prefill0-r0"]


# --- A file another role writes (the host certificate) restarts the units that serve with it -------------------

PKI = {"ca": "/etc/k31/pki/ca.crt", "cert": "/etc/k31/pki/host.crt", "key": "/etc/k31/pki/host.key"}
PUBLIC = {"cert": "/etc/k31/tls/public.crt", "key": "/etc/k31/tls/public.key", "ca": "/etc/k31/tls/ca.crt"}


ROUTER, FRONTEND = "roles/k31_router/tasks/main.yml", "roles/k31_dynamo/tasks/main.yml"
CA_AND_HOST = [PKI["ca"], PKI["cert"]]


@pytest.mark.parametrize(("tasks_file", "scope", "watched"), [
    (ROUTER, {"_k31_plan": {"pki": PKI}, "_k31_router_plan": {"tls": None}}, CA_AND_HOST),
    (ROUTER, {"_k31_plan": {"pki": PKI}, "_k31_router_plan": {"tls": PUBLIC}}, [*CA_AND_HOST, PUBLIC["cert"]]),
    # an SGLang router without monitoring: the plan has no cluster CA (pki: null)
    (ROUTER, {"_k31_plan": {"pki": None}, "_k31_router_plan": {"tls": None}}, []),
    (ROUTER, {"_k31_plan": {"pki": None}, "_k31_router_plan": {"tls": PUBLIC}}, [PUBLIC["cert"]]),
    (FRONTEND, {"_k31_dynamo_pki": PKI, "_k31_dynamo_plan": {"tls": None}}, CA_AND_HOST),
    (FRONTEND, {"_k31_dynamo_pki": PKI, "_k31_dynamo_plan": {"tls": PUBLIC}}, [*CA_AND_HOST, PUBLIC["cert"]]),
    ("roles/k31_dynamo/tasks/discovery.yml", {"_k31_dynamo_pki": PKI}, CA_AND_HOST),
])
def test_the_control_planes_watch_the_cluster_ca_and_their_certificate_and_the_sites_with_public_tls(
        tasks_file, scope, watched):
    assert native(unit_include(ROOT / tasks_file)["vars"]["k31_unit_watch"], scope, {}) == watched


def test_a_watched_files_digest_is_in_the_unit_so_a_new_certificate_rewrites_and_restarts_it():
    router = ROOT / ROUTER
    context = {"_k31_router_plan": {"unit": "k31-router", "tls": None}, "_k31_plan": {"pki": PKI},
               "k31_router_etc_dir": "/etc/k31", "k31_router_runtime": "venv", "k31_router_container_cli": "podman",
               "k31_router_api_key": "", "k31_router_control_plane_key": "", "k31_router_secret_exec": "x"}
    old = render_units(router, watched=(f"{'a' * 64}  {PKI['cert']}",), **context)["k31-router"]
    new = render_units(router, watched=(f"{'b' * 64}  {PKI['cert']}",), **context)["k31-router"]
    assert f"# Serves with (a change restarts it): {'a' * 64}  {PKI['cert']}\n" in old
    assert old != new
    # k31_unit restarts a unit whose unit file changed, and reads the digests without changing the host, also
    # under --check; a file not there yet is left out of the list rather than failing the deploy.
    read = _unit_task("Read the digests of the files the units serve with")
    assert (read["changed_when"], read["failed_when"], read["check_mode"]) == (False, False, False)
    assert read["vars"] == {"ansible_ssh_use_tty": False}    # raw: stdout alone
    worked_out = _unit_task("Work out each unit's name, files and directives")
    assert worked_out["ansible.builtin.set_fact"]["_k31_unit_one"]["unit"]["watch"] == (
        "{{ _k31_unit_watched.stdout_lines | default([]) }}")


def test_the_watched_digests_are_read_raw_through_a_shell_as_sha256sum_prints_them(tmp_path):
    """The raw read's own command through a real shell: one line per file there, in sha256sum's format (what the unit
    file carries), a file not there yet left out, an odd file name quoted."""
    read = _unit_task("Read the digests of the files the units serve with")
    there, odd = tmp_path / "host.crt", tmp_path / "it's a cert.crt"
    there.write_text("cert\n")
    odd.write_text("odd\n")
    command = native(read["ansible.builtin.raw"], {"k31_unit_watch": [str(there), str(tmp_path / "none"), str(odd)]},
                     _filters())
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=False)
    digests = [hashlib.sha256(path.read_bytes()).hexdigest() for path in (there, odd)]
    assert done.returncode != 0 and done.stdout.splitlines() == [f"{digests[0]}  {there}", f"{digests[1]}  {odd}"]


def test_no_role_reads_another_roles_internal_facts():
    """A role's `_k31_<role>_` facts are its own: the others read the plan and the shared facts of roles/k31 (its
    vars). (A fact set in an earlier play and read by a later role is lost
    when a run stops between them: the host certificate's restart was.)"""
    shared = {name for name in yaml.safe_load((ROOT / "roles/k31/vars/main.yml").read_text())}
    strays = []
    for role in sorted(p for p in (ROOT / "roles").iterdir() if p.is_dir()):
        own = "_" + role.name
        for path in sorted(f for f in role.rglob("*") if f.is_file() and f.suffix in {".yml", ".j2"}):
            for name in set(re.findall(r"\b_k31_[a-z0-9_]+", path.read_text(encoding="utf-8"))):
                if name != own and not name.startswith(own + "_") and name not in shared:
                    strays.append(f"{path.relative_to(ROOT)}: {name}")
    assert not strays, strays



def _defined_names(node):
    """The variable names a tasks file defines: set_fact keys, register, task/block/include vars, loop_var."""
    if isinstance(node, list):
        for item in node:
            yield from _defined_names(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key == "vars" and isinstance(value, dict):
                yield from value
            elif key in {"ansible.builtin.set_fact", "set_fact"} and isinstance(value, dict):
                yield from (name for name in value if name != "cacheable")
            elif key == "register" and isinstance(value, str):
                yield value
            elif key == "loop_control" and isinstance(value, dict) and "loop_var" in value:
                yield value["loop_var"]
            yield from _defined_names(value)


def test_every_name_a_role_defines_is_an_input_or_its_own_internal():
    """A name without the leading underscore is an input some role declares (meta/argument_specs.yml, defaults), as
    when a role hands k31_unit its k31_unit_* settings; everything else a role's tasks define is `_<role>_...`.
    The validate play's two results are the hand-off every later play reads, by their documented names, and the
    pre-flight probe the one k31_rdma reads (roles/k31_preflight/tasks/probe.yml). Ansible's own `ansible_*` names
    (a raw read's ansible_ssh_use_tty) are Ansible's settings for one task."""
    inputs = set()
    for role in (ROOT / "roles").iterdir():
        specs, defaults = role / "meta" / "argument_specs.yml", role / "defaults" / "main.yml"
        if specs.is_file():
            for entry in (yaml.safe_load(specs.read_text()) or {}).get("argument_specs", {}).values():
                inputs |= set(entry.get("options") or {})
        if defaults.is_file():
            inputs |= set(yaml.safe_load(defaults.read_text()) or {})
    outputs = {"k31_validate_plan", "k31_validate_problems", "k31_preflight_probe"}
    strays = []
    for tasks in sorted((ROOT / "roles").glob("*/tasks/*.yml")):
        role = tasks.parent.parent.name
        for name in sorted(set(_defined_names(yaml.safe_load(tasks.read_text())))):
            if not name.startswith((f"_{role}_", "ansible_")) and name not in inputs | outputs:
                strays.append(f"{tasks.relative_to(ROOT)}: {name}")
    assert not strays, strays

# --- One module run writes a host's files; a changed file restarts its unit; no secret in what is logged -----------

SECRET = "k31-test-secret-4c1d"
INCLUDE = {"k31_unit_name": "k31-watch", "k31_unit_service": {"Description": "d", "ExecStart": "/x"},
           "k31_unit_stage_dir": "", "k31_unit_first": False, "k31_unit_restart": False, "k31_unit_watch": [],
           "k31_unit_current_check": False, "k31_unit_first_in_play": False,
           "k31_unit_files": [{"dest": "/etc/k31/watch.json", "content": SECRET, "mode": "0600", "secret": True},
                              {"dest": "/etc/k31/watch.py", "src": "watch.py", "mode": "0755"},
                              {"dest": "/etc/k31/watch.sh", "template": "watch.sh.j2", "mode": "0755",
                               "validate": "sh -n %s"},
                              {"dest": "", "template": "absent.j2", "mode": "0644"}],
           "k31_unit_shared_files": [{"dest": "/usr/local/lib/k31/gate", "src": "gate", "mode": "0755"}]}


def _lookup(kind: str, name: str, **options) -> str:
    """Ansible's file and template lookups, as text that says what they were asked."""
    assert kind in {"ansible.builtin.file", "ansible.builtin.template"}
    return f"{kind.rsplit('.', 1)[-1]}:{name}:{sorted(options.get('template_vars', {}).items())}"


def _filters() -> dict:
    """Ansible's own filters Jinja lacks (its versions of Jinja's builtins need its templar)."""
    ansible_filters = {**CoreFilters().filters(), **MathFilters().filters()}
    names = ("bool", "combine", "dirname", "flatten", "unique", "quote", "hash")
    return {**{name: ansible_filters[name] for name in names}, **UNIT_FILTERS}


def _block_scope(include: dict, contexts: list[dict]) -> tuple[dict, dict, dict]:
    """k31_unit's "Write the units' ..." block, its variables worked out for `include` with one unit per context."""
    filters = _filters()
    worked_out = _unit_task("Work out each unit's name, files and directives")
    results = []
    for context in contexts:
        # Ansible templates the include's variables where they are read, with this unit's context
        here = native(include, {**include, "k31_unit_context": context}, filters)
        scope = {**here, "k31_unit_context": context, "_k31_unit_watched": {}}
        results.append({"ansible_facts": {"_k31_unit_one": native(worked_out["ansible.builtin.set_fact"]
                                                                   ["_k31_unit_one"], scope, filters)}})
    block = _unit_task("Write the units' files and unit files, then start them")
    scope = {**include, "_k31_unit_worked_out": {"results": results}, "lookup": _lookup,
             "role_path": "/roles/k31_unit"}
    for name, value in block["vars"].items():    # in order: each reads the ones before
        if name not in ("_k31_unit_rendered", "_k31_unit_starts"):    # each task's own (its vars)
            scope[name] = native(value.strip(), scope, filters)
    return block, scope, filters


def _writers(block: dict) -> list[dict]:
    """The block's two k31_files runs that write: the secret files', then the others' (which starts the units)."""
    return [task for task in block["block"] if "files" in task.get("k31_files", {})]


def _starters(block: dict) -> list[dict]:
    """The block's k31_files runs that start units: the others' write, then the second group's start."""
    return [task for task in block["block"] if "units" in task.get("k31_files", {})]


def _handed(block: dict, scope: dict, task: dict, filters: dict | None = None) -> dict:
    """What a start task hands k31_files besides the files: its units and the files changed before it."""
    here, filters = dict(scope), filters or _filters()
    for name, value in task.get("vars", {}).items():
        here[name] = native(value.strip(), here, filters or {}) if isinstance(value, str) else value
    here["_k31_unit_starts"] = native(block["vars"]["_k31_unit_starts"].strip(), here, filters)
    return {key: native(task["k31_files"][key], here, filters) for key in ("units", "changed", "unit_files")
            if key in task["k31_files"]}


def _written(block: dict, scope: dict, filters: dict, task: dict) -> list[dict]:
    """The files a write task of the block hands k31_files, `_k31_unit_rendered` worked out with the task's vars."""
    here = {**scope, **task.get("vars", {})}
    here["_k31_unit_rendered"] = native(block["vars"]["_k31_unit_rendered"].strip(), here, filters)
    return native(task["k31_files"]["files"], here, filters)


def test_a_hosts_files_and_units_go_in_one_run_and_the_secret_ones_in_a_no_log_run_of_their_own():
    asked = []
    block, scope, filters = _block_scope(INCLUDE, [{"rank": 0}, {"rank": 1}])
    scope["lookup"] = lambda *args, **options: asked.append(args[1]) or _lookup(*args, **options)
    secret_task, plain_task = _writers(block)
    assert secret_task["no_log"] is True and "no_log" not in plain_task
    assert secret_task["vars"] == {"_k31_unit_secrets": True} and plain_task["vars"]["_k31_unit_secrets"] is False
    secret, plain = (_written(block, scope, filters, task) for task in (secret_task, plain_task))
    assert secret == [{"dest": "/etc/k31/watch.json", "mode": "0600", "content": SECRET}] * 2
    # the files first (a src copied, a template rendered with its unit's context, validate kept), the units last
    assert plain == [
        {"dest": "/etc/k31/watch.py", "mode": "0755", "content": "file:watch.py:[]"},
        {"dest": "/etc/k31/watch.sh", "mode": "0755", "validate": "sh -n %s",
         "content": "template:watch.sh.j2:[('k31_unit_context', {'rank': 0})]"},
        {"dest": "/etc/k31/watch.py", "mode": "0755", "content": "file:watch.py:[]"},
        {"dest": "/etc/k31/watch.sh", "mode": "0755", "validate": "sh -n %s",
         "content": "template:watch.sh.j2:[('k31_unit_context', {'rank': 1})]"},
        {"dest": "/usr/local/lib/k31/gate", "mode": "0755", "content": "file:gate:[]"},    # shared: once per host
        *[{"dest": "/etc/systemd/system/k31-watch.service", "mode": "0644",
           "content": f"template:/roles/k31_unit/templates/k31.service.j2:[('_k31_unit', {unit!r})]"}
          for unit in scope["_k31_unit_list"]]]
    assert SECRET not in repr(plain)
    # each file rendered once, for its own run only
    assert sorted(asked) == sorted(["watch.py", "watch.sh.j2"] * 2 + ["gate"]
                                   + ["/roles/k31_unit/templates/k31.service.j2"] * 2)


def test_a_staged_render_puts_the_unit_files_below_the_stage_root():
    block, scope, filters = _block_scope({**INCLUDE, "k31_unit_stage_dir": "/var/lib/k31/next"}, [{}])
    assert scope["_k31_unit_list"][0]["path"] == "/var/lib/k31/next/etc/systemd/system/k31-watch.service"
    assert _written(block, scope, filters, _writers(block)[1])[-1]["dest"] == scope["_k31_unit_list"][0]["path"]


@pytest.mark.parametrize(("written", "secret", "restarted"), [
    ([], [], []),
    (["/etc/k31/a.sh"], [], ["k31-a"]),
    ([], ["/etc/k31/b.env"], ["k31-b"]),                       # a secret file restarts its unit too
    (["/usr/local/lib/k31/gate"], [], []),                     # a shared file restarts none
    (["/etc/systemd/system/k31-b.service"], [], ["k31-b"]),    # a unit file (k31_files reloads systemd for it)
])
def test_a_changed_file_restarts_its_unit(tmp_path, written, secret, restarted):
    """Each unit is handed its files (the secret ones too) and its unit file, and the write run the secret run's
    changes; library/k31_files.py (test_k31_files_units) decides from them, as here with a stand-in systemctl."""
    block, scope, filters = _block_scope({**INCLUDE, "k31_unit_files": [
        {"dest": "/etc/k31/{{ k31_unit_context.name[-1] }}.sh", "content": "x", "mode": "0755"},
        {"dest": "/etc/k31/{{ k31_unit_context.name[-1] }}.env", "content": "y", "mode": "0600", "secret": True}],
        "k31_unit_name": "{{ k31_unit_context.name }}"}, [{"name": "k31-a"}, {"name": "k31-b"}])
    write, _ = _starters(block)
    handed = _handed(block, {**scope, "_k31_unit_secret_files": {"changed_files": secret}}, write, filters)
    assert handed["units"] == [{"name": f"k31-{n}", "state": "started",
                                "unit_file": f"/etc/systemd/system/k31-{n}.service",
                                "restart_on": [f"/etc/k31/{n}.sh", f"/etc/k31/{n}.env"]} for n in "ab"]
    assert handed["changed"] == secret
    # a skipped secret run (no secret file) has no changed_files
    assert _handed(block, {**scope, "_k31_unit_secret_files": {"skipped": True}}, write, filters)["changed"] == []
    # what k31_files does with them, this run's writes counted as `changed` (the stand-in writes no file)
    _, calls = k31_files_units(tmp_path, handed["units"], {"k31-a": ("enabled", "active"),
                                                          "k31-b": ("enabled", "active")}, changed=written + secret)
    assert calls == [f"restart -- {name}.service" for name in restarted]


def test_no_task_that_logs_carries_a_secret_file():
    """-v and the run records print a task's loop items and results unless it is no_log: a secret file's content
    is only in its own no_log run's arguments, never in its unit's loop item or the other files' run (the PD
    watcher's config holds the API keys beside its scripts)."""
    block, scope, filters = _block_scope(INCLUDE, [{}, {"rank": 1}])
    worked_out = _unit_task("Work out each unit's name, files and directives")
    assert native(worked_out["no_log"].strip(), INCLUDE, filters) is True
    logged = 0
    for task in block["block"]:
        if task.get("no_log") is True or "k31_files" not in task:
            continue
        logged += 1
        handed = _written(block, scope, filters, task) if "files" in task["k31_files"] else []
        if "units" in task["k31_files"]:
            handed = [handed, _handed(block, {**scope, "_k31_unit_secret_files": {"changed_files": []},
                                              "_k31_unit_written": {"changed_files": []}}, task, filters)]
        assert SECRET not in repr(handed), task["name"]
    assert logged == 2     # the other files, the unit files and the units' start; the second group's start


# --- k31_unit_current_check: one raw read, and the writes and starts skipped where all is in place ----------------

def test_the_current_check_reads_the_host_through_a_real_shell_and_skips_only_what_is_all_in_place(tmp_path):
    """The read's own command (mode, owner, digest of every file the runs would write; each unit enabled and
    active) against real files, compared by the role's own Jinja: in place only when every file, mode and unit
    is; the writes and the start then skip. A unit that asks to restart, a changed file or mode, a missing file or
    a stopped unit each make it write and start as before."""
    include = {**INCLUDE, "k31_unit_current_check": True, "k31_unit_stage_dir": str(tmp_path),
               "k31_unit_files": [{"dest": str(tmp_path / "watch.json"), "content": SECRET, "mode": "0600",
                                   "secret": True},
                                  {"dest": str(tmp_path / "watch.sh"), "content": "#!/bin/sh\n", "mode": "0755"}],
               "k31_unit_shared_files": []}
    block, scope, filters = _block_scope(include, [{}])
    read = next(t for t in block["block"] if "ansible.builtin.raw" in t)
    decide = next(t for t in block["block"] if "ansible.builtin.set_fact" in t)
    assert read["no_log"] is True and decide["no_log"] is True and read["check_mode"] is False
    here = {**scope, **read["vars"]}
    here["_k31_unit_rendered"] = native(block["vars"]["_k31_unit_rendered"].strip(), here, filters)
    files = here["_k31_unit_rendered"]
    assert [f["dest"] for f in files] == [str(tmp_path / "watch.json"), str(tmp_path / "watch.sh"),
                                          scope["_k31_unit_list"][0]["path"]]
    command = native(read["ansible.builtin.raw"], here, filters)
    assert SECRET not in command
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "systemctl").write_text('#!/bin/sh\nverb=$1; shift 2\nfor u; do\n'
                                       'if [ "$verb" = is-enabled ]; then echo enabled; else cat "$STATE"; fi\ndone\n')
    (bin_dir / "systemctl").chmod(0o755)

    def in_place(state: str = "active", restart: bool = False) -> bool:
        (tmp_path / "state").write_text(state + "\n")
        done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, check=True,
                              env={"PATH": f"{bin_dir}:/usr/bin:/bin", "STATE": str(tmp_path / "state")})
        lines = done.stdout.splitlines()
        units = [{**u, "restart": restart} for u in scope["_k31_unit_list"]]
        fact = native(decide["ansible.builtin.set_fact"]["_k31_unit_current"].strip(),
                      {**here, "_k31_unit_read": {"stdout_lines": lines}, "_k31_unit_list": units}, filters)
        # the unit file went below tmp_path by way of the stage root; the check itself runs on live paths
        return native(block["vars"]["_k31_unit_in_place"].strip(),
                      {**scope, "k31_unit_stage_dir": "", "_k31_unit_current": fact}, filters)

    assert in_place() is False    # nothing there yet
    for f in files:
        Path(f["dest"]).parent.mkdir(parents=True, exist_ok=True)
        Path(f["dest"]).write_text(f["content"])
        Path(f["dest"]).chmod(int(f["mode"], 8))
    assert in_place() is True
    assert in_place(state="inactive") is False and in_place(restart=True) is False
    (tmp_path / "watch.sh").chmod(0o700)
    assert in_place() is False
    (tmp_path / "watch.sh").chmod(0o755)
    (tmp_path / "watch.json").write_text(SECRET + "2")
    assert in_place() is False
    # what skips: both writes and the starts, on this include's own answer only
    guarded = [*_writers(block), *_starters(block)]
    assert all("not _k31_unit_in_place" in str(t["when"]) for t in guarded)
    assert native(block["vars"]["_k31_unit_in_place"].strip(),
                  {**scope, "k31_unit_current_check": False, "_k31_unit_current": True}, filters) is False


def test_the_lifecycles_decisions_are_plain_python():
    """k31deploy.units, which the role's filters adapt: the start groups, and the in-place comparison (modes as
    stat prints them, however the role's file list spells them)."""
    from k31deploy import units
    decode = {"name": "k31-decode0-r0", "first": True, "restart": False, "path": "/d"}
    prefill = {"name": "k31-prefill0-r0", "first": False, "restart": True, "path": "/p"}
    files = [{"dest": "/etc/k31/a.env", "unit": "k31-prefill0-r0"}, {"dest": "/etc/k31/b.sh", "unit": "other"}]
    assert units.starts([decode, prefill], files, "first") == [
        {"name": "k31-decode0-r0", "state": "started", "unit_file": "/d", "restart_on": []}]
    assert units.starts([decode, prefill], files, "others") == [
        {"name": "k31-prefill0-r0", "state": "restarted", "unit_file": "/p", "restart_on": ["/etc/k31/a.env"]}]
    assert [u["name"] for u in units.starts([decode, prefill], files, "all")] == ["k31-decode0-r0", "k31-prefill0-r0"]
    with pytest.raises(ValueError, match="valid choices: all, first, others"):
        units.starts([decode], files, "some")
    rendered = [{"dest": "/x", "mode": "0600", "content": "a"}, {"dest": "/y", "mode": 0o755, "content": ""}]
    read = [f"600:root:root {hashlib.sha256(b'a').hexdigest()}", f"755:root:root {hashlib.sha256(b'').hexdigest()}",
            "enabled", "active"]
    assert units.in_place(read, rendered, [decode]) is True
    assert units.in_place(read, rendered, [prefill]) is False                    # it asks to restart
    assert units.in_place([read[0], "missing", *read[2:]], rendered, [decode]) is False
    assert units.in_place([*read[:3], "inactive"], rendered, [decode]) is False
    # the role's filter reads set_fact's booleans-as-text leniently
    assert UNIT_FILTERS["k31_unit_in_place"](read, rendered, [{**decode, "restart": "False"}]) is True
