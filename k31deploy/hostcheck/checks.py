"""Pre-flight checks: one host's probe output (the collect script's sections) against what the plan needs.

Every check gives a record {host, check, status, found, expected, note}:
  pass  - the host has what the plan needs
  fail  - it does not, and k31 will not change that: pre-flight refuses the host
  fix   - it does not yet, and a later prepare role changes it (the note names the role)
  skip  - not checked here, and the note says why (no GPU expected on this host, size unknown ...)
All records of all hosts are reported together, so one run names every problem."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from k31deploy import memory
from k31deploy.errors import K31Error
from k31deploy.hostcheck import gpu, rdma, system
from k31deploy.plan import Plan, kv_crosses_nodes

GB = 10**9
# A GPU reports a little less than its HBM (firmware, ECC): an H200 141 GiB shows 143,771 MiB (99.6%).
GPU_MEMORY_TOLERANCE = 0.95
# The model name each platform's GPUs report must contain (nvidia-smi name / amd-smi market_name).
GPU_NAME_TOKEN = {
    "b300": "B300", "gb300": "GB300", "b200": "B200", "gb200": "GB200", "h200": "H200", "h100": "H100",
    "mi350x": "MI350X", "mi355x": "MI355X", "vera-rubin": "Rubin",
}
# The first CUDA release that compiles for the architecture (Hopper sm_90: 11.8, Blackwell sm_100: 12.8,
# Blackwell Ultra sm_103: 12.9): a driver reporting less cannot run the image's kernels. Vera Rubin: none
# k31 relies on yet (k31_preflight_min_cuda sets one).
MIN_CUDA = {"h100": "11.8", "h200": "11.8", "b200": "12.8", "gb200": "12.8", "b300": "12.9", "gb300": "12.9"}
IMEX_CHANNEL_DEVICE = "nvidia-caps-imex-channels"


@dataclass(frozen=True)
class Settings:
    """What the role passes (k31_preflight_* variables without the prefix)."""

    require_gpu: bool = True  # false on hosts without GPUs (the sandbox): hardware checks are skipped
    require_rdma: bool | None = None  # None: needed for PD, a multi-node server or a Mooncake store, off NVL72
    weights_gb_per_gpu: float | None = None  # sizes the HiCache host pools (else measured safetensors)
    model_gb: float | None = None  # model + draft on disk (else measured at the staging source)
    min_cuda: str | None = None  # else MIN_CUDA
    min_driver: str | None = None

    @classmethod
    def from_mapping(cls, values: dict[str, Any] | None) -> Settings:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values or {}) - names)
        if unknown:
            raise K31Error(f"pre-flight setting(s) {', '.join(unknown)} unknown; valid: {', '.join(sorted(names))}")
        return cls(**{k: _coerce(k, cls.__dataclass_fields__[k].type, v) for k, v in (values or {}).items()
                      if v is not None and v != ""})


def _coerce(name: str, kind: str, value: Any) -> Any:
    """Ansible may hand booleans and numbers over as text ("False", "220")."""
    try:
        if kind.startswith("bool") and isinstance(value, str):
            return {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}[value.lower()]
        if kind.startswith("float"):
            return float(value)
    except (KeyError, ValueError):
        raise K31Error(f"k31_preflight_{name}={value!r} is not a valid {kind.split()[0]}") from None
    return str(value) if kind.startswith("str") else value


def _record(host: str, check: str, status: str, found: Any, expected: Any, note: str = "") -> dict[str, Any]:
    return {"host": host, "check": check, "status": status, "found": found, "expected": expected, "note": note}


def _gib(n: float | None) -> str:
    return "unknown" if n is None else memory.fmt_bytes(n)


class _Host:
    def __init__(self, doc: dict[str, Any], host: str, probes: dict[str, system.Section], settings: Settings):
        # the memory planner reads (and sizes) the plan's dict; everything else its typed reading
        self.doc, self.plan = doc, Plan.of(doc)
        self.host, self.p, self.s = host, probes, settings
        self.platform, self.spec = self.plan.platform, self.plan.hardware
        self.family = self.spec.family
        self.servers = [s for s in self.plan.servers if host in s.hosts]
        self.records: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {}

    def add(self, check: str, status: str, found: Any, expected: Any, note: str = "") -> None:
        self.records.append(_record(self.host, check, status, found, expected, note))

    def text(self, name: str) -> system.Section | None:
        return self.p.get(name)

    def said(self, name: str) -> str:
        """What a failed probe said, for a 'found' field."""
        sec = self.p.get(name)
        if sec is None:
            return f"{name}: not run"
        last = re.sub(r"\x1b\[[0-9;]*m", "", (sec.text.strip().splitlines() or [""])[-1]).strip()
        return f"{name}: {'not installed' if sec.missing else last or 'rc ' + str(sec.rc)}"

    # -- every host ---------------------------------------------------------------------------------
    def os(self) -> None:
        rel = system.parse_os_release(self.p["os-release"].text) if "os-release" in self.p else {}
        kernel = self.p["kernel"].text.strip() if "kernel" in self.p else "unknown"
        self.facts.update(os=rel.get("PRETTY_NAME", "unknown"), kernel=kernel)
        state = self.p["systemd"].text.strip().splitlines()[-1] if self.p.get("systemd") and \
            self.p["systemd"].text.strip() else "unknown"
        self.facts["systemd"] = state
        ok = state in ("running", "degraded")
        self.add("os", "pass" if ok else "fail", f"{self.facts['os']}, kernel {kernel}, systemd {state}",
                 "Linux with systemd running (engines run as systemd units)")

    def time(self) -> None:
        synced, how = system.time_sync(self.p.get("timedatectl"), self.p.get("chrony"))
        self.facts["time_sync"] = synced
        if synced is None:
            self.add("time_sync", "skip", how, "clock synchronised (NTP)",
                     "no time service answered on this host; check its clock by hand")
        else:
            self.add("time_sync", "pass" if synced else "fail", how, "clock synchronised (NTP)")

    # -- engine hosts -------------------------------------------------------------------------------
    def hardware_skip(self, checks: list[str], why: str) -> None:
        for check in checks:
            self.add(check, "skip", "not checked", "-", why)

    def gpus(self) -> None:
        names = ["gpu_count", "gpu_model", "gpu_memory", "gpu_driver",
                 "cuda_version" if self.family == "cuda" else "rocm_version"]
        if not self.s.require_gpu:
            self.hardware_skip(names, "k31_preflight_require_gpu is false (a host without GPUs, e.g. the sandbox)")
            return
        want = self.spec.gpus_per_node
        token = GPU_NAME_TOKEN.get(self.platform)
        expected_count = f"{want} GPUs per {self.spec.form}"
        probe = "nvidia-query" if self.family == "cuda" else "amd-static"
        sec = self.p.get(probe)
        if sec is None or not sec.ok:
            self.add("gpu_count", "fail", self.said(probe), expected_count)
            self.hardware_skip(names[1:], "no GPU inventory (see gpu_count)")
            return
        gpus = gpu.parse_nvidia_query(sec.text) if self.family == "cuda" else gpu.parse_amd_smi_static(sec.text)
        self.facts["gpus"] = [g.to_dict() for g in gpus]
        self.add("gpu_count", "pass" if len(gpus) == want else "fail", f"{len(gpus)} GPUs", expected_count)
        names_seen = sorted({g.name for g in gpus})
        ok = bool(gpus) and all(re.search(rf"\b{re.escape(token)}\b", g.name, re.I) for g in gpus)
        self.add("gpu_model", "pass" if ok else "fail", ", ".join(names_seen) or "none",
                 f"{token} ({self.platform})")
        hbm = memory.constants()["gpus"][self.platform]["hbm_gib"]
        floor = GPU_MEMORY_TOLERANCE * hbm * 1024
        low = min((g.memory_mib for g in gpus), default=0)
        self.add("gpu_memory", "pass" if gpus and low >= floor else "fail", f"{low:.0f} MiB (smallest GPU)",
                 f">= {floor:.0f} MiB ({GPU_MEMORY_TOLERANCE:.0%} of {hbm} GiB, data/memory.yaml)")
        drivers = sorted({g.driver for g in gpus})
        self._driver(drivers)
        if self.family == "cuda":
            self._cuda()
        else:
            self._rocm()

    def _driver(self, drivers: list[str]) -> None:
        minimum = self.s.min_driver
        status = "pass" if len(drivers) == 1 else "fail"
        if status == "pass" and minimum and gpu.version_tuple(drivers[0]) < gpu.version_tuple(minimum):
            status = "fail"
        expected = "one driver version on every GPU" + (f", >= {minimum}" if minimum else "")
        self.add("gpu_driver", status, ", ".join(drivers) or "none", expected)

    def _cuda(self) -> None:
        header = gpu.parse_nvidia_header(self.p["nvidia-header"].text) if self.p.get("nvidia-header") else {}
        cuda = header.get("cuda_version")
        self.facts["cuda_version"] = cuda
        minimum = self.s.min_cuda or MIN_CUDA.get(self.platform)
        if cuda is None:
            self.add("cuda_version", "fail", self.said("nvidia-header"), f">= {minimum or 'any'}")
        elif minimum is None:
            self.add("cuda_version", "pass", cuda, "any", "no minimum known for this platform "
                     "(k31_preflight_min_cuda sets one)")
        else:
            ok = gpu.version_tuple(cuda) >= gpu.version_tuple(minimum)
            self.add("cuda_version", "pass" if ok else "fail", f"CUDA {cuda} (driver {header.get('driver_version')})",
                     f">= {minimum} (first CUDA for {self.platform})")

    def _rocm(self) -> None:
        # The catalog says "ROCm 10" (seed: "Requires ROCm 10; the recipes have not run on ROCm 7 images").
        runtime = self.spec.runtime
        need = gpu.version_tuple(runtime.split()[-1])
        sec = self.p.get("amd-version")
        version = gpu.parse_amd_smi_version(sec.text).get("rocm") if sec is not None and sec.ok else None
        self.facts["rocm_version"] = version
        have = gpu.version_tuple(version)
        if have is None:
            found = f"ROCm {version}" if version else self.said("amd-version")
            self.add("rocm_version", "fail", found, f"{runtime} or newer (seed AMD MI350X / MI355X)")
        else:
            ok = have[: len(need)] >= need
            self.add("rocm_version", "pass" if ok else "fail", f"ROCm {version}",
                     f"{runtime} or newer (seed AMD MI350X / MI355X)")

    def _options(self) -> tuple[memory.Options | None, str]:
        """Weights per GPU: given, or measured from the safetensors on this host (the staged copy or the
        staging source), as k31 calc --checkpoint measures them: target / (TP x PP) + draft / TP."""
        if self.s.weights_gb_per_gpu:
            given = float(self.s.weights_gb_per_gpu)
            return memory.Options(weights_gb_per_gpu=given), "k31_preflight_weights_gb_per_gpu"
        sizes = self.facts.get("sizes", {})
        target = sizes.get("model", {}).get("safetensors") or sizes.get("model-source", {}).get("safetensors")
        if not target or not self.servers:
            return None, "plan"
        draft = sizes.get("draft", {}).get("safetensors") or sizes.get("draft-source", {}).get("safetensors") or 0
        lay = self.servers[0].layout
        weights = target / (lay.tp * lay.pp) + draft / lay.tp
        return memory.Options(weights_gb_per_gpu=weights / GB), "the safetensors measured on this host"

    def host_memory(self) -> None:
        mem = system.parse_meminfo(self.p["meminfo"].text) if self.p.get("meminfo") else {}
        total = mem.get("MemTotal")
        self.facts["mem_total_bytes"] = total
        options, source = self._options()
        try:
            need = memory.host_memory_need(self.doc, self.host, options)
        except K31Error as exc:
            self.add("host_memory", "skip", _gib(total), "unknown", f"{exc} (k31_preflight_weights_gb_per_gpu)")
            return
        tier = ", ".join(f"{s.name} kv_offload={s.kv_offload}" for s in self.servers)
        expected = f">= {_gib(need)} ({tier}: HiCache pinned pools + 10 GiB, weights from {source})"
        if total is None:
            self.add("host_memory", "fail", self.said("meminfo"), expected)
        else:
            self.add("host_memory", "pass" if total >= need else "fail", f"{_gib(total)} MemTotal", expected)
        self.facts["host_memory_need_bytes"] = need
        if self.family == "rocm" and need:
            self._gtt(options)

    def _gtt(self, options: memory.Options | None) -> None:
        pinned = 0
        for server in self.servers:
            section = server.memory if options is None else memory.server_memory(
                self.doc, next(s for s in self.doc["servers"] if s["name"] == server.name), options)
            pinned = max(pinned, (section or {}).get("host_pinned_bytes_per_gpu") or 0)
        expected = f">= {_gib(pinned)} per GPU (HiCache pools are GTT memory on ROCm, seed On AMD MI355X)"
        if not self.s.require_gpu:
            self.add("gtt_limit", "skip", "not checked", expected, "k31_preflight_require_gpu is false")
            return
        limits = gpu.parse_gtt(self.p["gtt"].text)["cards"] if self.p.get("gtt") else {}
        if not limits:
            self.add("gtt_limit", "fail", "no /sys/class/drm/card*/device/mem_info_gtt_total", expected)
            return
        low = min(limits.values())
        self.facts["gtt_bytes_per_gpu"] = low
        self.add("gtt_limit", "pass" if low >= pinned else "fail", f"{_gib(low)} (smallest card)", expected,
                 "" if low >= pinned else "raise amdgpu gttsize, or lower --hicache-ratio / "
                 "SGLANG_HICACHE_MAMBA_HOST_RATIO")

    def disk(self) -> None:
        dirs = [p for p in (self.plan.knob("model_path"), self.plan.knob("draft_model_path")) if isinstance(p, str)]
        if not dirs or not all(p.startswith("/") for p in dirs):
            self.add("disk", "skip", ", ".join(dirs) or "no model_path", "a local directory",
                     "model_path is not a local directory; set k31_model_path to where k31_model stages it")
            return
        sizes = self.facts.get("sizes", {})
        if self.s.model_gb:
            need, source = int(float(self.s.model_gb) * GB), "k31_preflight_model_gb"
        elif "model-source" in sizes:
            need = sizes["model-source"]["total"] + sizes.get("draft-source", {}).get("total", 0)
            source = "the staging source"
        else:
            need, source = None, ""
        if not self.p.get("df-model") or not self.p["df-model"].ok:
            self.add("disk", "fail", self.said("df-model"), f"free space under {dirs[0]}")
            return
        df = system.parse_df(self.p["df-model"].text)
        present = sizes.get("model", {}).get("total", 0) + sizes.get("draft", {}).get("total", 0)
        room = df["avail"] + present
        self.facts["disk"] = {**df, "present_bytes": present}
        found = f"{_gib(df['avail'])} free on {df['mount']} + {_gib(present)} already staged"
        if need is None:
            self.add("disk", "skip", found, "model size unknown",
                     "set k31_preflight_model_gb, or stage from a path (k31_model_source=path) k31 can measure")
        else:
            self.add("disk", "pass" if room >= need else "fail", found, f">= {_gib(need)} (model + draft, {source})")

    def rdma_and_memlock(self) -> None:
        links = self.p.get("rdma-link")
        sysfs = rdma.parse_sysfs(self.p["rdma-sysfs"].text) if self.p.get("rdma-sysfs") else {"ports": [], "gids": []}
        ports = rdma.merge_ports(
            rdma.parse_rdma_link(links.text) if links is not None and links.ok else [],
            rdma.parse_ibv_devinfo(self.p["ibv-devinfo"].text) if self.p.get("ibv-devinfo") and
            self.p["ibv-devinfo"].ok else [],
            sysfs["ports"])
        active = [p.name for p in ports if p.state == "ACTIVE"]
        self.facts["rdma_ports"] = [p.to_dict() for p in ports]
        required = self.s.require_rdma
        if required is None:
            # KV or tensors leave this host's servers' nodes (NVL72 moves them over NVLink)
            spans = kv_crosses_nodes(self.plan.topology, [(s.layout.nnodes, s.kv_offload) for s in self.servers])
            required = self.s.require_gpu and spans and not self.spec.nvl72
        why = ("the plan moves KV or tensors between nodes (PD or multi-node) over RDMA" if required
               else "not required here (k31_preflight_require_rdma sets it)")
        found = ", ".join(f"{p.name} {p.state}" for p in ports) or "no RDMA devices"
        if required:
            self.add("rdma_ports", "pass" if active else "fail", found, "at least one ACTIVE RDMA port", why)
        else:
            self.add("rdma_ports", "pass" if active or not ports else "skip", found, "-", why)
        if not (required or ports):
            self.add("memlock", "skip", "not checked", "unlimited", "no RDMA devices on this host")
            return
        sec = self.p.get("ulimit-l")
        try:
            kib = system.parse_ulimit(sec.text) if sec is not None and sec.ok else 0
        except ValueError:
            kib = 0
        if kib == 0:
            self.add("memlock", "fail", self.said("ulimit-l"), "unlimited")
            return
        can_raise = bool(self.p.get("capeff")) and system.has_capability(
            system.parse_capeff(self.p["capeff"].text), system.CAP_SYS_RESOURCE)
        found = "unlimited" if kib is None else f"{kib} KiB"
        if kib is None:
            self.add("memlock", "pass", found, "unlimited")
        elif can_raise:
            self.add("memlock", "fix", found, "unlimited", "k31_rdma sets memlock unlimited (limits.d, systemd)")
        else:
            self.add("memlock", "fail", found, "unlimited", "this session cannot raise rlimits (no CAP_SYS_RESOURCE)")

    def imex(self) -> None:
        if not self.spec.nvl72:
            return
        if not self.s.require_gpu:
            self.add("imex_channel", "skip", "not checked", "/dev/nvidia-caps-imex-channels/channel0",
                     "k31_preflight_require_gpu is false")
            return
        devices = system.parse_proc_devices(self.p["proc-devices"].text) if self.p.get("proc-devices") else {}
        present = bool(self.p.get("imex-channel")) and self.p["imex-channel"].ok
        if IMEX_CHANNEL_DEVICE not in devices:
            self.add("imex_channel", "fail", f"no {IMEX_CHANNEL_DEVICE} in /proc/devices",
                     "an NVIDIA driver with IMEX channels (NVL72)")
        elif present:
            self.add("imex_channel", "pass", "channel0 present", "/dev/nvidia-caps-imex-channels/channel0")
        else:
            self.add("imex_channel", "fix", "channel0 missing", "/dev/nvidia-caps-imex-channels/channel0",
                     "k31_mnnvl creates it (mknod now, NVreg_CreateImexChannel0=1 for reboots)")

    def run(self) -> dict[str, Any]:
        self.facts["sizes"] = _sizes(self.p.get("sizes"))
        self.os()
        self.time()
        if not self.servers:
            self.add("engine", "skip", "no engine rank", "-", "this host runs no engine (router / frontend)")
        elif self.family == "tpu":
            self.add("engine", "skip", "TPU host", "-", "k31 has no TPU hardware check")
        else:
            self.gpus()
            self.host_memory()
            self.disk()
            self.rdma_and_memlock()
            self.imex()
        return {"host": self.host, "checks": self.records, "facts": self.facts}


def _sizes(section: system.Section | None) -> dict[str, dict[str, int]]:
    """The collect script's `sizes` lines: LABEL TOTAL_BYTES SAFETENSORS_BYTES PATH."""
    out: dict[str, dict[str, int]] = {}
    for line in section.text.splitlines() if section is not None else []:
        parts = line.split(None, 3)
        if len(parts) == 4 and parts[1].isdigit() and parts[2].isdigit():
            out[parts[0]] = {"total": int(parts[1]), "safetensors": int(parts[2]), "path": parts[3]}
    return out


def evaluate(plan: dict[str, Any], host: str, output: str | dict[str, system.Section],
             settings: Settings | dict[str, Any] | None = None) -> dict[str, Any]:
    """All checks of one host: {host, checks: [records], facts}."""
    probes = system.sections(output) if isinstance(output, str) else output
    if not isinstance(settings, Settings):
        settings = Settings.from_mapping(settings)
    return _Host(plan, host, probes, settings).run()


def report(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Every host's records together: failures first, then what prepare will fix, then what was skipped."""
    records = [r for result in results for r in result["checks"]]
    by = {status: [r for r in records if r["status"] == status] for status in ("fail", "fix", "skip", "pass")}

    def line(r: dict[str, Any]) -> str:
        text = f"{r['status'].upper()} {r['host']} | {r['check']}: found {r['found']}; expected {r['expected']}"
        return text + (f" ({r['note']})" if r["note"] else "")

    # Checks skipped on a host for one reason share a line ("SKIP h | gpu_count, gpu_model: reason").
    skipped: dict[tuple[str, str], list[str]] = {}
    for r in by["skip"]:
        if r["found"] == "not checked":
            skipped.setdefault((r["host"], r["note"]), []).append(r["check"])
    skip_lines = [f"SKIP {host} | {', '.join(names)}: {note}" for (host, note), names in skipped.items()]
    skip_lines += [line(r) for r in by["skip"] if r["found"] != "not checked"]
    return {
        "ok": not by["fail"],
        "counts": {k: len(v) for k, v in by.items()},
        "failures": by["fail"], "fixes": by["fix"], "skipped": by["skip"],
        "lines": [line(r) for status in ("fail", "fix") for r in by[status]] + skip_lines,
        "hosts": {r["host"]: {"checks": r["checks"], "facts": r["facts"]} for r in results},
    }
