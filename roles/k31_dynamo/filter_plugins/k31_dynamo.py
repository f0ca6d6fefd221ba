"""Role filters over k31deploy.discovery: etcd's command line and NATS's configuration for Dynamo's discovery
and event plane. Docs: `ansible-doc -t filter k31_etcd_exec_start`, `ansible-doc -t filter k31_nats_conf`."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

try:
    from k31deploy import discovery
    from k31deploy.errors import K31Error
except ImportError as exc:  # pragma: no cover - only without the package installed
    raise AnsibleFilterError(f"k31 filters need the k31deploy package (pip install -e .): {exc}") from exc


def k31_etcd_exec_start(plan: dict[str, Any], state_dir: str) -> str:
    """etcd's ExecStart= value (a group of flags per continued line), its data in `<state_dir>/etcd`."""
    try:
        return discovery.etcd_exec_start(plan, state_dir)
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_nats_conf(plan: dict[str, Any], token: str) -> str:
    """NATS's configuration: listen address and port, TLS with cluster-CA client certificates, the token."""
    try:
        return discovery.nats_conf(plan, token)
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


class FilterModule:
    def filters(self):
        return {"k31_etcd_exec_start": k31_etcd_exec_start, "k31_nats_conf": k31_nats_conf}
