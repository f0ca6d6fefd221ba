"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest
from loopback import Servers


@pytest.fixture
def loopback():
    """Serve stand-in handlers on 127.0.0.1 (`loopback.serve(handler, engine)`); stopped after the test."""
    servers = Servers()
    yield servers
    servers.close()
