"""Role filter: the run's prerequisites (wheel sets, the serving image's source, vault secrets, the monitoring
host's settings), one sentence per problem; the checks are k31deploy.prereqs."""

from __future__ import annotations

from ansible.errors import AnsibleFilterError

try:
    from k31deploy.errors import K31Error
    from k31deploy.prereqs import CHECKS, prerequisites
except ImportError as exc:  # pragma: no cover - only without the package installed
    raise AnsibleFilterError(f"k31 filters need the k31deploy package (pip install -e .): {exc}") from exc


def k31_validate_prerequisites(plan, groups, hostvars, playbook_dir, checks=CHECKS, run_tags=("all",),
                               skip_tags=()):
    try:
        return prerequisites(plan, groups, hostvars, playbook_dir, checks, run_tags, skip_tags)
    except K31Error as exc:
        raise AnsibleFilterError(str(exc)) from None


class FilterModule:
    def filters(self):
        return {"k31_validate_prerequisites": k31_validate_prerequisites}
