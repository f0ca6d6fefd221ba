"""Ansible filters over k31deploy.hostcheck: pre-flight checks, RDMA device choice and IMEX status.

Thin on purpose: the roles hand over what host tools printed; parsing and every rule live in
k31deploy.hostcheck (tested against captured tool output). Docs: `ansible-doc -t filter k31_preflight_checks`.
"""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleFilterError

try:
    from k31deploy import memory
    from k31deploy.errors import K31Error
    from k31deploy.hostcheck import checks, engine, mnnvl, rdma, system
except ImportError as exc:  # pragma: no cover - only without the package installed
    raise AnsibleFilterError(f"k31 filters need the k31deploy package (pip install -e .): {exc}") from exc


def k31_preflight_checks(output: str, plan: dict[str, Any], host: str,
                         settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """One host's pre-flight records from the collect script's output."""
    try:
        return checks.evaluate(plan, host, output, settings)
    except (K31Error, ValueError) as exc:
        raise AnsibleFilterError(f"error: {host}: {exc}") from None


def k31_preflight_report(hosts: list[str], hostvars: Any, fact: str = "_k31_preflight_result") -> dict[str, Any]:
    """All hosts' records together; a host without a result (unreachable, probe failed) is a failure."""
    results = []
    for host in hosts:
        result = hostvars[host].get(fact) if host in hostvars else None
        if not isinstance(result, dict):
            result = {"host": host, "facts": {}, "checks": [
                {"host": host, "check": "probe", "status": "fail", "found": "no pre-flight result",
                 "expected": "the host answers the probe", "note": "unreachable, or the probe failed"}]}
        results.append(result)
    return checks.report(results)


def k31_probe_sections(output: str) -> dict[str, dict[str, Any]]:
    """Probe output in `### k31:NAME` ... `### k31:NAME rc=N` sections -> {NAME: {rc, text}}."""
    return {name: {"rc": sec.rc, "text": sec.text} for name, sec in system.sections(output).items()}


def k31_host_memory_need(plan: dict[str, Any], host: str, weights_gb_per_gpu: float | None = None) -> int:
    """Bytes of host DRAM the HiCache pinned pools of `host` need (0 without a host tier)."""
    try:
        options = memory.Options(weights_gb_per_gpu=float(weights_gb_per_gpu)) if weights_gb_per_gpu else None
        return memory.host_memory_need(plan, host, options)
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_rdma_choice(output: str, host_ip: str | None, cidrs: list[str] | None = None, gid_index: Any = None,
                    extra_env: dict[str, Any] | None = None) -> dict[str, Any]:
    """What k31_rdma does on this host, from the pre-flight probe's output (rdma.choose)."""
    gid = None if gid_index is None or gid_index == "" else int(gid_index)
    try:
        return rdma.choose(system.sections(output), host_ip or None, list(cidrs or []), gid, dict(extra_env or {}))
    except ValueError as exc:
        raise AnsibleFilterError(f"error: k31_rdma_fabric_cidrs: {exc}") from None


def k31_mlnx_qos(output: str) -> dict[str, Any]:
    """`mlnx_qos -i IF` -> {trust, pfc: [8 bits]}."""
    return rdma.parse_mlnx_qos(output)


def k31_pfc_vector(priorities: list[int]) -> list[int]:
    return rdma.pfc_vector([int(p) for p in priorities])


def k31_imex_domain(plan: dict[str, Any]) -> list[str]:
    """Inventory hosts of the plan's NVLink domain (NVL72 platforms), in plan order; [] elsewhere."""
    return mnnvl.domain_hosts(plan)


def k31_imex_nodes_config(addresses: list[str]) -> str:
    try:
        return mnnvl.nodes_config(list(addresses))
    except ValueError as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_imex_config(text: str, values: dict[str, Any]) -> str:
    """nvidia-imex config.cfg with k31's keys set, the rest of the file kept."""
    return mnnvl.set_config_keys(text, dict(values))


def k31_imex_status(output: str, addresses: list[str]) -> dict[str, Any]:
    """`nvidia-imex-ctl -N` -> {ready, reason, nodes, matrix, domain_state}."""
    status = mnnvl.parse_imex_ctl(output)
    ready, reason = mnnvl.imex_ready(status, list(addresses))
    return {**status, "ready": ready, "reason": reason}


def k31_engine_probe(command: list[str]) -> list[str]:
    """argv that prints the SGLang version and plugins a Python sees: `command` starts that Python (a
    venv's python3, or `docker run ... --entrypoint python3 IMAGE`), the probe's arguments follow."""
    return [*command, *engine.probe_args()]


def k31_engine_check(output: str, plan: dict[str, Any]) -> dict[str, Any]:
    """The engine probe's output against the plan's engine build and plugins: {ok, found, problems}."""
    return engine.check(output, plan["engine"])


class FilterModule:
    def filters(self):
        return {
            "k31_preflight_checks": k31_preflight_checks, "k31_preflight_report": k31_preflight_report,
            "k31_host_memory_need": k31_host_memory_need, "k31_rdma_choice": k31_rdma_choice,
            "k31_mlnx_qos": k31_mlnx_qos, "k31_pfc_vector": k31_pfc_vector, "k31_imex_domain": k31_imex_domain,
            "k31_imex_nodes_config": k31_imex_nodes_config, "k31_imex_status": k31_imex_status,
            "k31_imex_config": k31_imex_config,
            "k31_probe_sections": k31_probe_sections,
            "k31_engine_probe": k31_engine_probe, "k31_engine_check": k31_engine_check,
        }
