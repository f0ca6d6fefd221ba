"""RDMA ports and GIDs: parsers for `rdma link` (iproute2, text or `-j`), `ibv_devinfo` (rdma-core),
the GID tables in sysfs and `mlnx_qos -i IF`, and the choice of the devices NCCL and Mooncake use.

Field notes §6: list only active ports whose RoCE v2 GID carries the fabric address; listing every
HCA caused QP timeouts in one public project."""

from __future__ import annotations

import ipaddress
import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from k31deploy.hostcheck import system


@dataclass(frozen=True)
class Port:
    device: str
    port: int
    state: str  # ACTIVE, DOWN, INIT, ARMED ... (the IB port states, as `rdma link` prints them)
    physical_state: str | None = None
    netdev: str | None = None
    link_layer: str | None = None  # Ethernet (RoCE) or InfiniBand

    @property
    def name(self) -> str:
        return f"{self.device}/{self.port}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Gid:
    device: str
    port: int
    index: int
    gid: str
    type: str | None  # "RoCE v2", "IB/RoCE v1"
    netdev: str | None

    @property
    def ipv4(self) -> str | None:
        """The IPv4 address of an IPv4-mapped GID (::ffff:a.b.c.d), else None."""
        try:
            mapped = ipaddress.IPv6Address(self.gid).ipv4_mapped
        except ValueError:
            return None
        return str(mapped) if mapped else None


_LINK_HEAD = re.compile(r"^(?:link\s+|\d+/\d+:\s+)(?P<dev>[^/\s]+)/(?P<port>\d+):?\s*(?P<rest>.*)$")


def parse_rdma_link(text: str) -> list[Port]:
    """`rdma link show` (text: "link mlx5_0/1 state ACTIVE physical_state LINK_UP netdev ens1f0np0"; older
    iproute2 prints "1/1: mlx5_0/1: state ...") or `rdma -j link show` (a JSON list)."""
    text = text.strip()
    if text.startswith("["):
        return [Port(str(e["ifname"]), int(e["port"]), str(e.get("state", "")), e.get("physical_state"),
                     e.get("netdev")) for e in json.loads(text)]
    ports = []
    for line in text.splitlines():
        m = _LINK_HEAD.match(line.strip())
        if not m:
            continue
        words = m["rest"].split()
        attrs = dict(zip(words[::2], words[1::2], strict=False))
        ports.append(Port(m["dev"], int(m["port"]), attrs.get("state", ""), attrs.get("physical_state"),
                          attrs.get("netdev")))
    return ports


def parse_ibv_devinfo(text: str) -> list[Port]:
    """`ibv_devinfo`: hca_id blocks with port sections; "PORT_ACTIVE (4)" reads ACTIVE."""
    ports: list[Port] = []
    device: str | None = None
    current: dict[str, Any] | None = None

    def flush() -> None:
        if current is not None and device is not None:
            ports.append(Port(device, current["port"], current.get("state", ""), current.get("phys_state"),
                              None, current.get("link_layer")))

    for line in text.splitlines():
        key, sep, value = line.strip().partition(":")
        if not sep:
            continue
        value = value.strip()
        if key == "hca_id":
            flush()
            device, current = value, None
        elif key == "port" and value.isdigit():
            flush()
            current = {"port": int(value)}
        elif current is not None and key in ("state", "phys_state", "link_layer"):
            word = value.split()[0] if value else ""
            current[key] = word.removeprefix("PORT_") if key == "state" else word
    flush()
    return ports


_SYSFS = re.compile(r"^/sys/class/infiniband/(?P<dev>[^/]+)/ports/(?P<port>\d+)/"
                    r"(?P<kind>gids|gid_attrs/types|gid_attrs/ndevs|state|link_layer)(?:/(?P<idx>\d+))?:(?P<value>.*)$")


def parse_sysfs(text: str) -> dict[str, Any]:
    """`grep -H .` over /sys/class/infiniband/*/ports/*/{state,link_layer,gids/*,gid_attrs/{types,ndevs}/*}:
    each port's state and link layer, and every non-zero GID with its type and network device."""
    ports: dict[tuple[str, int], dict[str, str]] = {}
    raw: dict[tuple[str, int, int], dict[str, str]] = {}
    for line in text.splitlines():
        m = _SYSFS.match(line.strip())
        if not m:
            continue
        key = (m["dev"], int(m["port"]))
        value = m["value"].strip()
        if m["kind"] == "state":
            ports.setdefault(key, {})["state"] = value.split(":", 1)[-1].strip()  # "4: ACTIVE"
        elif m["kind"] == "link_layer":
            ports.setdefault(key, {})["link_layer"] = value
        elif m["idx"] is not None:
            raw.setdefault((*key, int(m["idx"])), {})[m["kind"].rsplit("/", 1)[-1]] = value
    gids = [Gid(dev, port, idx, v["gids"], v.get("types"), v.get("ndevs"))
            for (dev, port, idx), v in sorted(raw.items())
            if "gids" in v and v["gids"].strip("0:") != ""]
    port_list = [Port(dev, port, v.get("state", ""), None, None, v.get("link_layer"))
                 for (dev, port), v in sorted(ports.items())]
    return {"ports": port_list, "gids": gids}


def merge_ports(*sources: list[Port]) -> list[Port]:
    """One Port per device/port: the first source that knows a field wins, later ones fill the gaps."""
    merged: dict[tuple[str, int], dict[str, Any]] = {}
    for source in sources:
        for p in source:
            entry = merged.setdefault((p.device, p.port), p.to_dict())
            for key, value in p.to_dict().items():
                if not entry.get(key) and value:
                    entry[key] = value
    return [Port(**v) for _, v in sorted(merged.items())]


def select(ports: list[Port], gids: list[Gid], host_ip: str | None,
           cidrs: list[str] | None = None) -> dict[str, Any]:
    """The RDMA ports NCCL and Mooncake should use: active InfiniBand ports, and active Ethernet (RoCE) ports
    with a RoCE v2 GID whose IPv4 address is the host's fabric address (or lies in one of `cidrs`, for hosts
    with one address per rail). Returns the chosen ports, the GID index they share, and why others were left."""
    networks = [ipaddress.ip_network(c, strict=False) for c in cidrs or []]

    def on_fabric(ip: str) -> bool:
        return any(ipaddress.ip_address(ip) in n for n in networks) if networks else ip == host_ip

    chosen: list[dict[str, Any]] = []
    left: list[str] = []
    for p in ports:
        if p.state != "ACTIVE":
            left.append(f"{p.name}: state {p.state or 'unknown'}")
            continue
        if p.link_layer == "InfiniBand":
            chosen.append({"device": p.device, "port": p.port, "gid_index": None, "ip": None, "netdev": p.netdev})
            continue
        match = [g for g in gids if (g.device, g.port) == (p.device, p.port) and g.type == "RoCE v2"
                 and g.ipv4 and on_fabric(g.ipv4)]
        if match:
            g = match[0]
            chosen.append({"device": p.device, "port": p.port, "gid_index": g.index, "ip": g.ipv4,
                           "netdev": p.netdev or g.netdev})
        else:
            where = f"in {', '.join(cidrs)}" if cidrs else f"for {host_ip}"
            left.append(f"{p.name}: no RoCE v2 GID {where}")
    indexes = sorted({c["gid_index"] for c in chosen if c["gid_index"] is not None})
    return {"ports": chosen, "devices": sorted({c["device"] for c in chosen}),
            "gid_index": indexes[0] if len(indexes) == 1 else None, "gid_indexes": indexes, "left_out": left}


def rdma_env(selection: dict[str, Any], host_ip: str | None) -> dict[str, str]:
    """What the engines read: NCCL's HCA list (exact names, `=` prefix), the GID index for NCCL and Mooncake
    (MC_GID_INDEX, field notes §3), Mooncake's device list and the address it advertises (SGLANG_HOST_IP)."""
    env: dict[str, str] = {}
    if host_ip:
        env["SGLANG_HOST_IP"] = host_ip
    if selection["ports"]:
        env["NCCL_IB_HCA"] = "=" + ",".join(f"{p['device']}:{p['port']}" for p in selection["ports"])
        env["MOONCAKE_DEVICE"] = ",".join(selection["devices"])
    if selection["gid_index"] is not None:
        env["NCCL_IB_GID_INDEX"] = str(selection["gid_index"])
        env["MC_GID_INDEX"] = str(selection["gid_index"])
    return env


def choose(probes: dict[str, system.Section], host_ip: str | None, cidrs: list[str] | None = None,
           gid_index: int | None = None, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """What k31_rdma does on a host, from the probe pre-flight runs (its rdma-sysfs, rdma-link and capeff sections):
    the chosen ports (select) with every port seen (`all_ports`), whether an active port was left without a fabric
    GID (`unmatched`, which the role refuses with k31_rdma_require_match), the engines' env (rdma_env, then the
    site's GID index for NCCL and Mooncake and its extra variables), one line saying what was chosen
    (`summary`), and whether this session may raise resource limits (`can_raise_limits`: CAP_SYS_RESOURCE, which
    a container lacks), so memlock is set only where it can be."""
    def text(name: str, ok_only: bool = False) -> str:
        sec = probes.get(name)
        return sec.text if sec is not None and (sec.ok or not ok_only) else ""

    parsed = parse_sysfs(text("rdma-sysfs"))
    ports = merge_ports(parse_rdma_link(text("rdma-link", ok_only=True)), parsed["ports"])
    selection = select(ports, parsed["gids"], host_ip, list(cidrs or []))
    env = rdma_env(selection, host_ip)
    if gid_index is not None:
        env.update(NCCL_IB_GID_INDEX=str(gid_index), MC_GID_INDEX=str(gid_index))
    env.update({str(k): str(v) for k, v in (extra_env or {}).items()})
    names = ", ".join(c["device"] for c in selection["ports"]) or "none"
    left = f"; left out: {'; '.join(selection['left_out'])}" if selection["left_out"] else ""
    summary = (f"RDMA ports: {names}{left}" if ports else
               "skipped: no RDMA devices on this host (/sys/class/infiniband is empty): rdma-core, port choice and "
               "QoS left out; rdma.env carries SGLANG_HOST_IP only")
    try:
        can_raise = system.has_capability(system.parse_capeff(text("capeff")), system.CAP_SYS_RESOURCE)
    except ValueError:    # no CapEff line: the probe did not read it
        can_raise = False
    return {**selection, "all_ports": [p.to_dict() for p in ports], "env": env, "summary": summary,
            "unmatched": not selection["ports"] and any(p.state == "ACTIVE" for p in ports),
            "can_raise_limits": can_raise}


def parse_mlnx_qos(text: str) -> dict[str, Any]:
    """`mlnx_qos -i IF`: the trust state ("Priority trust state: dscp") and the PFC enabled bit per priority."""
    out: dict[str, Any] = {"trust": None, "pfc": None}
    lines = [line.strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if line.lower().startswith("priority trust state:"):
            out["trust"] = line.split(":", 1)[1].strip()
        elif line.startswith("PFC configuration"):
            for follow in lines[i + 1:i + 4]:
                words = follow.split()
                if words and words[0] == "enabled":
                    out["pfc"] = [int(w) for w in words[1:9]]
                    break
    return out


def pfc_vector(priorities: list[int]) -> list[int]:
    """[3] -> [0, 0, 0, 1, 0, 0, 0, 0], as mlnx_qos --pfc takes it."""
    return [1 if p in priorities else 0 for p in range(8)]
