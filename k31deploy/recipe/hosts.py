"""The host layout a plan is resolved against: inventory hosts, or placeholders when there is none.

Inventory contract (architecture.md): groups k31_unified / k31_prefill / k31_decode (engines),
k31_router, k31_mooncake_master; host var `k31_server` groups hosts into one multi-node server
(default: the host name), `k31_node_rank` orders them (default: inventory order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k31deploy.errors import K31Error
from k31deploy.recipe.catalog import ROLES, knob_specs

ENGINE_GROUPS = {role: f"k31_{role}" for role in ROLES}
ROUTER_GROUP = "k31_router"
MOONCAKE_GROUP = "k31_mooncake_master"
K31_GROUPS = (*ENGINE_GROUPS.values(), ROUTER_GROUP, MOONCAKE_GROUP)

# `k31_*` variables that are not recipe knobs: the layout host vars and the roles' own
# (role-prefixed) variables. Anything else named k31_* is a typo'd knob and is refused.
LAYOUT_VARS = ("k31_server", "k31_node_rank")
ROLE_VAR_PREFIXES = (
    "k31_validate_", "k31_engine_", "k31_router_", "k31_dynamo_", "k31_mooncake_store_", "k31_smoke_",
    "k31_preflight_", "k31_container_runtime_", "k31_image_", "k31_model_", "k31_rdma_", "k31_mnnvl_",
    "k31_redeploy_", "k31_status_", "k31_sandbox_", "k31_observability_", "k31_reboot_",
)


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    groups: tuple[str, ...]
    vars: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def server(self) -> str:
        return str(self.vars.get("k31_server") or self.name)


def from_mapping(name: str, groups: list[str] | tuple[str, ...], hostvars: dict[str, Any]) -> Host:
    """Build a Host from Ansible-style data (inventory API or the filter plugin's hostvars)."""
    address = str(hostvars.get("ansible_host") or name)
    kept = {k: v for k, v in hostvars.items() if k.startswith("k31_") or k == "ansible_host"}
    return Host(name=name, address=address, groups=tuple(g for g in groups if g in K31_GROUPS), vars=kept)


def inventory_knobs(hosts: list[Host]) -> dict[str, Any]:
    """Knob values set in the inventory (`k31_<knob>`); they are cluster-wide, so hosts must agree."""
    specs = knob_specs()
    seen: dict[str, tuple[Any, str]] = {}
    for host in hosts:
        for var, value in host.vars.items():
            if not var.startswith("k31_") or var in LAYOUT_VARS or value is None:
                continue
            knob = var[len("k31_"):]
            if knob not in specs:
                if var.startswith(ROLE_VAR_PREFIXES):
                    continue
                raise K31Error(
                    f"unknown inventory variable '{var}' on host {host.name}; recipe knobs are "
                    f"k31_<knob> with knob one of: {', '.join(sorted(specs))}"
                )
            if knob in seen and seen[knob][0] != value:
                other_value, other = seen[knob]
                hint = " (both PD roles must use the same backend)" if knob == "attention_backend" else ""
                raise K31Error(
                    f"{var} differs between hosts ({other}: {other_value}, {host.name}: {value}); recipe "
                    f"knobs are cluster-wide{hint}: set it once in group_vars/all"
                )
            seen.setdefault(knob, (value, host.name))
    return {knob: value for knob, (value, _) in seen.items()}


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
            as_int = sorted(int(r) for r in ranks)
        except (TypeError, ValueError):
            raise K31Error(
                f"k31_node_rank of server {server.name} must be set on all of its hosts "
                f"({', '.join(h.name for h in server.hosts)}) as 0..{len(ranks) - 1}, or on none"
            ) from None
        if as_int != list(range(len(ranks))):
            raise K31Error(
                f"k31_node_rank of server {server.name} must number its hosts 0..{len(ranks) - 1} "
                f"exactly once; found {', '.join(str(r) for r in ranks)}"
            )
        server.hosts.sort(key=lambda h: int(h.vars["k31_node_rank"]))
    return list(servers.values())


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
