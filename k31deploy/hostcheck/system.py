"""Parsers for the operating system's own reports: /proc/meminfo, `ulimit -l`, `df -P -B1`,
`timedatectl show`, `chronyc tracking`, /etc/os-release, /proc/devices, capability masks and
`ip -o -4 addr`. Each takes the tool's text as it printed it and returns plain values."""

from __future__ import annotations

import re
from dataclasses import dataclass

# The collect script prints each probe between these marks: `### k31:NAME` ... `### k31:NAME rc=N`.
_MARK = re.compile(r"^### k31:(?P<name>[\w.-]+)(?: rc=(?P<rc>-?\d+))?$")
MISSING = 127  # the shell's "command not found"
CAP_SYS_RESOURCE = 24  # linux/capability.h: raise resource limits (memlock above the hard limit)


@dataclass(frozen=True)
class Section:
    """One probe's output and exit status."""

    rc: int
    text: str

    @property
    def ok(self) -> bool:
        return self.rc == 0

    @property
    def missing(self) -> bool:
        return self.rc == MISSING


def sections(text: str) -> dict[str, Section]:
    """Split the collect script's output into its probes (a probe cut off before its end mark reads rc -1)."""
    out: dict[str, Section] = {}
    name: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        mark = _MARK.match(line)
        if not mark:
            if name is not None:
                lines.append(line)
            continue
        if mark["rc"] is None:
            name, lines = mark["name"], []
        elif name == mark["name"]:
            out[name] = Section(int(mark["rc"]), "\n".join(lines))
            name = None
    if name is not None:
        out[name] = Section(-1, "\n".join(lines))
    return out


def parse_os_release(text: str) -> dict[str, str]:
    """KEY=value lines, quotes removed (os-release(5))."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and not key.startswith("#"):
            out[key.strip()] = value.strip().strip('"').strip("'")
    return out


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo in bytes (the kernel writes kB meaning KiB; HugePages_* are counts, kept as is)."""
    out = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        fields = rest.split()
        if not sep or not fields or not fields[0].isdigit():
            continue
        value = int(fields[0])
        out[key.strip()] = value * 1024 if len(fields) > 1 and fields[1] == "kB" else value
    return out


def parse_ulimit(text: str) -> int | None:
    """`ulimit -l`: the memlock limit in KiB, None for unlimited."""
    value = text.strip().splitlines()[-1].strip() if text.strip() else ""
    if value == "unlimited":
        return None
    if not value.isdigit():
        raise ValueError(f"ulimit -l printed {value!r}, not a number or 'unlimited'")
    return int(value)


def parse_df(text: str) -> dict[str, int | str]:
    """`df -P -B1 PATH`: the filesystem holding PATH (sizes in bytes)."""
    rows = [line.split() for line in text.strip().splitlines()[1:] if line.strip()]
    if not rows or len(rows[-1]) < 6:
        raise ValueError("df printed no filesystem line")
    fs, size, used, avail, _, mount = rows[-1][:6]
    return {"filesystem": fs, "size": int(size), "used": int(used), "avail": int(avail), "mount": mount}


def parse_key_values(text: str, sep: str = "=") -> dict[str, str]:
    """`timedatectl show` style KEY=value lines."""
    out = {}
    for line in text.splitlines():
        key, found, value = line.partition(sep)
        if found:
            out[key.strip()] = value.strip()
    return out


def time_sync(timedatectl: Section | None, chrony: Section | None) -> tuple[bool | None, str]:
    """Whether the clock is synchronised, and what said so; None when nothing could tell."""
    if timedatectl is not None and timedatectl.ok:
        props = parse_key_values(timedatectl.text)
        if "NTPSynchronized" in props:
            synced = props["NTPSynchronized"] == "yes"
            return synced, f"timedatectl: NTPSynchronized={props['NTPSynchronized']}, NTP={props.get('NTP', '?')}"
    if chrony is not None and chrony.ok:
        leap = parse_key_values(chrony.text, ":").get("Leap status")
        if leap:
            return leap != "Not synchronised", f"chronyc tracking: Leap status {leap}"
    said = [f"{name}: {(s.text.strip().splitlines() or ['rc ' + str(s.rc)])[-1]}"
            for name, s in (("timedatectl", timedatectl), ("chronyc", chrony)) if s is not None and not s.ok]
    return None, "; ".join(said) or "no time service answered"


def parse_proc_devices(text: str) -> dict[str, int]:
    """Character devices of /proc/devices: name -> major (the block devices are left out)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("Block devices"):
            break
        fields = line.split(None, 1)
        if len(fields) == 2 and fields[0].isdigit():
            out.setdefault(fields[1].strip(), int(fields[0]))
    return out


def parse_capeff(text: str) -> int:
    """The effective capability mask from /proc/self/status (`CapEff:\\t000001ffffffffff`)."""
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split(":", 1)[1].strip(), 16)
    raise ValueError("no CapEff line")


def has_capability(mask: int, bit: int) -> bool:
    return bool(mask >> bit & 1)


def parse_ip_addr(text: str) -> list[dict[str, str | int]]:
    """`ip -o -4 addr show`: interface, address and prefix length per line."""
    out = []
    for line in text.splitlines():
        m = re.match(r"^\d+:\s+(?P<ifname>[^\s@]+)(?:@\S+)?\s+inet\s+(?P<ip>[\d.]+)/(?P<prefix>\d+)", line)
        if m:
            out.append({"ifname": m["ifname"], "ip": m["ip"], "prefix": int(m["prefix"])})
    return out
