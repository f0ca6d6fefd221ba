"""resolve(knobs, hosts) -> plan: the only place the recipe's rules are applied.

No Ansible, nothing written. It reads the data under k31deploy/data (catalog, knobs, flags, memory, the
engine dump and lane record) and, for an inventory, the roles' meta/argument_specs.yml (role variables,
recipe.hosts); with resolve_names=True (a deploy) it also looks host names up in DNS. Otherwise the same
input gives the same plan. The plan is built here with argv.py (command lines and env), ports.py (the port
table), engine.lane (engine_check) and memory (servers[].memory); its contract is in docs/architecture.md.
Every refusal is a K31Error with one sentence naming the setting and the valid choices.

Layer: resolution, its top (docs/architecture.md). The pipeline below works on mutable Server records; at
the end it freezes them into recipe.model's Setup / ServerSpec (every value decided, engine settings
included) and hands those to argv.py, which imports nothing of this module: the imports run one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from types import MappingProxyType
from typing import Any

from k31deploy.catalog import (
    ROLES,
    STRATEGY_KNOB,
    catalog,
    cell_knobs,
    cell_layout,
    emit_check,
    flag_registry,
    knob_specs,
    mem_fraction_static_max,
    offered,
    platform_cells,
)
from k31deploy.engine import cli as engine_cli
from k31deploy.engine import lane
from k31deploy.errors import K31Error
from k31deploy.memory import Options, annotate_plan
from k31deploy.plan import EngineSettings, kv_crosses_nodes
from k31deploy.recipe import hosts as hostlib
from k31deploy.recipe import model, ports
from k31deploy.recipe.argv import DYNAMO_PARSER_WARNING, EngineArgv, dist_init_port, router_plan, router_tokenizer
from k31deploy.recipe.hosts import Host
from k31deploy.recipe.knobs import normalise
from k31deploy.recipe.model import ServerSpec, Setup

VERIFICATION_TEXT = {
    "verified": "Verified",
    "in-progress": "Final Verification In Progress (the recipe runs and is queued for measurement)",
    "not-verified": "Not Verified (Playground only)",
}


@dataclass
class Server:
    """A server while the pipeline decides it (mutable); frozen into a ServerSpec for the plan."""

    name: str
    role: str
    strategy: str
    cell: dict[str, Any]
    layout: dict[str, int]
    hosts: list[Host] = field(default_factory=list)
    moe_runner: str | None = None
    speculative: bool = False
    dflash_block: int | None = None
    kv_offload: str = "none"
    kv_measured: str = "none"    # the tier the seed measured this server with: another one is derived
    monokernel: bool = False
    max_running_requests: int | None = None
    cuda_graph_max_bs_decode: int | None = None
    decode_radix: bool = False
    megamoe_token_cap: int | None = None

    @property
    def flat_tp(self) -> bool:
        return model.flat_tp(self.layout)

    @property
    def hicache(self) -> bool:
        return model.hicache(self.kv_offload)


def resolve(knobs: dict[str, Any] | None = None, hosts: list[Host] | None = None, *,
            require_image: bool = False, engine_check: bool = True, resolve_names: bool = False) -> dict[str, Any]:
    """Resolve knobs (typed or strings) and an optional host layout into a plan (JSON contract).

    engine_check=False leaves out the engine lane's verdicts (what the lane's own case list uses).
    resolve_names=True turns inventory host names into the IPs services bind to, as a deploy does.
    """
    return _Resolver(knobs or {}, hosts, require_image, engine_check=engine_check,
                     resolve_names=resolve_names).run()


def layout_text(layout: dict[str, int]) -> str:
    """`{"tp": 8, "dcp": 8, "ep": 2}` -> "TP8 · DCP8 · EP2" (the seed's notation)."""
    parts = [f"{k.upper()}{layout[k]}" for k in ("pp", "pcp", "tp", "dp", "dcp", "ep") if layout.get(k, 1) > 1]
    return " · ".join(parts) or "TP1"


class _Resolver:
    def __init__(self, knobs: dict[str, Any], hosts: list[Host] | None, require_image: bool, *,
                 engine_check: bool = True, resolve_names: bool = False):
        self.resolve_names = resolve_names
        self.cat = catalog()
        self.with_lane = engine_check
        self.inventory = hosts
        if hosts is not None:
            hostlib.check_hosts(hosts)
        inv_knobs = hostlib.inventory_knobs(hosts) if hosts is not None else {}
        self.k = {**normalise(inv_knobs, "inventory"), **normalise(knobs, "settings")}
        self.require_image = require_image
        self.warnings: list[str] = []
        self.servers: list[Server] = []
        for knob in sorted(set(inv_knobs) - set(knobs)):
            unset = [h.name for h in hosts or [] if h.vars.get(f"k31_{knob}") is None]
            if unset:    # a group's value is the cluster's: say so where a group_vars of one role set it
                names = ", ".join(unset[:3]) + (f" and {len(unset) - 3} more" if len(unset) > 3 else "")
                self.warn(f"k31_{knob} is set on some hosts only (not on {names}); recipe knobs are cluster-wide, "
                          f"so its value applies to the whole cluster: set it once in group_vars/all")

    # -- helpers -------------------------------------------------------------------------------
    def knob(self, name: str, default: Any = None) -> Any:
        value = self.k.get(name)
        return default if value is None else value

    def refuse_unless(self, condition: bool, knob: str, why: str) -> None:
        """A knob that only makes sense in some setups: refuse it (explicitly set) elsewhere, naming the way out."""
        if not condition and knob in self.k:
            raise K31Error(f"{knob}={self.k[knob]} {why}; valid choices: the setup it names, or {knob} unset")

    def warn(self, text: str) -> None:
        if text not in self.warnings:
            self.warnings.append(text)

    # -- pipeline --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        self._platform()
        self._engine_build()
        self._agents()
        self._topology()
        self._cells()
        self._router_kind()
        self._place()
        self._speculative()
        self._kv_offload()
        self._monokernel()
        self._moe_checks()
        self._concurrency()
        self._other_checks()
        self._branch_features()
        self._cell_warnings()
        return self._plan()

    def _platform(self) -> None:
        platform = self.k.get("platform")
        if platform is None:
            raise K31Error(f"platform is not set; valid platforms: {', '.join(self.cat['platforms'])}")
        self.platform = platform
        self.pinfo = self.cat["platforms"][platform]
        self.family_name = self.pinfo["family"]
        self.family = self.cat["families"][self.family_name]
        self.rocm = self.family_name == "rocm"
        self.tpu = self.family_name == "tpu"
        if self.tpu:
            # seed 3.4: the TPU launcher reads its own config; engine knobs do not reach it.
            tpu_knobs = ("platform", "topology", "unified_strategy", "image", "router", "router_dialect")
            engine_knobs = sorted(set(self.k) - set(tpu_knobs))
            if engine_knobs:
                raise K31Error(
                    f"{engine_knobs[0]} does not apply to tpu7x: the TPU launcher takes "
                    f"recipe/configs/kimi_k3_1/server.py (seed 3.4); valid knobs there: {', '.join(tpu_knobs)}"
                )

    def _engine_build(self) -> None:
        """Which SGLang build the image carries: the recipe's branch, or a release k31 has a dump of."""
        builds = self.cat["engine_builds"]
        self.build = self.knob("engine_build", next(n for n, b in builds.items() if b.get("default")))
        self.build_cfg = builds[self.build]
        self.branch_only: list[dict[str, str]] = []

    def _agents(self) -> None:
        """seed AMD: pick the recipe by agent count (MI350X / MI355X only)."""
        self.agent_row: dict[str, Any] | None = None
        agents = self.k.get("agents")
        if agents is None or not self.rocm:
            return
        rows = self.cat["amd"]["agents"]
        for row in rows:
            if row["min"] <= agents and (row["max"] is None or agents <= row["max"]):
                self.agent_row = row
                break
        else:
            ranges = ", ".join(f"{r['min']}-{r['max'] or ''}" for r in rows)
            raise K31Error(
                f"agents={agents} is outside the seed's measured ranges on {self.platform} ({ranges}); "
                f"pick 4 (unified low-latency) or 8 (unified high-throughput)"
            )
        row = self.agent_row
        picks = {"topology": row["topology"]}
        roles = ("unified",) if row["topology"] == "unified" else ("prefill", "decode")
        picks.update({STRATEGY_KNOB[r]: row["strategy"] for r in roles})
        for knob, value in picks.items():
            if knob in self.k and self.k[knob] != value:
                raise K31Error(
                    f"{knob}={self.k[knob]} contradicts agents={agents}, which picks {knob}={value} on "
                    f"{self.platform} (seed AMD: pick the recipe by agent count); unset one of them"
                )

    def _topology(self) -> None:
        row = self.agent_row or {}
        self.topology = self.knob("topology", row.get("topology", "unified"))
        self.roles = ("unified",) if self.topology == "unified" else ("prefill", "decode")
        if self.topology == "pd" and not offered(self.platform, "prefill"):
            raise K31Error(f"topology=pd is not offered on {self.platform}; valid topologies: unified")
        for role in ROLES:
            self.refuse_unless(role in self.roles, STRATEGY_KNOB[role],
                               f"applies to {role} servers, and topology={self.topology} has none")
        self.refuse_unless(self.topology == "pd", "transfer_backend", "applies to topology=pd only")
        self.refuse_unless(self.topology == "pd", "decode_radix_cache", "applies to PD decode servers only")
        self.refuse_unless(self.topology == "unified", "prefill_decode_interval",
                           "applies to unified servers only (a PD server runs one phase)")

    def _cells(self) -> None:
        row = self.agent_row or {}
        self.cells: dict[str, tuple[str, dict[str, Any]]] = {}
        for role in self.roles:
            knob = STRATEGY_KNOB[role]
            choices = offered(self.platform, role)
            default = row.get("strategy") or next(s for s in choices if platform_cells(self.platform)[role][s]
                                                  .get("default"))
            strategy = self.knob(knob, default)
            if strategy not in choices:
                raise K31Error(
                    f"{knob}={strategy} is not offered on {self.platform}; valid choices: {', '.join(choices)}"
                )
            self.cells[role] = (strategy, platform_cells(self.platform)[role][strategy])
        if self.knob("wide_ep"):
            wide = {r: (s, c) for r, cs in platform_cells(self.platform).items() for s, c in cs.items()
                    if c.get("knob") == "wide_ep"}
            if not wide:
                raise K31Error(f"wide_ep=true is a GB300 decode cell; {self.platform} does not offer it (valid "
                               f"there: wide_ep=false, or platform=gb300)")
            if self.topology != "pd":
                raise K31Error("wide_ep=true is a PD decode server; set topology=pd")
            if "decode_strategy" in self.k:
                raise K31Error("wide_ep=true replaces decode_strategy; unset decode_strategy")
            self.cells.update(wide)

    def _moe_runner(self, role: str, cell: dict[str, Any]) -> str | None:
        if self.platform not in self.cat["dsa_platforms"]:
            return None
        runner = self.knob("moe_runner", cell.get("moe_runner", "trtllm"))
        if cell.get("knob") == "wide_ep" and runner != "megamoe":
            raise K31Error("moe_runner=trtllm contradicts wide_ep=true: WideEP decode is MegaMoE EP16 (seed)")
        return runner

    def _router_kind(self) -> None:
        router_cfg = self.cat["router"]
        default = router_cfg["default_kind"][self.family_name][self.topology]
        if default == "none" and self.inventory is not None and any(
                hostlib.ROUTER_GROUP in h.groups for h in self.inventory):
            default = "sglang"    # the inventory asks for a router in front of unified servers
        self.router = self.knob("router", default)
        if self.tpu and self.router == "dynamo":
            raise K31Error("router=dynamo needs dynamo.sglang workers, but tpu7x runs the TPU launcher (seed 3.4), "
                           "which does not register with Dynamo; valid choices there: none, sglang")
        if self.topology == "pd" and self.router == "none":
            raise K31Error("router=none cannot serve topology=pd: the router pairs prefill and decode; "
                           "valid choices: sglang, dynamo")
        self.refuse_unless(self.router == "sglang", "router_dialect", "applies to router=sglang only")
        self.refuse_unless(self.router == "dynamo", "dynamo_session_affinity_ttl", "applies to router=dynamo only")
        self.dialect = self.knob("router_dialect", router_cfg["default_dialect"][self.family_name][self.topology])
        self.refuse_unless(self.router == "sglang" and router_cfg["dialects"][self.dialect]["startup_timeout"],
                           "router_worker_startup_timeout", "applies to router=sglang with "
                           "router_dialect=launch_router only (the seed's sgl-router command has no startup timeout)")
        if self.router == "sglang" and self.dialect == "sgl-router" and self.topology == "unified":
            raise K31Error("router_dialect=sgl-router is the seed's PD command (--prefill/--decode); unified "
                           "servers need router_dialect=launch_router (--worker-urls)")
        self.public_tls = bool(self.knob("public_tls", False))
        if self.public_tls and self.router == "none":
            raise K31Error("public_tls=true needs a router or the Dynamo frontend to serve HTTPS: with router=none "
                           "the unified engines serve clients themselves; valid choices: router=sglang, "
                           "router=dynamo, or public_tls=false")
        if self.public_tls and self.router == "sglang" and self.dialect == "sgl-router":
            raise K31Error("public_tls=true with router_dialect=sgl-router: the seed's sgl-router command shows no "
                           "TLS flag, so k31 cannot serve HTTPS with it; valid choices: router_dialect=launch_router "
                           "(--tls-cert-path / --tls-key-path), or public_tls=false")

    def _place(self) -> None:
        """Servers with their hosts: from the inventory, or placeholders laid out as the recipe needs."""
        layouts = {}
        for role, (strategy, cell) in self.cells.items():
            runner = self._moe_runner(role, cell)
            layouts[role] = (strategy, cell, runner, cell_layout(self.platform, cell, runner))
        mooncake = self.knob("kv_offload") == "mooncake"
        hosts = self.inventory
        if hosts is None:
            hosts = hostlib.placeholders({r: v[3]["nnodes"] for r, v in layouts.items()},
                                         router=self.router != "none", mooncake=mooncake)
        hostlib.check_memberships(hosts)
        hostlib.check_unique_servers([g for role in ROLES for g in hostlib.group_servers(hosts, role)])
        if self.resolve_names and self.inventory is not None:    # after the layout checks: they say more
            hosts = hostlib.resolved(hosts)
        for role in ROLES:
            grouped = hostlib.group_servers(hosts, role)
            if role not in layouts:
                if grouped:
                    raise K31Error(
                        f"hosts in group {hostlib.ENGINE_GROUPS[role]} ({grouped[0].hosts[0].name}) but "
                        f"topology={self.topology}; valid groups here: "
                        f"{', '.join(hostlib.ENGINE_GROUPS[r] for r in self.roles)}"
                    )
                continue
            if not grouped:
                raise K31Error(f"topology={self.topology} needs at least one host in group "
                               f"{hostlib.ENGINE_GROUPS[role]}")
            strategy, cell, runner, layout = layouts[role]
            for g in grouped:
                if len(g.hosts) != layout["nnodes"]:
                    raise K31Error(
                        f"server {g.name} has {len(g.hosts)} host(s) ({', '.join(h.name for h in g.hosts)}) "
                        f"but {role} {strategy} on {self.platform} needs {layout['nnodes']} "
                        f"({layout['tp'] * layout['pp']} GPUs at {self.pinfo['gpus_per_node']} per node); "
                        f"give the server's hosts the same k31_server"
                    )
                self.servers.append(Server(g.name, role, strategy, cell, dict(layout), g.hosts, runner))
        self.router_host = self._first_in(hosts, hostlib.ROUTER_GROUP, self.router != "none",
                                          f"router={self.router}")
        self.mooncake_host = self._first_in(hosts, hostlib.MOONCAKE_GROUP, mooncake, "kv_offload=mooncake")
        tokenizer = router_tokenizer(self.cat["router"]["dialects"][self.dialect], self.knob("model_path"))
        if self.router == "sglang" and tokenizer and all(self.router_host not in s.hosts for s in self.servers):
            raise K31Error(
                f"router_dialect={self.dialect} reads --tokenizer-path {tokenizer} on the router host "
                f"{self.router_host.name}, which runs no engine, so k31 stages no model there; valid choices: put "
                f"the router on an engine host, model_path=<hub id>, or router_dialect=launch_router")
        if self.router == "none" and any(hostlib.ROUTER_GROUP in h.groups for h in hosts):
            self.warn("hosts in k31_router are unused: router=none")
        if not mooncake and any(hostlib.MOONCAKE_GROUP in h.groups for h in hosts):
            self.warn(f"hosts in {hostlib.MOONCAKE_GROUP} are unused: the Mooncake store runs with kv_offload=mooncake "
                      f"only")
        self.monitoring = self.knob("monitoring", "prometheus")
        # Prometheus and Alertmanager: the k31_monitoring host, else the router's, else the first engine host.
        self.monitoring_host: Host | None = None
        if self.monitoring != "none":
            chosen = [h for h in hosts if hostlib.MONITORING_GROUP in h.groups]
            self.monitoring_host = chosen[0] if chosen else self.router_host or self.servers[0].hosts[0]
        elif any(hostlib.MONITORING_GROUP in h.groups for h in hosts):
            self.warn("hosts in k31_monitoring are unused: monitoring=none")

    @staticmethod
    def _first_in(hosts: list[Host], group: str, needed: bool, why: str) -> Host | None:
        found = [h for h in hosts if group in h.groups]
        if needed and not found:
            raise K31Error(f"{why} needs a host in group {group}")
        return found[0] if needed else None

    # -- features --------------------------------------------------------------------------------
    def _speculative(self) -> None:
        pp_servers = [s for s in self.servers if s.layout["pp"] > 1]
        placeholder = any(s.cell.get("placeholder") for s in self.servers)
        default = "none" if (pp_servers or placeholder or self.tpu) else "dflash"
        spec = self.knob("speculative", default)
        if spec == "dflash" and pp_servers:
            raise K31Error(
                f"speculative=dflash cannot run with the PP{pp_servers[0].layout['pp']} × "
                f"PCP{pp_servers[0].layout['pcp']} {pp_servers[0].role} ({pp_servers[0].strategy}): PP is "
                f"not speculative and DFLASH must run on both PD roles (seed 3.3); valid: speculative=none, "
                f"or prefill_strategy=low-latency"
            )
        if pp_servers and spec == "none" and "speculative" not in self.k and self.topology == "pd":
            self.warn("DFLASH is off: the PP4 × PCP2 prefill is not speculative and DFLASH must run on both "
                      "PD roles (seed 3.3)")
        if placeholder and not self.tpu and "speculative" not in self.k:
            self.warn(f"DFLASH is off: the seed gives the {self.platform} placeholder shape as a layout only "
                      f"(Recipe shapes); speculative=dflash adds it, derived")
        self.speculative = spec
        self.refuse_unless(spec == "dflash", "dflash_block", "needs speculative=dflash")
        self.refuse_unless(spec == "dflash", "draft_model_path", "needs speculative=dflash")
        dflash = self.cat["speculative"]["dflash"]
        fam = dflash["family"].get(self.family_name, {})
        for s in self.servers:
            s.speculative = spec == "dflash"
            if s.speculative:
                s.dflash_block = self.knob("dflash_block", s.cell.get("dflash_block", fam.get("block",
                                                                                              dflash["block"])))
        if spec == "dflash" and "draft_model_path" not in self.k:
            self.warn(f"the seed names the draft Kimi-K3.1-Dflash2-Preview without its org; k31 uses "
                      f"{self.cat['model']['draft']} (the measured runs read a local copy: set draft_model_path)")

    def _kv_offload(self) -> None:
        explicit = self.k.get("kv_offload")
        row_default = (self.agent_row or {}).get("kv_offload")
        for s in self.servers:
            if self.rocm:
                # seed AMD: HiCache is the default and what was measured, but for the agent rows without it
                s.kv_measured = row_default or "hicache"
                if s.cell.get("hicache") is False:    # Low-Latency and the PD decode run without it
                    if explicit in ("hicache", "mooncake") and all(x.cell.get("hicache") is False
                                                                  for x in self.servers):
                        raise K31Error(
                            f"kv_offload={explicit}: {self.platform} {s.role} {s.strategy} runs without "
                            f"HiCache (seed AMD HiCache); valid choices: none"
                        )
                    if explicit == "hicache":    # the prefill takes it; say that this server does not
                        self.warn(f"{s.name}: kv_offload=hicache does not reach this {s.role} server: the "
                                  f"{self.platform} {s.role} {s.strategy} runs without HiCache (seed AMD HiCache)")
                    s.kv_offload = s.kv_measured = "none"
                    continue
                s.kv_offload = explicit or s.kv_measured
            else:
                s.kv_measured = self.cat["measured"]["kv_offload"][s.role]
                s.kv_offload = explicit or "none"
            if s.kv_offload == "mooncake" and s.role == "decode":
                s.kv_offload = "none"    # field notes §3: in PD the store's HiCache flags go on the prefill
        for s in self.servers:   # seed: on a PD decode server HiCache also turns on the decode radix cache
            s.decode_radix = s.role == "decode" and bool(self.knob("decode_radix_cache", s.hicache))
        any_hicache = any(s.hicache for s in self.servers)
        for knob in ("hicache_write_policy", "hicache_ratio", "hicache_mamba_host_ratio"):
            self.refuse_unless(any_hicache, knob, "needs kv_offload=hicache or mooncake on some server")

    def _monokernel(self) -> None:
        row = self.agent_row or {}
        mono = self.knob("monokernel", row.get("monokernel", False))
        if mono and not self.rocm:
            raise K31Error(f"monokernel=true is the MI350X / MI355X decode monokernel; {self.platform} has none "
                           f"(valid: monokernel=false)")
        if not mono:
            return
        roles = self.cat["amd"]["monokernel"]["roles"]
        for s in self.servers:
            if s.role not in roles:
                continue
            if s.hicache:
                raise K31Error(
                    f"monokernel=true does not accept KV offload (seed AMD Monokernel), but {s.name} has "
                    f"kv_offload={s.kv_offload}; valid: kv_offload=none, or monokernel=false"
                )
            s.monokernel = True
            if not s.speculative:    # seed: "It takes TP8 or DCP8 with DFLASH"; its verify steps are DFLASH's
                self.warn(f"{s.name}: the monokernel without DFLASH is derived: the seed runs it with DFLASH "
                          f"(decode and verify steps), and SGLang stops at startup where it does not support a setup")
            if s.role == "decode":
                self.warn(f"{s.name}: the monokernel was measured on the single-node recipes (1 to 8 agents); "
                          f"on a PD decode it is derived")

    def _moe_checks(self) -> None:
        dsa = self.platform in self.cat["dsa_platforms"]
        for knob in ("moe_runner", "attention_backend"):
            self.refuse_unless(dsa, knob, f"is offered on {', '.join(self.cat['dsa_platforms'])} only "
                                          f"(seed Configuration Tips), not {self.platform}")
        mega = [s for s in self.servers if s.moe_runner == "megamoe"]
        if mega and self.knob("enable_symm_mem"):
            raise K31Error("enable_symm_mem=true deadlocks with moe_runner=megamoe (seed Tuning notes); "
                           "valid: enable_symm_mem=false, or moe_runner=trtllm")
        self.refuse_unless(bool(mega), "megamoe_token_cap", "needs moe_runner=megamoe on some server")
        self.refuse_unless(any(s.flat_tp for s in mega), "shared_experts_tp_size",
                           "applies to MegaMoE on the flat TP cells only (seed MoE Runner)")
        cfg = self.cat["moe_runners"]["megamoe"]
        for s in self.servers:
            measured = f"{s.role}/{s.strategy}" in cfg["measured_on"]
            if s.moe_runner == "megamoe" and not measured:
                self.warn(f"{s.name}: MegaMoE has only been measured on the High-Throughput (PP4 × PCP2) "
                          f"prefill; TRT-LLM on the other cells (seed)")
            if s.moe_runner == "trtllm" and measured:
                self.warn(f"{s.name}: the High-Throughput prefill cell carries MegaMoE; TRT-LLM here was "
                          f"not measured (seed)")
            if s.moe_runner == "megamoe":
                cap = s.megamoe_token_cap = self.knob("megamoe_token_cap", cfg["token_cap"][s.role])
                self.warn(f"{s.name}: MegaMoE reserves a symmetric workspace growing with EP "
                          f"{s.layout['ep']} × token cap {cap}; lower mem_fraction_static if startup runs out "
                          f"of memory (seed)")
        backend = self.knob("attention_backend", "flashmla")
        if backend != "flashmla":
            self.warn(f"attention_backend={backend} stores the KV as plain FP8 and runs the query in FP8; "
                      f"numerics differ slightly from FlashMLA (seed)")

    def _concurrency(self) -> None:
        agents = self.k.get("agents")
        overrides = self.cat["amd"]["concurrency_overrides"]
        derived = overrides.get(agents, agents) if agents is not None else None
        for s in self.servers:
            if s.role == "prefill":
                continue
            s.max_running_requests = self.knob("max_running_requests", derived)
            if self.rocm and derived is not None:
                s.cuda_graph_max_bs_decode = derived
            s.cuda_graph_max_bs_decode = self.knob("cuda_graph_max_bs_decode", s.cuda_graph_max_bs_decode)
            needs = []
            if s.speculative:
                needs.append("DFLASH decode (seed Tuning notes: DFLASH)")
            if s.moe_runner == "megamoe":
                needs.append("MegaMoE on a non-prefill role (seed Tuning notes: MegaMoE)")
            if needs and s.max_running_requests is None:
                raise K31Error(
                    f"max_running_requests is not set, but {s.name} ({s.role}) runs {' and '.join(needs)}, "
                    f"which needs an explicit --max-running-requests; set max_running_requests=N or agents=N"
                )
        if (self.rocm and self.topology == "pd" and agents is not None
                and "max_running_requests" not in self.k):
            self.warn(f"max_running_requests={derived} on the 1P1D decode follows the agent count; the seed "
                      f"gives it for the single-node shape only (derived)")

    def _other_checks(self) -> None:
        k = self.k
        mfs = k.get("mem_fraction_static")
        limit = mem_fraction_static_max(self.platform, self.topology)
        if mfs is not None and limit is not None and mfs > limit:
            raise K31Error(
                f"mem_fraction_static={mfs} is too high on the {self.platform} single-node recipe: 0.87 and 0.88 "
                f"overflowed GTT at startup or ran slower (seed AMD Memory); valid: <= {limit}"
            )
        dcp = [s for s in self.servers if s.layout["dcp"] > 1]
        self.refuse_unless(bool(dcp), "dcp_comm_backend", "needs a DCP layout (dcp > 1) on some server")
        transfer = k.get("transfer_backend", self.cat["pd"]["transfer_default"])
        if self.topology == "pd" and transfer != self.cat["pd"]["dcp_requires"] and dcp:
            raise K31Error(
                f"transfer_backend={transfer} is rejected by DCP ({dcp[0].name} runs "
                f"{layout_text(dcp[0].layout)}) on either PD role (seed 3.3); valid choices: mooncake"
            )
        self.transfer = transfer
        pp = [s for s in self.servers if s.layout["pp"] > 1]
        self.refuse_unless(bool(pp), "pp_layer_partition", "applies to the PP4 × PCP2 prefill only")
        if "pp_layer_partition" in k and pp:
            self._check_partition(k["pp_layer_partition"], pp[0].layout["pp"])
        self.refuse_unless(any(s.role in ("unified", "prefill") for s in self.servers), "prefill_cuda_graph",
                           "applies to unified and prefill servers only")
        per_path = k.get("kda_states_per_path")
        if per_path == 1 and self.rocm and any(s.hicache for s in self.servers):
            self.warn("kda_states_per_path=1 lowered the prefix hit rate on MI355X; the recipes keep every "
                      "KDA state per path (seed AMD HiCache)")
        if self.knob("decode_radix_cache") or any(s.hicache and s.role == "decode" for s in self.servers):
            self.warn("the PD decode radix cache still keeps one KDA state slot per request: the decode tree "
                      "caches KV only (seed)")

    def _check_partition(self, text: str, pp: int) -> None:
        layers = self.cat["model"]["num_layers"]
        try:
            parts = [int(p) for p in text.split(",")]
        except ValueError:
            parts = []
        if len(parts) != pp or sum(parts) != layers or min(parts, default=0) < 1:
            raise K31Error(
                f"pp_layer_partition={text} must be {pp} positive layer counts summing to {layers} "
                f"(e.g. 24,24,24,21 as the seed keeps)"
            )

    def _branch_features(self) -> None:
        """Recipe features only the kimi-k31-pro branch runs: refused on a release, a warning on the branch."""
        for name, feature in self.cat["branch_features"].items():
            for s in self.servers:
                facts = {"hicache": s.hicache, "dcp": s.layout["dcp"] > 1, "speculative": s.speculative,
                         "monokernel": s.monokernel, "decode_radix": s.decode_radix}
                if not all(facts[k] == v for k, v in feature["when"].items()):
                    continue
                refusal = " ".join(feature["refusal"].split())
                if not self.build_cfg.get("branch"):
                    raise K31Error(
                        f"engine_build={self.build} cannot start {s.name}: it refuses {name} at start-up "
                        f"({refusal}, {feature['upstream']}); the recipe runs it on its kimi-k31-pro branch; "
                        f"valid: {feature['valid']}"
                    )
                self.branch_only.append({"server": s.name, "feature": name, "refusal": refusal,
                                         "plugin": feature.get("plugin")})
                self.warn(f"{s.name}: {name} runs only on the recipe's kimi-k31-pro branch"
                          + (f" (plugin {feature['plugin']} in the image)" if feature.get("plugin") else "")
                          + f"; SGLang {self.cat['engine_builds'][self.build_cfg['reference']]['version']} "
                          f"refuses it ({refusal}); the recipe: \"{feature['recipe']}\"")

    def _cell_warnings(self) -> None:
        measured = self.cat["measured"]
        for s in self.servers:
            status = s.cell["verification"]
            if status != "verified":
                what = "the seed's placeholder shape" if s.cell.get("placeholder") else "a recipe cell"
                self.warn(f"{s.name}: {s.strategy} {s.role} on {self.platform} ({layout_text(s.layout)}) is "
                          f"{what}, {VERIFICATION_TEXT[status]}")
            if s.cell.get("note") and s.speculative:
                self.warn(f"{s.name}: {s.cell['note']}; DFLASH here is derived")
            if s.kv_offload != s.kv_measured:
                self.warn(f"{s.name}: kv_offload={s.kv_offload} on a {s.role} server is derived; the seed "
                          f"measured {s.role} servers with kv_offload={s.kv_measured}")
            if s.kv_offload == "mooncake" and self.family_name not in measured["mooncake_platform_families"]:
                self.warn(f"{s.name}: the Mooncake store (L3) is derived and was not measured"
                          + ("; it has not run on MI350X / MI355X (seed)" if self.rocm else ""))
        if self.router == "sglang" and self.topology == "pd" and not self.cat["router"]["dialects"][self.dialect][
                "model_flags"]:    # the engine decides: field notes §4
            self.warn(f"router_dialect={self.dialect} takes no --model-id (PyPI sglang-router 0.3.2): k31 leaves out "
                      f"seed 3.3's --model-id, and its --tokenizer-path with it (power_of_two routing reads no "
                      f"tokens)")
        host = self.router_host
        if (self.router == "sglang" and self.topology == "pd" and not self.public_tls and host is not None
                and host.public_address != host.address):    # oncall/rollout.follow_config: router_url
            self.warn(f"the PD watchers on the prefill hosts drain through the router's worker API at its public "
                      f"address {host.public_address}, so without public_tls its control-plane key crosses that "
                      f"network in the clear; set public_tls=true")
        expected = measured["router"].get(self.family_name)
        if self.router != "none" and expected and self.router != expected:
            self.warn(f"router={self.router} is derived from the same engine settings and was not measured; "
                      f"the seed measured {expected} on {self.platform}")

    # -- plan ------------------------------------------------------------------------------------
    def _plan(self) -> dict[str, Any]:
        image = self.knob("image", self.family["image"])
        if self.require_image and (image is None or str(image).startswith("<")):
            raise K31Error(
                f"image is {image or 'not set'}: set k31_image (or --set image=REF) to the {self.family['runtime']} "
                f"serving image before a deploy (the seed's commands show the placeholder {self.family['image']})"
            )
        setup = self._setup()
        engine = EngineArgv(setup)
        servers = []
        for spec in map(self._spec, self.servers):
            server = engine.server(spec)
            if not self.tpu:    # ranks differ only in --node-rank
                self.engine_check(spec.name, server["ranks"][0]["argv"][len(engine.launcher()):])
            if self.router == "dynamo":
                self.warn(DYNAMO_PARSER_WARNING)
            servers.append(server)
        plan = {
            "model": self.cat["model"]["name"],
            # the DFLASH draft's hub id where a server speculates (k31_model's hub download)
            "draft_model": self.cat["model"]["draft"] if self.speculative == "dflash" else None,
            "platform": self.platform,
            # what the host checks and the IMEX setup compare a machine with
            "hardware": {"family": self.family_name, "runtime": self.family["runtime"],
                         "form": self.pinfo["form"], "gpus_per_node": self.pinfo["gpus_per_node"],
                         "nvl72": bool(self.pinfo.get("nvl72"))},
            "topology": self.topology,
            "image": image,
            "engine": self._engine_section(),
            "container_flags": self._container_flags(),
            "knobs": self._resolved_knobs(),
            "servers": servers,
            "router": router_plan(setup, servers),
            "mooncake_master": engine.mooncake_master(),
            # Mooncake's PD transfer RPC ports, picked at run time from this range: the firewall opens it between
            # the engine hosts (not a listener of the port table)
            "pd_transfer_ports": list(self.cat["ports"]["mooncake_transfer_rpc"]) if self.topology == "pd" else None,
            "monitoring": self._monitoring(servers),
            # the cluster CA's files (k31 pki) wherever a control plane authenticates by certificate:
            # Dynamo's, and Prometheus, Alertmanager and the node exporters (mutual TLS)
            "pki": dict(self.cat["pki"]) if self.router == "dynamo" or self.monitoring != "none" else None,
            "warnings": self.warnings,
        }
        listening = ports.listeners(plan, dist_init_port(setup))
        ports.check(listening)
        plan["ports"] = ports.table(listening)
        if self.with_lane:
            for text in lane.annotate(plan, self.pinfo, self.family, self.build_cfg["reference"],
                                      self._base_digest):
                self.warn(text)
        annotate_plan(plan, Options(weights_gb_per_gpu=self.k.get("weights_gb_per_gpu")))
        return plan

    def _setup(self) -> Setup:
        return Setup(platform=self.platform, topology=self.topology, router=self.router, dialect=self.dialect,
                     public_tls=self.public_tls, transfer=self.transfer,
                     attention_dp_flags=MappingProxyType(dict(self.build_cfg.get("attention_dp_flags", {}))),
                     knobs=MappingProxyType(dict(self.k)), router_host=self.router_host,
                     mooncake_host=self.mooncake_host)

    def _spec(self, s: Server) -> ServerSpec:
        return ServerSpec(
            name=s.name, role=s.role, strategy=s.strategy, cell=MappingProxyType(s.cell),
            layout=MappingProxyType(dict(s.layout)), hosts=tuple(s.hosts), moe_runner=s.moe_runner,
            speculative=s.speculative, dflash_block=s.dflash_block, kv_offload=s.kv_offload,
            monokernel=s.monokernel, decode_radix=s.decode_radix, settings=self._engine_settings(s))

    def _engine_settings(self, s: Server) -> EngineSettings:
        """The values behind a server's memory and scheduling flags and env vars, each decided once here."""
        k, cat = self.knob, self.cat
        hc = cat["hicache"]
        hicache_ratio = mamba_host_ratio = None
        if s.hicache and self.rocm:
            hicache_ratio = k("hicache_ratio", hc["rocm"]["ratio"])
            mamba_host_ratio = k("hicache_mamba_host_ratio",
                                 s.cell.get("hicache_mamba_host_ratio", hc["rocm"]["mamba_host_ratio"]))
        elif s.hicache:
            hicache_ratio = k("hicache_ratio")
            mamba_host_ratio = self.k.get("hicache_mamba_host_ratio")
        mooncake = hc["mooncake"]
        return EngineSettings(
            mem_fraction_static=k("mem_fraction_static", mem_fraction_static_max(self.platform, self.topology)),
            max_running_requests=s.max_running_requests,
            cuda_graph_max_bs_decode=s.cuda_graph_max_bs_decode,
            max_mamba_cache_size=k("kda_state_slots"),
            mamba_full_memory_ratio=k("mamba_full_memory_ratio"),
            radix_cache=s.decode_radix if s.role == "decode" else True,
            hicache_ratio=hicache_ratio,
            hicache_mamba_host_ratio=mamba_host_ratio,
            rocm_runtime_reserve_gb=(cat["amd"]["runtime_reserve_gb"]["dcp" if s.layout["dcp"] > 1 else "tp"]
                                     if self.rocm else None),
            megamoe_token_cap=s.megamoe_token_cap,
            mooncake_segment_bytes=(_size_bytes(mooncake["env"][mooncake["segment_env"]])
                                    if s.kv_offload == "mooncake" else None),
            prefill_decode_interval=k("prefill_decode_interval"),
        )

    def _monitoring(self, servers: list[dict[str, Any]]) -> dict[str, Any] | None:
        """Where Prometheus, Alertmanager and the blackbox exporter run, and every host of the plan, each
        running a node exporter: all on cluster addresses (the blackbox exporter on loopback)."""
        host = self.monitoring_host
        if host is None:
            return None
        ports = self.cat["ports"]
        used = [host, *(h for s in self.servers for h in s.hosts), *(h for h in (self.router_host, self.mooncake_host)
                                                                      if h is not None)]
        nodes: dict[str, str] = {}    # address -> host: hosts sharing an address are one machine, one exporter
        for h in used:
            nodes.setdefault(h.address, h.name)
        return {"host": host.name, "address": host.address, "prometheus_port": ports["prometheus"],
                "alertmanager_port": ports["alertmanager"], "blackbox_port": ports["blackbox_exporter"],
                "node_exporter_port": ports["node_exporter"],
                "nodes": [{"host": name, "address": address} for address, name in nodes.items()]}

    def _engine_section(self) -> dict[str, Any]:
        cfg = self.build_cfg
        return {"build": self.build, "version": cfg.get("version"), "branch": bool(cfg.get("branch")),
                "reference": cfg["reference"],
                "plugins": sorted({b["plugin"] for b in self.branch_only if b["plugin"]}),
                "branch_only": self.branch_only}

    def _base_digest(self, role: str, strategy: str) -> str | None:
        """Today's digest of a catalog cell's server (default knobs), to tell a stale lane record."""
        return cell_digest(self.platform, role, strategy)

    def _container_flags(self) -> list[str]:
        """The family's device, IPC, shm and memlock flags, its RDMA ones where KV moves between nodes; NVL72 adds
        the IMEX channel."""
        flags = list(self.family["container_flags"])
        if kv_crosses_nodes(self.topology, [(s.layout["nnodes"], s.kv_offload) for s in self.servers]):
            flags += self.family.get("rdma_container_flags", [])
        if self.pinfo.get("nvl72") and any(s.layout["nnodes"] > 1 for s in self.servers):
            flags += self.cat["nvl72"]["container_flags"]
        return flags

    def _resolved_knobs(self) -> dict[str, Any]:
        strategies = {STRATEGY_KNOB[s.role]: s.strategy for s in self.servers if not s.cell.get("knob")}
        out = {"platform": self.platform, "agents": self.k.get("agents"), "topology": self.topology,
               **strategies, "router": self.router, "speculative": self.speculative}
        if self.router == "sglang":
            out["router_dialect"] = self.dialect
        if self.topology == "pd":
            out["transfer_backend"] = self.transfer
        out.update({k: v for k, v in sorted(self.k.items()) if k not in out})
        return out

    def engine_check(self, server: str, argv: list[str]) -> None:
        """An engine command against the build's own parser (the machine dump of its CLI).

        A release refuses what its parser refuses, in argparse's words. On the branch, the branch-only
        values of flags.yaml pass with a warning; anything else its reference release refuses is a k31 bug.
        """
        emit_check("engine", argv)
        branch_values = {flag: spec.get("branch_choices", {}) for flag, spec in flag_registry()["engine"].items()}
        reference = self.build_cfg["reference"]
        version = self.cat["engine_builds"][reference]["version"]
        for refusal in engine_cli.check(reference, argv):
            setting = branch_values.get(refusal.flag, {}).get(refusal.value)
            if setting is None:
                if self.build_cfg.get("branch"):
                    raise AssertionError(f"{server}: SGLang {version} refuses k31's {refusal.message}")
                raise K31Error(f"engine_build={self.build} refuses {server}'s command: {refusal.message}")
            knob = setting.partition("=")[0]
            if any(b["server"] == server and b["feature"] == setting for b in self.branch_only):
                continue    # one setting may emit several branch-only values (both DSA backends)
            if not self.build_cfg.get("branch"):
                others = [c for c in knob_specs()[knob]["choices"]
                          if f"{knob}={c}" not in {v for b in branch_values.values() for v in b.values()}]
                raise K31Error(
                    f"{setting} is not accepted by engine_build={self.build}: {refusal.message}; valid: "
                    f"{knob}={'|'.join(map(str, others))}, or engine_build=kimi-k31-pro (the recipe's branch)"
                )
            self.branch_only.append({"server": server, "feature": setting, "refusal": refusal.message,
                                     "flag": refusal.flag, "plugin": None})
            self.warn(f"{server}: {setting} ({refusal.flag} {refusal.value}) needs the recipe's kimi-k31-pro "
                      f"branch; SGLang {version} refuses it ({_core(refusal.message)})")


def _size_bytes(text: str) -> int:
    """`16gb` / `512mb` / bytes, binary units as Mooncake reads them (MOONCAKE_GLOBAL_SEGMENT_SIZE)."""
    text = str(text).strip().lower()
    for suffix, size in (("tb", 1 << 40), ("gb", 1 << 30), ("mb", 1 << 20), ("kb", 1 << 10)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * size)
    return int(text)


def _core(message: str) -> str:
    return message.split(" (choose from")[0]


@cache
def cell_digest(platform: str, role: str, strategy: str) -> str | None:
    """The lane digest of a catalog cell's server as k31 plans it today (its canonical knobs)."""
    cell = platform_cells(platform)[role][strategy]
    plan = _Resolver(cell_knobs(platform, role, strategy, cell), None, False, engine_check=False).run()
    found = [s for s in plan["servers"] if s["role"] == role]
    info = catalog()["platforms"][platform]
    return lane.server_digest(plan, found[0], info, catalog()["families"][info["family"]]) if found else None
