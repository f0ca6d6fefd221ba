"""Multi-node NVLink (GB200 / GB300 NVL72): the IMEX domain of a plan, its nodes config, and the
`nvidia-imex-ctl -N` status (field notes §6; NVIDIA IMEX guide)."""

from __future__ import annotations

import re
from typing import Any

from k31deploy.plan import Plan


def domain_hosts(doc: Plan | dict[str, Any]) -> list[str]:
    """The engine hosts of an NVL72 plan, in plan order: one IMEX domain (the inventory's trays are assumed
    to share one NVLink domain; empty for other platforms)."""
    plan = Plan.of(doc)
    return plan.engine_hosts if plan.hardware.nvl72 else []


def nodes_config(addresses: list[str]) -> str:
    """/etc/nvidia-imex/nodes_config.cfg: one IP per line, the same order on every tray (IMEX compares the
    node maps of all instances and refuses a mismatch)."""
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"IMEX node addresses repeat: {addresses}")
    return "".join(f"{a}\n" for a in addresses)


def set_config_keys(text: str, values: dict[str, Any]) -> str:
    """config.cfg with each KEY=value of `values` set: an existing `KEY=` line is replaced in place (the
    packaged file's comments and other keys stay), a missing key is appended."""
    lines = text.splitlines()
    for key, value in values.items():
        line = f"{key}={value}"
        at = [i for i, old in enumerate(lines) if old.startswith(f"{key}=")]
        if at:
            lines[at[0]] = line
            lines = [old for i, old in enumerate(lines) if i not in at[1:]]
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


_NODE = re.compile(r"^Node #(?P<index>\d+)\s+-\s+(?P<ip>\S+)\s+-\s+(?P<status>\S+)(?:\s+-\s+Version:\s*(?P<ver>\S+))?")


def parse_imex_ctl(text: str) -> dict[str, Any]:
    """`nvidia-imex-ctl -N`: the nodes with their status, the From\\To connectivity matrix and the domain state."""
    nodes, matrix, state = [], [], None
    in_matrix = False
    for raw in text.splitlines():
        line = raw.strip()
        m = _NODE.match(line)
        if m:
            nodes.append({"index": int(m["index"]), "ip": m["ip"], "status": m["status"], "version": m["ver"]})
        elif line.startswith("Nodes From"):
            in_matrix = True
        elif line.startswith("Domain State:"):
            state = line.split(":", 1)[1].strip()
            in_matrix = False
        elif in_matrix and line:
            cells = line.split()
            if cells[0].isdigit():
                matrix.append({"from": int(cells[0]), "to": cells[1:]})
    return {"nodes": nodes, "matrix": matrix, "domain_state": state}


def imex_ready(status: dict[str, Any], addresses: list[str]) -> tuple[bool, str]:
    """Every expected node listed, READY, connected (C) to every other, and the domain UP."""
    listed = {n["ip"]: n for n in status["nodes"]}
    problems = [f"{a} not listed" for a in addresses if a not in listed]
    problems += [f"{n['ip']} {n['status']}" for n in status["nodes"] if n["status"] != "READY"]
    for row in status["matrix"]:
        bad = [str(i) for i, cell in enumerate(row["to"]) if cell != "C"]
        if bad:
            problems.append(f"node {row['from']} not connected to {', '.join(bad)}")
    if status["domain_state"] != "UP":
        problems.append(f"domain state {status['domain_state'] or 'unknown'}")
    return (not problems, "; ".join(problems) or f"{len(addresses)} nodes connected, domain UP")
