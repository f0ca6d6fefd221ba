"""The podman CLI, always run with the project's containers.conf (field notes §7: never edit /etc)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

from k31deploy.errors import K31Error
from k31deploy.sandbox import DATA_DIR

CONTAINERS_CONF = DATA_DIR / "containers.conf"
# debootstrap only builds the base image, but a fresh machine needs it for the first `up`.
UP_TOOLS = ("podman", "runc", "debootstrap", "ssh", "ssh-keygen")


def env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def check_host(tools: tuple[str, ...] = ("podman",)) -> None:
    """The controller must run rootful podman: it reaches the containers by their bridge IPs."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing:
        raise K31Error(
            f"k31 sandbox needs {', '.join(missing)} on PATH; install them with "
            "`apt-get install -y podman runc debootstrap openssh-client`"
        )
    if os.geteuid() != 0:
        raise K31Error("k31 sandbox must run as root (rootful podman), so the controller can reach node IPs")


def failure(what: str, proc: subprocess.CompletedProcess) -> K31Error:
    """One sentence for a failed command: what was tried and the command's own last words."""
    lines = [line for line in (proc.stderr or proc.stdout or "").splitlines() if line.strip()]
    return K31Error(f"{what} failed (exit {proc.returncode}): {lines[-1] if lines else 'no output'}")


def run(*args: str, check: bool = True, stdin: Any = None,
        stdin_text: str | None = None) -> subprocess.CompletedProcess:
    """podman ARGS; `stdin_text` is written to its standard input (`exec -i`)."""
    if stdin_text is not None:
        proc = subprocess.run(["podman", *args], env=env(), input=stdin_text, capture_output=True, text=True)
    else:
        proc = subprocess.run(["podman", *args], env=env(), stdin=stdin, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise failure(f"podman {' '.join(args[:2])}", proc)
    return proc


def json_out(*args: str) -> Any:
    out = run(*args).stdout.strip()
    return json.loads(out) if out else []
