"""What tree staging (k31_model_fanout=tree) needs of a sandbox, for the staging benchmark and its integration test:
engine hosts that reach each other over SSH as root with checked host keys (a site's prerequisite, as the seed
host is for k31_model_source=rsync), links rate-limited on the nodes' interfaces, and a synthetic model with a
SHA256SUMS manifest on the seed node. Nothing here changes how `k31 sandbox up` makes nodes."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from k31deploy.errors import K31Error
from k31deploy.sandbox import cluster, podman


def nodes(name: str) -> list[str]:
    """The sandbox's containers in shape order."""
    return [ctr["Names"][0] for ctr in cluster._containers(name)]


def node_sh(container: str, command: str, privileged: bool = False) -> str:
    argv = ["exec", *(["--privileged"] if privileged else []), container, "sh", "-c", command]
    return podman.run(*argv).stdout


def peer_ssh(name: str) -> None:
    """Root on every node may ssh to every other node: one key pair for the sandbox's nodes, its public half in
    each node's authorized_keys, and the sandbox's known_hosts (host keys read out of the containers through
    podman, not over the network) as root's known_hosts. Idempotent."""
    directory = cluster.sandbox_dir(name)
    key = directory / "peer_ed25519"
    known = directory / "known_hosts"
    if not known.is_file():
        raise K31Error(f"sandbox {name} has no known_hosts; run `k31 sandbox up --name {name}` first")
    if not key.is_file():
        argv = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"k31-sandbox-{name}-peers", "-f", str(key)]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise podman.failure("ssh-keygen", proc)
    public = Path(f"{key}.pub").read_text().strip()

    def install(ctr: str) -> None:
        podman.run("cp", str(key), f"{ctr}:/root/.ssh/id_ed25519")
        podman.run("cp", str(known), f"{ctr}:/root/.ssh/known_hosts")
        node_sh(ctr, "chown root:root /root/.ssh/id_ed25519 /root/.ssh/known_hosts && chmod 600 /root/.ssh/id_ed25519 "
                     f"&& (grep -qxF {shlex.quote(public)} /root/.ssh/authorized_keys "
                     f"|| echo {shlex.quote(public)} >> /root/.ssh/authorized_keys)")

    cluster._parallel(install, nodes(name))


def shape_links(name: str, rate: str | None) -> None:
    """Egress shaping on each node's eth0 (tc tbf), or none with rate None. A source's uplink is then what a
    copy waits on, as on a real cluster's links. `podman exec --privileged` gives tc the capabilities it needs."""
    if rate:
        command = f"tc qdisc replace dev eth0 root tbf rate {shlex.quote(rate)} burst 256kb latency 50ms"
    else:
        command = "tc qdisc del dev eth0 root 2>/dev/null || true"
    cluster._parallel(lambda ctr: node_sh(ctr, command, privileged=True), nodes(name))


def shape_controller_link(name: str, rate: str | None) -> None:
    """Egress shaping of the controller's side of the sandbox's network (tc tbf on its bridge, on this machine), or
    none with rate None: what the controller sends to all the nodes together (k31_image_fanout=controller) then
    shares one rate-limited link, as a real controller's uplink does. Traffic between nodes is switched between
    the bridge's ports and is shaped on the nodes (shape_links). Removed with the sandbox's network."""
    bridge = podman.run("network", "inspect", cluster.network_name(name), "--format",
                        "{{.NetworkInterface}}").stdout.strip()
    if not bridge:
        raise K31Error(f"sandbox {name} has no bridge interface to shape")
    argv = (["tc", "qdisc", "replace", "dev", bridge, "root", "tbf", "rate", rate, "burst", "256kb", "latency", "50ms"]
            if rate else ["tc", "qdisc", "del", "dev", bridge, "root"])
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0 and rate:
        raise podman.failure("tc", proc)


def make_model(container: str, directory: str, total_mb: int, files: int = 4) -> None:
    """A synthetic model on one node: `files` random shards totalling total_mb MiB, a config.json and a
    SHA256SUMS manifest over them."""
    each = max(1, total_mb // files)
    d = shlex.quote(directory)
    shards = " && ".join(
        f"head -c {each}M /dev/urandom > model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files))
    node_sh(container, f"set -e; rm -rf {d}; mkdir -p {d}; cd {d}; {shards}; echo '{{}}' > config.json; "
                       "sha256sum config.json *.safetensors > SHA256SUMS")
