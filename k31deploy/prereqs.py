"""What a run needs before any host is touched, one sentence per problem: the wheel sets the hosts' runtimes
install, the serving image's source, the secrets (Ansible Vault) the roles read and the monitoring host's settings.

The validate play (roles/k31_validate, its filter k31_validate_prerequisites) calls `prerequisites` on localhost,
where the other roles' defaults are not in scope: they are read from roles/*/defaults/main.yml, and the secrets
are the role variables whose argument_specs say no_log. Driver layer (docs/architecture.md): it reads the plan
and the inventory's hostvars as Ansible hands them over, never the catalog's rules.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ansible.module_utils.parsing.convert_bool import boolean

from k31deploy import imagearchive, wheelhouse
from k31deploy.catalog import load_yaml
from k31deploy.errors import K31Error
from k31deploy.monitoring import rules as monitoring_rules
from k31deploy.plan import Plan
from k31deploy.recipe.hosts import (
    ENGINE_GROUPS,
    PEM_ROLE_VARS,
    ROLES_DIR,
    is_pem,
    role_variables,
    serves_image,
)

CHECKS = ("secrets", "image", "wheelhouse")
IMAGE_SOURCES = ("registry", "tarball", "build")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Tags of the tasks that install each wheel set (a run whose tags skip them needs no wheelhouse).
SET_TAGS = {
    "router": {"k31_router", "k31_router_install"},
    "dynamo-frontend": {"k31_dynamo", "k31_dynamo_install"},
    "dynamo-workers": {"k31_engine", "k31_engine_install", "k31_redeploy"},
    "mooncake": {"k31_mooncake_store", "k31_mooncake_store_install"},
}


def role_defaults(playbook_dir: str) -> dict[str, Any]:
    """Every role's defaults, `{{ playbook_dir }}` and the shared paths of roles/k31 (`{{ _k31_wheelhouse }}`)
    filled in as the roles see them."""
    def fill(value: Any, names: dict[str, str]) -> Any:
        if not isinstance(value, str):
            return value
        for name, text in names.items():
            value = value.replace(f"{{{{ {name} }}}}", text)
        return value

    names = {"playbook_dir": playbook_dir}
    shared = load_yaml(ROLES_DIR / "k31" / "vars" / "main.yml") or {}
    names |= {name: fill(value, names) for name, value in shared.items()
              if isinstance(value, str) and value.count("{{") == 1 and "playbook_dir" in value}
    out: dict[str, Any] = {}
    for path in sorted(ROLES_DIR.glob("*/defaults/main.yml")):
        for name, value in (load_yaml(path) or {}).items():
            out[name] = fill(value, names)
    return out


def secret_names() -> list[str]:
    """The role variables whose argument specs say no_log: the resolver's own reading of the specs (cached, and
    parsed before the workers fork, callback_plugins/k31_warm.py)."""
    return sorted(name for name, spec in role_variables().items() if spec.get("no_log"))


class Unreadable(Exception):
    """A variable whose value cannot be worked out (undefined reference, vault without its password)."""


class Host:
    """One host's variables as its roles will see them: the inventory's (hostvars), else the role default."""

    def __init__(self, name: str, hostvars: Any, defaults: dict[str, Any]) -> None:
        self.name = name
        self.vars = hostvars[name]
        self.defaults = defaults

    def has(self, var: str) -> bool:
        return var in self.vars

    def get(self, var: str) -> Any:
        if var not in self.vars:
            return self.defaults.get(var)
        try:
            value = self.vars[var]
            str(value)  # an undefined reference or an undecryptable vault value trips only when used
        except Exception as exc:  # Ansible's marker errors; the message says which
            raise Unreadable(" ".join(str(exc).split())) from None
        return value

    def text(self, var: str) -> str:
        value = self.get(var)
        return "" if value is None else str(value)

    def flag(self, var: str) -> bool:
        return boolean(self.get(var) or False, strict=False)    # as the roles' `| bool` reads it


class Problems:
    """Sentences, each said once; the same problem on several hosts is one sentence naming them all."""

    def __init__(self) -> None:
        self.hosts: dict[str, list[str]] = {}

    def add(self, sentence: str, host: str | None = None) -> None:
        hosts = self.hosts.setdefault(sentence, [])
        if host and host not in hosts:
            hosts.append(host)

    def sentences(self) -> list[str]:
        return [s.replace("{hosts}", ", ".join(h)) for s, h in self.hosts.items()]


def plan_hosts(plan: Plan) -> list[str]:
    hosts = plan.engine_hosts + [part.host for part in (plan.router, plan.mooncake_master, plan.monitoring) if part]
    return list(dict.fromkeys(hosts))


def check_secrets(plan: Plan, hosts: dict[str, Host], problems: Problems) -> None:
    """Every secret a host of the plan (or the controller) defines must resolve to a one-line, non-empty value;
    the router key must be one the router can keep out of argv, and the same wherever it is read."""
    keys: dict[str, str] = {}
    names = secret_names()
    for host in hosts.values():
        for var in names:
            if not host.has(var):
                continue
            try:
                value = host.text(var)
            except Unreadable as exc:
                why = str(exc)
                if "is undefined" not in why and ("vault" in why.lower() or "decrypt" in why.lower()):
                    problems.add(f"{var} is vault-encrypted on {{hosts}} but could not be decrypted ({why}); give "
                                 f"its vault password (--vault-password-file FILE or --ask-vault-pass)", host.name)
                else:
                    problems.add(f"{var} on {{hosts}} cannot be resolved ({why}); pass the vaulted vars file that "
                                 f"defines it (-e @secrets.yml) or remove {var}", host.name)
                continue
            if not value.strip():
                problems.add(f"{var} is set but empty on {{hosts}}; give the secret (Ansible Vault) or remove {var}",
                             host.name)
            elif var in PEM_ROLE_VARS:    # PEM text: several lines by design, checked for its shape instead
                kind = PEM_ROLE_VARS[var]
                if not is_pem(kind, value):
                    problems.add(f"{var} on {{hosts}} is not a PEM {kind}", host.name)
            elif CONTROL.search(value):
                problems.add(f"{var} on {{hosts}} holds a control character (a line break?); a secret must be one "
                             f"line", host.name)
            elif var.endswith("_api_key") and value.startswith("-"):
                problems.add(f"{var} on {{hosts}} starts with '-': the engines' --config file becomes SGLang's "
                             f"arguments, where the key would read as an option; give a key that does not start with "
                             f"'-'", host.name)
            elif var == "k31_router_api_key":
                keys[host.name] = value
    router = plan.router
    check_control_planes(plan, hosts, keys, problems)
    if not keys:
        return
    if router and router.kind == "dynamo":
        problems.add(f"k31_router_api_key is set ({', '.join(keys)}) but router=dynamo: the Dynamo frontend "
                     f"(ai-dynamo 1.6.1) has no API key check, so the key would guard nothing (its clients present "
                     f"a cluster-CA certificate instead); unset it, or put the endpoint behind router=sglang")
        return
    if not router:    # the unified engines serve clients themselves and check the key
        return
    if not router.secret_exec:    # the catalog's dialect: a binary, its flags in argv
        dialect = router.dialect
        problems.add(f"k31_router_api_key cannot be kept out of the router's argv with router_dialect={dialect}: "
                     f"the {dialect} binary takes the key only as --api-key, which every local user reads in "
                     "/proc/<pid>/cmdline; use router_dialect=launch_router or leave k31_router_api_key unset")
    # The smoke check (localhost) and redeploys (engine hosts) send the key the router checks.
    want = keys.get(router.host)
    if want is None:
        problems.add(f"k31_router_api_key is set on {', '.join(keys)} but not on the router host {router.host}, "
                     f"so the router would run without it; set it once for group all (-e @secrets.yml does)")
        return
    differ = [h for h in hosts if h in ("localhost", *plan.engine_hosts) and keys.get(h) != want]
    if differ:
        problems.add(f"k31_router_api_key on {', '.join(differ)} is unset or not the router's ({router.host}); "
                     f"the smoke check (localhost) and redeploys (engine hosts) send it, so set it once for group "
                     f"all (-e @secrets.yml does)")


def check_control_planes(plan: Plan, hosts: dict[str, Host], keys: dict[str, str],
                         problems: Problems) -> None:
    """Every API the plan exposes is authenticated: engines serving HTTP (and the router in front of them)
    check k31_router_api_key, their admin API and the router's worker API keys derived from the k31 cluster CA;
    Dynamo's control planes check certificates of that CA."""
    serving = [r.host for s in plan.servers for r in s.ranks if r.auth_file]
    if serving and not keys:
        problems.add(f"the engines' HTTP API ({', '.join(dict.fromkeys(serving))}) and the router in front of them "
                     f"are authenticated with k31_router_api_key, which is not set; put it in Ansible Vault and pass "
                     f"it for group all (-e @secrets.yml)")
    if plan.pki or serving:
        missing = [name for name in plan_hosts(plan) if name in hosts
                   and not (hosts[name].has("k31_pki_ca_cert") and hosts[name].has("k31_pki_ca_key"))]
        dynamo = plan.router_kind == "dynamo"
        what = ("router=dynamo: its control planes (NATS, the request and response planes, the frontend) "
                "authenticate with certificates of the k31 cluster CA" if dynamo else
                "the engines' admin API (--admin-api-key) and the router's worker API (--control-plane-api-keys) "
                "authenticate with keys derived from the k31 cluster CA" if serving else
                "monitoring=prometheus: Prometheus, Alertmanager and the node exporters authenticate with "
                "certificates of the k31 cluster CA")
        if missing:
            problems.add(f"{what}, which {', '.join(missing)} lack; run `k31 pki init --vars-file "
                         f"<inventory>/group_vars/all/k31_pki.yml --vault-password-file FILE` and deploy with that "
                         f"vault password")
    router = plan.router
    if router and router.tls and router.host in hosts:
        lacking = [v for v in ("k31_pki_public_cert", "k31_pki_public_key") if not hosts[router.host].has(v)]
        if lacking:
            problems.add(f"public_tls=true: the router host {router.host} serves clients over HTTPS with the "
                         f"site's certificate, and {' and '.join(lacking)} {'is' if len(lacking) == 1 else 'are'} "
                         f"not set there; give the PEM certificate (naming {router.public_address}) and its key "
                         f"(Ansible Vault), or set k31_public_tls=false")


def image_hosts(plan: Plan, groups: dict[str, list[str]], hosts: dict[str, Host]) -> list[Host]:
    """Hosts that run something from the serving image: k31_image_enabled where the inventory sets it, else the
    test roles/k31's _k31_serves_image asks too (k31deploy.recipe.hosts.serves_image), on the roles' defaults."""
    return [host for host in hosts.values()
            if (host.flag("k31_image_enabled") if host.has("k31_image_enabled") else
                serves_image(host.name, groups, plan.router_kind, host.text("k31_engine_runtime"),
                             host.text("k31_router_runtime"), host.text("k31_dynamo_runtime")))]


def check_image(plan: Plan, groups: dict[str, list[str]], hosts: dict[str, Host],
                problems: Problems) -> None:
    image = plan.image
    archives: dict[str, str] = {}     # a tarball's verdict, read once for all the hosts that load it
    for host in image_hosts(plan, groups, hosts):
        try:
            source = host.text("k31_image_source")
            if source not in IMAGE_SOURCES:
                problems.add(f"k31_image_source={source} on {{hosts}} is not valid; valid choices: "
                             f"{', '.join(IMAGE_SOURCES)}", host.name)
            elif source == "registry":
                digest = host.text("k31_image_digest")
                if digest and not DIGEST.match(digest):
                    problems.add(f"k31_image_digest={digest} on {{hosts}} is not an image digest; give sha256: and "
                                 f"64 hex digits (the RepoDigests entry `docker inspect {image}` shows)", host.name)
            elif source == "tarball":
                tarball = host.text("k31_image_tarball")
                if not tarball:
                    problems.add(f"k31_image_source=tarball on {{hosts}} needs k31_image_tarball, a `docker save` "
                                 f"of {image}", host.name)
                elif host.text("k31_image_digest"):
                    problems.add("k31_image_digest on {hosts} pins a registry digest, which a `docker save` archive "
                                 "does not keep; with k31_image_source=tarball leave it empty (k31 checks the loaded "
                                 "image's ID against the archive's)", host.name)
                elif host.flag("k31_image_tarball_on_host"):
                    pass     # on the hosts' own storage: read there, after the load (k31_image)
                elif not Path(tarball).is_file():
                    problems.add(f"k31_image_tarball={tarball} (for {{hosts}}) does not exist on the controller; "
                                 f"give the path of a `docker save` of {image}, or set "
                                 f"k31_image_tarball_on_host=true where each host already has it", host.name)
                else:
                    if tarball not in archives:
                        try:
                            imagearchive.find(tarball, str(image))
                            archives[tarball] = ""
                        except K31Error as exc:
                            archives[tarball] = str(exc)
                    if archives[tarball]:
                        problems.add(f"{archives[tarball]} (for {{hosts}})", host.name)
                    elif imagearchive.copies_over_ssh(host.text("ansible_connection")) and not shutil.which("rsync"):
                        problems.add(f"k31_image_tarball={tarball} goes to {{hosts}} by rsync from the controller "
                                     "(an interrupted copy resumes), and this controller has no rsync; install it "
                                     "(apt install rsync), or set k31_image_tarball_on_host=true where each host "
                                     "already has the archive", host.name)
            else:
                if not host.text("k31_image_build_context"):
                    problems.add("k31_image_source=build on {hosts} needs k31_image_build_context, an SGLang "
                                 "checkout on each host", host.name)
                dockerfile = host.text("k31_image_dockerfile")
                if not Path(dockerfile).is_file():
                    problems.add(f"k31_image_dockerfile={dockerfile} (for {{hosts}}) does not exist on the "
                                 f"controller; give the Dockerfile k31_image_source=build builds", host.name)
        except Unreadable as exc:
            problems.add(f"the image settings of {{hosts}} cannot be resolved ({exc})", host.name)


def wheel_needs(plan: Plan, groups: dict[str, list[str]],
                hosts: dict[str, Host]) -> Iterable[tuple[str, str, str, str]]:
    """(set, its tag group, wheelhouse folder, why) for every venv a host's runtime installs from the wheelhouse."""
    router = plan.router
    if router and router.kind == "sglang" and router.host in hosts:
        host = hosts[router.host]
        if host.text("k31_router_runtime") == "venv":
            yield ("router", "router", host.text("k31_router_wheelhouse"),
                   f"the router runs from a venv (k31_router_runtime=venv on {host.name})")
    if router and router.kind == "dynamo":
        if router.host in hosts:
            host = hosts[router.host]
            if host.text("k31_dynamo_runtime") == "venv":
                yield ("dynamo", "dynamo-frontend", host.text("k31_dynamo_wheelhouse"),
                       f"the Dynamo frontend runs from a venv (k31_dynamo_runtime=venv on {host.name})")
        for name in (h for g in ENGINE_GROUPS.values() for h in groups.get(g, [])):
            if name in hosts and hosts[name].text("k31_engine_runtime") == "standin":
                yield ("dynamo", "dynamo-workers", hosts[name].text("k31_engine_wheelhouse"),
                       f"the Dynamo worker stand-in runs from a venv (k31_engine_runtime=standin on {name})")
    master = plan.mooncake_master
    if master and master.host in hosts:
        host = hosts[master.host]
        if host.text("k31_mooncake_store_runtime") == "venv":
            yield ("mooncake", "mooncake", host.text("k31_mooncake_store_wheelhouse"),
                   f"the Mooncake master runs from a venv (k31_mooncake_store_runtime=venv on {host.name})")


def runs(tags: set[str], run_tags: Iterable[str], skip_tags: Iterable[str]) -> bool:
    run, skip = set(run_tags or ["all"]), set(skip_tags or [])
    return ("all" in run or bool(tags & run)) and not tags & skip


def check_wheelhouse(plan: Plan, groups: dict[str, list[str]], hosts: dict[str, Host], problems: Problems,
                     run_tags: Iterable[str], skip_tags: Iterable[str]) -> None:
    arch = wheelhouse.host_arch()  # what `k31 wheelhouse pack` packs for, on this controller
    seen: set[tuple[str, str]] = set()
    for set_name, group, folder, why in wheel_needs(plan, groups, hosts):
        if not runs(SET_TAGS[group], run_tags, skip_tags) or (set_name, folder) in seen:
            continue
        seen.add((set_name, folder))
        found = wheelhouse.problem(set_name, Path(folder), arch)
        if found:
            problems.add(f"{why}, but {found}")


# The k31_monitoring settings Prometheus or Alertmanager read as durations (Prometheus' duration syntax).
MONITORING_DURATIONS = ("k31_monitoring_scrape_interval", "k31_monitoring_evaluation_interval",
                        "k31_monitoring_retention", "k31_monitoring_group_wait", "k31_monitoring_group_interval",
                        "k31_monitoring_repeat_interval")


def check_monitoring(plan: Plan, hosts: dict[str, Host], problems: Problems) -> None:
    """The monitoring host's settings, here rather than in the monitoring play, which runs after the engines."""
    mon = plan.monitoring
    if not mon or mon.host not in hosts:
        return
    host = hosts[mon.host]
    for var in MONITORING_DURATIONS:
        value = host.text(var)
        if not monitoring_rules.DURATION.match(value):
            problems.add(f"{var} is {value!r}; it takes a Prometheus duration such as 15s, 5m or 15d")
    settings = host.get("k31_monitoring_rule_settings") or {}
    if not isinstance(settings, dict):
        problems.add(f"k31_monitoring_rule_settings is {settings!r}; it takes a mapping such as "
                     "{engine_down_for: 30m}")
        return
    try:
        monitoring_rules.rules(plan, {"inventory": "-", **settings})
    except K31Error as exc:
        problems.add(f"k31_monitoring_rule_settings: {exc}")


def prerequisites(doc: dict[str, Any], groups: dict[str, list[str]], hostvars: Any, playbook_dir: str,
                  checks: Iterable[str] = CHECKS, run_tags: Iterable[str] = ("all",),
                  skip_tags: Iterable[str] = ()) -> list[str]:
    """One sentence per missing prerequisite of `checks` (secrets, image, wheelhouse); [] when nothing is missing."""
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise K31Error(f"k31_validate_prerequisites names {', '.join(unknown)}; valid choices: {', '.join(CHECKS)}")
    if "error" in doc:    # the plan's own refusal, which the validate play reports
        return []
    plan = Plan.of(doc)
    defaults = role_defaults(playbook_dir)
    names = list(dict.fromkeys([*plan_hosts(plan), "localhost"]))
    hosts = {n: Host(n, hostvars, defaults) for n in names if n in hostvars}
    problems = Problems()
    try:
        check_monitoring(plan, hosts, problems)
        if "secrets" in checks:
            check_secrets(plan, hosts, problems)
        if "image" in checks and runs({"k31_image"}, run_tags, skip_tags):
            check_image(plan, groups, hosts, problems)
        if "wheelhouse" in checks:
            check_wheelhouse(plan, groups, hosts, problems, run_tags, skip_tags)
    except Unreadable as exc:
        problems.add(f"a runtime setting cannot be resolved ({exc})")
    except K31Error as exc:
        problems.add(str(exc))
    return problems.sentences()

