"""A host's firewall from the plan: exactly the ports the plan lists for it, each open only to the sources
that need it, and nothing else.

The plan's `ports` table says what each host listens on; internal services (engines, PD bootstrap,
dist-init, etcd, NATS, the Mooncake master, metrics) accept the cluster's addresses, the client endpoint
(the router or Dynamo frontend) its configured public sources. Ports chosen at run time are opened to the
peers that use them: the Mooncake transfer RPC range between PD engine hosts, and every port between the
nodes of one multi-node server (NCCL and torch.distributed pick theirs). SSH, loopback, replies and ICMP
stay open so the controller keeps its way in.

`nftables()` renders one self-contained table (`inet k31`, its input chain's policy drop) that `nft -f`
replaces atomically; `firewalld()` lists the rich rules the same decisions give in firewalld's terms.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from k31deploy import validate
from k31deploy.errors import K31Error
from k31deploy.plan import Plan

ANY = ["0.0.0.0/0", "::/0"]


@dataclass(frozen=True)
class Rule:
    ports: str                 # "30000" or "15000-17000"; "" = every port
    sources: tuple[str, ...]   # networks (CIDR); 0.0.0.0/0 and ::/0 for anywhere
    comment: str
    proto: str = "tcp"

    def to_dict(self) -> dict[str, Any]:
        return {"ports": self.ports, "proto": self.proto, "sources": list(self.sources), "comment": self.comment}


@dataclass
class Settings:
    cluster_sources: list[str] = field(default_factory=list)   # default: every address of the plan
    public_sources: list[str] = field(default_factory=lambda: list(ANY))
    ssh_port: int = 22
    ssh_sources: list[str] = field(default_factory=lambda: list(ANY))
    extra: list[dict[str, Any]] = field(default_factory=list)  # site rules: {ports, proto, sources, comment}


def _network(text: str, what: str) -> str:
    try:
        return validate.network(text)
    except ValueError:
        raise K31Error(f"{what} entry {text!r} is not an IP address or network (CIDR)") from None


def _networks(items: list[str], what: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(_network(i, what) for i in items))


def client_endpoints(plan: Plan) -> set[tuple[str, int]]:
    """(host, port) clients use: the router or Dynamo frontend, else each unified server's rank 0."""
    if plan.router:
        return {(plan.router.host, plan.router.port)}
    return {(s.ranks[0].host, s.port) for s in plan.servers if s.role == "unified"}


def plan_addresses(plan: Plan) -> list[str]:
    found = [r.address for s in plan.servers for r in s.ranks]
    found += [other.address for other in (plan.router, plan.mooncake_master) if other]
    found += [n.address for n in plan.monitoring.nodes] if plan.monitoring else []
    return list(dict.fromkeys(found))


def rules(doc: Plan | dict[str, Any], host: str, settings: Settings) -> list[Rule]:
    """The host's rules in order: SSH, then each planned port, then the run-time port peers."""
    plan = Plan.of(doc)
    cluster = _networks(settings.cluster_sources or plan_addresses(plan), "k31_firewall_cluster_sources")
    public = _networks(settings.public_sources, "k31_firewall_public_sources")
    out = [Rule(str(settings.ssh_port), _networks(settings.ssh_sources, "k31_firewall_ssh_sources"),
                "ssh: the controller's way in")]
    endpoint = client_endpoints(plan)
    for entry in plan.ports:
        if entry.host != host:
            continue
        sources = public if (entry.host, entry.port) in endpoint else cluster
        numbers = f"{entry.port}-{entry.port_last}" if entry.port_last else str(entry.port)
        out.append(Rule(numbers, sources, f"{entry.service}: {entry.purpose}", entry.proto))
    mine = plan.placed(host)
    if plan.topology == "pd" and mine and plan.pd_transfer_ports:
        peers = [r.address for s in plan.servers for r in s.ranks]
        low, high = plan.pd_transfer_ports
        out.append(Rule(f"{low}-{high}", _networks(peers, "engine addresses"),
                        "mooncake: PD transfer RPC between engine hosts (MC_MIN_RPC_PORT..MC_MAX_RPC_PORT)"))
    for server, rank in mine:
        if server.layout.nnodes > 1:
            peers = [r.address for r in server.ranks if r is not rank]
            for proto in ("tcp", "udp"):
                out.append(Rule("", _networks(peers, "server addresses"), f"{server.name}: its other nodes "
                                f"(NCCL and torch.distributed pick their ports at run time)", proto))
    for extra in settings.extra:
        if not validate.firewall_rule(extra):
            raise K31Error(f"k31_firewall_extra entry {extra!r} is not valid; valid: {validate.FIREWALL_EXTRA_VALID}")
        out.append(Rule(str(extra.get("ports", "")), _networks(extra.get("sources") or ANY, "k31_firewall_extra"),
                        str(extra.get("comment", "site rule")), str(extra.get("proto", "tcp"))))
    return out


def _quote(text: str) -> str:
    return '"' + "".join(c for c in text if c.isprintable() and c not in '"\\')[:120] + '"'


def nftables(plan: Plan | dict[str, Any], host: str, settings: Settings) -> str:
    lines = [
        f"# k31 firewall of {host}, from the plan's ports (k31 plan); rendered by k31, replaced on each deploy.",
        "table inet k31",
        "delete table inet k31",
        "table inet k31 {",
        "  chain input {",
        "    type filter hook input priority filter; policy drop;",
        '    iif "lo" accept',
        "    ct state established,related accept",
        "    ct state invalid drop",
        # ICMP (1) and ICMPv6 (58) by number: names need /etc/protocols, which minimal hosts lack.
        "    meta l4proto { 1, 58 } accept",
    ]
    for rule in rules(plan, host, settings):
        port = f" {rule.proto} dport {rule.ports}" if rule.ports else f" meta l4proto {rule.proto}"
        v4 = [n for n in rule.sources if ipaddress.ip_network(n).version == 4]
        v6 = [n for n in rule.sources if ipaddress.ip_network(n).version == 6]
        matches = ([f"ip saddr {{ {', '.join(v4)} }}"] if v4 else []) + ([f"ip6 saddr {{ {', '.join(v6)} }}"]
                                                                        if v6 else [])
        for match in matches:
            lines.append(f"    {match} {port.strip()} accept comment {_quote(rule.comment)}")
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def firewalld(plan: Plan | dict[str, Any], host: str, settings: Settings) -> list[str]:
    """The same rules as firewalld rich rules (for the host's default zone)."""
    out = []
    for rule in rules(plan, host, settings):
        port = (f'port port="{rule.ports}" protocol="{rule.proto}"' if rule.ports
                else f'protocol value="{rule.proto}"')
        for net in rule.sources:
            out.append(f'rule family="ipv{ipaddress.ip_network(net).version}" source address="{net}" {port} accept')
    return out


def ufw(plan: Plan | dict[str, Any], host: str, settings: Settings) -> list[str]:
    """The same rules as `ufw show added` prints them (what `ufw` takes after its name), each commented k31."""
    out = []
    for rule in rules(plan, host, settings):
        comment = "k31 " + "".join(c for c in rule.comment if c.isalnum() or c in " .,:-_/()")[:80]
        for net in rule.sources:
            port = f" port {rule.ports.replace('-', ':')}" if rule.ports else ""
            out.append(f"allow from {net} to any{port} proto {rule.proto} comment '{comment}'")
    return out


def changes(desired: list[str], current: list[str], ours: list[str]) -> list[dict[str, str]]:
    """What to add (desired, not in place) and remove (k31's own from before, no longer desired), in that
    order, so a rule the plan still needs is never missing in between."""
    have = set(current)
    add = [{"op": "add", "rule": r} for r in desired if r not in have]
    remove = [{"op": "remove", "rule": r} for r in dict.fromkeys(ours) if r not in set(desired) and r in have]
    return add + remove


def ruleset(doc: Plan | dict[str, Any], host: str, settings: Settings) -> dict[str, Any]:
    """Everything a backend needs, and the table `--check` shows."""
    plan = Plan.of(doc)
    found = rules(plan, host, settings)
    shown = [f"{(r.ports or 'all') + '/' + r.proto:<16} from {', '.join(r.sources):<32} {r.comment}" for r in found]
    return {"rules": [r.to_dict() for r in found], "shown": shown, "nft": nftables(plan, host, settings),
            "firewalld": firewalld(plan, host, settings), "ufw": ufw(plan, host, settings)}
