"""The recipe: catalog data + resolver. `resolve()` is the one entry point the CLI and Ansible use.

`catalog` here is the function (k31deploy.catalog.catalog), not the submodule recipe/catalog.py: importing
through that submodule first loads it, so the name below is bound last and stays the function.
"""

from k31deploy.recipe.catalog import catalog, flag_registry, iter_cells, knob_specs, offered
from k31deploy.recipe.hosts import Host, from_mapping
from k31deploy.recipe.knobs import parse_sets
from k31deploy.recipe.resolver import layout_text, resolve

__all__ = [
    "Host", "catalog", "flag_registry", "from_mapping", "iter_cells", "knob_specs", "layout_text", "offered",
    "parse_sets", "resolve",
]
