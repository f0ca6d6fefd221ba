"""A site's cluster CA and router API key for test inventories, as `k31 pki init` and the vault give them
(plain here: a throwaway test site). The validate play refuses a plan whose engines serve HTTP without both."""

from __future__ import annotations

from pathlib import Path

import yaml

from k31deploy import pki

ROUTER_KEY = "rk-test-3c5e7a9b1d"


def write_site_vars(inventory_dir: Path, router_key: bool = True) -> Path:
    """group_vars/all/k31_site.yml beside the inventory (Ansible reads it for every host), with a new CA."""
    ca = pki.new_ca("k31 test CA")
    data = {"k31_pki_ca_cert": ca.cert, "k31_pki_ca_key": ca.key}
    if router_key:
        data["k31_router_api_key"] = ROUTER_KEY
    path = inventory_dir / "group_vars" / "all" / "k31_site.yml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("---\n" + yaml.safe_dump(data))
    return path
