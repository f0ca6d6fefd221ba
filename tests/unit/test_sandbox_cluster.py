"""Pure parts of the sandbox lifecycle: names, subnets and the CLI surface (no podman)."""

import argparse
import ipaddress

import pytest

from k31deploy.commands import sandbox as command
from k31deploy.errors import K31Error
from k31deploy.sandbox.cluster import SUPERNET, check_name, container_name, network_name, pick_subnet, ssh_argv


def test_names():
    assert check_name("ci-7") == "ci-7"
    assert container_name("ci-7", "prefill0") == "k31-ci-7-prefill0"
    assert network_name("ci-7") == "k31-ci-7"
    for bad in ("", "Default", "a_b", "-a", "a" * 25, "../x"):
        with pytest.raises(K31Error, match="--name"):
            check_name(bad)


def test_subnet_is_a_private_24_derived_from_the_name():
    first = pick_subnet("alpha", [])
    assert first.prefixlen == 24 and first.subnet_of(SUPERNET) and first.is_private
    assert pick_subnet("alpha", []) == first
    assert pick_subnet("beta", []) != first


def test_subnet_avoids_networks_in_use():
    first = pick_subnet("alpha", [])
    second = pick_subnet("alpha", [first, ipaddress.ip_network("192.168.0.0/16")])
    assert second != first and second.subnet_of(SUPERNET)
    # A wide route over the whole range leaves nothing free.
    with pytest.raises(K31Error, match="no free /24"):
        pick_subnet("alpha", [ipaddress.ip_network("10.0.0.0/8")])


def test_ssh_checks_host_keys_with_the_sandbox_files(tmp_path):
    argv = ssh_argv("10.231.1.10", tmp_path / "id", tmp_path / "kh", "true")
    assert argv[:3] == ["ssh", "-i", str(tmp_path / "id")]
    assert f"UserKnownHostsFile={tmp_path / 'kh'}" in argv
    assert "StrictHostKeyChecking=yes" in argv
    assert argv[-2:] == ["root@10.231.1.10", "true"]


def _parser():
    parser = argparse.ArgumentParser(prog="k31")
    command.register(parser.add_subparsers(required=True))
    return parser


def test_cli_surface():
    args = _parser().parse_args(["sandbox", "up", "--shape", "gb300-pd", "--name", "x"])
    assert (args.shape, args.name, args.nodes) == ("gb300-pd", "x", None)
    args = _parser().parse_args(["sandbox", "up", "--nodes", "8"])
    assert (args.shape, args.nodes, args.name) == (None, 8, "default")
    assert _parser().parse_args(["sandbox", "down", "--purge-images"]).purge_images
    assert _parser().parse_args(["sandbox", "status", "--json"]).json


def test_up_refuses_an_unknown_shape_before_touching_podman():
    args = _parser().parse_args(["sandbox", "up", "--shape", "h100-huge"])
    with pytest.raises(K31Error, match="not a sandbox shape; choose one of mi355x-1p1d"):
        args.func(args)
