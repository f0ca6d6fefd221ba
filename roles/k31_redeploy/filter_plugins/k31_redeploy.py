"""Role filters: the redeploy's rollout order and the k31-pd-follow watcher's config, from the plan (rules
in k31deploy.oncall.rollout)."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

try:
    from k31deploy.errors import K31Error
    from k31deploy.oncall.rollout import follow_config, rollout
except ImportError as exc:  # pragma: no cover - only without the package installed
    raise AnsibleFilterError(f"k31 filters need the k31deploy package (pip install -e .): {exc}") from exc


def k31_redeploy_rollout(plan: dict[str, Any], targets: Any = None, batch: Any = 1) -> dict[str, Any]:
    """Steps, host order and serial batches; {'error': sentence} for a target or batch k31 cannot take."""
    try:
        return rollout(plan, list(targets) if isinstance(targets, list | tuple) else targets, batch)
    except K31Error as exc:
        return {"error": str(exc)}


def k31_redeploy_follow_config(plan: dict[str, Any], host: str, settings: dict[str, Any] | None = None) -> dict | None:
    """The watcher's config for `host`; None where it runs no prefill rank of a PD plan."""
    return follow_config(plan, host, **(settings or {}))


class FilterModule:
    def filters(self):
        return {"k31_redeploy_rollout": k31_redeploy_rollout, "k31_redeploy_follow_config": k31_redeploy_follow_config}
