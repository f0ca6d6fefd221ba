"""The recipe data's loader lives in k31deploy.catalog (the lowest layer, outside this package so that
importing it does not run the resolver); this name is kept for importers that still use it."""

from k31deploy.catalog import (
    DATA_DIR,
    ROLES,
    STRATEGY_KNOB,
    catalog,
    cell_knobs,
    emit_check,
    flag_registry,
    iter_cells,
    knob_specs,
    mem_fraction_static_max,
    offered,
    platform_cells,
)

__all__ = ["DATA_DIR", "ROLES", "STRATEGY_KNOB", "catalog", "cell_knobs", "emit_check", "flag_registry",
           "iter_cells", "knob_specs", "mem_fraction_static_max", "offered", "platform_cells"]
