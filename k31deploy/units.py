"""The k31_unit role's decisions (roles/k31_unit: the systemd units of every role that runs a process), which its
tasks hand to library/k31_files.py: which units a start run starts and on what it restarts them, and whether one
read of a host shows every file and unit already as the runs would leave them. Driver layer: the role's filter
(roles/k31_unit/filter_plugins/k31_unit.py) is its only caller.
"""

from __future__ import annotations

import hashlib
from typing import Any

GROUPS = ("all", "first", "others")


def starts(units: list[dict[str, Any]], files: list[dict[str, Any]], group: str) -> list[dict[str, Any]]:
    """k31_files' `units` for one start run: every unit (`all`), those marked first (an engine's decodes), or the
    others; each restarted where one of its files (`restart_on`: their paths) or its unit file changed, or it asks
    (`restart`)."""
    if group not in GROUPS:
        raise ValueError(f"start group {group!r}; valid choices: {', '.join(GROUPS)}")
    return [{"name": u["name"], "state": "restarted" if u["restart"] else "started", "unit_file": u["path"],
             "restart_on": [f["dest"] for f in files if f.get("unit") == u["name"]]}
            for u in units if group == "all" or bool(u["first"]) == (group == "first")]


def _mode(mode: Any) -> str:
    """A file mode as stat -c %a prints it ("0644" or 420 -> "644")."""
    return format(mode if isinstance(mode, int) else int(str(mode), 8), "o")


def in_place(read: list[str], rendered: list[dict[str, Any]], units: list[dict[str, Any]]) -> bool:
    """Whether the read's lines (per file `MODE:OWNER:GROUP SHA256` or `missing`, then each unit's is-enabled, then
    its is-active) show every rendered file root's with its mode and content, and every unit enabled and active;
    never where a unit asks to restart."""
    want = [f"{_mode(f['mode'])}:root:root {hashlib.sha256(f['content'].encode()).hexdigest()}" for f in rendered]
    return (list(read) == want + ["enabled"] * len(units) + ["active"] * len(units)
            and not any(u["restart"] for u in units))
