"""Parsers for GPU inventories: `nvidia-smi --query-gpu=index,name,memory.total,driver_version,pci.bus_id
--format=csv,noheader,nounits`, the `nvidia-smi -q` / `nvidia-smi` header (driver and CUDA version),
`amd-smi static --json`, `amd-smi version`, and the amdgpu GTT limits from sysfs."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

QUERY_FIELDS = ("index", "name", "memory.total", "driver_version", "pci.bus_id")


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    memory_mib: float
    driver: str
    bus_id: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_nvidia_query(text: str) -> list[Gpu]:
    """One GPU per CSV line in QUERY_FIELDS order; memory.total is MiB with `nounits`."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(QUERY_FIELDS):
            raise ValueError(f"nvidia-smi --query-gpu line has {len(fields)} fields, expected "
                             f"{len(QUERY_FIELDS)}: {line!r}")
        index, name, memory, driver, bus = fields
        gpus.append(Gpu(int(index), name, float(memory), driver, bus))
    return gpus


def parse_nvidia_header(text: str) -> dict[str, str]:
    """Driver and CUDA version from `nvidia-smi -q` ("CUDA Version : 13.0") or the plain table's banner
    ("Driver Version: 580.159.04     CUDA Version: 13.0")."""
    out = {}
    for key, pattern in (("driver_version", r"Driver Version\s*:\s*([\w.]+)"),
                         ("cuda_version", r"CUDA Version\s*:\s*([\w.]+)"),
                         ("attached_gpus", r"Attached GPUs\s*:\s*(\d+)")):
        m = re.search(pattern, text)
        if m:
            out[key] = m.group(1)
    return out


def _amd_size_mib(size: Any) -> float | None:
    """amd-smi's VRAM size: {"value": N, "unit": "MB"} in JSON, "N MB" in older text-like fields. amd-smi's
    "MB" is MiB (an MI300X reports 196608 for its 192 GiB)."""
    if isinstance(size, dict):
        value, unit = size.get("value"), str(size.get("unit", "MB")).upper()
    elif isinstance(size, str) and size.split()[0].isdigit():
        value, unit = int(size.split()[0]), [*size.split(), "MB"][1].upper()
    elif isinstance(size, int | float):
        value, unit = size, "MB"
    else:
        return None
    if not isinstance(value, int | float):
        return None
    scale = {"B": 1 / (1 << 20), "KB": 1 / 1024, "MB": 1, "GB": 1024}.get(unit)
    return None if scale is None else value * scale


def parse_amd_smi_static(text: str) -> list[Gpu]:
    """`amd-smi static --json`: a list of GPUs (older releases) or {"gpu_data": [...]} (newer ones)."""
    data = json.loads(text)
    if isinstance(data, dict):
        data = data.get("gpu_data", [])
    gpus = []
    for entry in data:
        if not isinstance(entry, dict) or "gpu" not in entry:
            continue
        asic = entry.get("asic") if isinstance(entry.get("asic"), dict) else {}
        vram = entry.get("vram") if isinstance(entry.get("vram"), dict) else {}
        driver = entry.get("driver") if isinstance(entry.get("driver"), dict) else {}
        bus = entry.get("bus") if isinstance(entry.get("bus"), dict) else {}
        memory = _amd_size_mib(vram.get("size", vram.get("vram_size")))
        gpus.append(Gpu(int(entry["gpu"]), str(asic.get("market_name", "")), memory or 0.0,
                        str(driver.get("version", driver.get("driver_version", ""))), str(bus.get("bdf", ""))))
    return gpus


def parse_amd_smi_version(text: str) -> dict[str, str]:
    """`amd-smi version`: "AMDSMI Tool: 24.7.1+... | AMDSMI Library version: 24.7.2.0 | ROCm version: 6.2.0 |
    amdgpu version: 6.10.10" -> {"tool", "library", "rocm", "amdgpu"} (values as printed, "N/A" kept)."""
    keys = {"amdsmi tool": "tool", "amdsmi library version": "library", "rocm version": "rocm",
            "amdgpu version": "amdgpu"}
    out = {}
    for part in text.strip().splitlines()[0].split("|") if text.strip() else []:
        key, sep, value = part.partition(":")
        if sep and key.strip().lower() in keys:
            out[keys[key.strip().lower()]] = value.strip()
    return out


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    """"13.0" -> (13, 0); "6.4.1" -> (6, 4, 1); None for "N/A" or nothing."""
    m = re.match(r"^\s*(\d+(?:\.\d+)*)", text or "")
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def parse_gtt(text: str) -> dict[str, Any]:
    """`grep -H . /sys/class/drm/card*/device/mem_info_gtt_total /sys/module/amdgpu/parameters/gttsize`:
    the GTT size of each amdgpu device in bytes (amdgpu sysfs ABI), and the module's gttsize in MiB
    (-1: the driver's default)."""
    cards: dict[str, int] = {}
    gttsize: int | None = None
    for line in text.splitlines():
        path, sep, value = line.rpartition(":")
        if not sep or not value.strip().lstrip("-").isdigit():
            continue
        m = re.search(r"/(card\d+)/device/mem_info_gtt_total$", path)
        if m:
            cards[m.group(1)] = int(value)
        elif path.endswith("/amdgpu/parameters/gttsize"):
            gttsize = int(value)
    return {"cards": cards, "gttsize_mib": gttsize}
