"""A golden plan per cell of the seed: any change to an emitted flag, env var or port shows up here.

Regenerate after an intended change with `K31_UPDATE_GOLDEN=1 pytest tests/unit/test_golden_plans.py`
and review the diff of tests/unit/golden/ like code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from recipe_helpers import cell_knobs

from k31deploy.recipe import iter_cells, resolve

GOLDEN = Path(__file__).resolve().parent / "golden"
CELLS = list(iter_cells())


@pytest.mark.parametrize("platform,role,strategy,cell", CELLS, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CELLS])
def test_cell_matches_its_golden_plan(platform, role, strategy, cell):
    plan = resolve(cell_knobs(platform, role, strategy, cell))
    (server,) = [s for s in plan["servers"] if s["role"] == role]
    assert server["verification"] == cell["verification"]
    path = GOLDEN / f"{platform}-{role}-{strategy}.json"
    text = json.dumps(plan, indent=1, sort_keys=True) + "\n"
    if os.environ.get("K31_UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"no golden plan for {path.name}: run with K31_UPDATE_GOLDEN=1 and review it"
    assert json.loads(path.read_text(encoding="utf-8")) == json.loads(text)


def test_no_stale_goldens():
    expected = {f"{p}-{r}-{s}.json" for p, r, s, _ in CELLS}
    assert {p.name for p in GOLDEN.glob("*.json")} == expected
