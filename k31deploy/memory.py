"""Memory planner: what each server of a plan holds in GPU and host memory, and whether the plan's
--max-running-requests fits.

Pure Python over the plan JSON (docs/architecture.md): the resolver annotates every plan with it
(servers[].memory), `k31 calc` asks it with more options. It reads a server's typed engine settings from the
plan (servers[].settings, decided once by the resolver), never its argv; the constants and where each comes
from are in data/memory.yaml, the env var names it quotes in the catalog. Layer: resolution, below the
resolver; it imports the catalog and errors only. Figures are per GPU unless their name says per server
or per node. A server with attention DP runs DP workers, each with its own pools; SGLang sizes the pools
per worker.

The GPU budget follows upstream SGLang (model_executor kv cache configurator):
    pool = mem_fraction_static x GPU memory - weights - ROCm runtime reserve - MegaMoE workspace
and the engine splits the pool between KDA state slots and KV tokens: --max-mamba-cache-size, or
--mamba-full-memory-ratio (a KDA:KV ratio), or one slot per request with the radix cache off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from k31deploy.catalog import catalog, load_yaml, mem_fraction_static_max
from k31deploy.errors import K31Error

DATA_FILE = Path(__file__).resolve().parent / "data" / "memory.yaml"
GB = 10**9
GIB = 1 << 30
MIB = 1 << 20


@cache
def constants() -> dict[str, Any]:
    """data/memory.yaml."""
    return load_yaml(DATA_FILE)


def fmt_bytes(n: float) -> str:
    """Decimal units, as the seed writes sizes: 52 MB, 18.9 KB, 190 GB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.4g} B"


@dataclass(frozen=True)
class Options:
    """What a plan does not say: the weights, the question asked, and the node's DRAM."""

    weights_gb_per_gpu: float | None = None  # target + draft weights per GPU, GB (10^9 bytes)
    checkpoint: str | None = None  # or: a local checkpoint directory to measure
    draft_checkpoint: str | None = None  # the DFLASH draft's directory, added to the measured weights
    context_length: int | None = None  # tokens each concurrent request holds
    concurrency: int | None = None  # size for N requests (as if --max-running-requests N)
    host_dram_gb: float | None = None  # host DRAM per node, GB; default per platform (memory.yaml)

    def __post_init__(self) -> None:
        for name in ("weights_gb_per_gpu", "context_length", "concurrency", "host_dram_gb"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0 or not math.isfinite(value)):
                raise K31Error(f"--{name.replace('_', '-')}={value} is not valid; it must be a number > 0")
        if self.weights_gb_per_gpu is not None and self.checkpoint is not None:
            raise K31Error("--weights-gb-per-gpu and --checkpoint both give the weights; pass one of them")
        if self.draft_checkpoint is not None and self.checkpoint is None:
            raise K31Error("--draft-checkpoint adds the draft to a measured --checkpoint; pass --checkpoint "
                           "too (or include the draft in --weights-gb-per-gpu)")


def checkpoint_bytes(path: str, option: str = "--checkpoint") -> int:
    """Total size of the *.safetensors shards in a checkpoint directory (symlinks followed, as in a
    Hugging Face cache snapshot)."""
    root = Path(path)
    if not root.is_dir():
        raise K31Error(f"{option} {path} is not a directory; give the model's local directory")
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise K31Error(f"{option} {path} holds no *.safetensors files; give the directory of the weight "
                       f"shards")
    return sum(shard.stat().st_size for shard in shards)


def _number(value: float | int | None, cast=float):
    return None if value is None else cast(value)


class _Server:
    """The memory model of one server of a plan."""

    def __init__(self, plan: dict[str, Any], server: dict[str, Any], opts: Options):
        self.c = constants()
        self.opts = opts
        self.plan = plan
        self.s = server
        self.lay = server["layout"]
        self.settings = server["settings"]    # what the ranks' argv and env carry, typed (recipe.model)
        self.values: dict[str, Any] = {}
        self.derivation: dict[str, str] = {}
        self.notes: list[str] = []
        self.refusal: str | None = None
        self.pool: int | None = None

    def put(self, key: str, value: Any, line: str | None = None) -> Any:
        self.values[key] = value
        if line:
            self.derivation[key] = line
        return value

    def run(self) -> dict[str, Any]:
        lay = self.lay
        self.dp, self.tp, self.pp = lay["dp"], lay["tp"], lay["pp"]
        self.gpus_per_node = self.tp * self.pp // lay["nnodes"]
        self.dflash = self.s.get("speculative") == "dflash"
        self._gpu()
        self._fraction()
        self._weights()
        self._reserves()
        self._units()
        self._split_mode()
        self._pool()
        self._host()
        if self.plan["platform"] == "tpu7x":
            self.notes.append("the TPU launcher sizes its own pools from its config (seed 3.4); these "
                              "figures apply the same model as an estimate")
        return {**self.values, "derivation": self.derivation, "notes": self.notes}

    # -- the GPU budget ----------------------------------------------------------------------------
    def _gpu(self) -> None:
        platform = self.plan["platform"]
        spec = self.c["gpus"][platform]
        self.gpu_mib = spec["hbm_gib"] * 1024
        self.gpu = self.put("gpu_bytes", spec["hbm_gib"] * GIB,
                            f"{spec['hbm_gib']} GiB per {platform} GPU ({spec['source']}; HBM sizes are "
                            f"binary)")

    def _fraction(self) -> None:
        given = _number(self.settings["mem_fraction_static"])
        if given is not None:
            mfs, line = given, "--mem-fraction-static in the plan's argv"
        else:
            mfs, line = self._auto_fraction()
        self.mfs = self.put("mem_fraction_static", mfs, line)
        self.static = self.put("static_bytes", int(mfs * self.gpu),
                               f"{mfs} x {fmt_bytes(self.gpu)}: weights and pools live in this share")
        limit = mem_fraction_static_max(self.plan["platform"], self.plan["topology"])
        if limit is not None and mfs > limit:
            self.notes.append(f"mem_fraction_static {mfs} is above {limit}: 0.87 and 0.88 overflowed GTT at "
                              f"startup or ran slower on the single-node recipe (seed AMD Memory); set "
                              f"mem_fraction_static")

    def _auto_fraction(self) -> tuple[float, str]:
        """Upstream's value when --mem-fraction-static is not given (server_args.py)."""
        a = self.c["mem_fraction_static_auto"]
        tier = next(t for t in a["tiers"] if t[0] is None or self.gpu_mib < t[0])
        chunk = max(tier[1], a["min_chunk_tokens"])    # k31 emits no --chunked-prefill-size: upstream's tier
        bs = _number(self.settings["cuda_graph_max_bs_decode"], int) or tier[2 if self.tp < 4 else 3]
        per_token = a["prefill_mib_per_token"]
        terms = [(f"{a['base_mib']} base", a["base_mib"]),
                 (f"{per_token} x {chunk} prefill chunk", per_token * chunk),
                 (f"{a['cuda_graph_mib_per_bs']} x {bs} CUDA graph bs", a["cuda_graph_mib_per_bs"] * bs),
                 (f"{a['parallel_mib_per_8_gpus']} x TP{self.tp}·PP{self.pp}/8",
                  a["parallel_mib_per_8_gpus"] * self.tp * self.pp / 8)]
        if self.dp > 1:
            terms.append((f"{a['dp_attention_mib_per_bs_dp']} x {bs} x DP{self.dp}",
                          a["dp_attention_mib_per_bs_dp"] * bs * self.dp))
            if bs > a["dp_attention_large_bs"]:
                terms.append((f"{a['dp_attention_large_mib_per_bs_dp']} x {bs} x DP{self.dp}",
                              a["dp_attention_large_mib_per_bs_dp"] * bs * self.dp))
        reserved = sum(v for _, v in terms)
        text = " + ".join(t for t, _ in terms)
        if self.gpu_mib > a["large_gpu_mib"] and reserved < a["large_gpu_floor_mib"]:
            reserved, text = a["large_gpu_floor_mib"], f"max({text}, {a['large_gpu_floor_mib']})"
        if self.dflash:
            reserved += a["speculative_mib"]
            text += f" + {a['speculative_mib']} draft"
        mfs = round((self.gpu_mib - reserved) / self.gpu_mib, 3)
        return mfs, (f"upstream's automatic value (server_args.py): ({self.gpu_mib} - reserved) / "
                     f"{self.gpu_mib} MiB, reserved = {text} = {reserved:g} MiB")

    def _weights(self) -> None:
        o = self.opts
        if o.weights_gb_per_gpu is not None:
            weights, line = int(o.weights_gb_per_gpu * GB), "given (--weights-gb-per-gpu), target + draft"
        elif o.checkpoint is not None:
            total = checkpoint_bytes(o.checkpoint)
            weights = total // (self.tp * self.pp)
            line = (f"{fmt_bytes(total)} of *.safetensors in {o.checkpoint} / (TP{self.tp} x PP{self.pp}); "
                    f"approximate: EP only moves experts inside that group, and layers replicated under DP "
                    f"attention, PCP or --shared-experts-tp-size add a little")
            if o.draft_checkpoint is not None:
                draft = checkpoint_bytes(o.draft_checkpoint, "--draft-checkpoint")
                weights += draft // self.tp
                line += f"; + draft {fmt_bytes(draft)} / TP{self.tp}"
        else:
            self.weights = self.put("weights_bytes", None,
                                    "unknown: pass --weights-gb-per-gpu or --checkpoint (Kimi-K3.1-Pro's "
                                    "size is not in the seed), so capacity figures are left out")
            return
        if weights >= self.gpu:
            raise K31Error(f"weights of {fmt_bytes(weights)} per GPU are larger than the "
                           f"{fmt_bytes(self.gpu)} of a {self.plan['platform']} GPU ({self.s['name']}, "
                           f"TP{self.tp} x PP{self.pp}); check --weights-gb-per-gpu / --checkpoint or pick a "
                           f"larger layout")
        self.weights = self.put("weights_bytes", weights, line)

    def _reserves(self) -> None:
        r = self.c["rocm_runtime_reserve"]
        gib = _number(self.settings["rocm_runtime_reserve_gb"])
        env = catalog()["amd"]["runtime_reserve_env"]
        self.reserve = self.put("runtime_reserve_bytes", int((gib or 0) * GIB),
                                f"{env}={gib:g} GiB in the plan's env ({r['source'].split(':')[0]})"
                                if gib else "none (the ROCm reserve applies to MI350X / MI355X only)")
        mega = self.c["megamoe"]
        if self.s.get("moe_runner") == "megamoe":
            cap = int(self.settings["megamoe_token_cap"])
            per = mega["workspace_bytes_per_token_per_ep_rank"]
            ep = self.lay["ep"]
            self.workspace = self.put("megamoe_workspace_bytes", ep * cap * per,
                                      f"EP{ep} x token cap {cap} x {per:,} B per token per EP rank (an "
                                      f"estimate: FP8 dispatch + BF16 combine of a 7,168-wide hidden state)")
        else:
            self.workspace = self.put("megamoe_workspace_bytes", 0, "none (MoE runner is not MegaMoE)")

    def _units(self) -> None:
        kda, mla = self.c["kda_state"], self.c["mla_kv"]
        pcp, dcp = self.lay["pcp"], self.lay["dcp"]
        attn_tp = self.tp // (self.dp * pcp)
        per_rank = kda["bytes_per_request_per_rank"] * kda["at_attention_tp"] / attn_tp / self.pp
        self.k = self.put("kda_bytes_per_request", round(per_rank),
                          f"{fmt_bytes(kda['bytes_per_request_per_rank'])} at TP8 (seed Tuning notes) x 8 / "
                          f"attention TP{attn_tp} (TP{self.tp} / DP{self.dp} / PCP{pcp}) / PP{self.pp}; DCP "
                          f"does not shard KDA states")
        self.c_target = mla["bytes_per_token"] / dcp / self.pp
        per_token, line = self.c_target, (f"{fmt_bytes(mla['bytes_per_token'])} MLA + indexer (seed Tuning "
                                          f"notes) / DCP{dcp} / PP{self.pp}; TP and PCP replicate it")
        if self.dflash:
            share = self.c["dflash_draft_kv"]["fraction_of_target_kv"]
            per_token *= 1 + share
            line += f"; x {1 + share:g} for the DFLASH draft KV ring (seed)"
        self.c_kv = self.put("kv_bytes_per_token", per_token, line)

    def _split_mode(self) -> None:
        """How the engine splits the pool between KDA slots and KV (upstream _handle_max_mamba_cache)."""
        slots_cfg = self.c["kda_slots_per_running_request"]
        given, role = self.settings, self.s["role"]
        radix_off = not given["radix_cache"]
        if role == "decode" or radix_off:
            self.ratio = self.put("kda_slots_per_request", slots_cfg["no_radix"],
                                  slots_cfg["no_radix_source"])
        else:
            self.ratio = self.put("kda_slots_per_request", slots_cfg["radix"],
                                  f"radix cache on: {slots_cfg['radix_source']}")
        planned = _number(given["max_running_requests"], int)
        self.n = self.opts.concurrency or planned
        why = ("--concurrency" if self.opts.concurrency else
               "--max-running-requests in the plan's argv" if planned else
               "not set: the engine derives it (prefill servers need none)")
        self.put("max_running_requests", self.n, why)
        self.n_w = math.ceil(self.n / self.dp) if self.n else None
        self.t = self.opts.context_length or 2    # upstream: max_running_requests <= KV tokens // 2
        explicit = _number(given["max_mamba_cache_size"], int)
        if explicit is not None:
            self.mode, self.slots_w = "explicit", explicit // self.dp
            self.mode_text = f"--max-mamba-cache-size {explicit} / DP{self.dp}"
        elif radix_off and self.n:
            self.mode = "running"
            self.mode_text = "radix cache off: upstream sets one slot per running request"
        else:
            self.mode = "ratio"
            ratio = _number(given["mamba_full_memory_ratio"])
            self.r = ratio or self.c["mamba_full_memory_ratio_default"]
            self.mode_text = (f"pool x {self.r:g} / (1 + {self.r:g}) for KDA states "
                              f"(--mamba-full-memory-ratio {self.r:g}, a KDA:KV ratio)")

    def _capacity(self, pool: float) -> tuple[int, int, int]:
        """(KDA slots, KV tokens, most requests of self.t tokens each), per DP worker."""
        k, c, t = self.k, self.c_kv, self.t
        if self.mode == "running":
            slots = self.n_w
        elif self.mode == "explicit":
            slots = self.slots_w
        else:
            slots = int(pool * self.r / (1 + self.r) // k)
        kv = pool - slots * k
        tokens = int(kv // c) if kv > 0 else 0
        if self.mode == "running":
            return slots, tokens, int(pool // (k + t * c))
        return slots, tokens, min(slots // self.ratio, tokens // t)

    def _pool_needed(self) -> float:
        """The least pool per GPU that serves n_w requests of self.t tokens (inf: no pool does)."""
        k, c, n, t = self.k, self.c_kv, self.n_w, self.t
        if self.mode == "running":
            return n * (k + t * c)
        if self.mode == "explicit":
            return math.inf if n > self.slots_w // self.ratio else self.slots_w * k + n * t * c
        # slots = floor(pool r/(1+r) / k) >= n x ratio, and KV >= pool/(1+r) covers n x t tokens
        return max(n * self.ratio * k * (1 + self.r) / self.r, n * t * c * (1 + self.r))

    def _pool(self) -> None:
        avail = self.static - self.reserve - self.workspace
        self.budget = (f"{self.mfs} x {fmt_bytes(self.gpu)} GPU - reserve {fmt_bytes(self.reserve)} - "
                       f"MegaMoE workspace {fmt_bytes(self.workspace)}")
        self.per_req = f"{self.t:,} tokens" if self.opts.context_length else "the engine's 2-token minimum"
        if self.n:
            need = self._pool_needed()
            self.put("weights_headroom_bytes", None if math.isinf(need) else int(avail - need),
                     f"{self.budget} - the pool {self.n} requests need ({self.per_req} each, {self.ratio} "
                     f"KDA slot(s) per request, {self.mode_text}): the most weights per GPU that still fit")
            if self.weights is None and avail < need:
                # name the setting that is out of range, where it is not max_running_requests itself
                hint = ("; the static memory fraction came out at or below 0: lower cuda_graph_max_bs_decode or set "
                        "mem_fraction_static" if self.mfs <= 0 else
                        f"; lower kda_state_slots: its KDA states alone need {fmt_bytes(self.slots_w * self.k)}"
                        if self.mode == "explicit" and self.slots_w * self.k > avail else "")
                self.refusal = self._refusal(
                    "--max-mamba-cache-size gives too few KDA slots" if math.isinf(need) else
                    f"even with no weights, {self.budget} leaves {fmt_bytes(avail)} per GPU, short of the "
                    f"{fmt_bytes(need)} it needs{hint}")
        if self.weights is None:
            self.put("fits", False if self.refusal else None,
                     "not with any weights" if self.refusal else "unchecked: the weights per GPU are unknown")
            return
        pool = self.put("pool_bytes", avail - self.weights,
                        f"{self.budget} - weights {fmt_bytes(self.weights)}")
        if pool <= 0:
            self.put("fits", False, "the weights and reserves fill the static share")
            self.refusal = (f"{self._where()} cannot load: weights {fmt_bytes(self.weights)} per GPU exceed "
                            f"{self.budget} = {fmt_bytes(avail)}; raise mem_fraction_static or pick a layout "
                            f"that shards the weights further")
            return
        self.pool = pool
        self.slots_w, self.tokens_w, most_w = self._capacity(pool)
        self._figures(most_w)
        most = most_w * self.dp
        if self.n:
            fits = self.put("fits", self.n_w <= most_w, f"{self.n} requests ({self.n_w} per worker) vs at "
                                                          f"most {most}")
        else:
            fits = self.put("fits", most_w >= 1, f"at most {most} requests of {self.per_req}")
        if fits:
            return
        if self.slots_w * self.k >= pool:
            hint = "lower kda_state_slots: its KDA states fill the pool"
        elif self.mode != "running" and self.slots_w // self.ratio < (self.n_w or 1):
            hint = "raise kda_state_slots or mamba_full_memory_ratio"
        else:
            hint = "shorten the context or give the server more memory"
        self.refusal = self._refusal(
            f"at most {most} fit in the {fmt_bytes(pool)} pool per GPU ({self.budget} - weights "
            f"{fmt_bytes(self.weights)}), at {fmt_bytes(self.k)} per KDA slot, {self.ratio} slot(s) per "
            f"request and {fmt_bytes(self.c_kv)} KV per token; lower max_running_requests to {most}, or "
            f"{hint}")

    def _where(self) -> str:
        s = self.s
        return f"{s['name']} ({s['role']} {s['strategy']}, {self.plan['platform']})"

    def _refusal(self, why: str) -> str:
        subject = f"max_running_requests={self.n}" if self.n else "a single request"
        return f"{self._where()} cannot fit {subject} ({self.per_req} each): {why}"

    def _figures(self, most_w: int) -> None:
        pool, dp = self.pool, (f" x DP{self.dp}" if self.dp > 1 else "")
        self.put("kda_slots", self.slots_w * self.dp, f"{self.mode_text}: {self.slots_w:,} per worker{dp}")
        self.put("kda_pool_bytes", self.slots_w * self.k, f"{self.slots_w:,} slots x {fmt_bytes(self.k)}")
        self.put("kv_tokens", self.tokens_w * self.dp,
                 f"(pool - KDA states) / {fmt_bytes(self.c_kv)} per token = {self.tokens_w:,} per worker{dp}")
        length = self.opts.context_length
        self.put("context_length", length, "--context-length" if length else None)
        self.put("max_concurrency", most_w * self.dp,
                 f"min(KDA slots / {self.ratio}, KV tokens / {self.per_req}) with the plan's split{dp}"
                 if self.mode != "running" else
                 f"pool / (KDA state + {self.per_req} x KV per token){dp}: one slot per request")
        if length:
            best = int(pool // (self.ratio * self.k + self.t * self.c_kv))
            self.put("max_concurrency_best_split", best * self.dp,
                     f"pool / ({self.ratio} x {fmt_bytes(self.k)} KDA + {self.t:,} x {fmt_bytes(self.c_kv)} "
                     f"KV){dp}, with the KDA slots sized to the requests (the recommended settings)")
        if self.n:
            self.put("tokens_per_request", self.tokens_w // self.n_w,
                     f"KV tokens per worker / {self.n_w} requests per worker")
            self._recommend(pool)

    def _recommend(self, pool: int) -> None:
        slots_w = self.n_w * self.ratio
        kda = slots_w * self.k
        dp = f" x DP{self.dp}" if self.dp > 1 else ""
        self.put("recommended_max_mamba_cache_size", slots_w * self.dp,
                 f"{self.n_w} requests per worker x {self.ratio} slot(s){dp}: the least that serves them, "
                 f"exact (more slots keep more prefix states on the radix tree)")
        if self.mode == "running":
            self.notes.append("with the radix cache off the engine sets the KDA slots to "
                              "--max-running-requests and ignores --mamba-full-memory-ratio")
        if kda >= pool:
            self.put("recommended_mamba_full_memory_ratio", None, "none: the KDA states alone fill the pool")
            return
        ratio = math.ceil(kda / (pool - kda) * 10**4) / 10**4
        self.put("recommended_mamba_full_memory_ratio", ratio,
                 f"{fmt_bytes(kda)} KDA / {fmt_bytes(pool - kda)} KV, rounded up; it follows the estimated "
                 f"pool, so prefer --max-mamba-cache-size")

    # -- the host tier -----------------------------------------------------------------------------
    def _host(self) -> None:
        hc = self.c["hicache"]
        offload = self.s.get("kv_offload", "none")
        hicache = offload in ("hicache", "mooncake")    # both emit --enable-hierarchical-cache
        dram = self._dram()
        if not hicache:
            self.put("host_pinned_bytes_per_gpu", 0, "no HiCache host tier on this server")
            self.put("host_pinned_bytes_per_node", 0)
            self.put("host_needed_bytes_per_node", 0)
            self.put("host_fits", True if dram else None)
            return
        ratio = _number(self.settings["hicache_ratio"]) or hc["ratio_default"]
        mamba_ratio = _number(self.settings["hicache_mamba_host_ratio"]) or ratio
        mamba_env = catalog()["hicache"]["rocm"]["mamba_host_ratio_env"]
        if self.pool is None:
            self.put("host_pinned_bytes_per_gpu", None,
                     f"{ratio:g} x GPU KV + {mamba_ratio:g} x GPU KDA states: needs the weights per GPU")
            for key in ("host_pinned_bytes_per_node", "host_needed_bytes_per_node", "host_fits"):
                self.put(key, None)
            return
        kv_target = self.tokens_w * self.c_target
        kda = self.slots_w * self.k
        segment = self.settings["mooncake_segment_bytes"] if offload == "mooncake" else 0
        per_gpu = int(ratio * kv_target + mamba_ratio * kda + segment)
        line = (f"--hicache-ratio {ratio:g} x {fmt_bytes(kv_target)} target KV + "
                f"{mamba_env} {mamba_ratio:g} x {fmt_bytes(kda)} KDA states")
        if segment:
            line += f" + {fmt_bytes(segment)} Mooncake store segment"
        self.put("host_pinned_bytes_per_gpu", per_gpu,
                 f"{line} (upstream memory_pool_host.py; seed AMD HiCache)")
        node = self.put("host_pinned_bytes_per_node", per_gpu * self.gpus_per_node,
                        f"{self.gpus_per_node} GPUs per node x {fmt_bytes(per_gpu)}")
        headroom = hc["host_headroom_bytes"]
        need = self.put("host_needed_bytes_per_node", node + headroom,
                        f"pinned + {fmt_bytes(headroom)} the engine keeps free ({hc['headroom_source']})"
                        + ("; on ROCm the pools are GTT memory and count against the node's GTT limit (seed)"
                           if self.reserve else ""))
        self.put("host_fits", None if dram is None else need <= dram)

    def _dram(self) -> int | None:
        if self.opts.host_dram_gb is not None:
            return self.put("host_dram_bytes_per_node", int(self.opts.host_dram_gb * GB),
                            "given (--host-dram-gb)")
        spec = self.c["host_dram"][self.plan["platform"]]
        gib = spec["gib"]
        return self.put("host_dram_bytes_per_node", None if gib is None else gib * GIB,
                        f"default {gib} GiB ({spec['source']})" if gib else spec["source"])


def server_memory(plan: dict[str, Any], server: dict[str, Any],
                  options: Options | None = None) -> dict[str, Any]:
    """The `memory` section of one server (it does not refuse: `fits` says whether it fits)."""
    return _Server(plan, server, options or Options()).run()


def _evaluate(plan: dict[str, Any], options: Options | None) -> list[str]:
    """Set every server's `memory` section; return the refusals."""
    refusals = []
    for server in plan["servers"]:
        model = _Server(plan, server, options or Options())
        server["memory"] = model.run()
        if model.refusal:
            refusals.append(model.refusal)
    return refusals


def annotate_plan(plan: dict[str, Any], options: Options | None = None) -> None:
    """Add a `memory` section to every server of the plan; refuse (K31Error, with the numbers) a server
    whose --max-running-requests cannot fit. Without the weights per GPU the fit is checked only
    against the budget with no weights at all, and the section says the rest is unchecked."""
    refusals = _evaluate(plan, options)
    if refusals:
        raise K31Error(refusals[0])


def calc(plan: dict[str, Any], options: Options | None = None) -> tuple[dict[str, Any], list[str]]:
    """`k31 calc`: the plan's servers with their memory sections and each host's need, plus the
    refusals (empty when everything fits)."""
    refusals = _evaluate(plan, options)
    keys = ("name", "role", "strategy", "layout", "memory")
    servers = [{key: s[key] for key in keys} for s in plan["servers"]]
    hosts = []
    for s in plan["servers"]:
        m = s["memory"]
        need, dram = m["host_needed_bytes_per_node"], m["host_dram_bytes_per_node"]
        hosts += [{"host": rank["host"], "needed_bytes": need, "dram_bytes": dram,
                   "fits": None if need is None or dram is None else need <= dram} for rank in s["ranks"]]
    report = {"platform": plan["platform"], "topology": plan["topology"], "servers": servers, "hosts": hosts}
    return report, refusals


def host_memory_need(plan: dict[str, Any], host: Any, options: Options | None = None) -> int:
    """Bytes of host memory a host needs for the HiCache pinned pools of the server it runs (the pools
    plus the engine's 10 GiB headroom; 0 when it runs none), so pre-flight can refuse a node that lacks
    it. `host` is an inventory host name (or has `.name`). Without options the plan's memory sections
    are used where present. The host pools follow the GPU pools, so they need the weights per GPU: an
    unknown size is a K31Error."""
    name = getattr(host, "name", host)
    need = 0
    for server in plan["servers"]:
        if not any(rank["host"] == name for rank in server["ranks"]):
            continue
        memory = server["memory"] if options is None and "memory" in server else server_memory(
            plan, server, options)
        value = memory["host_needed_bytes_per_node"]
        if value is None:
            raise K31Error(f"host {name} runs {server['name']} with a HiCache host tier, whose size follows "
                           f"the GPU KV pool; give the weights per GPU (k31 calc --weights-gb-per-gpu or "
                           f"--checkpoint) to size it")
        need += value
    return need
