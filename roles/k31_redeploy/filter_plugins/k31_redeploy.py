"""Role filters: the redeploy's rollout order, its steps' decisions and its report, the k31-pd-follow watcher's
config, and the repair of an interrupted redeploy (its lock and its decisions), from the plan (rules in
k31deploy.oncall.rollout and k31deploy.oncall.recover)."""

from __future__ import annotations

import json
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible.module_utils.parsing.convert_bool import boolean

try:
    from k31deploy.errors import K31Error
    from k31deploy.oncall import gather, recover
    from k31deploy.oncall.rollout import (
        follow_config,
        gate_args,
        held,
        hold_now,
        idle_spec,
        incomplete,
        outcomes,
        report,
        rollout,
        step_files,
        step_mode,
        step_report,
        step_status,
    )
except ImportError as exc:  # pragma: no cover - only without the package installed
    raise AnsibleFilterError(f"k31 filters need the k31deploy package (pip install -e .): {exc}") from exc


def k31_redeploy_rollout(plan: dict[str, Any], targets: Any = None, batch: Any = 1) -> dict[str, Any]:
    """Steps, host order and serial batches; {'error': sentence} for a target or batch k31 cannot take."""
    try:
        return rollout(plan, list(targets) if isinstance(targets, list | tuple) else targets, batch)
    except K31Error as exc:
        return {"error": str(exc)}


def k31_redeploy_follow_config(plan: dict[str, Any], host: str, settings: dict[str, Any] | None = None) -> dict | None:
    """The watcher's config for `host`; None where it runs no prefill rank of a PD plan."""
    return follow_config(plan, host, **(settings or {}))


def k31_redeploy_recover_spec(plan: dict[str, Any]) -> dict[str, Any]:
    """Where the repair looks (oncall/gather.repair_spec)."""
    return gather.repair_spec(plan)


def k31_redeploy_lock_owner(what: str, seconds: Any) -> dict[str, Any]:
    """This run's lock record (its controller, its ansible-playbook process, an expiry `seconds` from now)."""
    return recover.new_owner(str(what), float(seconds))


def k31_redeploy_lock_renew(owner: dict[str, Any], seconds: Any) -> str:
    return recover.lock_text(recover.renew(owner, float(seconds)))


def k31_redeploy_lock_text(owner: dict[str, Any]) -> str:
    return recover.lock_text(owner)


def k31_redeploy_lock_verdict(text: Any, host: str, owner: dict[str, Any] | None = None) -> dict[str, Any]:
    """free | ours | stale | live with one sentence, as this controller sees the lock's record."""
    me = {**recover.controller(), "id": (owner or {}).get("id")}
    return recover.lock_verdict(str(text or ""), host, me)


def _fact(hostvars: Any, host: str, var: str) -> dict[str, Any] | None:
    """What `host` set or registered as `var` in an earlier play; None where it has none (skipped, left out)."""
    try:
        return dict(hostvars[host][var])
    except (KeyError, TypeError):
        return None


def k31_redeploy_recover_answers(results: list[Any], hostvars: Any = None, var: str = "") -> dict[str, dict[str, Any]]:
    """The probe's results -> {host: its JSON | {'unreachable' | 'failed': why}}: a loop's results (item: host),
    or, with `hostvars`, the hosts named in `results` and what each registered as `var` (observe_host.yml)."""
    if hostvars is not None:
        facts = {host: _fact(hostvars, host, var) for host in results}
        results = [{**(fact if fact is not None else {"unreachable": True, "msg": "not probed (left out of the run)"}),
                    "item": host} for host, fact in facts.items()]
    out: dict[str, dict[str, Any]] = {}
    for res in results:
        host = res.get("item")
        if res.get("unreachable"):
            out[host] = {"unreachable": str(res.get("msg", "unreachable"))}
            continue
        try:
            out[host] = json.loads(res.get("stdout") or "")
        except ValueError:
            out[host] = {"failed": str(res.get("msg") or res.get("stderr") or "the probe printed no JSON")}
    return out


def k31_redeploy_recovery(plan: dict[str, Any], answers: dict[str, Any], health_timeout: Any = 3600,
                          skip: Any = None) -> dict[str, Any]:
    """What the repair does now (k31deploy.oncall.recover.decide); `skip`: a redeploy's own targets."""
    return recover.decide(plan, answers, health_timeout=float(health_timeout), skip=list(skip or []))


def k31_redeploy_readd_now(rec: dict[str, Any], failed: Any = None) -> list[str]:
    return recover.readd_now(dict(rec), list(failed or []))


def k31_redeploy_release_now(rec: dict[str, Any], prefill_hosts: Any) -> list[str]:
    return recover.release_now(dict(rec), list(prefill_hosts or []))


def k31_redeploy_repair_incomplete(rec: dict[str, Any], failed: Any = None) -> str:
    return recover.incomplete(dict(rec), list(failed or []))


def k31_redeploy_restart_calls(step: dict[str, Any], drain: dict[str, Any] | None,
                               gate: dict[str, Any]) -> dict[str, list]:
    """A plain restart of one server as the host-side client's stop and start calls, per host."""
    return recover.restart_calls(dict(step), dict(drain) if drain else None, dict(gate))


def k31_redeploy_idle_spec(step: dict[str, Any], timeout: Any, not_before: Any = 0) -> dict[str, Any]:
    """What rank 0's stop waits for first: the grace after the removal, then no request in flight."""
    return idle_spec(dict(step), timeout, not_before)


def k31_redeploy_resume_calls(rec: dict[str, Any], steps: dict[str, Any], gate: dict[str, Any]) -> list[list]:
    """The start calls that bring back what an interrupted redeploy stopped and gate what is loading."""
    return recover.resume_calls(dict(rec), dict(steps), dict(gate))


def k31_redeploy_gate_args(step: dict[str, Any], units: list[str], gate: dict[str, Any]) -> list[str]:
    """The health gate's arguments on the server's rank-0 host (gate: timeout, quick, interval, max_restarts)."""
    return gate_args(dict(step), list(units), **dict(gate))


def k31_redeploy_step_mode(step: dict[str, Any], done: list[dict[str, Any]]) -> str:
    """rollout | restart (the PD rule after a failure) | skip, from the results of the steps before."""
    return step_mode(step, list(done))


def k31_redeploy_step_files(ranks: list[dict[str, Any]], etc_dir: str, stage_dir: str) -> list[dict[str, str]]:
    return step_files(list(ranks), str(etc_dir), str(stage_dir))


def k31_redeploy_step_status(mode: str, reachable: Any, went: Any, failed: Any, rollback_failed: Any) -> str:
    # set_fact may hand booleans over as their text ("False")
    return step_status(str(mode), boolean(reachable, strict=False), boolean(went, strict=False),
                       boolean(failed, strict=False), bool(rollback_failed))


def k31_redeploy_results(rollout: dict[str, Any], hostvars: Any) -> dict[str, dict[str, Any]]:
    """The step results recorded so far (server.yml's _k31_redeploy_result), host -> result, in rollout order."""
    found = {host: _fact(hostvars, host, "_k31_redeploy_result") for host in rollout["hosts"]}
    return {host: result for host, result in found.items() if result is not None}


def k31_redeploy_hold_now(rollout: dict[str, Any], done: list[dict[str, Any]]) -> list[str]:
    return hold_now(rollout, list(done))


def k31_redeploy_held(step: dict[str, Any], rollout: dict[str, Any], status: str) -> bool:
    return held(step, rollout, str(status))


def k31_redeploy_step_report(result: dict[str, Any]) -> str:
    return step_report(dict(result))


def k31_redeploy_outcomes(rollout: dict[str, Any], results: dict[str, dict[str, Any]],
                          rejoin_errors: Any = None) -> list[dict[str, Any]]:
    return outcomes(rollout, dict(results), list(rejoin_errors or []))


def k31_redeploy_report(outcomes: list[dict[str, Any]]) -> list[str]:
    return report(list(outcomes))


def k31_redeploy_incomplete(outcomes: list[dict[str, Any]]) -> str:
    return incomplete(list(outcomes))


class FilterModule:
    def filters(self):
        return {f.__name__: f for f in (
            k31_redeploy_rollout, k31_redeploy_follow_config, k31_redeploy_recover_spec, k31_redeploy_lock_owner,
            k31_redeploy_lock_renew, k31_redeploy_lock_text, k31_redeploy_lock_verdict, k31_redeploy_recover_answers,
            k31_redeploy_recovery, k31_redeploy_step_mode, k31_redeploy_step_files, k31_redeploy_step_status,
            k31_redeploy_results, k31_redeploy_hold_now, k31_redeploy_held, k31_redeploy_step_report,
            k31_redeploy_outcomes, k31_redeploy_report, k31_redeploy_incomplete, k31_redeploy_readd_now,
            k31_redeploy_release_now, k31_redeploy_repair_incomplete, k31_redeploy_restart_calls,
            k31_redeploy_gate_args, k31_redeploy_resume_calls, k31_redeploy_idle_spec)}
