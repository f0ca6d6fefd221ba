"""The converge stamp: a deploy that would change nothing skips the host plays.

At the end of a whole, successful deploy (no --tags, --skip-tags or --limit, not --check), every host records
two digests in /var/lib/k31/converged.json (0600): the run's *inputs* (the plan, every inventory host's k31_*
variables, k31's own code, the wheelhouse's file list) and the host's *state* (the files k31 manages, the states
of its units, the loaded firewall table, the container images, the package database;
roles/k31_stamp/templates/host-state.sh.j2).

The next deploy reads every host's stamp and state in one command per host. When the inputs digest is the same
and every host's state still matches its stamp, the deploy would change nothing by construction: it validates,
runs the smoke checks, and skips the host plays. Any difference (one host drifted, a unit stopped, one variable,
another k31 version, a host without a stamp) and the whole deploy runs, on every host (all or nothing, so the
plays' cross-host rules such as the PD restart stay whole). `k31 deploy --full` (k31_stamp_check=false) always
runs the whole deploy. Weights on disk are not part of the state: a full deploy re-verifies them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

# What k31 itself is made of, relative to the project root: a change to any of it may change what a host gets.
CODE = ("deploy.yml", "ansible.cfg", "pyproject.toml", "roles", "playbooks", "filter_plugins", "k31deploy")
SKIPPED_PARTS = {"__pycache__", ".pytest_cache"}
# Variables the run itself sets, or that only choose whether the stamp is used or which servers a redeploy
# restarts (k31 redeploy TARGET --batch N): not inputs.
NOT_INPUTS = ("k31_validate_", "k31_stamp_", "k31_redeploy_targets", "k31_redeploy_batch")


def _files(root: Path, names: Iterable[str]) -> list[Path]:
    out: list[Path] = []
    for name in names:
        path = root / name
        if path.is_file():
            out.append(path)
        elif path.is_dir():
            out += [p for p in path.rglob("*")
                    if p.is_file() and not SKIPPED_PARTS & set(p.parts) and p.suffix != ".pyc"]
    return sorted(out)


def code_digest(root: Path) -> str:
    """sha256 over k31's own files (paths and contents)."""
    h = hashlib.sha256()
    for path in _files(root, CODE):
        h.update(f"{path.relative_to(root)}\0{path.stat().st_size}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def listing_digest(path: Path) -> str:
    """sha256 over a folder's top-level file names and sizes (the wheelhouse: hundreds of MB, not read). Its
    subfolders are derived caches -- `packs/`, which a deploy writes the first time it copies a wheel set
    (k31deploy.wheelhouse.pack) -- and counting them made the deploy after the one that packed a whole one."""
    h = hashlib.sha256()
    if path.is_dir():
        for p in sorted(q for q in path.iterdir() if q.is_file()):
            h.update(f"{p.name}\0{p.stat().st_size}\n".encode())
    return h.hexdigest()


def inputs_digest(plan: Mapping[str, Any], host_vars: Mapping[str, Mapping[str, Any]], root: Path,
                  wheelhouse: Path) -> str:
    """sha256 of everything a deploy renders from: the plan, each host's k31_* variables (vault values
    decrypted: a rotated secret is a new input), k31's code and the wheelhouse's files."""
    variables = {host: {k: v for k, v in sorted(values.items())
                        if k.startswith("k31_") and not k.startswith(NOT_INPUTS)}
                 for host, values in sorted(host_vars.items())}
    doc = {"plan": plan, "vars": variables, "code": code_digest(root), "wheelhouse": listing_digest(wheelhouse)}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


def settled(reads: Mapping[str, Any], inputs: str) -> dict[str, Any]:
    """Whether every host is as the last whole deploy left it, from each host's read (`{"stamp": {"inputs",
    "state"} or null, "state": digest, null without a stamp}`, or None for a host that gave no answer):
    {"settled": bool, "why": [...]} with one line per host that is not."""
    why: list[str] = []
    for host, read in sorted(reads.items()):
        if not isinstance(read, Mapping):
            why.append(f"{host}: its state could not be read")
        elif not isinstance(read.get("stamp"), Mapping):
            why.append(f"{host}: no record of a whole deploy")
        elif not read.get("state"):
            why.append(f"{host}: its state could not be read")
        elif read["stamp"].get("inputs") != inputs:
            why.append(f"{host}: the inputs changed since its last whole deploy (plan, variables, k31 or wheelhouse)")
        elif read["stamp"].get("state") != read["state"]:
            why.append(f"{host}: its files, units, firewall or images changed since its last whole deploy")
    return {"settled": bool(reads) and not why, "why": why}
