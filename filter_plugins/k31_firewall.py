"""Ansible filter over k31deploy.firewall: a host's firewall rules from the plan's ports. Docs:
`ansible-doc -t filter k31_firewall`."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

try:
    from k31deploy import firewall
    from k31deploy.errors import K31Error
except ImportError as exc:  # pragma: no cover - only without the package installed
    raise AnsibleFilterError(f"k31 filters need the k31deploy package (pip install -e .): {exc}") from exc


def k31_firewall(plan: dict[str, Any], host: str, settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """{rules, shown, nft, firewalld, ufw} for `host` (settings: the role's k31_firewall_* values)."""
    s = dict(settings or {})
    try:
        return firewall.ruleset(plan, host, firewall.Settings(
            cluster_sources=list(s.get("cluster_sources") or []),
            public_sources=list(s.get("public_sources") or firewall.ANY),
            ssh_port=int(s.get("ssh_port") or 22),
            ssh_sources=list(s.get("ssh_sources") or firewall.ANY),
            extra=list(s.get("extra") or [])))
    except (K31Error, ValueError) as exc:
        raise AnsibleFilterError(f"error: {host}: {exc}") from None


def k31_firewall_changes(desired: list[str], current: list[str], ours: list[str]) -> list[dict[str, str]]:
    """[{op: add|remove, rule}]: desired rules not in place, then k31's earlier rules the plan dropped."""
    return firewall.changes(list(desired), list(current), list(ours))


class FilterModule:
    def filters(self):
        return {"k31_firewall": k31_firewall, "k31_firewall_changes": k31_firewall_changes}
