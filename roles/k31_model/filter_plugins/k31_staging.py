"""Ansible filters over k31deploy.staging: what k31_model stages on a host, what an rsync dry run found different, and
the tree fan-out schedule and peer-copy arguments it follows (k31_model_fanout=tree).
Docs: `ansible-doc -t filter k31_model_rounds`."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

try:
    from k31deploy import staging
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


def k31_model_stage_items(wanted: list[dict[str, Any]], source: str) -> dict[str, Any]:
    """{items, why_not}: what this host stages (each item with its manifest `sums` and verified `stamp`)."""
    return staging.stage_items([dict(w) for w in wanted], str(source or ""))


def k31_model_differing(results: list[dict[str, Any]]) -> list[str]:
    """The item names an itemized rsync dry run found different."""
    return staging.differing([dict(r) for r in results])


def k31_model_peer_args(me: dict[str, Any], items: list[dict[str, Any]], pending: list[str], seed: str) -> list[str]:
    """k31-stage-from-peer.sh's SRC/ DEST/ MANIFEST STAMP arguments for this host's round."""
    return staging.peer_args(dict(me), [dict(i) for i in items], list(pending), str(seed))


class FilterModule:
    def filters(self):
        return {f.__name__: f for f in (k31_model_rounds, k31_model_stage_items, k31_model_differing,
                                        k31_model_peer_args)}
