#!/usr/bin/env python3
"""Ansible script inventory for molecule: the k31 sandbox's own inventory, once `sandbox up` wrote it.

Molecule wants its inventory link to exist before `create` runs; the sandbox writes its inventory
only then. This script always exists and prints the sandbox inventory (empty before `create`).
"""

import json
import os
import sys
from pathlib import Path

import yaml


def load() -> dict:
    root = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", Path(__file__).resolve().parents[2]))
    path = root / ".k31" / "sandbox" / os.environ.get("K31_MOLECULE_SANDBOX", "") / "inventory.yml"
    out: dict = {"_meta": {"hostvars": {}}, "all": {"hosts": [], "vars": {}, "children": []}}
    if not path.is_file():
        return out
    inventory = yaml.safe_load(path.read_text())["all"]
    out["all"]["vars"] = inventory.get("vars") or {}
    for group, spec in (inventory.get("children") or {}).items():
        hosts = (spec or {}).get("hosts") or {}
        out[group] = {"hosts": list(hosts)}
        out["all"]["children"].append(group)
        for name, hostvars in hosts.items():
            out["_meta"]["hostvars"].setdefault(name, {}).update(hostvars or {})
    return out


if __name__ == "__main__":
    print(json.dumps(load() if "--list" in sys.argv else {}))
