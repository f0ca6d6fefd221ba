"""Sandbox shapes: data in shapes.yaml (hosts, groups, servers, knobs), resolved into a Shape."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from k31deploy.errors import K31Error
from k31deploy.sandbox import DATA_DIR

SHAPES_FILE = DATA_DIR / "shapes.yaml"
GROUPS = ("k31_unified", "k31_prefill", "k31_decode", "k31_router", "k31_mooncake_master")
DEFAULT_SHAPE = "mi355x-1p1d"
# Host names become container names and hostnames: keep them DNS labels.
HOST_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,40}[a-z0-9])?$")
MAX_NODES = 64


@dataclass(frozen=True)
class Host:
    name: str
    groups: tuple[str, ...]
    server: str | None = None


@dataclass(frozen=True)
class Shape:
    name: str
    description: str
    knobs: dict[str, Any]
    hosts: tuple[Host, ...]
    role_vars: dict[str, Any] = field(default_factory=dict)   # k31_<role>_* settings the shape needs
    # Nodes that run containers themselves (privileged, podman inside, stand-in GPU/RDMA device nodes), and
    # the host that serves the sandbox's image registry (Debian's docker-registry) to the others.
    nested: bool = False
    registry: str | None = None
    # The stand-in serving image as a `podman save` archive on the controller instead (k31_image_source=tarball).
    tarball: bool = False


def load_shapes(path: Path = SHAPES_FILE) -> dict[str, dict[str, Any]]:
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or not data:
        raise K31Error(f"{path} must map shape names to shapes")
    return data


def _host(shape: str, spec: Any) -> Host:
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise K31Error(f"shape {shape}: every host needs a name (got {spec!r})")
    name = spec["name"]
    if not HOST_NAME.match(name):
        raise K31Error(f"shape {shape}: host name {name!r} must be lowercase letters, digits and dashes")
    groups = spec.get("groups") or []
    bad = [group for group in groups if group not in GROUPS]
    if not groups or bad:
        raise K31Error(f"shape {shape}: host {name} groups {bad or groups} must be among {', '.join(GROUPS)}")
    return Host(name=name, groups=tuple(groups), server=spec.get("server"))


def resolve_shape(name: str | None, nodes: int | None, path: Path = SHAPES_FILE) -> Shape:
    """The shape `up` starts; `--nodes N` alone means the generic `fanout` shape."""
    shapes = load_shapes(path)
    name = name or ("fanout" if nodes is not None else DEFAULT_SHAPE)
    if name not in shapes:
        raise K31Error(f"--shape {name!r} is not a sandbox shape; choose one of {', '.join(shapes)}")
    spec = shapes[name]
    knobs = spec.get("knobs") or {}
    if not all(isinstance(value, str | int | float | bool) for value in knobs.values()):
        raise K31Error(f"shape {name}: knob values must be scalars")
    if "repeat" in spec:
        repeat = spec["repeat"]
        count = repeat.get("default_nodes", 1) if nodes is None else nodes
        if not 1 <= count <= MAX_NODES:
            raise K31Error(f"--nodes must be between 1 and {MAX_NODES} (got {count})")
        hosts = [_host(name, {**repeat, "name": repeat["name"].format(index=i)}) for i in range(count)]
    else:
        if nodes is not None:
            counted = [shape for shape, s in shapes.items() if "repeat" in s]
            raise K31Error(f"--nodes applies only to {', '.join(counted)}; shape {name} has fixed hosts")
        hosts = [_host(name, host) for host in spec.get("hosts") or []]
    if not hosts:
        raise K31Error(f"shape {name} has no hosts")
    names = [host.name for host in hosts]
    if len(set(names)) != len(names):
        raise K31Error(f"shape {name} lists a host name twice: {names}")
    role_vars = spec.get("role_vars") or {}
    if not all(str(key).startswith("k31_") for key in role_vars):
        raise K31Error(f"shape {name}: role_vars must be k31_<role>_* variables")
    nested = spec.get("nested", False)
    if not isinstance(nested, bool):
        raise K31Error(f"shape {name}: nested must be true or false (got {nested!r})")
    registry = spec.get("registry")
    if registry is not None and (not nested or registry not in names):
        raise K31Error(f"shape {name}: registry {registry!r} must be one of its hosts ({', '.join(names)}) "
                       f"and needs nested: true")
    tarball = spec.get("tarball", False)
    if not isinstance(tarball, bool) or (tarball and (not nested or registry is not None)):
        raise K31Error(f"shape {name}: tarball must be true or false, needs nested: true and excludes registry "
                       f"(got tarball={tarball!r}, registry={registry!r})")
    return Shape(name=name, description=spec.get("description", ""), knobs=dict(knobs), hosts=tuple(hosts),
                 role_vars=dict(role_vars), nested=nested, registry=registry, tarball=tarball)
