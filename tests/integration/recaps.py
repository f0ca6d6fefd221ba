"""Parse ansible-playbook's PLAY RECAP lines, for the tests that run playbooks or molecule."""

from __future__ import annotations

import re

KEYS = ("ok", "changed", "unreachable", "failed", "skipped", "rescued", "ignored")
# ansible-playbook's recap line, or the k31 live view's (the same counts in another order).
RECAP = re.compile(r"^(\S+)\s+: ((?:\s*\w+=\d+)+)\s*$", re.M)


def recap(output: str) -> dict[str, dict[str, int]]:
    """Every host's counts, from the recap lines of `output` (the last recap wins for a host)."""
    out = {}
    for host, counts in RECAP.findall(output):
        values = dict(pair.split("=") for pair in counts.split())
        if set(KEYS) <= set(values):
            out[host] = {k: int(values[k]) for k in KEYS}
    return out


def changed(output: str) -> dict[str, int]:
    """Every host's changed= count."""
    return {host: counts["changed"] for host, counts in recap(output).items()}
