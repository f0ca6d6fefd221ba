"""Ansible filter over k31deploy.staging: the tree fan-out schedule k31_model follows (k31_model_fanout=tree).
Docs: `ansible-doc -t filter k31_model_rounds`."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

try:
    from k31deploy.errors import K31Error
    from k31deploy.staging import rounds
except ImportError as exc:  # pragma: no cover - only without the package installed
    raise AnsibleFilterError(f"k31 filters need the k31deploy package (pip install -e .): {exc}") from exc


def k31_model_rounds(hosts: list[str], seed: str, have: list[str] | None = None) -> dict[str, Any]:
    """{rounds, hosts: {host: {round, source, after}}}: who copies from whom, and after which hosts."""
    try:
        return rounds(list(hosts), seed, list(have or []))
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


class FilterModule:
    def filters(self):
        return {"k31_model_rounds": k31_model_rounds}
