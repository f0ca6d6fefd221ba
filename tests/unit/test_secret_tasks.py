"""Every task that touches a secret is no_log, and none hands one over through `environment:`.

Ansible puts a task's `environment:` into the `sh -c` command line it starts the module with (visible in
ps on the host and the controller, and in -vvv output, so in run records), whatever no_log says. Secrets are
the role variables whose argument_specs say `no_log: true`, plus every default, set_fact or task var whose
value refers to one of them.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
TASK_FILES = sorted([*REPO.glob("roles/*/tasks/*.yml"), *REPO.glob("playbooks/*.yml"), *REPO.glob("molecule/*/*.yml"),
                     *REPO.glob("molecule/shared/*.yml")])
# Keys of a task that do not hand a value to anything (conditions, names, control).
INERT_KEYS = {"name", "when", "no_log", "tags", "changed_when", "failed_when", "until", "register", "loop_control",
              "delegate_to", "run_once", "become", "check_mode", "retries", "delay", "ignore_errors",
              "ignore_unreachable", "timeout", "async", "poll", "notify", "listen"}
BLOCK_KEYS = ("block", "rescue", "always")
SECRET_WORDS = re.compile(r"(api_key|_token|passw(or)?d|credentials?|_secret)$", re.IGNORECASE)
# The internal role that writes a unit's files for the role including it: the files marked `secret` in a no_log
# run of their own, which unit_file_leaks checks at every include instead of the include as a whole.
UNIT_ROLE = "k31_unit"


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!vault", lambda loader, node: "<vaulted>")


def load(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=_Loader)  # a SafeLoader that reads !vault as a placeholder


def argument_specs() -> dict[str, dict[str, Any]]:
    options: dict[str, dict[str, Any]] = {}
    for path in REPO.glob("roles/*/meta/argument_specs.yml"):
        for spec in (load(path).get("argument_specs") or {}).values():
            options.update(spec.get("options") or {})
    return options


def refers(text: str, names: set[str]) -> set[str]:
    return {n for n in names if re.search(rf"(?<![\w.]){re.escape(n)}\b", text)}


def tasks(node: Any) -> Iterator[dict[str, Any]]:
    """Every task of a tasks list or playbook, blocks' own tasks included."""
    for item in node if isinstance(node, list) else []:
        if not isinstance(item, dict):
            continue
        for key in ("tasks", "pre_tasks", "post_tasks", "handlers"):
            yield from tasks(item.get(key))
        if any(k in item for k in BLOCK_KEYS):
            yield item
            for key in BLOCK_KEYS:
                yield from tasks(item.get(key))
        elif "hosts" not in item and "import_playbook" not in item and "ansible.builtin.import_playbook" not in item:
            yield item


def unit_include(task: dict[str, Any]) -> bool:
    module = task.get("ansible.builtin.include_role") or task.get("include_role")
    return isinstance(module, dict) and module.get("name") == UNIT_ROLE and "tasks_from" not in module


def unit_files(node: Any) -> Iterator[dict[str, Any]]:
    """The file entries (dest, mode, template / src / content) anywhere in a k31_unit include's vars or loop."""
    if isinstance(node, dict):
        if "dest" in node and "mode" in node:
            yield node
        else:
            for value in node.values():
                yield from unit_files(value)
    elif isinstance(node, list):
        for value in node:
            yield from unit_files(value)


def secret_names() -> set[str]:
    """Declared secrets, then whatever takes its value from one (defaults, set_fact, task vars), to a fixpoint."""
    names = {name for name, spec in argument_specs().items() if spec.get("no_log")}
    sources: list[dict[str, Any]] = [load(p) or {} for p in REPO.glob("roles/*/defaults/main.yml")]
    for path in TASK_FILES:
        for task in tasks(load(path)):
            if not unit_include(task):    # what a k31_unit include hands over is checked file by file
                sources.append(task.get("vars") or {})
            for key in ("ansible.builtin.set_fact", "set_fact"):
                if isinstance(task.get(key), dict):
                    sources.append(task[key])
    grew = True
    while grew:
        before = len(names)
        for mapping in sources:
            names |= {k for k, v in mapping.items() if refers(yaml.safe_dump(v), names)}
        grew = len(names) > before
    return names


SECRETS = secret_names()


def template_outputs(task: dict[str, Any], path: Path) -> str:
    """The `{{ ... }}` expressions of the template a template task renders (what lands in the file, and in --diff)."""
    module = task.get("ansible.builtin.template") or task.get("template")
    if not isinstance(module, dict) or "src" not in module:
        return ""
    role = path.parents[1] if path.parent.name == "tasks" else None
    source = role / "templates" / module["src"] if role else None
    if source is None or not source.is_file():
        return ""
    return " ".join(re.findall(r"{{.*?}}", source.read_text(), flags=re.S))


def handed_over(task: dict[str, Any], path: Path) -> set[str]:
    """Secrets a task passes to a module (its arguments, loop, vars or rendered template)."""
    if any(k in task for k in BLOCK_KEYS):
        return set()
    text = yaml.safe_dump({k: v for k, v in task.items() if k not in INERT_KEYS})
    return refers(text + template_outputs(task, path), SECRETS)


def all_tasks() -> list[tuple[str, dict[str, Any], Path]]:
    out = []
    for path in TASK_FILES:
        for task in tasks(load(path)):
            out.append((f"{path.relative_to(REPO)}: {task.get('name', '?')}", task, path))
    return out


def test_the_declared_secrets_and_what_derives_from_them_are_found():
    assert {"k31_router_api_key", "k31_engine_hf_token", "k31_model_hf_token", "k31_smoke_api_key",
            "k31_redeploy_follow_api_key", "_k31_redeploy_follow_config"} <= SECRETS


def test_every_role_variable_named_like_a_secret_is_declared_no_log():
    loose = [n for n, spec in argument_specs().items() if SECRET_WORDS.search(n) and not spec.get("no_log")]
    assert loose == []


def environment_leaks() -> list[str]:
    return [f"{where}: `environment:` puts {sorted(used)} in the module's sh -c command line; pass it on stdin"
            for where, task, _ in all_tasks()
            if (used := refers(yaml.safe_dump(task.get("environment") or {}), SECRETS))]


def raw_leaks() -> list[str]:
    """A raw task's command is the host's process argv (sh -c ...), as `environment:` is: no secret, not even a word
    for one, may be in it (the host-side client reads the keys it needs on the host, from the units' own files)."""
    return [f"{where}: raw puts {sorted(used) or 'a key or token'} in the host's sh -c command line; pass it on stdin"
            for where, task, path in all_tasks() if "ansible.builtin.raw" in task
            and ((used := handed_over(task, path))
                 or re.search(r"api_key|token|password", str(task["ansible.builtin.raw"]), re.IGNORECASE))]


def unit_file_leaks() -> list[str]:
    """A file handed to k31_unit whose content, source or template refers to a secret must be `secret: true`, or
    `secret` must follow that secret. Its dest is a place (a condition there on a key only says whether the
    file exists, as for the router's launcher)."""
    out = []
    for where, task, path in all_tasks():
        if not unit_include(task):
            continue
        for entry in unit_files([task.get("vars"), task.get("loop")]):
            text = yaml.safe_dump({k: v for k, v in entry.items() if k not in ("secret", "dest")})
            if "template" in entry:
                text += template_outputs({"ansible.builtin.template": {"src": entry["template"]}}, path)
            secret = entry.get("secret", False)
            if (used := refers(text, SECRETS)) and secret is not True and not refers(str(secret), SECRETS):
                out.append(f"{where}: {entry['dest']} holds {sorted(used)}; its secret must be true or follow "
                           f"that, not {secret!r}")
    return out


def unlogged() -> list[str]:
    out = []
    for where, task, path in all_tasks():
        if unit_include(task):
            continue    # unit_file_leaks
        used = handed_over(task, path)
        if not used:
            continue
        if "no_log" not in task:
            out.append(f"{where} passes {sorted(used)} without no_log")
        elif task["no_log"] is not True and not refers(str(task["no_log"]), SECRETS):
            out.append(f"{where}: no_log must be true or follow the secret it hides, not {task['no_log']!r}")
    return out


def whole_results(text: str, names: set[str]) -> set[str]:
    """Registered results `text` loops over whole: `x` or `x.results` (items are module results, arguments
    and all); `x.stdout_lines` or `x.json.workers` are only what the module returned."""
    return {n for n in names if re.search(rf"(?<![\w.]){re.escape(n)}(\.results)?(?![\w.\[])", text)}


def looped_results() -> list[str]:
    """-vvv prints every loop item; a loop over the registered results of a task that handed over a secret
    prints them, module arguments (stdin, headers) included."""
    results = {task["register"] for _, task, path in all_tasks() if task.get("register") and handed_over(task, path)}
    out = []
    for where, task, _ in all_tasks():
        loop = yaml.safe_dump({k: v for k, v in task.items() if k == "loop" or k.startswith("with_")})
        if (used := whole_results(loop, results)) and task.get("no_log") is None:
            out.append(f"{where} loops over {sorted(used)}, the results of a task that handed over a secret")
    return out


def test_no_loop_prints_the_result_of_a_task_that_handed_over_a_secret():
    assert looped_results() == []


def async_leaks() -> list[str]:
    """An async task's result, its module arguments (stdin) included, is what Ansible's async wrapper writes to the
    host's ~/.ansible_async/<job>, no_log or not: a task handing over a secret does not run async."""
    return [f"{where}: async writes its arguments ({sorted(used)}) to the host's ~/.ansible_async; read the secret "
            f"from a 0600 file instead" for where, task, path in all_tasks()
            if "async" in task and (used := handed_over(task, path))]


def test_no_async_task_hands_over_a_secret():
    assert len([task for _, task, _ in all_tasks() if "async" in task]) >= 2
    assert async_leaks() == []


def test_no_secret_goes_through_environment():
    assert environment_leaks() == []


def test_no_secret_goes_into_a_raw_command():
    assert len([task for _, task, _ in all_tasks() if "ansible.builtin.raw" in task]) >= 10
    assert raw_leaks() == []


def test_every_task_handing_over_a_secret_is_no_log():
    assert unlogged() == []


def test_every_file_handed_to_k31_unit_that_holds_a_secret_is_secret():
    assert unit_file_leaks() == []


def test_k31_unit_writes_the_files_marked_secret_in_a_no_log_run_of_their_own():
    """The split itself (a secret file's content in no other run's arguments) is test_k31_unit's to pin."""
    writers = {task["name"]: task for _, task, path in all_tasks() if path.parts[-3] == UNIT_ROLE
               and "files" in task.get("k31_files", {})}
    assert {name: (task["k31_files"]["files"], task["vars"]["_k31_unit_secrets"], task.get("no_log"))
            for name, task in writers.items()} == {
        "Write the units' files that hold a secret": ("{{ _k31_unit_rendered }}", True, True),
        "Write the units' other files, the files they share and the unit files, then start the units": (
            "{{ _k31_unit_rendered }}", False, None)}


def test_the_checker_catches_what_it_is_for(tmp_path):
    """A task with the key in its environment, and one sending it in a header without no_log, are both found."""
    bad_env = {"name": "smoke", "ansible.builtin.command": {"argv": ["x"]},
               "environment": {"K": "{{ k31_router_api_key }}"}}
    bad_header = {"name": "drain", "ansible.builtin.uri": {"url": "u", "headers": "{{ _k31_redeploy_follow_config }}"}}
    assert refers(yaml.safe_dump(bad_env["environment"]), SECRETS)
    assert handed_over(bad_header, tmp_path / "x.yml") == {"_k31_redeploy_follow_config"}
    bad_raw = {"name": "drain", "ansible.builtin.raw": "printf %s {{ k31_redeploy_follow_api_key | quote }} | x"}
    assert handed_over(bad_raw, tmp_path / "x.yml") == {"k31_redeploy_follow_api_key"}
    only_condition = {"name": "c", "ansible.builtin.debug": {"msg": "hi"}, "when": "k31_router_api_key | length > 0"}
    assert handed_over(only_condition, tmp_path / "x.yml") == set()
    names = {"_k31_model_download"}
    assert whole_results("{{ _k31_model_download.results }}", names) == names
    assert whole_results("{{ _k31_model_download }}", names) == names
    assert whole_results("{{ _k31_model_download.stdout_lines }}", names) == set()
    assert whole_results("{{ _k31_model_download.results[0].stdout_lines }}", names) == set()
