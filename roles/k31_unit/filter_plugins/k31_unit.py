"""Role filters: the unit lifecycle's decisions (k31deploy.units), for k31_unit's tasks."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError
from ansible.module_utils.parsing.convert_bool import boolean

try:
    from k31deploy import units
except ImportError as exc:  # pragma: no cover - only without the package installed
    raise AnsibleFilterError(f"k31 filters need the k31deploy package (pip install -e .): {exc}") from exc


def _units(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # set_fact hands booleans over as their text where it templated them ("False")
    return [{**u, "first": boolean(u.get("first", False), strict=False),
             "restart": boolean(u.get("restart", False), strict=False)} for u in items]


def k31_unit_starts(items: list[dict[str, Any]], files: list[dict[str, Any]], group: str) -> list[dict[str, Any]]:
    """The units one start run hands k31_files (all, the first group, or the others)."""
    try:
        return units.starts(_units(items), list(files), str(group))
    except ValueError as exc:
        raise AnsibleFilterError(str(exc)) from None


def k31_unit_in_place(read: list[str], rendered: list[dict[str, Any]], items: list[dict[str, Any]]) -> bool:
    """Whether the host's read shows every file and unit as the runs would leave them."""
    return units.in_place(list(read), list(rendered), _units(items))


class FilterModule:
    def filters(self):
        return {"k31_unit_starts": k31_unit_starts, "k31_unit_in_place": k31_unit_in_place}
