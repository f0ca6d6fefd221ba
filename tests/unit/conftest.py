"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
from loopback import Servers

from k31deploy import pki


@pytest.fixture
def loopback():
    """Serve stand-in handlers on 127.0.0.1 (`loopback.serve(handler, engine)`); stopped after the test."""
    servers = Servers()
    yield servers
    servers.close()


@pytest.fixture
def cluster(tmp_path):
    """A cluster CA, a host certificate for 127.0.0.1 and a stranger's (another CA), as files: ca.crt, host.crt,
    host.key, stranger.crt, stranger.key under tmp_path/tls."""
    ca = pki.new_ca()
    files = {"ca.crt": ca.cert}
    for name, pair in (("host", pki.issue(ca, "r0", ["127.0.0.1"])),
                       ("stranger", pki.issue(pki.new_ca(), "stranger", ["127.0.0.1"]))):
        files[f"{name}.crt"], files[f"{name}.key"] = pair.cert, pair.key
    tls = tmp_path / "tls"
    tls.mkdir()
    for name, text in files.items():
        (tls / name).write_text(text)
    return tls
