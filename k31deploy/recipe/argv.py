"""The command lines and environments the plan carries: each engine rank's argv and env, the router's or
Dynamo frontend's, and the Mooncake master's.

Layer: resolution (docs/architecture.md). Called by the resolver with the frozen description of the plan
(recipe.model: Setup, ServerSpec); it decides nothing the resolver has not, it spells the resolved values as
flags and env vars from the catalog. It imports the catalog, recipe.model and address only. A rank's argv
is the exact engine command line; the router's is complete but for what its role adds at start (the API key
through k31-secret-exec). Checking an engine command against the engine build's parser is the resolver's
(it keeps the branch-only record); flags.yaml registration is checked here (catalog.emit_check).
"""

from __future__ import annotations

from typing import Any

from k31deploy.address import host_port, http_url, url
from k31deploy.catalog import catalog, emit_check
from k31deploy.recipe.model import ServerSpec, Setup

# Behind Dynamo the resolver adds this warning once (argv.env puts the parsers in the workers' env).
DYNAMO_PARSER_WARNING = (
    "behind Dynamo the seed's --tool-call-parser goes to the workers as DYN_TOOL_CALL_PARSER (and the "
    "reasoning parser also as DYN_REASONING_PARSER): the frontend parses with the parsers the worker "
    "registers, and dynamo.sglang refuses SGLang's --tool-call-parser next to them (ai-dynamo 1.6.1 "
    "components/src/dynamo/sglang/args.py)")


def _extend(argv: list[str], flags: dict[str, Any]) -> None:
    """Append `{flag: value}`: True is a bare switch, None/False are left out."""
    for flag, value in flags.items():
        if value is None or value is False:
            continue
        argv.append(flag)
        if value is not True:
            argv.append(str(value))


class EngineArgv:
    def __init__(self, setup: Setup):
        self.r = setup
        self.cat = catalog()

    # -- engines ---------------------------------------------------------------------------------
    def server(self, s: ServerSpec) -> dict[str, Any]:
        """The plan's server entry; rank 0's engine command (after launcher()) is for the resolver to check."""
        port = self.cat["ports"][s.role]
        bootstrap = self.cat["ports"]["bootstrap"] if s.role == "prefill" else None
        ranks = []
        for rank, host in enumerate(s.hosts):
            argv = self.argv(s, rank, port)
            if self.r.tpu:
                emit_check("tpu", argv[len(self.launcher()):])
            ranks.append({"host": host.name, "address": host.address, "node_rank": rank,
                          "unit": f"k31-{s.name}-r{rank}", "argv": argv, "env": self.env(s, port, host.address),
                          "env_from_files": self.dynamo_env_from_files(),
                          "request_plane_ports": self.request_plane_ports(), "auth_file": self.auth_file(s, rank)})
        return {
            "name": s.name,
            "role": s.role,
            "strategy": s.strategy,
            "layout": dict(s.layout),
            "verification": s.cell["verification"],
            "port": port,
            "bootstrap_port": bootstrap,
            "moe_runner": s.moe_runner,
            "speculative": "dflash" if s.speculative else "none",
            "kv_offload": s.kv_offload,
            "monokernel": s.monokernel,
            "settings": s.settings.as_dict(),
            "ranks": ranks,
        }

    def auth_file(self, s: ServerSpec, rank: int) -> str | None:
        """The 0600 YAML an engine serving HTTP reads its API keys from (None behind Dynamo, or on TPU)."""
        if self.r.router == "dynamo" or self.r.tpu:
            return None
        return self.cat["engine_auth"]["path"].format(unit=f"k31-{s.name}-r{rank}")

    def launcher(self) -> list[str]:
        if self.r.router == "dynamo" and not self.r.tpu:
            return list(self.cat["dynamo"]["worker"])
        return list(self.r.family["launcher"])

    def argv(self, s: ServerSpec, rank: int, port: int) -> list[str]:
        r, cat, k = self.r, self.cat, self.r.knob
        st = s.settings
        argv = self.launcher()
        if r.tpu:
            return argv    # seed 3.4: everything else lives in the launcher's config
        lay = s.layout
        flags: dict[str, Any] = {
            "--model-path": k("model_path", cat["model"]["name"]),
            "--served-model-name": cat["model"]["name"],
            "--trust-remote-code": True,
        }
        if r.router != "dynamo":    # a dynamo.sglang worker serves no HTTP; the frontend does
            # Engines bind the cluster address only: their API (admin endpoints too) is internal.
            flags.update({"--host": s.hosts[rank].address, "--port": port})
        flags["--tp-size"] = lay["tp"]
        if lay["dp"] > 1:    # attention DP, spelled as the engine build spells it
            flags.update({flag: lay["dp"] if value == "dp" else value
                          for flag, value in r.attention_dp_flags.items()})
        flags.update({
            "--pp-size": lay["pp"] if lay["pp"] > 1 else None,
            # MegaMoE sets EP itself (EP = TP); TRT-LLM takes the cell's EP.
            "--ep-size": lay["ep"] if lay["ep"] > 1 and s.moe_runner != "megamoe" else None,
            "--dcp-size": lay["dcp"] if lay["dcp"] > 1 else None,
            "--dcp-comm-backend": k("dcp_comm_backend", s.cell.get("dcp_comm_backend")) if lay["dcp"] > 1 else None,
        })
        if lay["pcp"] > 1:
            flags.update(cat["prefill_cp"]["flags"])
            flags[cat["prefill_cp"]["size_flag"]] = lay["pcp"]
        if lay["pp"] > 1:
            flags.update(cat["pp"]["flags"])
        if lay["nnodes"] > 1:
            head = s.hosts[0].address
            flags.update({"--nnodes": lay["nnodes"], "--node-rank": rank,
                          "--dist-init-addr": host_port(head, dist_init_port(r))})
        if s.role in ("prefill", "decode"):
            flags.update({
                "--disaggregation-mode": s.role,
                "--disaggregation-transfer-backend": r.transfer,
                "--disaggregation-bootstrap-port": cat["ports"]["bootstrap"] if s.role == "prefill" else None,
                "--disaggregation-ib-device": k("disaggregation_ib_device"),
            })
        self._moe(s, flags)
        flags.update(cat["attention_backends"][k("attention_backend", "flashmla")]["flags"]
                     if s.moe_runner is not None else {})
        self._speculative(s, flags)
        self._hicache(s, flags)
        flags.update({
            "--max-mamba-cache-size": st.max_mamba_cache_size,
            "--mamba-full-memory-ratio": st.mamba_full_memory_ratio,
        })
        if "kda_states_per_path" in r.knobs:
            flags["--mamba-max-states-per-path"] = r.knobs["kda_states_per_path"]
        flags.update({
            "--max-running-requests": st.max_running_requests,
            "--cuda-graph-max-bs-decode": st.cuda_graph_max_bs_decode,
            "--mem-fraction-static": st.mem_fraction_static,
            "--prefill-decode-interval": st.prefill_decode_interval,
            "--cuda-graph-backend-prefill": k("prefill_cuda_graph") if s.role != "decode" else None,
            "--enable-symm-mem": bool(k("enable_symm_mem")),
        })
        if s.monokernel:
            flags.update(cat["amd"]["monokernel"]["flags"])
        flags.update({
            "--reasoning-parser": k("reasoning_parser", cat["parsers"]["reasoning"]),
            # Behind Dynamo the frontend builds the tool calls from the worker's Dynamo parser (worker_env), and
            # dynamo.sglang refuses SGLang's --tool-call-parser next to it (args.py _validate_parser_flags).
            "--tool-call-parser": None if r.router == "dynamo" else k("tool_call_parser", cat["parsers"]["tool_call"]),
            "--enable-metrics": True,
        })
        if r.router != "dynamo":    # its HTTP API is authenticated; the keys are in a 0600 file
            flags[cat["engine_auth"]["flag"]] = self.auth_file(s, rank)
        _extend(argv, flags)
        return argv

    def _moe(self, s: ServerSpec, flags: dict[str, Any]) -> None:
        if s.moe_runner != "megamoe":
            return
        mega = self.cat["moe_runners"]["megamoe"]
        flags.update(mega["flags"])
        if s.flat_tp:
            flags["--shared-experts-tp-size"] = self.r.knob(
                "shared_experts_tp_size", mega["flat_tp_flags"]["--shared-experts-tp-size"])

    def _speculative(self, s: ServerSpec, flags: dict[str, Any]) -> None:
        if not s.speculative:
            return
        dflash = self.cat["speculative"]["dflash"]
        flags.update(dflash["flags"])
        flags[dflash["draft_flag"]] = self.r.knob("draft_model_path", self.cat["model"]["draft"])
        flags[dflash["block_flag"]] = s.dflash_block
        flags.update(dflash["family"].get(self.r.family_name, {}).get("flags", {}))
        if s.role in dflash["replayssm_roles"]:
            flags[dflash["replayssm_flag"]] = True
        if s.layout["dp"] > 1:
            flags.update(dflash["attention_dp"]["flags"])

    def _hicache(self, s: ServerSpec, flags: dict[str, Any]) -> None:
        hc, k = self.cat["hicache"], self.r.knob
        if s.hicache:
            if self.r.rocm:
                flags.update(hc["rocm"]["flags"])
                flags["--hicache-ratio"] = s.settings.hicache_ratio
                flags["--hicache-write-policy"] = k("hicache_write_policy", hc["rocm"]["write_policy"])
            else:
                flags.update(hc["overlay"]["flags"])
                flags["--hicache-ratio"] = s.settings.hicache_ratio
                flags["--hicache-write-policy"] = k("hicache_write_policy")
            if s.kv_offload == "mooncake":
                flags.update(hc["mooncake"]["flags"])
        if s.decode_radix:
            flags[hc["decode_radix_flag"]] = True

    def env(self, s: ServerSpec, port: int, address: str) -> dict[str, str]:
        r, cat, st = self.r, self.cat, s.settings
        env: dict[str, Any] = dict(r.family["env"])
        env.update(s.cell.get("env", {}))
        if s.layout["pp"] > 1 and "pp_layer_partition" in r.knobs:
            env[cat["pp"]["partition_env"]] = r.knobs["pp_layer_partition"]
        if r.rocm:
            amd = cat["amd"]
            env[amd["runtime_reserve_env"]] = st.rocm_runtime_reserve_gb
            if s.monokernel:
                env.update(amd["monokernel"]["env"])
            if s.hicache:
                hc = cat["hicache"]["rocm"]
                env[hc["mamba_host_ratio_env"]] = st.hicache_mamba_host_ratio
                env.update(hc["env"])
        elif st.hicache_mamba_host_ratio is not None:
            env[cat["hicache"]["rocm"]["mamba_host_ratio_env"]] = st.hicache_mamba_host_ratio
        if s.speculative and s.layout["dp"] > 1:
            env.update(cat["speculative"]["dflash"]["attention_dp"]["env"])
        if s.moe_runner == "megamoe":
            mega = cat["moe_runners"]["megamoe"]
            env[mega["token_cap_env"]] = st.megamoe_token_cap
        if r.nvl72:
            if s.layout["nnodes"] > 1:
                env.update(cat["nvl72"]["multinode_env"])
            if s.role != "unified" and r.knob("mooncake_mnnvl", True):
                env.update(cat["nvl72"]["pd_env"])
        if s.kv_offload == "mooncake":
            mc = cat["hicache"]["mooncake"]
            env.update(mc["env"])
            env[mc["master_env"]] = host_port(r.mooncake_host.address, cat["ports"]["mooncake_master"])
        if r.router == "dynamo":
            dyn = cat["dynamo"]
            env.update(dyn["worker_system_env"])
            # The frontend parses reasoning and tool calls with the parsers the worker registers (Dynamo's
            # tokenizer path: SGLang returns token ids, so SGLang's own parsers never see the text).
            env[dyn["worker_parser_env"]["reasoning"]] = r.knob("reasoning_parser", cat["parsers"]["reasoning"])
            env[dyn["worker_parser_env"]["tool_call"]] = r.knob("tool_call_parser", cat["parsers"]["tool_call"])
            env[dyn["worker_system_port_env"]] = port
            env[dyn["worker_system_host_env"]] = address    # its status server, on the cluster address
            env.update(self.dynamo_discovery_env(address))    # DYN_TCP_RPC_PORT: request_plane_ports
        return {key: str(value) for key, value in env.items()}

    def request_plane_ports(self) -> list[int] | None:
        """Behind Dynamo, the range a worker's request plane (DYN_TCP_RPC_PORT) takes its port from at each
        start (catalog ports.dynamo_request says why it moves); None otherwise."""
        if self.r.router != "dynamo":
            return None
        first, last = self.cat["ports"]["dynamo_request"]
        return [int(first), int(last)]

    def dynamo_env_from_files(self) -> dict[str, str]:
        """Env vars a Dynamo process takes as the text of a file (etcd's client: PEM, not a path)."""
        if self.r.router != "dynamo":
            return {}
        pki = self.cat["pki"]
        return {key: pki[part] for key, part in self.cat["dynamo"]["etcd_tls_env_from_files"].items()}

    def dynamo_discovery_env(self, address: str) -> dict[str, str]:
        """How a Dynamo process on `address` reaches etcd and NATS (TLS with the host's cluster certificate;
        etcd's PEM from dynamo_env_from_files), and where its request/response-plane and event-plane
        listeners bind: mutual TLS with that certificate."""
        host = self.r.router_host.address
        ports, pki, dyn = self.cat["ports"], self.cat["pki"], self.cat["dynamo"]
        env = {"ETCD_ENDPOINTS": url("https", host, ports["etcd"]),
               "NATS_SERVER": url("tls", host, ports["nats"]),
               "DYN_TCP_RPC_HOST": address, "DYN_TCP_RESPONSE_STREAM_HOST": address, "DYN_EVENT_PLANE_HOST": address}
        env.update({key: pki[part] for key, part in dyn["client_tls_env"].items()})
        return env

    def mooncake_master(self) -> dict[str, Any] | None:
        host = self.r.mooncake_host
        if host is None:
            return None
        ports = self.cat["ports"]
        # upstream binds both on 0.0.0.0 by default (mooncake_master --helpfull): the cluster address only.
        argv = ["mooncake_master", f"--rpc_address={host.address}", f"--rpc_port={ports['mooncake_master']}",
                f"--metrics_host={host.address}", f"--metrics_port={ports['mooncake_metrics']}"]
        emit_check("mooncake_master", argv[1:])
        return {"host": host.name, "address": host.address, "port": ports["mooncake_master"],
                "metrics_port": ports["mooncake_metrics"], "unit": "k31-mooncake-master", "argv": argv}


def dist_init_port(setup: Setup) -> int:
    """The multi-node rendezvous port (--dist-init-addr): the knob, else the catalog's."""
    return setup.knob("dist_init_port", catalog()["ports"]["dist_init"])


def router_tokenizer(dialect: dict[str, Any], model_path: str | None) -> str | None:
    """The seed's router --tokenizer-path where the dialect takes it: a local model's tokenizer.json (for a hub id
    the router falls back to --model-id)."""
    if dialect["model_flags"] and model_path and model_path.startswith("/"):
        return f"{model_path.rstrip('/')}/tokenizer.json"
    return None


def router_plan(r: Setup, servers: list[dict[str, Any]]) -> dict[str, Any] | None:
    if r.router == "none":
        return None
    cat, host = catalog(), r.router_host
    cfg = cat["router"]
    tls = dict(cat["public_tls"]) if r.public_tls else None
    if r.router == "dynamo":
        dyn = cat["dynamo"]
        argv = [*dyn["frontend"], "--http-host", host.public_address, "--http-port", str(cat["ports"]["router"]),
                "--router-mode", dyn["router_mode"], "--router-session-affinity-ttl-secs",
                str(r.knob("dynamo_session_affinity_ttl", dyn["session_affinity_ttl_secs"])),
                "--migration-limit", str(dyn["migration_limit"]),
                "--discovery-backend", dyn["discovery_backend"], "--event-plane", dyn["event_plane"]]
        emit_check("dynamo_frontend", argv[len(dyn["frontend"]):])
        env = EngineArgv(r).dynamo_discovery_env(host.address)
        env["DYN_TCP_RESPONSE_STREAM_PORT"] = str(cat["ports"]["dynamo_response"])
        env.update(dyn["frontend_env"])
        env.update({key: cat["pki"][part] for key, part in dyn["frontend_tls_env"].items()})
        if tls:    # the site's certificate faces clients; their certificates still come from the cluster CA
            env.update({"DYN_TLS_CERT_PATH": tls["cert"], "DYN_TLS_KEY_PATH": tls["key"]})
        return {"kind": "dynamo", "host": host.name, "address": host.address,
                "public_address": host.public_address, "port": cat["ports"]["router"], "tls": tls,
                "mounts": [cat["pki"]["dir"], *([tls["dir"]] if tls else [])],
                "unit": "k31-dynamo-frontend", "argv": argv, "env": env,
                "env_from_files": EngineArgv(r).dynamo_env_from_files(),
                "discovery": {"etcd_port": cat["ports"]["etcd"], "nats_port": cat["ports"]["nats"]}}
    dialect = cfg["dialects"][r.dialect]
    argv = list(dialect["launcher"])

    def worker_url(server: dict[str, Any]) -> str:
        return http_url(server["ranks"][0]["address"], server["port"])

    if r.topology == "pd":
        argv.append("--pd-disaggregation")
        for s in servers:
            if s["role"] == "prefill":
                argv += ["--prefill", worker_url(s), str(s["bootstrap_port"])]
        for s in servers:
            if s["role"] == "decode":
                argv += ["--decode", worker_url(s)]
    else:
        argv += ["--worker-urls", *(worker_url(s) for s in servers)]
    argv += ["--host", host.public_address, "--port", str(cat["ports"]["router"]), "--policy", cfg["policy"]]
    mounts = [tls["dir"]] if tls else []
    if dialect["model_flags"]:
        argv += ["--model-id", cat["model"]["name"]]
        tokenizer = router_tokenizer(dialect, r.knob("model_path"))
        if tokenizer:    # in the model k31_model staged on this engine host (the resolver made sure it is one)
            argv += ["--tokenizer-path", tokenizer]
            mounts.append(tokenizer.rsplit("/", 1)[0])
    argv += ["--request-timeout-secs", str(cfg["request_timeout_secs"])]
    if dialect["metrics_flags"]:
        argv += ["--prometheus-host", host.address, "--prometheus-port", str(cat["ports"]["router_metrics"])]
    if tls:
        argv += ["--tls-cert-path", tls["cert"], "--tls-key-path", tls["key"]]
    if dialect["startup_timeout"]:
        argv += ["--worker-startup-timeout-secs",
                 str(r.knob("router_worker_startup_timeout", cfg["worker_startup_timeout_secs"]))]
    launcher_len = len(dialect["launcher"])
    emit_check("router", argv[launcher_len:])
    return {"kind": "sglang", "dialect": r.dialect, "host": host.name, "address": host.address,
            "public_address": host.public_address, "port": cat["ports"]["router"], "tls": tls,
            "mounts": mounts, "unit": "k31-router",
            "argv": argv, "env": dict(cfg["env"]), "secret_exec": dialect["secret_exec"],
            "metrics_port": cat["ports"]["router_metrics"] if dialect["metrics_flags"] else None}
