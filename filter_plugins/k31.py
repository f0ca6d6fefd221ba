"""Ansible filters over k31deploy.recipe: the playbooks' one door to the recipe's rules.

Thin on purpose: it turns Ansible's `groups` / `hostvars` into the resolver's hosts and returns
the plan; every rule lives in k31deploy (catalog + resolver). Docs: `ansible-doc -t filter k31_plan`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible.module_utils.parsing.convert_bool import boolean

try:
    from k31deploy import address, envfile, imagearchive, launch, staging, stamp
    from k31deploy.errors import K31Error
    from k31deploy.monitoring import config as monitoring
    from k31deploy.monitoring import converge
    from k31deploy.paths import state_dir
    from k31deploy.plan import Plan, Rank
    from k31deploy.recipe import from_mapping, resolve
    from k31deploy.recipe.hosts import K31_GROUPS, check_groups, serves_image
except ImportError as exc:  # pragma: no cover - only without the package installed
    raise AnsibleFilterError(f"k31 filters need the k31deploy package (pip install -e .): {exc}") from exc


def _hosts(groups: dict[str, list[str]], hostvars: Any) -> list:
    check_groups(dict(groups), "the inventory")
    names: list[str] = []
    for group in K31_GROUPS:
        names += [h for h in groups.get(group, []) if h not in names]
    order = {h: i for i, h in enumerate(groups.get("all", []))}
    names.sort(key=lambda h: order.get(h, len(order)))
    hosts = []
    for name in names:
        hv = hostvars[name]
        wanted = {k: hv[k] for k in hv if k.startswith("k31_") or k == "ansible_host"}
        member_of = [g for g in K31_GROUPS if name in groups.get(g, [])]
        hosts.append(from_mapping(name, member_of, wanted))
    return hosts


def k31_plan(groups: dict[str, list[str]], hostvars: Any, settings: dict[str, Any] | None = None,
             require_image: bool = False, on_error: str = "raise", resolve_names: bool = True) -> dict[str, Any]:
    """Resolve the plan for the inventory; on_error='return' gives {'error': sentence} instead of failing.
    Host names become the IPs services bind to (resolve_names), as every playbook reaching hosts needs."""
    try:
        return resolve(dict(settings or {}), _hosts(groups, hostvars), require_image=bool(require_image),
                       resolve_names=bool(resolve_names))
    except K31Error as exc:
        if on_error == "return":
            return {"error": str(exc)}
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_host_ranks(plan: dict[str, Any], host: str) -> list[dict[str, Any]]:
    """The ranks `host` runs: [{server, rank, health_url}] (one per engine host)."""
    return launch.host_ranks(plan, host)


def k31_docker_daemon(current: dict[str, Any] | None, nvidia: Any, nvidia_default: Any, memlock: Any,
                      nofile: Any) -> dict[str, Any]:
    """docker's daemon.json with k31's settings merged into the site's (launch.docker_daemon)."""
    return launch.docker_daemon(dict(current or {}), boolean(nvidia, strict=False),
                                boolean(nvidia_default, strict=False), int(memlock), int(nofile))


def k31_engine_gate(ranks: list[dict[str, Any]], timeout: Any, quick: Any, interval: Any,
                    max_restarts: Any) -> list[str]:
    """The health gate's command on an engine host (its k31_host_ranks): [] where it runs no rank 0."""
    return launch.host_gate(list(ranks), timeout=timeout, quick=quick, interval=interval, max_restarts=max_restarts)


def k31_engine_command(rank: dict[str, Any], plan: dict[str, Any], runtime: str, env_file: str,
                       container_cli: str = "docker", venv: str = "/opt/k31/venv",
                       extra_flags: list[str] | None = None, image: str | None = None) -> list[str]:
    """The command a rank's unit runs for the host's runtime (container, venv or the stand-in); a container
    runs `image` (k31_image_pinned) or else the plan's image."""
    try:
        typed, one = Plan.of(plan), Rank.of(rank)    # read once for the command and its mounts
        return launch.engine_command(typed, one, runtime, env_file=env_file, container_cli=container_cli,
                                     venv=venv, mounts=launch.model_mounts(typed) + launch.rank_mounts(typed, one),
                                     extra_flags=extra_flags, image=image or None)
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_serves_image(host: str, groups: dict[str, list[str]], plan: dict[str, Any], engine_runtime: str,
                     router_runtime: str, dynamo_runtime: str) -> bool:
    """Whether the host runs something from the serving image (k31deploy.recipe.hosts.serves_image); the runtimes'
    defaults are roles/k31's."""
    return serves_image(host, groups, (plan.get("router") or {}).get("kind"), engine_runtime, router_runtime,
                        dynamo_runtime)


def k31_image_pinned(image: str, digest: str = "") -> str:
    """`repo@sha256:...` when a digest is known (in the image or k31_image_digest), else the image as given."""
    try:
        return launch.pinned_image(image, digest)
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_image_archive_id(tarball: str, image: str) -> str:
    """The image ID (sha256:...) of `image` in a `docker save` archive on the controller; a load must give it."""
    try:
        return imagearchive.find(tarball, image).id
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_over_ssh(connection: str | None) -> bool:
    """Whether the controller's image archive goes to a host with this ansible_connection by rsync over SSH."""
    return imagearchive.copies_over_ssh(connection)


def k31_call(result: Any, default: str = "no answer") -> dict[str, Any]:
    """A host-side client call's answer (`k31_probe.py --call ...`, a raw task's registered result): its JSON line,
    for a loop the first item that failed (else the last). Where it printed none, {"ok": false, "reason": its
    stderr; else Ansible's msg where the host did not answer; else `default` (the caller's words for a call that
    timed out or said nothing)}."""
    items = list(result.get("results") or [result]) if isinstance(result, dict) else [{}]
    failed = [r for r in items if r.get("failed") or r.get("unreachable")]
    item = failed[0] if failed else items[-1]
    try:
        answer = json.loads((item.get("stdout") or "").strip().splitlines()[-1])
    except (IndexError, ValueError):
        answer = None
    if not isinstance(answer, dict):
        answer = {}
    answer["ok"] = answer.get("ok") is True    # always there: Ansible 2.19 refuses `.ok` on a dict without it
    if not answer["ok"] and not answer.get("reason"):
        lost = str(item.get("msg") or "").strip() if item.get("unreachable") else ""
        answer["reason"] = str(item.get("stderr") or "").strip() or lost or str(default)
    return answer


def k31_ssh_addresses(hosts: list[str], hostvars: Any) -> list[str]:
    """Where each host is reached over SSH: its ansible_host, else its inventory name (the tree staging's peers)."""
    out = []
    for host in hosts:
        try:
            out.append(str(hostvars[host]["ansible_host"]))
        except (KeyError, TypeError):
            out.append(str(host))
    return out


def k31_image_archive_sha256(tarball: str) -> str:
    """The sha256 of the controller's archive (64 hex; k31_image_fanout=tree checks each host's copy against it):
    hashed once, then remembered per path, size and mtime in the state directory (image-archives.json)."""
    try:
        return imagearchive.sha256(tarball, state_dir() / "image-archives.json")
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_image_rounds(hosts: list[str], need: list[str], hold: list[str]) -> dict[str, Any]:
    """{seed, controller, rounds, hosts: {host: {round, source, after}}}: the archive's tree (k31_image_fanout=tree)."""
    try:
        return staging.from_controller(list(hosts), list(need), list(hold))
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_cdi_devices(flags: list[str], cli: str) -> list[dict[str, Any]]:
    """The CDI devices (kind=name) a container run with the plan's flags asks for under `cli`, each with the
    nvidia-ctk arguments that write its kind's spec."""
    return [{"device": d, "generate": launch.CDI_GENERATE[d.split("=", 1)[0]]}
            for d in launch.cdi_devices(list(flags), cli)]


def k31_service_command(argv: list[str], runtime: str, unit: str, image: str | None, venv: str,
                        container_cli: str = "docker", env_file: str | None = None,
                        mounts: list[str] | None = None, pass_env: list[str] | None = None) -> list[str]:
    """Router, Dynamo frontend or Mooncake master command for the host's runtime (container or venv)."""
    try:
        return launch.service_command(argv, runtime, unit=unit, image=image, venv=venv,
                                      container_cli=container_cli, env_file=env_file, mounts=mounts,
                                      pass_env=list(pass_env or []))
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_env_from_files(mapping: dict[str, str] | None) -> list[str]:
    """Launch-script lines setting variables to the text of files (the plan's env_from_files)."""
    try:
        return launch.env_from_files(mapping)
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_start_env(rank: dict[str, Any]) -> list[str]:
    """Launch-script lines setting what a rank chooses at each start (a Dynamo worker's request-plane port)."""
    try:
        return launch.start_env(rank)
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_metrics_targets(plan: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Prometheus file_sd target groups by file name (engines, router or frontend)."""
    return launch.metrics_targets(plan)


def k31_endpoint(plan: dict[str, Any]) -> str:
    """The OpenAI base URL clients use (router, frontend, or the unified server)."""
    return launch.endpoint(plan)


def k31_url(host: str, port: int, scheme: str = "http", path: str = "") -> str:
    """`scheme://host:port/path` with an IPv6 host in brackets (k31deploy.address)."""
    return address.url(scheme, str(host), port, path)


def k31_host_port(host: str, port: int) -> str:
    """`host:port` with an IPv6 host in brackets."""
    return address.host_port(str(host), port)


def k31_env_file(texts: list[str]) -> dict[str, str]:
    """KEY=VALUE lines of env files as k31_env_line writes them (comments and blanks skipped), later files
    winning."""
    return envfile.parse(texts)


def k31_env_line(key: str, value: Any, container: bool = False) -> str:
    """One env-file line no value can break out of (k31deploy.envfile): container=true when docker/podman
    --env-file read the file too."""
    try:
        return envfile.line(key, value, container=bool(container))
    except K31Error as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_env_comment(text: Any) -> str:
    """Text safe on one `# ...` line of an env file or script."""
    return envfile.comment(text)


def k31_flag_value(argv: list[str], flag: str) -> str | None:
    """The token after `flag` in an argv (None when the flag is absent), for verify plays."""
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else None


def _plain(value: Any) -> Any:
    """Ansible's values as plain Python (its tagged str/int subclasses are not YAML-representable)."""
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return value


def k31_monitoring_files(plan: dict[str, Any], host: str, settings: dict[str, Any] | None = None,
                         rule_settings: dict[str, Any] | None = None,
                         grafana_provisioning: bool = False) -> dict[str, str]:
    """Every file k31_monitoring writes on `host` (path -> content), from the plan."""
    try:
        return monitoring.files(_plain(plan), str(host), monitoring.Settings(**_plain(settings or {})),
                                _plain(rule_settings or {}), bool(grafana_provisioning))
    except (K31Error, TypeError, ValueError) as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_monitoring_args(plan: dict[str, Any], host: str, settings: dict[str, Any] | None = None) -> dict[str, str]:
    """The Debian monitoring units `host` runs -> their ARGS (/etc/default/<unit>)."""
    return monitoring.service_args(plan, host, monitoring.Settings(**(settings or {})))


def k31_monitoring_ready_urls(plan: dict[str, Any], host: str) -> list[str]:
    """The monitoring URLs the role waits for on `host` (node exporter; Prometheus and Alertmanager)."""
    return monitoring.ready_urls(plan, host)


def k31_monitoring_host_state(lines: list[str], files: dict[str, str], units: Any) -> dict[str, Any]:
    """What the monitoring probe found against the plan: stale files, missing packages, idle units, the
    certificate copies (k31deploy.monitoring.converge)."""
    return converge.host_state([str(line) for line in lines], dict(files), list(units))


def k31_monitoring_run(have: dict[str, Any], plan: dict[str, Any], host: str, files: dict[str, str], units: Any,
                       secret_receivers: Any, check_mode: Any, ready_timeout: Any) -> dict[str, Any]:
    """What the role's write does on `host`: folders, files, Alertmanager's secret file, units, checks, the wait
    (k31deploy.monitoring.converge.run)."""
    try:
        return converge.run(plan, str(host), dict(have), dict(files), list(units),
                            boolean(secret_receivers, strict=False), boolean(check_mode, strict=False),
                            int(ready_timeout))
    except (K31Error, ValueError) as exc:
        raise AnsibleFilterError(f"error: {exc}") from None


def k31_stamp_inputs(plan: dict[str, Any], hostvars: Any, hosts: list[str], playbook_dir: str,
                     wheelhouse: str) -> str:
    """The digest of a deploy's inputs (k31deploy.stamp): the plan, the hosts' k31_* variables, k31's code
    (the project root above playbook_dir) and the wheelhouse's files."""
    values: dict[str, dict[str, Any]] = {}
    for host in hosts:
        hv = hostvars[host]
        values[host] = {}
        for key in [k for k in hv if k.startswith("k31_")]:
            try:
                values[host][key] = hv[key]
            except Exception as exc:  # a variable that does not template is still an input
                values[host][key] = f"<{type(exc).__name__}>"
    root = Path(playbook_dir).resolve()
    root = root.parent if root.name == "playbooks" else root
    return stamp.inputs_digest(plan, values, root, Path(wheelhouse))


def k31_stamp_settled(reads: dict[str, Any], inputs: str) -> dict[str, Any]:
    """Whether every host is as the last whole deploy left it: {settled, why} (k31deploy.stamp)."""
    return stamp.settled(reads, inputs)


class FilterModule:
    def filters(self):
        return {"k31_plan": k31_plan, "k31_host_ranks": k31_host_ranks, "k31_engine_command": k31_engine_command,
                "k31_engine_gate": k31_engine_gate, "k31_docker_daemon": k31_docker_daemon,
                "k31_metrics_targets": k31_metrics_targets, "k31_endpoint": k31_endpoint,
                "k31_flag_value": k31_flag_value, "k31_env_file": k31_env_file, "k31_env_line": k31_env_line,
                "k31_env_comment": k31_env_comment, "k31_service_command": k31_service_command,
                "k31_url": k31_url, "k31_host_port": k31_host_port, "k31_env_from_files": k31_env_from_files,
                "k31_start_env": k31_start_env,
                "k31_monitoring_files": k31_monitoring_files, "k31_monitoring_args": k31_monitoring_args,
                "k31_monitoring_ready_urls": k31_monitoring_ready_urls,
                "k31_monitoring_host_state": k31_monitoring_host_state,
                "k31_monitoring_run": k31_monitoring_run,
                "k31_stamp_inputs": k31_stamp_inputs, "k31_stamp_settled": k31_stamp_settled,
                "k31_image_pinned": k31_image_pinned, "k31_serves_image": k31_serves_image,
                "k31_image_archive_id": k31_image_archive_id, "k31_cdi_devices": k31_cdi_devices,
                "k31_image_archive_sha256": k31_image_archive_sha256, "k31_image_rounds": k31_image_rounds,
                "k31_over_ssh": k31_over_ssh, "k31_ssh_addresses": k31_ssh_addresses, "k31_call": k31_call}
