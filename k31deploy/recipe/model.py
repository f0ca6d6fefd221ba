"""The resolved description of a plan that the resolver hands to the command-line builders (argv.py):
frozen, typed, and free of rules. The resolver decides every value here; argv.py only spells them as
flags and env vars, and the engine settings below also go into the plan (`servers[].settings`), where
the memory planner and the monitoring rules read them instead of parsing argv back.

Layer: recipe model (docs/architecture.md); imports the catalog, recipe.hosts (Host) and plan (EngineSettings,
the plan's record of a server's settings) only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from k31deploy.catalog import catalog
from k31deploy.plan import EngineSettings
from k31deploy.recipe.hosts import Host


def flat_tp(layout: Mapping[str, Any]) -> bool:
    """Plain tensor parallelism: no decode or prefill context parallelism, pipeline or attention DP."""
    return all(layout[k] == 1 for k in ("dcp", "pp", "pcp", "dp"))


def hicache(kv_offload: str) -> bool:
    """HiCache runs: on its own, or as the L1/L2 in front of a Mooncake store."""
    return kv_offload in ("hicache", "mooncake")


@dataclass(frozen=True)
class Setup:
    """What every server of one plan shares, as resolved."""

    platform: str
    topology: str                      # unified | pd
    router: str                        # sglang | dynamo | none
    dialect: str                       # the SGLang router's command (launch_router | sgl-router)
    public_tls: bool
    transfer: str                      # the PD transfer backend (set, unused, with topology=unified)
    attention_dp_flags: Mapping[str, Any]    # the engine build's spelling of attention DP
    knobs: Mapping[str, Any]           # every knob as given (inventory, then settings), validated
    router_host: Host | None
    mooncake_host: Host | None

    def knob(self, name: str, default: Any = None) -> Any:
        value = self.knobs.get(name)
        return default if value is None else value

    @property
    def platform_info(self) -> dict[str, Any]:
        return catalog()["platforms"][self.platform]

    @property
    def family_name(self) -> str:
        return self.platform_info["family"]

    @property
    def family(self) -> dict[str, Any]:
        return catalog()["families"][self.family_name]

    @property
    def rocm(self) -> bool:
        return self.family_name == "rocm"

    @property
    def tpu(self) -> bool:
        return self.family_name == "tpu"

    @property
    def nvl72(self) -> bool:
        return bool(self.platform_info.get("nvl72"))


@dataclass(frozen=True)
class ServerSpec:
    """One engine server as resolved: its cell, layout, hosts (node-rank order) and features."""

    name: str
    role: str                          # unified | prefill | decode
    strategy: str
    cell: Mapping[str, Any]            # its catalog cell
    layout: Mapping[str, int]          # tp dcp pp pcp ep dp nnodes
    hosts: tuple[Host, ...]
    moe_runner: str | None
    speculative: bool                  # DFLASH
    dflash_block: int | None
    kv_offload: str                    # none | hicache | mooncake
    monokernel: bool
    decode_radix: bool                 # a PD decode's radix cache
    settings: EngineSettings

    @property
    def flat_tp(self) -> bool:
        return flat_tp(self.layout)

    @property
    def hicache(self) -> bool:
        return hicache(self.kv_offload)
