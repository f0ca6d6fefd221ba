"""The host layout a plan is resolved against: inventory hosts, or placeholders when there is none.

Inventory contract (docs/architecture.md): groups k31_unified / k31_prefill / k31_decode (engines),
k31_router, k31_mooncake_master, k31_monitoring; host var `k31_server` groups hosts into one multi-node server
(default: the host name), `k31_node_rank` orders them (default: inventory order).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from k31deploy import envfile, validate
from k31deploy.catalog import ROLES, knob_specs, load_yaml
from k31deploy.errors import K31Error
from k31deploy.recipe.knobs import closest

ENGINE_GROUPS = {role: f"k31_{role}" for role in ROLES}
ROUTER_GROUP = "k31_router"
MOONCAKE_GROUP = "k31_mooncake_master"
MONITORING_GROUP = "k31_monitoring"
K31_GROUPS = (*ENGINE_GROUPS.values(), ROUTER_GROUP, MOONCAKE_GROUP, MONITORING_GROUP)

# `k31_*` variables that are not recipe knobs: the layout host vars, the roles' own variables (each
# role's meta/argument_specs.yml, all entry points) and the few the playbooks read themselves. Anything
# else named k31_* is a typo and is refused, as a typo'd knob is: `k31_router_api_kye` would otherwise
# leave the router without its key.
LAYOUT_VARS = ("k31_server", "k31_node_rank", "k31_cluster_address", "k31_public_address")
PLAYBOOK_VARS = {    # each as a role variable's spec: its type, and the playbook that reads it
    "k31_reboot_ok": {"type": "bool", "source": "playbooks/prepare.yml"},
    "k31_teardown_confirm": {"type": "str", "source": "playbooks/teardown.yml"},
    "k31_teardown_purge": {"type": "bool", "source": "playbooks/teardown.yml"},
}
ROLES_DIR = Path(__file__).resolve().parents[2] / "roles"
# Roles only other roles include (roles/k31_unit: a unit's lifecycle): those roles set their variables, which
# an inventory could not change, so one naming them is refused like any other unknown k31_* variable.
INTERNAL_ROLES = ("k31_unit",)
# Role variables holding PEM text (several lines, so not the one-line strings the others must be): what each
# holds. The site's certificate may be a chain, its key any PEM private key.
PEM_ROLE_VARS = {"k31_pki_ca_cert": "certificate", "k31_pki_ca_key": "private key",
                 "k31_pki_public_cert": "certificate", "k31_pki_public_key": "private key",
                 "k31_pki_public_ca": "certificate"}
PEM_LABELS = {"certificate": "CERTIFICATE", "private key": "(?:RSA |EC |ENCRYPTED )?PRIVATE KEY"}
# Role variables holding a host's fabric address (SGLANG_HOST_IP, the IMEX nodes config): IPs, not names.
IP_ROLE_VARS = ("k31_rdma_host_ip", "k31_mnnvl_address")
# Role variables listing networks (nftables sources, the RDMA fabric): each item an IP network.
CIDR_ROLE_VARS = ("k31_firewall_cluster_sources", "k31_firewall_public_sources", "k31_firewall_ssh_sources",
                  "k31_rdma_fabric_cidrs")
# Role variables listing env file stems under the engine's etc dir (NAME.env): names, not paths.
STEM_ROLE_VARS = ("k31_engine_host_env_files",)
_STEM = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", re.ASCII)
# Ansible's boolean spellings (module_utils.parsing.convert_bool), as INI group vars arrive: strings.
_BOOLEANS = {"yes", "on", "1", "true", "y", "t", "no", "off", "0", "false", "n", "f"}
# What a role variable's checks read; anything else is vaulted (ansible's EncryptedString, not a str).
PLAIN = (str, int, float, bool, list, dict)
# Names k31 redeploy / k31 logs take as targets besides server names: a server may not be called so.
RESERVED_SERVER_NAMES = (*ROLES, "router")


def is_pem(kind: str, value: str) -> bool:
    """Whether value is PEM text of that kind (the only multi-line text a role variable may hold): one private
    key, or certificates (a chain)."""
    label = PEM_LABELS[kind]
    block = rf"\s*-----BEGIN ({label})-----\n[A-Za-z0-9+/=\n]+-----END \1-----\s*"
    return bool(re.fullmatch(rf"(?:{block})+" if kind == "certificate" else block, value))


def serves_image(host: str, groups: dict[str, list[str]], router_kind: str | None, engine_runtime: str,
                 router_runtime: str, dynamo_runtime: str) -> bool:
    """Whether `host` runs something from the serving image: an engine whose runtime is a container, or the router
    host when the router (the Dynamo frontend where the plan's router kind is dynamo) runs as one. roles/k31's
    _k31_serves_image (the k31_image and k31_container_runtime `enabled` default, per host) and the validate
    filter (before any host is touched) both ask this."""
    engines = {h for g in ENGINE_GROUPS.values() for h in groups.get(g) or []}
    if host in engines and engine_runtime == "container":
        return True
    runtime = dynamo_runtime if router_kind == "dynamo" else router_runtime
    return host in (groups.get(ROUTER_GROUP) or []) and runtime == "container"


@cache
def role_variables() -> dict[str, dict[str, Any]]:
    """Every role variable -> its argument spec (plus `role`), from roles/*/meta/argument_specs.yml."""
    specs = sorted(ROLES_DIR.glob("*/meta/argument_specs.yml"))
    if not specs:
        raise K31Error(f"k31's roles are not next to the installed package ({ROLES_DIR} has no "
                       f"*/meta/argument_specs.yml) to check role variables against; install k31 from its "
                       f"checkout with pip install -e")
    found: dict[str, dict[str, Any]] = {}
    for path in specs:
        if path.parts[-3] in INTERNAL_ROLES:
            continue
        data = load_yaml(path) or {}
        for entry in (data.get("argument_specs") or {}).values():
            for name, spec in (entry.get("options") or {}).items():
                found.setdefault(name, {**spec, "role": path.parts[-3]})
    return found


@dataclass(frozen=True)
class Host:
    """An inventory host. `address` is its cluster (backend) address: what internal services bind and
    reach each other on (k31_cluster_address, default ansible_host, default the name). `public` is where
    the router or Dynamo frontend takes clients (k31_public_address, default the cluster address)."""

    name: str
    address: str
    groups: tuple[str, ...]
    vars: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    public: str = ""

    @property
    def server(self) -> str:
        return str(self.vars.get("k31_server") or self.name)

    @property
    def public_address(self) -> str:
        return self.public or self.address


def from_mapping(name: str, groups: list[str] | tuple[str, ...], hostvars: dict[str, Any]) -> Host:
    """Build a Host from Ansible-style data (inventory API or the filter plugin's hostvars)."""
    address = str(hostvars.get("k31_cluster_address") or hostvars.get("ansible_host") or name)
    kept = {k: v for k, v in hostvars.items() if k.startswith("k31_") or k == "ansible_host"}
    return Host(name=name, address=address, groups=tuple(g for g in groups if g in K31_GROUPS), vars=kept,
                public=str(hostvars.get("k31_public_address") or ""))


def resolved(hosts: list[Host]) -> list[Host]:
    """The hosts with their cluster and public addresses as IPs, as a deploy needs them (etcd binds
    only to an IP, firewall rules match IPs): names resolve on the controller, once."""
    import socket

    cache_: dict[str, str] = {}

    def ip(host: Host, setting: str, text: str) -> str:
        if not text or validate.is_ip(text):
            return text
        if text not in cache_:
            try:
                cache_[text] = socket.getaddrinfo(text, None, proto=socket.IPPROTO_TCP)[0][4][0]
            except OSError as exc:
                raise K31Error(
                    f"{setting} of host {host.name} is {text}, which does not resolve on the controller "
                    f"({exc.strerror or exc}); set {setting} to the host's IP address"
                ) from None
        return validate.bind_address(setting, cache_[text], f"host {host.name}, resolved from {text}")

    out = []
    for h in hosts:
        cluster = "k31_cluster_address" if "k31_cluster_address" in h.vars else "ansible_host"
        out.append(Host(h.name, ip(h, cluster, h.address), h.groups, h.vars,
                        ip(h, "k31_public_address", h.public)))
    return out


def check_groups(groups: dict[str, list[str]], where: str) -> None:
    """A group named k31_* that is none of k31's, with hosts in it: a typo (k31_prefil) that would leave its hosts
    out of the plan without a word."""
    for group in sorted(groups):
        if group.startswith("k31_") and group not in K31_GROUPS and groups[group]:
            raise K31Error(f"group {validate.shown(group)} of {where} is not a k31 group, so its hosts "
                           f"({validate.shown(', '.join(groups[group][:3]))}) would be left out; "
                           f"{closest(group, K31_GROUPS)}valid groups: {', '.join(K31_GROUPS)}")


def check_hosts(hosts: list[Host]) -> None:
    """Host names, addresses (ansible_host, or the name) and engine hosts' server names, each against its
    allow-list: they reach unit files, env files, URLs and ssh."""
    for host in hosts:
        validate.host_name(host.name)
        if "ansible_host" in host.vars:
            validate.bind_address("ansible_host", str(host.vars["ansible_host"]), f"host {host.name}")
        for var in ("k31_cluster_address", "k31_public_address"):
            if host.vars.get(var):
                validate.bind_address(var, str(host.vars[var]), f"host {host.name}")
        if "ansible_host" not in host.vars and "k31_cluster_address" not in host.vars:
            validate.address(f"host {host.name}", host.address, "its name: no ansible_host is set")
        if host.public and ROUTER_GROUP not in host.groups:
            raise K31Error(f"k31_public_address is set on host {host.name}, which is not in {ROUTER_GROUP}; only "
                           f"the router or Dynamo frontend takes clients on a public address")
        if any(g in ENGINE_GROUPS.values() for g in host.groups):
            name = validate.server_name(host.server, host.name)
            if name in RESERVED_SERVER_NAMES:
                raise K31Error(
                    f"server name '{name}' of host {host.name} (k31_server, or the host name when unset) is also "
                    f"a target name of k31 redeploy and k31 logs; valid: any other name, e.g. {name}0"
                )


def inventory_knobs(hosts: list[Host]) -> dict[str, Any]:
    """Knob values set in the inventory (`k31_<knob>`); they are cluster-wide, so hosts must agree.
    Every other k31_* variable must be a layout, role or playbook variable (role values with `choices`
    in their argument spec are checked against them)."""
    specs = knob_specs()
    seen: dict[str, tuple[Any, str]] = {}
    for host in hosts:
        for var, value in host.vars.items():
            if not var.startswith("k31_") or var in LAYOUT_VARS or value is None:
                continue
            knob = var[len("k31_"):]
            if knob not in specs:
                check_role_variable(var, value, host.name, host.vars)
                continue
            if knob in seen and seen[knob][0] != value and repr(seen[knob][0]) != repr(value):    # nan != nan
                other_value, other = seen[knob]
                hint = " (both PD roles must use the same backend)" if knob == "attention_backend" else ""
                raise K31Error(
                    f"{var} differs between hosts ({other}: {validate.shown(other_value)}, {host.name}: "
                    f"{validate.shown(value)}); recipe knobs are cluster-wide{hint}: set it once in group_vars/all"
                )
            seen.setdefault(knob, (value, host.name))
    return {knob: value for knob, (value, _) in seen.items()}


def check_role_variable(var: str, value: Any, host: str, host_vars: dict[str, Any] | None = None) -> None:
    """A k31_* variable that is not a knob: a role's (argument_specs.yml) or a playbook's, else refused."""
    host_vars = host_vars or {}
    if var in PLAYBOOK_VARS:
        check_role_value(var, PLAYBOOK_VARS[var], value, f"host {host}")
        return
    roles = role_variables()
    spec = roles.get(var)
    if spec is None:
        knobs = [f"k31_{k}" for k in knob_specs()]
        role = next((r for r in sorted({s["role"] for s in roles.values()}, key=len, reverse=True)
                     if var.startswith(f"{r}_")), None)
        if role:
            valid = f"{role}'s variables are {', '.join(sorted(n for n, s in roles.items() if s['role'] == role))}"
        else:
            valid = (f"recipe knobs are k31_<knob> with knob one of: {', '.join(sorted(knob_specs()))}; role "
                     f"variables are those of roles/*/meta/argument_specs.yml")
        raise K31Error(f"unknown inventory variable '{validate.shown(var)}' on host {host}; "
                       f"{closest(var, [*knobs, *roles, *PLAYBOOK_VARS])}{valid}")
    if spec.get("type") in ("str", "path") and isinstance(value, str):    # vaulted values are not str here
        found = validate.CONTROL.search(value)
        if found:
            secret = spec.get("no_log")
            hint = " (a vaulted value piped from echo ends in a newline: use printf '%s')" if secret else ""
            raise K31Error(
                f"{var}={'(value not shown: a secret)' if secret else validate.shown(value)} (host {host}) is not "
                f"valid: it contains the control character {validate.shown(found.group())}, and none may reach a "
                f"host (a newline would start a new line in a root-run file); valid: one line{hint}"
            )
        if var in IP_ROLE_VARS and value and "{{" not in value:
            try:
                ipaddress.ip_address(value)
            except ValueError:
                raise K31Error(f"{validate.named(var, value, f'host {host}')} is not valid; valid: an IPv4 or IPv6 "
                               f"address, or '' to take the host's default-route address") from None
    if var in PEM_ROLE_VARS and isinstance(value, str) and "{{" not in value:
        kind = PEM_ROLE_VARS[var]
        if not is_pem(kind, value):
            shown_value = "(value not shown: a secret)" if spec.get("no_log") else validate.shown(value[:40]) + "..."
            raise K31Error(f"{var}={shown_value} (host {host}) is not valid; valid: a PEM {kind}")
    if var.endswith("_extra_env") and isinstance(value, dict):    # lines of the engines' env files
        # docker and podman read an --env-file more narrowly than systemd: the container runtime's rules
        container = host_vars.get("k31_engine_runtime", "container") == "container"
        for key, item in value.items():
            if not isinstance(item, PLAIN):    # vaulted
                continue
            if isinstance(item, dict | list):
                raise K31Error(f"{var} (host {host}) is not valid: the value of {validate.shown(key)} is a "
                               f"{type(item).__name__}; valid: a string or a number")
            try:
                envfile.line(key, item, container=container)
            except K31Error as exc:
                raise K31Error(f"{var} (host {host}) is not valid: {exc}") from None
    check_role_value(var, spec, value, f"host {host}")
    choices = spec.get("choices")
    if choices and isinstance(value, str) and "{{" not in value and "{%" not in value and value not in choices:
        raise K31Error(f"{validate.named(var, value, f'host {host}')} is not valid; valid choices: "
                       f"{', '.join(repr(c) if c == '' else str(c) for c in choices)} "
                       f"(roles/{spec['role']}/meta/argument_specs.yml)")


def check_role_value(var: str, spec: dict[str, Any], value: Any, where: str) -> None:
    """A role variable's value against its argument spec's type, before any host is touched (Ansible checks the
    spec only when the role starts, after the roles before it changed hosts), and the strings that reach a root
    shell or a unit against an allow-list. A template (`{{ ... }}`) is Ansible's to resolve."""
    if not isinstance(value, PLAIN) or (isinstance(value, str) and ("{{" in value or "{%" in value)):
        return    # a vaulted value (EncryptedString) cannot be read without its secret; the role checks it
    kind = spec.get("type", "str")

    def refuse(valid: str) -> K31Error:
        shown_value = "(value not shown: a secret)" if spec.get("no_log") else validate.shown(value)
        source = spec.get("source") or f"roles/{spec['role']}/meta/argument_specs.yml"
        return K31Error(f"{var}={shown_value} ({where}) is not valid; valid: {valid} ({source})")

    if kind == "int":
        text = str(value).strip() if isinstance(value, int | str) and not isinstance(value, bool) else ""
        unlimited = spec.get("default") == -1    # -1 means unlimited there (a container's memlock)
        if not (re.fullmatch(r"[0-9]{1,12}", text) or (unlimited and text == "-1")):
            raise refuse("a whole number, 0 or more" + (", or -1 for unlimited" if unlimited else ""))
        if var.endswith("_port") and not 1 <= int(text) <= 65535:
            raise refuse("a port, 1 to 65535")
    elif kind == "float":
        try:
            if validate.finite_float(value) < 0:
                raise ValueError
        except ValueError:
            raise refuse("a finite number, 0 or more") from None
    elif kind == "bool" and not (isinstance(value, bool) or str(value).strip().lower() in _BOOLEANS):
        raise refuse("true or false")
    elif kind == "dict" and not isinstance(value, dict):
        raise refuse("a mapping")
    elif kind == "list" and not isinstance(value, list | str):
        raise refuse("a list")
    elif kind == "path" and isinstance(value, str) and value and not validate.role_path(value):
        raise refuse(validate.ROLE_PATH_VALID)
    items = [i for i in (value if isinstance(value, list) else [value] if isinstance(value, str) else [])
             if isinstance(i, PLAIN)]
    if kind == "list" and spec.get("elements") in ("str", "path"):
        for item in items:
            if not isinstance(item, str) or validate.CONTROL.search(item):
                raise refuse("a list of one-line strings")
            if spec["elements"] == "path" and not validate.role_path(item):
                raise refuse(f"a list of paths: {validate.ROLE_PATH_VALID}")
    if var in CIDR_ROLE_VARS:
        for item in items:
            try:
                validate.network(item)
            except ValueError:
                raise refuse("a list of IP networks (10.0.0.0/8, fd00::/64) or addresses") from None
    if var == "k31_firewall_extra" and not all(validate.firewall_rule(i) for i in items):
        raise refuse(validate.FIREWALL_EXTRA_VALID)
    if var in STEM_ROLE_VARS and not all(isinstance(i, str) and _STEM.fullmatch(i) for i in items):
        raise refuse("a list of names (letters, digits, '_', '-'), each NAME.env in the engine's etc dir")


@dataclass
class ServerHosts:
    name: str
    role: str
    hosts: list[Host]


def group_servers(hosts: list[Host], role: str) -> list[ServerHosts]:
    """Engine hosts of one role grouped into servers, each ordered by node rank."""
    group = ENGINE_GROUPS[role]
    servers: dict[str, ServerHosts] = {}
    for host in hosts:
        if group in host.groups:
            servers.setdefault(host.server, ServerHosts(host.server, role, [])).hosts.append(host)
    for server in servers.values():
        ranks = [h.vars.get("k31_node_rank") for h in server.hosts]
        if all(r is None for r in ranks):
            continue
        try:
            as_int = sorted(validate.whole_number(r) for r in ranks)
        except ValueError:
            raise K31Error(
                f"k31_node_rank of server {server.name} must be set on all of its hosts "
                f"({', '.join(h.name for h in server.hosts)}) as 0..{len(ranks) - 1}, or on none"
            ) from None
        if as_int != list(range(len(ranks))):
            raise K31Error(
                f"k31_node_rank of server {server.name} must number its hosts 0..{len(ranks) - 1} "
                f"exactly once; found {', '.join(str(r) for r in ranks)}"
            )
        server.hosts.sort(key=lambda h: validate.whole_number(h.vars["k31_node_rank"]))
    return list(servers.values())


def check_unique_servers(servers: list[ServerHosts]) -> None:
    """One k31_server name is one server: on hosts of two roles it would be two servers sharing units'
    names and redeploy targets (the redeploy order then breaks)."""
    first: dict[str, ServerHosts] = {}
    for server in servers:
        other = first.setdefault(server.name, server)
        if other is not server:
            raise K31Error(
                f"k31_server={server.name} names a {other.role} server ({', '.join(h.name for h in other.hosts)}) "
                f"and a {server.role} server ({', '.join(h.name for h in server.hosts)}); server names must be "
                f"unique across roles: give each server its own k31_server"
            )


def check_memberships(hosts: list[Host]) -> None:
    """A host runs at most one engine server: it may not sit in two engine groups."""
    for host in hosts:
        roles = [g for g in host.groups if g in ENGINE_GROUPS.values()]
        if len(roles) > 1:
            raise K31Error(
                f"host {host.name} is in {' and '.join(roles)}; an engine host serves one role "
                f"(its GPUs belong to one server)"
            )


def placeholders(nnodes_by_role: dict[str, int], router: bool, mooncake: bool) -> list[Host]:
    """Hosts node0, node1, ... laid out as the recipe needs: one server per role; the router (and
    the Mooncake master) share node0, as the seed's two-node 1P1D does."""
    hosts: list[Host] = []
    for role, nnodes in nnodes_by_role.items():
        server = f"{role}0"
        for _ in range(nnodes):
            name = f"node{len(hosts)}"
            hosts.append(Host(name, name, (ENGINE_GROUPS[role],), {"k31_server": server}))
    extra = ((ROUTER_GROUP,) if router else ()) + ((MOONCAKE_GROUP,) if mooncake else ())
    if extra:
        first = hosts[0]
        hosts[0] = Host(first.name, first.address, first.groups + extra, first.vars)
    return hosts
