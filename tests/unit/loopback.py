"""In-process servers for the unit tests, on 127.0.0.1 only: a free port, and stand-in handlers served on an
ephemeral port and stopped when the test ends (the `loopback` fixture in conftest.py)."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path
from typing import Any

from k31deploy.standin.server import serve


def only_cluster_clients(server: Any, tls: Path) -> None:
    """Serve `server` over TLS with the host certificate of `tls` (the `cluster` fixture's files), taking only
    clients with a certificate of that cluster CA (mutual TLS, as k31's control planes do)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(tls / "ca.crt"))
    context.load_cert_chain(str(tls / "host.crt"), str(tls / "host.key"))
    context.verify_mode = ssl.CERT_REQUIRED
    server.socket = context.wrap_socket(server.socket, server_side=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Servers:
    """What a test served; each is shut down and closed at teardown."""

    def __init__(self) -> None:
        self.started: list[Any] = []

    def serve(self, handler: type, engine: Any) -> Any:
        server = serve("127.0.0.1", 0, handler, engine)
        self.started.append(server)
        return server

    def close(self) -> None:
        for server in self.started:
            server.shutdown()
            server.server_close()
