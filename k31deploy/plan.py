"""The plan contract, typed: frozen records of the `k31 plan --json` document, which its consumers read.

The resolver hands the plan on as a JSON-able dict (it crosses the CLI and Ansible as JSON; the contract is in
docs/architecture.md). A consumer reads it through `Plan.of(doc)`, once per call: the keys every consumer
relies on are checked there (a missing or mistyped one is a K31Error naming it, not a KeyError deep inside a
filter), and what follows reads attributes, `plan.hardware.nvl72`, `server.layout.nnodes`, `rank.unit`.
`EngineSettings` is both sides' record: the resolver fills it and writes it as `servers[].settings`.

Records keep the document's names and nesting; lists become tuples and sub-documents stay read-only mappings
where no consumer reads them field by field (a rank's env, the router's argv and discovery ports, the engine
section, the memory planner's figures).

Layer: base (docs/architecture.md); imports `errors` and `address` only, so every layer above reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import Any

from k31deploy.address import http_url
from k31deploy.errors import K31Error


class _Reader:
    """One sub-document of the plan, with where it sits (`servers[1].ranks[0]`) for the error."""

    def __init__(self, doc: Any, where: str):
        if not isinstance(doc, Mapping):
            raise K31Error(f"the plan's {where} is {type(doc).__name__}, not an object: the document is not a "
                           f"k31 plan (k31 plan --json)")
        self.doc, self.where = doc, where

    def need(self, key: str, kind: type | tuple[type, ...] = object) -> Any:
        if key not in self.doc:
            raise K31Error(f"the plan's {self.where} has no {key!r}: the document is not a k31 plan "
                           f"(k31 plan --json)")
        return self.check(key, self.doc[key], kind)

    def get(self, key: str, kind: type | tuple[type, ...] = object, default: Any = None) -> Any:
        value = self.doc.get(key)
        return default if value is None else self.check(key, value, kind)

    def check(self, key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # bool is an int to Python; a plan never has one where a number belongs
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds and object not in kinds):
            raise K31Error(f"the plan's {self._name(key)} is {value!r}; valid: {_kind_name(kind)}")
        return value

    def _name(self, key: str) -> str:
        return key if self.where == "document" else f"{self.where}.{key}"

    def mapping(self, key: str) -> Mapping[str, Any]:
        return MappingProxyType(dict(self.get(key, Mapping, {})))

    def sub(self, key: str) -> _Reader | None:
        value = self.doc.get(key)
        return None if value is None else _Reader(value, self._name(key))

    def items(self, key: str) -> list[_Reader]:
        return [_Reader(item, f"{self._name(key)}[{i}]") for i, item in enumerate(self.get(key, list, []))]


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    words = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
             Mapping: "an object"}
    return " or ".join(words.get(k, k.__name__) for k in kinds)


@dataclass(frozen=True)
class EngineSettings:
    """The numbers and switches of one server's engine command that size its memory and schedule it, as
    its ranks' argv and env carry them: None where k31 emits nothing (the engine's own default)."""

    mem_fraction_static: float | None          # --mem-fraction-static
    max_running_requests: int | None           # --max-running-requests
    cuda_graph_max_bs_decode: int | None       # --cuda-graph-max-bs-decode
    max_mamba_cache_size: int | None           # --max-mamba-cache-size (knob kda_state_slots)
    mamba_full_memory_ratio: float | None      # --mamba-full-memory-ratio
    radix_cache: bool                          # the radix cache runs (a PD decode: only with its decode flag)
    hicache_ratio: float | None                # --hicache-ratio
    hicache_mamba_host_ratio: float | None     # SGLANG_HICACHE_MAMBA_HOST_RATIO
    rocm_runtime_reserve_gb: float | None      # SGLANG_ROCM_RUNTIME_RESERVE_GB
    megamoe_token_cap: int | None              # SGLANG_OPT_DEEPGEMM_MEGA_MOE_NUM_MAX_TOKENS_PER_RANK
    mooncake_segment_bytes: int | None         # MOONCAKE_GLOBAL_SEGMENT_SIZE, in bytes
    prefill_decode_interval: int | None        # --prefill-decode-interval

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def read(cls, doc: _Reader) -> EngineSettings:
        return cls(**{f.name: doc.need(f.name, bool if f.name == "radix_cache" else (int, float, type(None)))
                      for f in fields(cls)})


@dataclass(frozen=True)
class Layout:
    """A server's parallelism (the contract's `layout`)."""

    tp: int
    dcp: int
    pp: int
    pcp: int
    ep: int
    dp: int
    nnodes: int

    @classmethod
    def read(cls, doc: _Reader) -> Layout:
        return cls(**{f.name: doc.need(f.name, int) for f in fields(cls)})


@dataclass(frozen=True)
class Rank:
    """One process of a server: the host it runs on, its unit and its exact command."""

    host: str
    node_rank: int
    address: str                       # the host's cluster address, where the rank listens
    unit: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    env_from_files: Mapping[str, str]  # variables set to a file's text at start (Dynamo's etcd client)
    auth_file: str | None              # the engine's key file (--config), behind an API key
    request_plane_ports: tuple[int, int] | None    # behind Dynamo: the range a start picks its port from

    @classmethod
    def of(cls, doc: Rank | Mapping[str, Any]) -> Rank:
        """The typed rank of one of the plan's `servers[].ranks` entries (a Rank is returned as it is)."""
        return doc if isinstance(doc, Rank) else cls.read(_Reader(doc, "rank"))

    @classmethod
    def read(cls, doc: _Reader) -> Rank:
        ports = doc.get("request_plane_ports", list)
        return cls(host=doc.need("host", str), node_rank=doc.need("node_rank", int),
                   address=doc.need("address", str), unit=doc.need("unit", str),
                   argv=tuple(doc.need("argv", list)), env=doc.mapping("env"),
                   env_from_files=doc.mapping("env_from_files"), auth_file=doc.get("auth_file", str),
                   request_plane_ports=(int(ports[0]), int(ports[1])) if ports else None)


def kv_crosses_nodes(topology: str, servers: Iterable[tuple[int, str]]) -> bool:
    """KV or tensors leave a node: PD's transfer, a server on several nodes, or a Mooncake store (its
    MOONCAKE_PROTOCOL is rdma). `servers` are (nnodes, kv_offload) pairs: the plan's (the resolver maps the
    family's RDMA devices into the containers then) or one host's (pre-flight requires RDMA ports there)."""
    return topology == "pd" or any(nnodes > 1 or kv_offload == "mooncake" for nnodes, kv_offload in servers)


@dataclass(frozen=True)
class Server:
    """One engine server: the contract's keys, then the resolver's features, settings and memory figures."""

    name: str
    role: str                          # unified | prefill | decode
    strategy: str
    layout: Layout
    port: int
    bootstrap_port: int | None         # a PD prefill's
    ranks: tuple[Rank, ...]            # node-rank order
    kv_offload: str                    # none | hicache | mooncake
    settings: EngineSettings | None
    memory: Mapping[str, Any]          # the memory planner's figures, derivation and notes

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(r.host for r in self.ranks))

    @property
    def url(self) -> str:
        """Where the server answers HTTP: rank 0's cluster address (what the SGLang router is given)."""
        return http_url(self.ranks[0].address, self.port)

    @property
    def offloads_kv(self) -> bool:
        """A HiCache host tier runs (on its own, or in front of a Mooncake store)."""
        return self.kv_offload in ("hicache", "mooncake")

    @classmethod
    def of(cls, doc: Server | Mapping[str, Any]) -> Server:
        """The typed server of one of the plan's `servers` entries (a Server is returned as it is)."""
        return doc if isinstance(doc, Server) else cls.read(_Reader(doc, "server"))

    @classmethod
    def read(cls, doc: _Reader) -> Server:
        settings = doc.sub("settings")
        ranks = tuple(Rank.read(r) for r in doc.items("ranks"))
        if not ranks:
            raise K31Error(f"the plan's {doc.where}.ranks is empty; valid: one rank per node of the server")
        return cls(name=doc.need("name", str), role=doc.need("role", str), strategy=doc.need("strategy", str),
                   layout=Layout.read(_Reader(doc.need("layout", Mapping), f"{doc.where}.layout")),
                   port=doc.need("port", int), bootstrap_port=doc.get("bootstrap_port", int), ranks=ranks,
                   kv_offload=doc.get("kv_offload", str, "none"),
                   settings=EngineSettings.read(settings) if settings else None,
                   memory=doc.mapping("memory"))


@dataclass(frozen=True)
class Hardware:
    """What the platform's machines are: what the host checks and the IMEX setup compare a machine with."""

    family: str                        # cuda | rocm | tpu
    runtime: str                       # CUDA | ROCm 10 | ...
    form: str
    gpus_per_node: int
    nvl72: bool

    @classmethod
    def read(cls, doc: _Reader) -> Hardware:
        return cls(family=doc.need("family", str), runtime=doc.need("runtime", str), form=doc.need("form", str),
                   gpus_per_node=doc.need("gpus_per_node", int), nvl72=bool(doc.need("nvl72")))


@dataclass(frozen=True)
class Service:
    """A process beside the engines: the SGLang router or Dynamo frontend (`router`), the Mooncake master."""

    kind: str                          # sglang | dynamo | mooncake
    host: str
    address: str                       # its cluster address
    public_address: str                # where clients reach it (the router's; the cluster address otherwise)
    port: int
    metrics_port: int | None
    tls: Mapping[str, str] | None      # the site's certificate facing clients (public_tls)
    unit: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    env_from_files: Mapping[str, str]
    mounts: tuple[str, ...]            # host folders it reads (certificates)
    dialect: str | None                # the SGLang router's command
    secret_exec: bool                  # the SGLang router takes its API key in-process
    discovery: Mapping[str, int]       # Dynamo: etcd_port, nats_port

    @classmethod
    def read(cls, doc: _Reader, kind: str | None = None) -> Service:
        address = doc.need("address", str)
        tls = doc.get("tls", Mapping)
        return cls(kind=kind or doc.need("kind", str), host=doc.need("host", str), address=address,
                   public_address=doc.get("public_address", str, address), port=doc.need("port", int),
                   metrics_port=doc.get("metrics_port", int), tls=MappingProxyType(dict(tls)) if tls else None,
                   unit=doc.need("unit", str), argv=tuple(doc.need("argv", list)), env=doc.mapping("env"),
                   env_from_files=doc.mapping("env_from_files"), mounts=tuple(doc.get("mounts", list, [])),
                   dialect=doc.get("dialect", str), secret_exec=bool(doc.get("secret_exec", bool, False)),
                   discovery=doc.mapping("discovery"))


@dataclass(frozen=True)
class Listener:
    """One row of the plan's port table: a port (or a range up to `port_last`) a host listens on."""

    host: str
    port: int
    proto: str
    service: str
    purpose: str
    port_last: int | None

    @classmethod
    def read(cls, doc: _Reader) -> Listener:
        return cls(host=doc.need("host", str), port=doc.need("port", int), proto=doc.need("proto", str),
                   service=doc.need("service", str), purpose=doc.need("purpose", str),
                   port_last=doc.get("port_last", int))


@dataclass(frozen=True)
class Node:
    """A machine a node exporter runs on."""

    host: str
    address: str


@dataclass(frozen=True)
class Monitoring:
    """Prometheus, Alertmanager and the blackbox exporter on one host, a node exporter on every machine."""

    host: str
    address: str
    prometheus_port: int
    alertmanager_port: int
    blackbox_port: int
    node_exporter_port: int
    nodes: tuple[Node, ...]            # one node exporter per machine

    @classmethod
    def read(cls, doc: _Reader) -> Monitoring:
        nodes = tuple(Node(n.need("host", str), n.need("address", str)) for n in doc.items("nodes"))
        ports = {f.name: doc.need(f.name, int) for f in fields(cls) if f.name.endswith("_port")}
        return cls(host=doc.need("host", str), address=doc.need("address", str), nodes=nodes, **ports)


@dataclass(frozen=True)
class Pki:
    """The cluster CA's files on each host."""

    dir: str
    ca: str
    cert: str
    key: str

    @classmethod
    def read(cls, doc: _Reader) -> Pki:
        return cls(**{f.name: doc.need(f.name, str) for f in fields(cls)})


@dataclass(frozen=True)
class Plan:
    """The whole plan: the contract's keys (model, platform, topology, servers, router, warnings) and what the
    resolver adds beyond them (docs/architecture.md, What the plan carries beyond the contract)."""

    model: str
    platform: str
    topology: str                      # unified | pd
    image: str | None
    draft_model: str | None
    hardware: Hardware
    servers: tuple[Server, ...]
    router: Service | None
    mooncake_master: Service | None
    pd_transfer_ports: tuple[int, int] | None
    monitoring: Monitoring | None
    pki: Pki | None
    ports: tuple[Listener, ...]
    knobs: Mapping[str, Any]
    container_flags: tuple[str, ...]
    engine: Mapping[str, Any]
    warnings: tuple[str, ...]

    @classmethod
    def of(cls, doc: Plan | Mapping[str, Any]) -> Plan:
        """The typed plan of a `k31 plan --json` document (a Plan is returned as it is)."""
        if isinstance(doc, Plan):
            return doc
        top = _Reader(doc, "document")
        router, master, mon, pki = (top.sub(k) for k in ("router", "mooncake_master", "monitoring", "pki"))
        transfer = top.get("pd_transfer_ports", list)
        return cls(model=top.need("model", str), platform=top.need("platform", str),
                   topology=top.need("topology", str), image=top.get("image", str),
                   draft_model=top.get("draft_model", str),
                   hardware=Hardware.read(_Reader(top.need("hardware", Mapping), "hardware")),
                   servers=tuple(Server.read(s) for s in top.items("servers")),
                   router=Service.read(router) if router else None,
                   mooncake_master=Service.read(master, "mooncake") if master else None,
                   pd_transfer_ports=(int(transfer[0]), int(transfer[1])) if transfer else None,
                   monitoring=Monitoring.read(mon) if mon else None, pki=Pki.read(pki) if pki else None,
                   ports=tuple(Listener.read(p) for p in top.items("ports")), knobs=top.mapping("knobs"),
                   container_flags=tuple(top.get("container_flags", list, [])), engine=top.mapping("engine"),
                   warnings=tuple(top.get("warnings", list, [])))

    def knob(self, name: str, default: Any = None) -> Any:
        value = self.knobs.get(name)
        return default if value is None else value

    def server(self, name: str) -> Server:
        for server in self.servers:
            if server.name == name:
                return server
        raise K31Error(f"server {name} is not in the plan; valid: {', '.join(s.name for s in self.servers)}")

    def placed(self, host: str) -> list[tuple[Server, Rank]]:
        """The (server, rank) pairs a host runs, in plan order."""
        return [(s, r) for s in self.servers for r in s.ranks if r.host == host]

    def rank(self, unit: str) -> Rank:
        for server in self.servers:
            for rank in server.ranks:
                if rank.unit == unit:
                    return rank
        raise K31Error(f"no rank of the plan runs as {unit}")

    @property
    def router_kind(self) -> str | None:
        """sglang | dynamo, None where clients reach the unified servers directly (router=none)."""
        return self.router.kind if self.router else None

    @property
    def engine_hosts(self) -> list[str]:
        """Every engine host once, in plan order."""
        return list(dict.fromkeys(r.host for s in self.servers for r in s.ranks))
