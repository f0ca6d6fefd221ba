"""The plan's port table: every port each host listens on and what for, built once from the plan (whose
numbers come from the catalog's `ports` and the dist_init_port knob). The resolver refuses a table in
which one machine listens twice on one port; `k31 plan` shows it; a firewall can open exactly it.

Hosts that share an address are one machine. A range entry (`port`..`port_last`) is one listener that
takes one port of the range at each start (a Dynamo worker's request plane). Ports a process picks at run
time (NCCL's, Mooncake's transfer RPC range 15000-17000 that the k31_rdma role opens, Dynamo's event-plane
publishers) are not planned and so not listed.

Layer: resolution (docs/architecture.md); it reads the plan dict and the catalog, and imports errors and
the catalog only.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from k31deploy.catalog import catalog
from k31deploy.errors import K31Error

# SGLang 0.5.23 PortArgs.init_new: with DP attention across nodes, six ZMQ ports port_base..port_base+5
# follow the --dist-init-addr port (port_base = dist_init_port + 1, or below it near 65535).
DP_ATTENTION_PORTS = 6


def dp_attention_ports(dist_init_port: int) -> list[int]:
    base = dist_init_port + 1
    if dist_init_port + DP_ATTENTION_PORTS > 65535:
        base = dist_init_port - DP_ATTENTION_PORTS - 1
    return list(range(base, base + DP_ATTENTION_PORTS))


@dataclass(frozen=True)
class Listener:
    host: str
    address: str
    port: int
    service: str
    purpose: str
    setting: str | None = None    # the knob that moves this port, if one does
    proto: str = "tcp"
    last: int | None = None       # a range port..last, one port of which the process takes at each start

    def numbers(self) -> range:
        return range(self.port, (self.last or self.port) + 1)

    def entry(self) -> dict[str, Any]:
        found = {"host": self.host, "port": self.port, "proto": self.proto, "service": self.service,
                 "purpose": self.purpose}
        if self.last is not None:
            found["port_last"] = self.last
        return found


def listeners(plan: dict[str, Any], dist_init_port: int) -> list[Listener]:
    """Every listener of a plan; `dist_init_port` is the multi-node rendezvous port as resolved (the knob,
    else the catalog's)."""
    ports = catalog()["ports"]
    dynamo = plan["router"] is not None and plan["router"]["kind"] == "dynamo"
    found: list[Listener] = []
    for s in plan["servers"]:
        name, nnodes = s["name"], s["layout"]["nnodes"]
        for rank in s["ranks"]:
            host, addr, n = rank["host"], rank["address"], rank["node_rank"]
            if dynamo:
                found.append(Listener(host, addr, s["port"], "dynamo-worker",
                                      f"{name} rank {n}: Dynamo worker status and /health (DYN_SYSTEM_PORT)"))
                if n == 0:
                    first, last = rank["request_plane_ports"]
                    found.append(Listener(host, addr, first, "dynamo-request-plane",
                                          f"{name}: requests from the Dynamo frontend (mutual TLS, DYN_TCP_RPC_PORT: "
                                          f"the next free port of the range at each start)", last=last))
            elif n == 0:
                found.append(Listener(host, addr, s["port"], "sglang",
                                      f"{name} ({s['role']}): OpenAI API, /health and /metrics of rank 0"))
            else:
                found.append(Listener(host, addr, s["port"], "sglang", f"{name} rank {n}: /health"))
            if n == 0 and s["bootstrap_port"]:
                found.append(Listener(host, addr, s["bootstrap_port"], "sglang-bootstrap",
                                      f"{name}: PD bootstrap server the decode servers fetch KV metadata from"))
            if n == 0 and nnodes > 1:
                port = dist_init_port
                found.append(Listener(host, addr, port, "torch-dist-init",
                                      f"{name}: --dist-init-addr rendezvous of its {nnodes} nodes", "dist_init_port"))
                if s["layout"]["dp"] > 1:
                    found += [Listener(host, addr, p, "sglang-dp-zmq",
                                       f"{name}: DP-attention ZMQ port (follows dist_init_port {port})",
                                       "dist_init_port") for p in dp_attention_ports(port)]
    router = plan["router"]
    if router:
        host, addr = router["host"], router["address"]
        if dynamo:
            found.append(Listener(host, addr, router["port"], "dynamo-frontend",
                                  "Dynamo frontend: OpenAI API for clients, /health and /metrics"))
            found.append(Listener(host, addr, ports["dynamo_response"], "dynamo-response-plane",
                                  "Dynamo frontend: response streams from the workers (mutual TLS)"))
            found.append(Listener(host, addr, router["discovery"]["etcd_port"], "etcd",
                                  "Dynamo discovery the workers register in (ETCD_ENDPOINTS)"))
            found.append(Listener(host, addr, router["discovery"]["nats_port"], "nats",
                                  "Dynamo event plane (NATS_SERVER)"))
        else:
            found.append(Listener(host, addr, router["port"], "sglang-router", "SGLang router: OpenAI API for clients"))
            if router.get("metrics_port"):
                found.append(Listener(host, addr, router["metrics_port"], "sglang-router-metrics",
                                      "SGLang router: Prometheus metrics"))
    master = plan["mooncake_master"]
    if master:
        found.append(Listener(master["host"], master["address"], master["port"], "mooncake-master",
                              "Mooncake store master RPC the HiCache L3 clients use (MOONCAKE_MASTER)"))
        found.append(Listener(master["host"], master["address"], master["metrics_port"], "mooncake-master-metrics",
                              "Mooncake store master: Prometheus metrics"))
    monitoring = plan.get("monitoring")
    if monitoring:
        host, addr = monitoring["host"], monitoring["address"]
        found.append(Listener(host, addr, monitoring["prometheus_port"], "prometheus",
                              "Prometheus: scrapes the fleet, evaluates k31's alert rules (mutual TLS)"))
        found.append(Listener(host, addr, monitoring["alertmanager_port"], "alertmanager",
                              "Alertmanager: alerts and silences (mutual TLS)"))
        found += [Listener(n["host"], n["address"], monitoring["node_exporter_port"], "node-exporter",
                           "node exporter: host metrics and k31's unit start times, for Prometheus (mutual TLS)")
                  for n in monitoring["nodes"]]
    return found


def check(found: list[Listener]) -> None:
    """One machine (hosts sharing an address are one) listens at most once on each port."""
    by_machine: dict[str, list[Listener]] = defaultdict(list)
    for item in found:
        by_machine[item.address].append(item)
    for address, items in by_machine.items():
        seen: dict[tuple[str, int], Listener] = {}
        for item in items:
            clash = [(n, seen.setdefault((item.proto, n), item)) for n in item.numbers()]
            number, first = next(((n, other) for n, other in clash if other is not item), (item.port, item))
            if first is item:
                continue
            hosts = sorted({first.host, item.host})
            where = f"host {hosts[0]}" if len(hosts) == 1 else f"hosts {' and '.join(hosts)} (both at {address})"
            setting = item.setting or first.setting
            if setting:
                taken = sorted({i.port for i in items if i.setting != setting})
                fix = (f"set {setting} to a port that no other service on {where} uses "
                       f"(taken: {', '.join(map(str, taken))})")
            else:
                fix = "give these hosts their own addresses or put the services on different hosts"
            raise K31Error(f"port {number}/{item.proto} on {where} is planned twice, for {first.purpose} and "
                           f"for {item.purpose}; {fix}")


def table(found: list[Listener]) -> list[dict[str, Any]]:
    """The plan's `ports`: by host in plan order, then port."""
    order = {h: i for i, h in enumerate(dict.fromkeys(i.host for i in found))}
    return [i.entry() for i in sorted(found, key=lambda i: (order[i.host], i.port, i.service))]
