"""Small helpers shared by the recipe tests: resolve a plan and read flags out of its argv."""

from __future__ import annotations

from typing import Any

import pytest

from k31deploy.catalog import cell_knobs  # noqa: F401 - the tests' name for a cell's knobs
from k31deploy.errors import K31Error
from k31deploy.recipe import resolve


def plan(**knobs: Any) -> dict[str, Any]:
    return resolve(knobs)


def server(p: dict[str, Any], role: str) -> dict[str, Any]:
    (found,) = [s for s in p["servers"] if s["role"] == role]
    return found


def argv(p: dict[str, Any], role: str, rank: int = 0) -> list[str]:
    return server(p, role)["ranks"][rank]["argv"]


def env(p: dict[str, Any], role: str, rank: int = 0) -> dict[str, str]:
    return server(p, role)["ranks"][rank]["env"]


def flag(args: list[str], name: str) -> str | bool | None:
    """Value of `name` in argv: the next token, True for a bare switch, None when absent."""
    if name not in args:
        return None
    i = args.index(name)
    nxt = args[i + 1] if i + 1 < len(args) else None
    return True if nxt is None or nxt.startswith("--") else nxt


def refused(match: str, **knobs: Any) -> str:
    with pytest.raises(K31Error, match=match) as info:
        resolve(knobs)
    message = str(info.value)
    assert "\n" not in message
    return message
