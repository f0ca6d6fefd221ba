"""The one place host:port pairs and URLs are built from a plan's addresses.

Plans keep addresses bare (`fd00::1`), as `ssh`, `nats-server -a` or a socket want them. Anything that
puts an address in front of a port writes an IPv6 address in brackets: URLs (RFC 3986), SGLang's
`--dist-init-addr` (its NetworkAddress.parse requires `[v6]:port`), Prometheus targets and Mooncake's
`MOONCAKE_MASTER`.
"""

from __future__ import annotations

import ipaddress


def is_ipv6(address: str) -> bool:
    try:
        ipaddress.IPv6Address(address)
    except ValueError:
        return False
    return True


def url_host(address: str) -> str:
    """The address as the host part of a URL or host:port: IPv6 in brackets."""
    return f"[{address}]" if is_ipv6(address) else address


def host_port(address: str, port: int | str) -> str:
    return f"{url_host(address)}:{port}"


def url(scheme: str, address: str, port: int | str, path: str = "") -> str:
    return f"{scheme}://{host_port(address, port)}{path}"


def http_url(address: str, port: int | str, path: str = "") -> str:
    return url("http", address, port, path)
