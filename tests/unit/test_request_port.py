"""roles/k31_engine/files/k31-request-port: each start of a Dynamo worker takes the next free port of its range."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import socket
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "roles" / "k31_engine" / "files" / "k31-request-port"


@pytest.fixture
def picker(tmp_path, monkeypatch):
    loader = importlib.machinery.SourceFileLoader("k31_request_port", str(SCRIPT))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    monkeypatch.setattr(module, "STATE_DIR", str(tmp_path / "state"))
    return module


def free_range(count: int) -> int:
    """The first port of `count` consecutive ports free on loopback now."""
    for first in range(41000, 60000, 97):
        socks = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free port range on loopback")


def test_each_start_takes_the_next_port_round_the_range(picker, capsys):
    first = free_range(3)
    got = []
    for _ in range(4):
        assert picker.main("k31-decode0-r0", "127.0.0.1", first, first + 2) == 0
        got.append(int(capsys.readouterr().out))
    assert got == [first, first + 1, first + 2, first]
    assert Path(picker.STATE_DIR, "k31-decode0-r0.request-port").read_text() == f"{first}\n"


def test_a_port_in_use_is_skipped_and_a_full_range_refused(picker, capsys):
    first = free_range(2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", first))
        busy.listen()
        assert picker.main("k31-decode0-r0", "127.0.0.1", first, first + 1) == 0
        assert int(capsys.readouterr().out) == first + 1
        with socket.socket() as other:
            other.bind(("127.0.0.1", first + 1))
            other.listen()
            assert picker.main("k31-decode0-r0", "127.0.0.1", first, first + 1) == 1
    assert f"no port of {first}-{first + 1} is free on 127.0.0.1" in capsys.readouterr().err


def test_units_are_remembered_apart_and_names_are_allow_listed(picker, capsys):
    first = free_range(2)
    assert picker.main("a", "127.0.0.1", first, first + 1) == 0
    assert picker.main("b", "127.0.0.1", first, first + 1) == 0
    assert picker.main("a", "127.0.0.1", first, first + 1) == 0
    assert [int(x) for x in capsys.readouterr().out.split()] == [first, first, first + 1]
    assert picker.main("../etc/passwd", "127.0.0.1", first, first + 1) == 2
    assert picker.main("a", "127.0.0.1", first + 1, first) == 2
