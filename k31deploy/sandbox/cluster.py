"""Sandbox lifecycle: a private podman network, one systemd container per shape host, a per-sandbox
SSH client key, a known_hosts file read out of the containers, and the inventory."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from k31deploy.errors import K31Error
from k31deploy.paths import state_dir
from k31deploy.recipe.catalog import catalog
from k31deploy.sandbox import DATA_DIR, image, podman, serving
from k31deploy.sandbox.inventory import (
    build_inventory,
    dump_inventory,
    known_hosts_text,
    router_kind,
    sandbox_secrets,
)
from k31deploy.sandbox.shapes import Shape

LABEL = "k31.sandbox"
HOST_LABEL = "k31.sandbox.host"
INDEX_LABEL = "k31.sandbox.index"
NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,22}[a-z0-9])?$")
# Sandbox networks are /24s inside this private range, one per sandbox; nodes from .10 up.
SUPERNET = ipaddress.ip_network("10.231.0.0/16")
FIRST_HOST = 10
# The hybrid cgroup layout of these machines: without this mount about one in three unit stops
# hangs for 90 s (field notes §7). Pure cgroup v2 hosts do not have the directory.
UNIFIED_CGROUP = Path("/sys/fs/cgroup/unified")
SSH_TIMEOUT_S = 180.0
# Nested-container nodes: podman's store on a volume of the node's own (overlay cannot sit on the node's overlay
# root); the volume carries the sandbox's label and goes with `down`.
NESTED_STORE = "/var/lib/containers"
# Stand-in device nodes, per platform family, at the paths the plan's container flags name (catalog.yaml
# families.*.container_flags, nvl72.container_flags; the IMEX channel of NVIDIA_IMEX_CHANNELS=0). Each is a
# character device 1:3 -- what /dev/null is -- so a container that opens one reads nothing and harms nothing.
STANDIN_DEVICES = {
    "rocm": ["/dev/kfd", "/dev/dri/card0", "/dev/dri/renderD128",
             "/dev/infiniband/uverbs0", "/dev/infiniband/rdma_cm"],
    "cuda": ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2", "/dev/nvidia3",
             "/dev/nvidia-caps-imex-channels/channel0", "/dev/infiniband/uverbs0", "/dev/infiniband/rdma_cm"],
}

Log = Callable[[str], None]


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise K31Error(f"--name {name!r} must be 1-24 lowercase letters, digits or dashes (e.g. default)")
    return name


def sandbox_dir(name: str) -> Path:
    return state_dir() / "sandbox" / name


def network_name(name: str) -> str:
    return f"k31-{name}"


def container_name(name: str, host: str) -> str:
    return f"k31-{name}-{host}"


def _parallel(fn: Callable[[Any], Any], items: list) -> list:
    if not items:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(items))) as pool:
        return list(pool.map(fn, items))


def _containers(name: str) -> list[dict]:
    """This sandbox's containers: carrying its label AND named as `up` names them, in shape order."""
    listed = podman.json_out("ps", "-a", "--filter", f"label={LABEL}={name}", "--format", "json")
    ours = []
    for ctr in listed:
        labels = ctr.get("Labels") or {}
        host = labels.get(HOST_LABEL, "")
        if labels.get(LABEL) == name and container_name(name, host) in ctr.get("Names", []):
            ours.append(ctr)
    return sorted(ours, key=lambda ctr: int(ctr["Labels"].get(INDEX_LABEL, 0)))


def _network(name: str) -> dict | None:
    net = network_name(name)
    for entry in podman.json_out("network", "ls", "--format", "json"):
        if entry.get("name") == net:
            if (entry.get("labels") or {}).get(LABEL) != name:
                raise K31Error(f"podman network {net} exists but no k31 sandbox made it; pick another --name")
            return entry
    return None


def _routed_networks() -> list[ipaddress.IPv4Network]:
    """Networks the host already routes (a sandbox subnet must not shadow them)."""
    nets = []
    try:
        lines = Path("/proc/net/route").read_text().splitlines()[1:]
    except OSError:
        return nets
    for line in lines:
        fields = line.split()
        dest, mask = (ipaddress.IPv4Address(bytes.fromhex(f)[::-1]) for f in (fields[1], fields[7]))
        if int(mask):
            nets.append(ipaddress.ip_network(f"{dest}/{mask}", strict=False))
    return nets


def pick_subnet(name: str, used: list) -> ipaddress.IPv4Network:
    """A free /24 of SUPERNET, starting from one derived from the name so sandboxes rarely collide."""
    subnets = list(SUPERNET.subnets(new_prefix=24))[1:]
    start = zlib.crc32(name.encode()) % len(subnets)
    for i in range(len(subnets)):
        candidate = subnets[(start + i) % len(subnets)]
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise K31Error(f"no free /24 is left in {SUPERNET} for a sandbox network; remove unused podman networks")


def _ensure_network(name: str) -> ipaddress.IPv4Network:
    existing = _network(name)
    if existing:
        return ipaddress.ip_network(existing["subnets"][0]["subnet"])
    used = [
        ipaddress.ip_network(sub["subnet"])
        for net in podman.json_out("network", "ls", "--format", "json")
        for sub in net.get("subnets") or []
    ] + _routed_networks()
    subnet = pick_subnet(name, used)
    podman.run("network", "create", "--subnet", str(subnet), "--label", f"{LABEL}={name}", network_name(name))
    return subnet


def _ensure_keypair(directory: Path) -> tuple[Path, Path]:
    """The sandbox's own SSH client key, and an authorized_keys file (0600) to copy into each node."""
    key = directory / "id_ed25519"
    if not key.is_file():
        comment = f"k31-sandbox-{directory.name}"
        argv = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise podman.failure("ssh-keygen", proc)
    authorized = directory / "authorized_keys"
    authorized.write_text(Path(f"{key}.pub").read_text())
    authorized.chmod(0o600)
    return key, authorized


def _address(ctr: str, net: str) -> str:
    networks = podman.json_out("inspect", "--format", "{{json .NetworkSettings.Networks}}", ctr)
    try:
        return networks[net]["IPAddress"]
    except (KeyError, TypeError) as exc:
        raise K31Error(f"container {ctr} has no address on network {net}") from exc


def _sshd_banner(address: str, timeout: float) -> bool:
    try:
        with socket.create_connection((address, 22), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def _wait_host_key(ctr: str, address: str, deadline: float) -> str:
    """The node's ed25519 host key, read through podman (not over the network it authenticates)
    once sshd answers -- sshd starts only after the first-boot unit wrote the keys."""
    while time.monotonic() < deadline:
        if _sshd_banner(address, timeout=2):
            proc = podman.run("exec", ctr, "cat", "/etc/ssh/ssh_host_ed25519_key.pub", check=False)
            if proc.returncode == 0 and proc.stdout.startswith("ssh-ed25519 "):
                return proc.stdout.strip()
        time.sleep(0.3)
    raise K31Error(f"sshd in {ctr} did not answer within {SSH_TIMEOUT_S:.0f} s; see `podman logs {ctr}`")


def ssh_argv(address: str, key: Path, known_hosts: Path, *command: str) -> list[str]:
    options = [
        "BatchMode=yes", "ConnectTimeout=10", "LogLevel=ERROR", "IdentitiesOnly=yes",
        "StrictHostKeyChecking=yes", f"UserKnownHostsFile={known_hosts}", "GlobalKnownHostsFile=/dev/null",
    ]  # fmt: skip
    return [
        "ssh",
        "-i",
        str(key),
        *(arg for opt in options for arg in ("-o", opt)),
        f"root@{address}",
        *command,
    ]


def ssh_answers(address: str, key: Path, known_hosts: Path) -> bool:
    """A real login with the sandbox key and a checked host key, as Ansible will make."""
    if not (key.is_file() and known_hosts.is_file()):
        return False
    try:
        proc = subprocess.run(ssh_argv(address, key, known_hosts, "true"), capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return proc.returncode == 0


def memory_mib(containers: list[str]) -> dict[str, float]:
    """Memory charged to each container's cgroup (podman stats), in MiB."""
    if not containers:
        return {}
    template = "{{.Name}} {{.ContainerStats.MemUsage}}"
    out = podman.run("stats", "--no-stream", "--format", template, *containers)
    return {name: int(used) / 2**20 for name, used in (line.split() for line in out.stdout.splitlines())}


def store_volume(name: str, host: str) -> str:
    return f"{container_name(name, host)}-containers"


def _run_flags(name: str, host: str, index: int, address: str, hosts_file: list[str], tag: str,
               nested: bool = False) -> list[str]:
    flags = [
        "--name", container_name(name, host), "--hostname", host,
        "--label", f"{LABEL}={name}", "--label", f"{HOST_LABEL}={host}", "--label", f"{INDEX_LABEL}={index}",
        "--network", network_name(name), "--ip", address, "--systemd=always",
        # k31_firewall loads an nftables table in the node's own network namespace (not the machine's)
        "--cap-add=NET_ADMIN",
    ]  # fmt: skip
    if UNIFIED_CGROUP.is_dir():
        flags += ["-v", f"{UNIFIED_CGROUP}:{UNIFIED_CGROUP}:rw"]
    if nested:
        # podman inside the node: mounts, namespaces, device nodes and its own store
        flags += ["--privileged", "-v", f"{store_volume(name, host)}:{NESTED_STORE}"]
    for entry in hosts_file:
        flags += ["--add-host", entry]
    return [*flags, tag]


def up(shape: Shape, name: str, log: Log) -> Path:
    """Start (or reuse) the sandbox and write its inventory; returns the inventory's path."""
    podman.check_host(podman.UP_TOOLS)
    check_name(name)
    started = time.monotonic()
    directory = sandbox_dir(name)
    directory.mkdir(parents=True, exist_ok=True)

    existing = {ctr["Labels"][HOST_LABEL]: ctr for ctr in _containers(name)}
    wanted = [host.name for host in shape.hosts]
    extra = sorted(set(existing) - set(wanted))
    if extra:
        raise K31Error(
            f"sandbox {name} has hosts {', '.join(extra)} that shape {shape.name} lacks; "
            f"run `k31 sandbox down --name {name}` first or pick another --name"
        )

    tag = image.ensure_image(state_dir() / "sandbox", log, nested=shape.nested)
    log(f"image {tag} ready after {time.monotonic() - started:.1f} s")

    subnet = _ensure_network(name)
    net = network_name(name)
    planned = {host: str(subnet[FIRST_HOST + i]) for i, host in enumerate(wanted)}
    key, authorized = _ensure_keypair(directory)

    def start(index: int) -> None:
        host = wanted[index]
        ctr = container_name(name, host)
        current = existing.get(host)
        if current is None:
            hosts_file = [f"{other}:{address}" for other, address in planned.items()]
            volume = store_volume(name, host)
            if shape.nested and podman.run("volume", "exists", volume, check=False).returncode != 0:
                podman.run("volume", "create", "--label", f"{LABEL}={name}", volume)
            podman.run("create", *_run_flags(name, host, index, planned[host], hosts_file, tag, shape.nested))
        elif current.get("Image") != tag:
            log(f"{ctr} runs {current.get('Image')}, not {tag}: `down` then `up` to refresh it")
        # Every up re-installs the current key, so a lost state dir does not lock us out.
        podman.run("cp", str(authorized), f"{ctr}:/root/.ssh/authorized_keys")
        if current is None or current.get("State") != "running":
            podman.run("start", ctr)

    t_start = time.monotonic()
    _parallel(start, list(range(len(wanted))))
    containers = [container_name(name, host) for host in wanted]
    addresses = dict(zip(wanted, _parallel(lambda ctr: _address(ctr, net), containers), strict=True))
    log(f"{len(wanted)} containers running after {time.monotonic() - t_start:.1f} s")

    deadline = time.monotonic() + SSH_TIMEOUT_S
    pairs = list(zip(containers, addresses.values(), strict=True))
    keys = _parallel(lambda pair: _wait_host_key(*pair, deadline), pairs)
    host_keys = dict(zip(wanted, keys, strict=True))
    if len(set(host_keys.values())) != len(host_keys):
        raise K31Error(f"sandbox {name}: two nodes share an SSH host key; the image must not carry host keys")
    known_hosts = directory / "known_hosts"
    known_hosts.write_text(known_hosts_text(addresses, host_keys))

    answers = _parallel(lambda address: ssh_answers(address, key, known_hosts), list(addresses.values()))
    failed = [host for host, ok in zip(wanted, answers, strict=True) if not ok]
    if failed:
        raise K31Error(f"ssh as root with the sandbox key failed on {', '.join(failed)}; see `k31 sandbox status`")
    log(f"sshd answers on every node after {time.monotonic() - t_start:.1f} s")

    extra: dict[str, Any] = {}
    if shape.nested:
        extra = _prepare_nested(shape, name, addresses, directory, log)
        log(f"nested containers ready after {time.monotonic() - t_start:.1f} s")

    inventory = directory / "inventory.yml"
    secrets = sandbox_secrets(directory, router_kind(shape))
    text = dump_inventory(build_inventory(shape, addresses, key, known_hosts, {**(secrets or {}), **extra}))
    fd = os.open(inventory, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)    # it holds the sandbox's secrets
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(inventory, 0o600)
    memory = memory_mib(containers)
    per_node = (f"{host} {memory.get(ctr, 0):.0f} MiB" for host, ctr in zip(wanted, containers, strict=True))
    log("memory per node: " + ", ".join(per_node))
    log(f"sandbox {name} ({shape.name}, nodes: {len(wanted)}) up in {time.monotonic() - started:.1f} s")
    return inventory


def platform_family(shape: Shape) -> str:
    platform = str(shape.knobs.get("platform", ""))
    platforms = catalog()["platforms"]
    if platform not in platforms:
        raise K31Error(f"shape {shape.name}: platform {platform!r} is not one of {', '.join(platforms)}")
    return platforms[platform]["family"]


ENGINE_GROUPS = ("k31_unified", "k31_prefill", "k31_decode")
# CUDA nested nodes get a stand-in nvidia-ctk (the toolkit's apt repository is out of reach): it writes and lists
# CDI specs over the stand-in device nodes, the two calls k31_container_runtime makes.
NVIDIA_CTK = DATA_DIR / "nested" / "nvidia-ctk"
# The name a tarball shape's archive holds the stand-in serving image under (the plan's k31_image).
TARBALL_IMAGE = "sandbox.k31.internal/standin/sglang-serving:r1"


def devices_script(paths: list[str], family: str) -> str:
    """Shell that makes each stand-in device node (character 1:3) where it is missing. On ROCm, the GPU nodes
    belong to group render, mode 0660, as the amdgpu driver's udev rules leave them on a real host."""
    lines = ["set -eu"]
    if family == "rocm":
        lines.append("getent group render >/dev/null || groupadd --system render")
    for path in paths:
        gpu = family == "rocm" and not path.startswith("/dev/infiniband/")
        mode = "0660" if gpu else "0666"
        lines.append(f"mkdir -p {os.path.dirname(path)}; [ -e {path} ] || mknod -m {mode} {path} c 1 3")
        if gpu:
            lines.append(f"chgrp render {path}")
    return "\n".join(lines)


def _prepare_nested(shape: Shape, name: str, addresses: dict[str, str], directory: Path, log: Log) -> dict:
    """Nested-container nodes: stand-in device nodes, the registry on the shape's registry host (trusted over
    plain HTTP by every node), and the stand-in serving image pushed there. Returns the inventory's k31_image."""
    family = platform_family(shape)
    devices = STANDIN_DEVICES.get(family, [])
    registry = addresses[shape.registry] if shape.registry else None

    engines = {h.name for h in shape.hosts if set(h.groups) & set(ENGINE_GROUPS)}

    def prepare(host: str) -> None:
        ctr = container_name(name, host)
        if devices and host in engines:
            podman.run("exec", ctr, "sh", "-c", devices_script(devices, family))
        if family == "cuda" and host in engines:
            podman.run("exec", "-i", ctr, "sh", "-c", "cat > /usr/local/bin/nvidia-ctk && chmod 0755 "
                       "/usr/local/bin/nvidia-ctk", stdin_text=NVIDIA_CTK.read_text())
        if registry:
            conf = serving.registries_conf(registry)
            podman.run("exec", "-i", ctr, "sh", "-c", "mkdir -p /etc/containers/registries.conf.d && cat > "
                       "/etc/containers/registries.conf.d/sandbox-registry.conf", stdin_text=conf)
        if host == shape.registry:
            podman.run("exec", "-i", ctr, "sh", "-c", "cat > /etc/docker/registry/config.yml",
                       stdin_text=serving.registry_config(registry))
            podman.run("exec", ctr, "systemctl", "enable", "--now", "docker-registry.service")

    _parallel(prepare, list(addresses))
    if shape.tarball:
        local = serving.build(state_dir() / "sandbox", 1, False, log)
        saved = serving.save(local, directory / "serving-r1.tar", TARBALL_IMAGE)
        log(f"stand-in serving image saved as {saved['tarball']} ({saved['name']}, {saved['id']})")
        return {"k31_image": saved["name"], "k31_image_tarball": saved["tarball"]}
    if not registry:
        return {}
    serving.wait_registry(registry)
    # The deploy's host firewall (k31_firewall) closes what the plan does not use: the registry is a site
    # service it keeps open to the sandbox's nodes, as a site lists its own (k31_firewall_extra).
    sources = sorted({str(ipaddress.ip_network(f"{a}/24", strict=False)) for a in addresses.values()})
    extra: dict[str, Any] = {"k31_firewall_extra": [{"ports": str(serving.REGISTRY_PORT), "proto": "tcp",
                                                     "sources": sources, "comment": "k31 sandbox registry"}]}
    images = directory / "images.json"
    if images.is_file():     # a re-run `up`: the image deploys run stays what it was
        first = json.loads(images.read_text())[0]
        return {**extra, "k31_image": first["ref"]}
    local = serving.build(state_dir() / "sandbox", 1, False, log)
    pushed = serving.push(local, registry, 1, False, directory)
    serving.record(directory, pushed, 1, False)
    log(f"stand-in serving image pushed as {pushed.ref}")
    return {**extra, "k31_image": pushed.ref}


def push_image(name: str, revision: int, broken: bool, log: Log) -> dict:
    """Build the stand-in serving image's `revision` (broken: its entry point exits) and push it to the
    sandbox's registry; returns what was pushed (ref = repo@sha256:...)."""
    podman.check_host()
    check_name(name)
    directory = sandbox_dir(name)
    inventory = directory / "inventory.yml"
    if not inventory.is_file():
        raise K31Error(f"no sandbox named {name}: run `k31 sandbox up --name {name} --shape SHAPE` first")
    import yaml

    children = yaml.safe_load(inventory.read_text())["all"]["children"]
    hosts = {h: v["ansible_host"] for group in children.values() for h, v in ((group or {}).get("hosts") or {}).items()}
    registry_host = next((h for h in hosts if _has_registry(name, h)), None)
    if registry_host is None:
        raise K31Error(f"sandbox {name} runs no registry; use a shape with `registry:` (e.g. mi355x-1p1d-container)")
    local = serving.build(state_dir() / "sandbox", revision, broken, log)
    pushed = serving.push(local, hosts[registry_host], revision, broken, directory)
    serving.record(directory, pushed, revision, broken)
    return {**pushed.to_dict(), "revision": revision, "broken": broken}


def _has_registry(name: str, host: str) -> bool:
    ctr = container_name(name, host)
    return podman.run("exec", ctr, "systemctl", "is-enabled", "--quiet", "docker-registry.service",
                      check=False).returncode == 0


def status(name: str) -> list[dict]:
    """Each container of the sandbox: its host, state, address, memory and whether ssh answers."""
    podman.check_host()
    check_name(name)
    ctrs = _containers(name)
    directory = sandbox_dir(name)
    key, known_hosts = directory / "id_ed25519", directory / "known_hosts"
    running = [ctr["Names"][0] for ctr in ctrs if ctr.get("State") == "running"]
    memory = memory_mib(running)

    def describe(ctr: dict) -> dict:
        container = ctr["Names"][0]
        address = _address(container, network_name(name)) if ctr.get("State") == "running" else None
        return {
            "host": ctr["Labels"][HOST_LABEL],
            "container": container,
            "state": ctr.get("State"),
            "ip": address,
            "ssh": bool(address) and ssh_answers(address, key, known_hosts),
            "memory_mib": round(memory[container], 1) if container in memory else None,
        }

    return _parallel(describe, ctrs)


def down(name: str, purge_images: bool, log: Log) -> None:
    """Remove what `up` made -- containers and network matched by name and label, and the state dir."""
    podman.check_host()
    check_name(name)
    ctrs = [ctr["Names"][0] for ctr in _containers(name)]
    _parallel(lambda ctr: podman.run("rm", "--force", "--time", "5", ctr), ctrs)
    net = _network(name)
    if net:
        podman.run("network", "rm", net["name"])
    volumes = [v["Name"] for v in podman.json_out("volume", "ls", "--filter", f"label={LABEL}={name}", "--format",
                                                   "json")
               if (v.get("Labels") or {}).get(LABEL) == name and v["Name"].startswith(f"k31-{name}-")]
    for volume in volumes:
        podman.run("volume", "rm", "--force", volume)
    directory = sandbox_dir(name)
    if directory.is_dir():
        shutil.rmtree(directory)
    log(f"sandbox {name}: removed {len(ctrs)} containers" + (f" and network {net['name']}" if net else ""))
    if purge_images:
        removed, kept = image.purge_images()
        log(f"removed images: {', '.join(removed) or 'none'}")
        if kept:
            log(f"kept images still in use by other sandboxes: {', '.join(kept)}")
