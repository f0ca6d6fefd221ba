"""One validation layer for every string and number that reaches a host.

Knob values (`--set`, inventory `k31_<knob>`, `-e`), inventory host names and addresses (`ansible_host`),
server names (`k31_server`), model paths, image references and RDMA device names are checked here, each
against an allow-list for its kind, before the resolver uses them. Control characters (and Unicode line
separators) are refused everywhere: a newline in any value that lands in an env file or a launch script
starts a new line there, and those run as root. Numbers must be finite and in range.

Every refusal is a K31Error: one sentence that names the setting, shows the value with its control
characters escaped (so the message stays one line) and says what is valid.

Layer: base (docs/architecture.md); it imports errors only.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Callable
from typing import Any

from k31deploy.errors import K31Error

# C0, DEL, C1 and the Unicode line/paragraph separators (str.splitlines() breaks on those too).
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
# Whole numbers are passed to SGLang, the router and systemd; keep them within a C int.
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
SHOWN_MAX = 80


def shown(value: Any) -> str:
    """A value for an error message: control characters escaped, long values cut."""
    text = CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(value))
    return text if len(text) <= SHOWN_MAX else text[:SHOWN_MAX] + "..."


def named(setting: str, value: Any, where: str = "") -> str:
    """`setting=value (where)`, as every refusal names what it refuses."""
    return f"{setting}={shown(value)}" + (f" ({where})" if where else "")


def refuse_control(setting: str, value: str, valid: str, where: str = "") -> None:
    found = CONTROL.search(value)
    if found:
        raise K31Error(f"{named(setting, value, where)} is not valid: it contains the control character "
                       f"{shown(found.group())}, and none may reach a host (a newline would start a new line in a "
                       f"root-run env file or script); valid: {valid}")


# -- host addresses and names ------------------------------------------------------------------------

_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*\.?", re.ASCII)
ADDRESS_VALID = ("a hostname (labels of 1-63 letters, digits, '-' or '_', joined by dots), an IPv4 address, "
                 "or an IPv6 address without brackets or zone")


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def address(setting: str, value: Any, where: str = "") -> str:
    """A host address as ssh, URLs and sockets take it: hostname, IPv4 or IPv6 (bare)."""
    text = str(value)
    refuse_control(setting, text, ADDRESS_VALID, where)
    try:
        ipaddress.IPv6Address(text)
        if "%" not in text:
            return text
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", text):    # all digits and dots: an IPv4 address or nothing
        try:
            if text.count(".") == 3:
                return str(ipaddress.IPv4Address(text))
        except ValueError:
            pass
        _bad_address(setting, text, where)
    if len(text) > 253 or not _HOSTNAME.fullmatch(text):
        _bad_address(setting, text, where)
    return text


def bind_address(setting: str, value: Any, where: str = "") -> str:
    """A host address services bind (the cluster or public address): one of the host's own, so not the wildcard
    (0.0.0.0, ::) that would expose every internal service on every interface, nor a multicast address."""
    text = address(setting, value, where)
    ip = ipaddress.ip_address(text) if is_ip(text) else None
    if ip is not None and (ip.is_unspecified or ip.is_multicast):
        raise K31Error(f"{named(setting, text, where)} is not valid: internal services bind the host's cluster "
                       f"address, and {text} is not one of the host's addresses; valid: the host's own IP or name")
    return text


def _bad_address(setting: str, text: str, where: str) -> None:
    hint = " (write it without brackets)" if text.startswith("[") else ""
    raise K31Error(f"{named(setting, text, where)} is not a valid host address{hint}; valid: {ADDRESS_VALID}")


_HOST_NAME = re.compile(r"[A-Za-z0-9:][A-Za-z0-9_.:-]{0,252}", re.ASCII)
_SERVER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}", re.ASCII)


def host_name(name: Any) -> str:
    """An inventory host name: it lands in unit descriptions, comments and run records."""
    text = str(name)
    if not _HOST_NAME.fullmatch(text):
        raise K31Error(f"inventory host name '{shown(text)}' is not valid; valid: 1-253 letters, digits, '.', '_', "
                       f"'-' or ':', starting with a letter, digit or ':'")
    return text


def server_name(name: Any, host: str) -> str:
    """A server name: systemd unit `k31-<server>-r<rank>`, its env file and script under /etc/k31."""
    text = str(name)
    if not _SERVER_NAME.fullmatch(text):
        raise K31Error(
            f"server name '{shown(text)}' of host {host} (k31_server, or the host name when unset) is not valid: it "
            f"names systemd units and files under /etc/k31; valid: 1-63 letters, digits, '.', '_' or '-', "
            f"starting with a letter or digit"
        )
    return text


# -- knob value formats (knobs.yaml `format:`) -------------------------------------------------------

_HF_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HF_ID = re.compile(rf"{_HF_PART}(?:/{_HF_PART})?", re.ASCII)
# Local paths are mounted as `-v PATH:PATH:ro` into the container: no ':' or ','; no spaces or quotes.
_PATH_PART = re.compile(r"[A-Za-z0-9._+@=-]+", re.ASCII)
PATH_VALID = "an absolute path of letters, digits and . _ - + @ = (no spaces, ':' or ',', no . or .. components)"


def _absolute_path(text: str) -> bool:
    parts = text.rstrip("/").split("/")
    return (text.startswith("/") and len(text) <= 4096 and len(parts) > 1 and parts[0] == ""
            and all(_PATH_PART.fullmatch(p) and p not in (".", "..") for p in parts[1:]))


def local_path(setting: str, text: Any, where: str = "") -> str:
    """A host path k31 writes into a unit or script unquoted (a role's directory variable)."""
    if isinstance(text, str) and _absolute_path(text):
        return text
    raise K31Error(f"{named(setting, text, where)} is not valid; valid: {PATH_VALID}")


ROLE_PATH_VALID = ("a path of letters, digits and . _ - + @ = separated by '/' (absolute on hosts, or relative to the "
                   "checkout on the controller; no spaces, quotes or shell characters)")


def role_path(text: str) -> bool:
    """A role's path variable: what a root-run shell task, unit or script may hold unquoted without harm."""
    parts = text.rstrip("/").split("/")
    return len(text) <= 4096 and all(_PATH_PART.fullmatch(p) for p in (parts[1:] if text.startswith("/") else parts))


def network(text: Any) -> str:
    """An IP network or address (an IPv6 literal's brackets dropped) as a firewall source takes it; ValueError else."""
    return str(ipaddress.ip_network(str(text).strip("[]"), strict=False))


# A site firewall rule (k31_firewall_extra): nftables' port, range or comma list, its protocol, networks, a comment.
_FIREWALL_PORTS = re.compile(r"[0-9]{1,5}(?:-[0-9]{1,5})?(?:,[0-9]{1,5}(?:-[0-9]{1,5})?)*", re.ASCII)
FIREWALL_EXTRA_VALID = ("a list of {ports: 8443 | 9000-9100 | 80,443, proto: tcp | udp, sources: [IP networks], "
                        "comment: one line}")


def firewall_rule(item: Any) -> bool:
    """A site rule whose every part nftables takes as written (the plan's role-variable check, firewall.rules)."""
    if not isinstance(item, dict) or set(item) - {"ports", "proto", "sources", "comment"}:
        return False
    sources = item.get("sources") or []
    try:
        for source in sources if isinstance(sources, list) else [None]:
            network(source)
    except ValueError:
        return False
    return (_FIREWALL_PORTS.fullmatch(str(item.get("ports", ""))) is not None
            and item.get("proto", "tcp") in ("tcp", "udp") and not CONTROL.search(str(item.get("comment", ""))))


MODEL_PATH_VALID = f"a Hugging Face id (org/name: letters, digits, '.', '_', '-') or {PATH_VALID}"


def model_path(setting: str, text: str, where: str = "") -> str:
    if text.startswith("/"):
        if _absolute_path(text):
            return text
    elif _HF_ID.fullmatch(text) and ".." not in text and "--" not in text:
        return text
    raise K31Error(f"{named(setting, text, where)} is not valid; valid: {MODEL_PATH_VALID}")


# distribution/reference's grammar (reference/regexp.go): [host[:port]/]path[:tag][@digest].
_DOMAIN_PART = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_DOMAIN = rf"(?:{_DOMAIN_PART}(?:\.{_DOMAIN_PART})*|\[[0-9A-Fa-f:]+\])(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
_IMAGE = re.compile(rf"(?P<name>{_NAME})(?::(?P<tag>\w[\w.-]{{0,127}}))?"
                    rf"(?:@(?P<algorithm>[a-z0-9]+(?:[+._-][a-z0-9]+)*):(?P<hex>[0-9a-f]+))?", re.ASCII)
_DIGEST_HEX = {"sha256": 64, "sha512": 128}
IMAGE_VALID = ("an OCI image reference [registry[:port]/]repository[:tag][@sha256:<64 hex digits>] (lowercase "
               "repository path)")


def image(setting: str, text: str, where: str = "", placeholders: tuple[str, ...] = ()) -> str:
    if text in placeholders:    # the catalog's <K31_IMAGE>: fine in a plan, refused at deploy
        return text
    found = _IMAGE.fullmatch(text)
    ok = found is not None and len(found["name"]) <= 255
    if ok and found["algorithm"]:
        ok = len(found["hex"]) == _DIGEST_HEX.get(found["algorithm"], -1)
    if not ok:
        raise K31Error(f"{named(setting, text, where)} is not valid; valid: {IMAGE_VALID}"
                       + (f", or the placeholder {' / '.join(placeholders)} until a deploy" if placeholders else ""))
    return text


_IB_DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", re.ASCII)
IB_VALID = ("RDMA device names as in /sys/class/infiniband (mlx5_0), one or a comma list (mlx5_0,mlx5_1), a "
            'per-GPU JSON map ({"0": "mlx5_0", "1": "mlx5_1"}) or an absolute path to such a map ending in .json')


def ib_device(setting: str, value: Any, where: str = "") -> str:
    """--disaggregation-ib-device in the forms SGLang 0.5.23 takes (validate_ib_devices,
    parse_ib_device_config): a device, a comma list, a per-GPU JSON map, or a path to a JSON map file."""
    if isinstance(value, dict):    # a YAML inventory may give the map as a mapping
        value = json.dumps({str(k): v for k, v in value.items()}, separators=(",", ":"))
    text = str(value)
    refuse_control(setting, text, IB_VALID, where)

    def devices(group: Any) -> bool:
        return isinstance(group, str) and all(_IB_DEVICE.fullmatch(d) for d in group.split(","))

    if text.startswith("{"):
        try:
            mapping = json.loads(text)
        except ValueError:
            mapping = None
        ok = (isinstance(mapping, dict) and bool(mapping)
              and all(re.fullmatch(r"[0-9]+", str(k)) and devices(v) for k, v in mapping.items()))
    elif text.endswith(".json"):
        ok = _absolute_path(text)
    else:
        ok = devices(text)
    if not ok:
        raise K31Error(f"{named(setting, text, where)} is not valid; valid: {IB_VALID}")
    return text


PARTITION_VALID = "comma-separated layer counts per pipeline stage, e.g. 24,24,24,21"


def layer_partition(setting: str, text: str, where: str = "") -> str:
    if not re.fullmatch(r"[0-9]{1,4}(?:,[0-9]{1,4})*", text, re.ASCII):
        raise K31Error(f"{named(setting, text, where)} is not valid; valid: {PARTITION_VALID}")
    return text


# knobs.yaml `format:` -> (check, what is valid)
FORMATS: dict[str, tuple[Callable[..., str], str]] = {
    "image": (image, IMAGE_VALID), "model_path": (model_path, MODEL_PATH_VALID),
    "ib_device": (ib_device, IB_VALID), "layer_partition": (layer_partition, PARTITION_VALID),
}


# -- numbers -----------------------------------------------------------------------------------------

def finite_float(value: Any) -> float:
    """A finite float, or ValueError (inf, nan, overflow, non-numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError
    try:
        number = float(value)
    except OverflowError:
        raise ValueError from None
    if not math.isfinite(number):
        raise ValueError
    return number


def whole_number(value: Any) -> int:
    """An int (4.0 is 4), or ValueError; the range is the caller's (knobs.yaml, INT_MIN..INT_MAX)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ValueError
        return int(value)
    if isinstance(value, str):
        text = value.strip()
        if not re.fullmatch(r"[+-]?[0-9]{1,30}", text, re.ASCII):
            raise ValueError
        return int(text)
    return value
