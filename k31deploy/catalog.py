"""Loading the recipe data: the catalog, the knob table and the flag registry (k31deploy/data), and the
few facts several modules read from them (one place each): cell layouts, the MI35x mem_fraction_static
ceiling, the flags.yaml check. Layer: base (docs/architecture.md); it imports errors only, and lives outside
recipe/ so that importing it does not run the resolver (recipe/__init__.py imports it)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import yaml

from k31deploy.errors import K31Error

DATA_DIR = Path(__file__).resolve().parent / "data"

ROLES = ("unified", "prefill", "decode")
STRATEGY_KNOB = {role: f"{role}_strategy" for role in ROLES}
LAYOUT_KEYS = ("tp", "dcp", "pp", "pcp", "ep", "dp", "nnodes")


# libyaml's parser where PyYAML was built with it: about ten times the pure-Python one's speed, and these files
# are read by every process that resolves or renders (k31, and ansible-playbook's filters).
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(path: Path) -> Any:
    """A data or role file's YAML (safe: plain data only)."""
    with path.open(encoding="utf-8") as fh:
        return yaml.load(fh, Loader=_LOADER)


def _load(name: str) -> dict[str, Any]:
    return load_yaml(DATA_DIR / name)


@cache
def catalog() -> dict[str, Any]:
    """The recipe catalog (data/catalog.yaml)."""
    return _load("catalog.yaml")


@cache
def knob_specs() -> dict[str, dict[str, Any]]:
    """Knob name -> spec (data/knobs.yaml); `choices_from` is expanded against the catalog."""
    specs = _load("knobs.yaml")
    for spec in specs.values():
        if "choices_from" in spec:
            spec["choices"] = list(catalog()[spec.pop("choices_from")])
    return specs


@cache
def flag_registry() -> dict[str, dict[str, Any]]:
    """Section -> flag -> spec (data/flags.yaml)."""
    return _load("flags.yaml")


def platform_cells(platform: str) -> dict[str, dict[str, dict[str, Any]]]:
    return catalog()["cells"][platform]


def offered(platform: str, role: str) -> list[str]:
    """Strategy names a platform offers for a role (cells chosen by a knob are not strategies)."""
    cells = platform_cells(platform).get(role, {})
    return [name for name, cell in cells.items() if "knob" not in cell]


def iter_cells():
    """Yield (platform, role, strategy, cell) for every cell of the catalog."""
    for platform, roles in catalog()["cells"].items():
        for role, cells in roles.items():
            for strategy, cell in cells.items():
                yield platform, role, strategy, cell


def cell_knobs(platform: str, role: str, strategy: str, cell: dict[str, Any]) -> dict[str, Any]:
    """The knobs that select one catalog cell as its canonical plan: a PD cell with the other role's
    default, and an explicit --max-running-requests (DFLASH and MegaMoE need one; 64 is the seed's
    MI355X figure at 56 agents)."""
    knobs: dict[str, Any] = {"platform": platform}
    if platform != "tpu7x":
        knobs["max_running_requests"] = 64
    if role == "unified":
        knobs["unified_strategy"] = strategy
    else:
        knobs["topology"] = "pd"
        knobs.update({cell["knob"]: True} if cell.get("knob") else {STRATEGY_KNOB[role]: strategy})
    return knobs


def emit_check(section: str, argv: list[str]) -> None:
    """Every flag k31 emits must be in data/flags.yaml (and so traced to the seed or upstream)."""
    known = flag_registry()[section]
    for token in argv:
        if token.startswith("--") and token.split("=", 1)[0] not in known:
            raise AssertionError(f"flag {token} is not registered in data/flags.yaml [{section}]")


def mem_fraction_static_max(platform: str, topology: str) -> float | None:
    """The highest --mem-fraction-static the recipe allows, or None where it sets none: the MI350X / MI355X
    single-node recipe (0.87 and 0.88 overflowed GTT at startup, seed AMD Memory). k31 emits it as the
    default there, refuses a higher knob, and the memory planner notes a higher value."""
    cat = catalog()
    if cat["platforms"][platform]["family"] == "rocm" and topology == "unified":
        return cat["amd"]["mem_fraction_static_max_single_node"]
    return None


def cell_layout(platform: str, cell: dict[str, Any], moe_runner: str | None) -> dict[str, int]:
    """A cell's layout on a platform: its shape's sizes (1 where not given), EP = TP under MegaMoE (seed:
    MegaMoE sets EP to the TP size), and nnodes = TP x PP GPUs over the platform's GPUs per node."""
    cat = catalog()
    layout = {k: 1 for k in LAYOUT_KEYS}
    layout.update(cat["shapes"][cell["shape"]])
    if moe_runner == "megamoe":
        layout["ep"] = layout["tp"]
    world = layout["tp"] * layout["pp"]
    per_node = cat["platforms"][platform]["gpus_per_node"]
    if world > per_node and world % per_node:
        raise K31Error(f"shape {cell['shape']} needs {world} GPUs, not a multiple of {per_node} per node")
    layout["nnodes"] = max(1, world // per_node)
    return layout
