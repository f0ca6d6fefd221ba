"""How a planned process is started on its host: in a container, in a venv, or as the CPU stand-in.

The plan says *what* runs (argv, env); this module only wraps that argv for the host's runtime.
Used by the roles through the k31 filters, so the wrapping is unit-tested in Python.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

from k31deploy import address as addr
from k31deploy.errors import K31Error
from k31deploy.plan import Plan, Rank

RUNTIMES = ("container", "venv", "standin")
CONTAINER_CLIS = ("docker", "podman")
# Python entry points the plan uses, and what the sandbox's CPU stand-in runs in their place.
STANDIN_MODULES = {
    "sglang.launch_server": "k31deploy.standin",
    "dynamo.sglang": "k31deploy.standin.dynamo",
}


def host_ranks(plan: dict[str, Any], host: str) -> list[dict[str, Any]]:
    """The ranks a host runs, each with its server's fields (without the other ranks)."""
    found = []
    for server in plan["servers"]:
        for rank in server["ranks"]:
            if rank["host"] == host:
                info = {k: v for k, v in server.items() if k != "ranks"}
                # engines bind their cluster address only (not loopback): probe it there
                found.append({"server": info, "rank": rank,
                              "health_url": addr.http_url(rank["address"], server["port"], "/health")})
    return found


# podman reaches NVIDIA devices through CDI (Container Device Interface) specs, not docker's nvidia hook:
# podman 4 takes --gpus and ignores it, so the container gets no GPU (NVIDIA/nvidia-container-runtime#190:
# `podman run --gpus all` shows no /dev/nvidia*, `--device nvidia.com/gpu=all` does), and the hook that reads
# NVIDIA_IMEX_CHANNELS is the legacy docker path too. The CDI kinds are those `nvidia-ctk cdi generate` writes
# (NVIDIA/nvidia-container-toolkit pkg/nvcdi: kind nvidia.com/gpu; --mode=imex: nvidia.com/imex-channel).
CDI_GPU = "nvidia.com/gpu"
CDI_IMEX = "nvidia.com/imex-channel"
IMEX_ENV = "NVIDIA_IMEX_CHANNELS="
# How a host gets the spec of each kind: the nvidia-ctk arguments that write it (k31_container_runtime).
CDI_GENERATE = {
    CDI_GPU: ["cdi", "generate", "--output=/etc/cdi/nvidia.yaml"],
    CDI_IMEX: ["cdi", "generate", "--mode=imex", "--output=/etc/cdi/nvidia-imex.yaml"],
}


def _container_flags(flags: list[str], cli: str) -> list[str]:
    if cli == "docker":
        return list(flags)
    # With --ipc=host the container uses the host's /dev/shm, so a --shm-size has nothing to size: docker
    # ignores it, podman refuses the run ("cannot set shmsize when running in the {host } IPC Namespace",
    # podman 4.3, tried in the sandbox). NVIDIA devices become CDI devices (CDI_GPU above).
    host_ipc = "--ipc=host" in flags
    out, i = [], 0
    while i < len(flags):
        if flags[i] == "--gpus":
            out += ["--device", f"{CDI_GPU}={flags[i + 1]}"]
            i += 2
            continue
        if host_ipc and flags[i] == "--shm-size":
            i += 2
            continue
        if host_ipc and flags[i].startswith("--shm-size="):
            i += 1
            continue
        if flags[i] in ("--env", "-e") and i + 1 < len(flags) and flags[i + 1].startswith(IMEX_ENV):
            # The variable stays (what the plan sets); the channels come as CDI devices, one per channel.
            out += flags[i:i + 2]
            for channel in flags[i + 1].removeprefix(IMEX_ENV).split(","):
                out += ["--device", f"{CDI_IMEX}={channel.strip()}"]
            i += 2
            continue
        out.append(flags[i])
        i += 1
    return out


def cdi_devices(flags: list[str], cli: str) -> list[str]:
    """The CDI devices (kind=name) a container run with the plan's flags asks for under `cli`: what the host's
    CDI specs must list before an engine starts (k31_container_runtime)."""
    run = _container_flags(flags, cli)
    return [run[i + 1] for i, flag in enumerate(run[:-1])
            if flag == "--device" and run[i + 1].split("=", 1)[0] in CDI_GENERATE]


def docker_daemon(current: Mapping[str, Any], nvidia: bool, nvidia_default: bool, memlock: int,
                  nofile: int) -> dict[str, Any]:
    """docker's daemon.json with k31's settings merged into the site's (`current`, kept where k31 sets nothing;
    nested objects merge key by key): default container ulimits, memlock (-1 unlimited) and nofile, which the
    engines' containers need (field notes §2, §6); on an NVIDIA host the nvidia runtime, and with
    `nvidia_default` that runtime as the default."""
    want: dict[str, Any] = {"default-ulimits": {
        name: {"Name": name, "Soft": int(limit), "Hard": int(limit)}
        for name, limit in (("memlock", memlock), ("nofile", nofile))}}
    if nvidia:
        want["runtimes"] = {"nvidia": {"path": "nvidia-container-runtime", "args": []}}
        if nvidia_default:
            want["default-runtime"] = "nvidia"
    return _merge(dict(current), want)


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) \
            else value
    return out


DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")


def pinned_image(image: str, digest: str = "") -> str:
    """The image reference a host pulls and every unit runs: `repo@sha256:...` once a digest is known (from
    `image` itself or `digest`, k31_image_digest), else `image` as given. A tag is dropped from a pinned
    reference: podman refuses `repo:tag@sha256:...` ("Docker references with both a tag and digest are
    currently not supported"), and the digest alone names the content."""
    image = str(image or "")
    digest = str(digest or "").strip()
    if digest and not DIGEST.match(digest):
        raise K31Error(f"k31_image_digest={digest!r} is not valid; valid: sha256: and 64 lowercase hex digits, "
                       f"or empty")
    name, _, own = image.partition("@")
    if own:
        if not DIGEST.match(own):
            raise K31Error(f"k31_image={image!r} is not valid; valid: REPO[:TAG] or REPO@sha256:<64 hex digits>")
        if digest and digest != own:
            raise K31Error(f"k31_image names digest {own} but k31_image_digest is {digest}; set one of them")
        digest = own
    if not digest:
        return image
    slash = name.rfind("/")
    colon = name.rfind(":")
    repo = name[:colon] if colon > slash else name     # a registry's :port comes before the last slash
    return f"{repo}@{digest}"


ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")


def env_from_files(mapping: dict[str, str] | None) -> list[str]:
    """Launch-script lines setting each variable to the text of its file, for programs that take PEM text
    rather than a path (Dynamo's etcd client): read at start, so the text is in no file k31 renders and in
    no argv. Assignment and export are two statements, so `set -e` stops the script when a file is missing."""
    lines = []
    for name, path in (mapping or {}).items():
        if not ENV_NAME.match(name) or not path.startswith("/") or any(not c.isprintable() for c in path):
            raise K31Error(f"env_from_files {name}={path!r} is not valid; valid: an env var name and an "
                           f"absolute path")
        lines.append(f'{name}="$(cat {shlex.quote(path)})"; export {name}')
    return lines


# Installed by the k31_engine role (roles/k31_engine/files/k31-request-port).
REQUEST_PORT_PICKER = "/usr/local/lib/k31/k31-request-port"
REQUEST_PORT_ENV = "DYN_TCP_RPC_PORT"


def start_env(doc: Rank | dict[str, Any]) -> list[str]:
    """Shell lines a rank's launch script runs to set what is chosen at each start: behind Dynamo, the
    request-plane port (DYN_TCP_RPC_PORT), the next free port of the plan's range after the one the
    previous start took. The frontend keeps a pooled TLS connection per worker address:port, and the first
    request it sends over it after the worker restarted on the same port fails (ai-dynamo 1.6.1
    lib/runtime/src/pipeline/network/egress/tcp_client.rs); a new port is a new pool."""
    rank = Rank.of(doc)
    if not rank.request_plane_ports:
        return []
    first, last = rank.request_plane_ports
    if not 1 <= first <= last <= 65535:
        raise K31Error(f"{rank.unit}: request_plane_ports {list(rank.request_plane_ports)} is not valid; valid: "
                       f"[first, last] with 1 <= first <= last <= 65535")
    pick = shlex.join([REQUEST_PORT_PICKER, rank.unit, rank.address, str(first), str(last)])
    return [f'{REQUEST_PORT_ENV}="$({pick})"; export {REQUEST_PORT_ENV}']


def start_env_names(rank: Rank) -> list[str]:
    return [REQUEST_PORT_ENV] if rank.request_plane_ports else []


def engine_command(doc: Plan | dict[str, Any], rank_doc: Rank | dict[str, Any], runtime: str, *, env_file: str,
                   container_cli: str = "docker", venv: str = "/opt/k31/venv",
                   mounts: list[str] | None = None, extra_flags: list[str] | None = None,
                   image: str | None = None) -> list[str]:
    """The full command a rank's systemd unit runs; a container runs `image` (the pinned reference,
    pinned_image) or else the plan's image."""
    plan, rank = Plan.of(doc), Rank.of(rank_doc)
    argv = list(rank.argv)
    if runtime not in RUNTIMES:
        raise K31Error(f"k31_engine_runtime={runtime} is not valid; valid choices: {', '.join(RUNTIMES)}")
    if runtime == "container":
        if container_cli not in CONTAINER_CLIS:
            raise K31Error(f"k31_engine_container_cli={container_cli} is not valid; valid choices: "
                           f"{', '.join(CONTAINER_CLIS)}")
        image = image or plan.image
        if not image or str(image).startswith("<"):
            raise K31Error(f"image is {image}: set k31_image to the serving image before a deploy")
        volumes = [t for m in (mounts or []) for t in ("-v", m)]
        # Variables the launch script set (env_from_files, start_env) pass by name: the value stays out of argv.
        passed = [t for name in [*rank.env_from_files, *start_env_names(rank)] for t in ("-e", name)]
        return [container_cli, "run", "--rm", "--name", rank.unit,
                *_container_flags(list(plan.container_flags), container_cli), *(extra_flags or []),
                "--env-file", env_file, *passed, *volumes,
                str(image), *argv]
    if argv[:2] != ["python3", "-m"]:
        raise K31Error(f"{rank.unit} runs {argv[0]}, which k31_engine_runtime={runtime} cannot start; "
                       f"use k31_engine_runtime=container")
    if runtime == "venv":
        return [f"{venv}/bin/python3", *argv[1:]]
    module = STANDIN_MODULES.get(argv[2])
    if module is None:
        raise K31Error(f"the stand-in has no replacement for {argv[2]}; valid: {', '.join(STANDIN_MODULES)}")
    return [f"{venv}/bin/python3", "-m", module, *argv[3:]]


# The health gate on engine hosts (k31deploy/oncall/gate.py, installed by k31_engine).
ENGINE_GATE = "/usr/local/lib/k31/k31-engine-gate"


def gate_args(targets: list[tuple[str, str]], watch: list[str], timeout: Any, quick: Any, interval: Any,
              max_restarts: Any) -> list[str]:
    """The health gate's arguments: each (unit, health URL) a target, each of `watch` watched for a crash loop."""
    return ["--timeout", str(timeout), "--quick", str(quick), "--interval", str(interval),
            "--max-restarts", str(max_restarts), *(f"--target={unit}={url}" for unit, url in targets),
            *(f"--watch={unit}" for unit in watch)]


def host_gate(ranks: list[dict[str, Any]], **gate: Any) -> list[str]:
    """A deploy's health gate on one engine host (k31_engine): every rank 0 the host runs (`ranks`: host_ranks)
    a target, every rank it runs watched; [] where it runs no rank 0, which has nothing to gate."""
    targets = [(r["rank"]["unit"], r["health_url"]) for r in ranks if r["rank"]["node_rank"] == 0]
    return [ENGINE_GATE, *gate_args(targets, [r["rank"]["unit"] for r in ranks], **gate)] if targets else []


def model_mounts(doc: Plan | dict[str, Any]) -> list[str]:
    """Local model and draft directories, mounted read-only at the same path in the container."""
    plan = Plan.of(doc)
    paths = [plan.knob("model_path"), plan.knob("draft_model_path")]
    return [f"{p}:{p}:ro" for p in paths if isinstance(p, str) and p.startswith("/")]


def rank_mounts(doc: Plan | dict[str, Any], rank_doc: Rank | dict[str, Any]) -> list[str]:
    """Files a rank's container reads from its host, read-only at the same path: its key file (--config)
    and, behind Dynamo, the cluster CA's folder (its TLS certificate and key)."""
    plan, rank = Plan.of(doc), Rank.of(rank_doc)
    found = [rank.auth_file] if rank.auth_file else []
    if plan.pki and plan.router_kind == "dynamo":
        found.append(plan.pki.dir)
    return [f"{p}:{p}:ro" for p in found]


def endpoint_address(doc: Plan | dict[str, Any]) -> tuple[str, int]:
    """(address, port) clients use: the router's or Dynamo frontend's public address, else the first unified
    server's rank 0."""
    plan = Plan.of(doc)
    if plan.router:
        return plan.router.public_address, plan.router.port
    for server in plan.servers:
        if server.role == "unified":
            return server.ranks[0].address, server.port
    raise K31Error("the plan has neither a router nor a unified server to smoke; add a host to k31_router")


def http_url(address: str, port: int, scheme: str = "http") -> str:
    """The OpenAI base URL of an address (IPv6 in brackets)."""
    return addr.url(scheme, address, port, "/v1")


def endpoint_scheme(doc: Plan | dict[str, Any]) -> str:
    """https behind the Dynamo frontend (it takes clients with a cluster-CA certificate) or with public_tls,
    else http."""
    router = Plan.of(doc).router
    return "https" if router and (router.kind == "dynamo" or router.tls) else "http"


def endpoint(doc: Plan | dict[str, Any]) -> str:
    """The OpenAI base URL clients use (see endpoint_address)."""
    plan = Plan.of(doc)
    return http_url(*endpoint_address(plan), endpoint_scheme(plan))


def metrics_targets(doc: Plan | dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Prometheus file_sd groups: engines (rank 0 serves /metrics with --enable-metrics), the router's
    metrics listener, the Dynamo frontend's /metrics."""
    plan = Plan.of(doc)
    engines = [{"targets": [addr.host_port(s.ranks[0].address, s.port)],
                "labels": {"k31_server": s.name, "k31_role": s.role, "k31_strategy": s.strategy}}
               for s in plan.servers]
    files: dict[str, list[dict[str, Any]]] = {"k31-engines": engines}
    router = plan.router
    if router:
        port = router.metrics_port or (router.port if router.kind == "dynamo" else None)
        if port:
            files["k31-router"] = [{"targets": [addr.host_port(router.address, port)],
                                    "labels": {"k31_router": router.kind}}]
    return files


def service_command(argv: list[str], runtime: str, *, unit: str, image: str | None, venv: str,
                    container_cli: str = "docker", env_file: str | None = None,
                    secret_flags: dict[str, str] | None = None,
                    secret_exec: str = "/usr/local/lib/k31/k31-secret-exec.py",
                    mounts: list[str] | None = None, pass_env: list[str] | None = None) -> list[str]:
    """The router, Dynamo frontend or Mooncake master command for the host's runtime: the serving
    image with host networking, or the same program from a venv (a Python module through the venv's
    interpreter, a binary from the venv's bin/).

    `secret_flags` ({flag: environment variable}) are flags whose values are secrets the program takes
    only on its command line (sglang-router's --api-key). They never go into argv, where /proc/<pid>/cmdline
    shows them to every local user: the program starts through `secret_exec` (roles/k31_router/files/
    k31-secret-exec.py), which reads each value from the environment (the unit's 0600 env file) and adds
    the flag in-process. Only a Python module can be started that way; a binary is refused.
    `mounts` are host folders the program reads (certificates: the plan's `mounts`), read-only in a container;
    `pass_env` variables the launch script set (env_from_files) that a container takes by name.
    """
    if secret_flags:
        if argv[:2] != ["python3", "-m"]:
            flags = ", ".join(secret_flags)
            raise K31Error(f"{unit}: {argv[0]} takes {flags} only on its command line, where every local user "
                           f"reads it in /proc/<pid>/cmdline; k31 keeps secrets out of argv only for Python "
                           f"modules (python3 -m ...), so run a Python entry point or set no secret")
        pairs = [token for flag, var in secret_flags.items() for token in ("--flag-from-env", flag, var)]
        argv = ["python3", secret_exec, *pairs, "-m", *argv[2:]]
    if runtime == "venv":
        return [f"{venv}/bin/{argv[0]}", *argv[1:]]
    if runtime != "container":
        raise K31Error(f"{unit}: runtime {runtime} is not valid; valid choices: container, venv")
    if not image or image.startswith("<"):
        raise K31Error(f"image is {image}: set k31_image to the serving image before a deploy")
    env = ["--env-file", env_file] if env_file else []
    # The launcher lives on the host; the container sees it read-only at the same path.
    files = [*([secret_exec] if secret_flags else []), *(mounts or [])]
    volumes = [t for path in files for t in ("-v", f"{path}:{path}:ro")]
    passed = [t for name in pass_env or [] for t in ("-e", name)]
    return [container_cli, "run", "--rm", "--name", unit, "--network=host", *env, *passed, *volumes, image, *argv]
