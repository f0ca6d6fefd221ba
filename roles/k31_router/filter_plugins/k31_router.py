"""Role filter: the router unit's command, with the API key handed over in-process (launch.service_command)."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

try:
    from k31deploy import launch
    from k31deploy.errors import K31Error
except ImportError as exc:  # pragma: no cover - only without the package installed
    raise AnsibleFilterError(f"k31 filters need the k31deploy package (pip install -e .): {exc}") from exc


def k31_router_command(argv: list[str], runtime: str, unit: str, image: str | None, venv: str,
                       container_cli: str = "docker", env_file: str | None = None,
                       secret_flags: dict[str, str] | None = None, secret_exec: str | None = None,
                       mounts: list[str] | None = None) -> list[str]:
    """The router's command for the host's runtime; `secret_flags` ({flag: env var}) go through k31-secret-exec."""
    extra: dict[str, Any] = {"secret_exec": secret_exec} if secret_exec else {}
    try:
        return launch.service_command(argv, runtime, unit=unit, image=image, venv=venv, container_cli=container_cli,
                                      env_file=env_file, secret_flags=dict(secret_flags or {}), mounts=mounts,
                                      **extra)
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


class FilterModule:
    def filters(self):
        return {"k31_router_command": k31_router_command}
