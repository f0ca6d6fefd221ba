"""Parse ansible-playbook's PLAY RECAP lines, for the tests that run playbooks or molecule."""

from __future__ import annotations

import re

KEYS = ("ok", "changed", "unreachable", "failed", "skipped", "rescued", "ignored")
RECAP = re.compile(r"^(\S+)\s+: " + r"\s+".join(rf"{k}=(\d+)" for k in KEYS), re.M)


def recap(output: str) -> dict[str, dict[str, int]]:
    """Every host's counts, from the recap lines of `output` (the last recap wins for a host)."""
    return {m[0]: dict(zip(KEYS, map(int, m[1:]), strict=True)) for m in RECAP.findall(output)}


def changed(output: str) -> dict[str, int]:
    """Every host's changed= count."""
    return {host: counts["changed"] for host, counts in recap(output).items()}
