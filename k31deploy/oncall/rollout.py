"""The order a redeploy restarts servers in, from the resolved plan, what each server step decides (its mode,
files and status) and what the run reports; pure Python, used by roles/k31_redeploy through its filters.

The seed's PD rule: the prefill keeps the old decode's Mooncake mapping, so after a decode restarts every
prefill paired with it restarts once the decode is healthy again. The SGLang router (and Dynamo) pair any
prefill with any decode, so in this PD topology "paired" means every prefill server of the plan.
"""

from __future__ import annotations

import re
from typing import Any

from k31deploy import launch
from k31deploy.address import http_url, url
from k31deploy.errors import K31Error
from k31deploy.monitoring.config import api_url
from k31deploy.plan import Plan, Server, Service

ROLES = ("decode", "prefill", "unified")  # also the rollout's phase order: prefills follow their decodes
RULE = "the prefill keeps the old decode's Mooncake mapping (seed, PD disaggregation)"


def http(address: str, port: int, path: str = "") -> str:
    return http_url(address, port, path)


def router_url(router: Service) -> str:
    """The router's base URL at its public address: https with public_tls."""
    return url("https" if router.tls else "http", router.public_address, router.port)


def router_auth(unit: str) -> dict[str, str]:
    """Where the host-side client, on the router's host, finds the router's keys: its own env file (k31_router writes
    it, 0600), the variable holding the control-plane key its worker API checks (id:name:role:key), and the one
    holding the key it sends its workers (--api-key: the engines' key, which a re-added worker's entry carries).
    The keys the running router uses, read there, so no call carries them."""
    return {"env_file": f"/etc/k31/{unit}.env", "var": "K31_ROUTER_CONTROL_PLANE_KEYS",
            "worker_var": "K31_ROUTER_API_KEY"}


def paired_prefills(plan: Plan) -> list[str]:
    """Prefill servers a decode exchanges KV with: the router pairs every prefill with every decode."""
    return [s.name for s in plan.servers if s.role == "prefill"]


def expand_targets(doc: Plan | dict[str, Any], targets: list[str] | None) -> list[str]:
    """Role and server names -> server names in plan order; nothing named means every server."""
    plan = Plan.of(doc)
    servers = [s.name for s in plan.servers]
    if not targets:
        return servers
    roles_present = [r for r in ROLES if any(s.role == r for s in plan.servers)]
    wanted: set[str] = set()
    for target in targets:
        if target in servers:
            wanted.add(target)
        elif target in roles_present:
            wanted.update(s.name for s in plan.servers if s.role == target)
        else:
            raise K31Error(f"redeploy target {target!r} is neither a server nor a role of this inventory; valid "
                           f"choices: {', '.join(roles_present + servers)}")
    return [name for name in servers if name in wanted]


def worker_entry(server: Server) -> dict[str, Any]:
    """The SGLang router's entry for the server (POST /workers, a re-add): its URL, a PD worker's type and a
    prefill's bootstrap port; the router host's client adds the key the router sends its workers."""
    entry: dict[str, Any] = {"url": server.url}
    if server.role != "unified":
        entry["worker_type"] = server.role
    if server.role == "prefill" and server.bootstrap_port:
        entry["bootstrap_port"] = int(server.bootstrap_port)
    return entry


def _step(doc: Server | dict[str, Any], reason: str) -> dict[str, Any]:
    server = Server.of(doc)
    rank0 = server.ranks[0]
    return {
        "name": server.name, "role": server.role, "reason": reason,
        "hosts": [r.host for r in server.ranks], "rank0_host": rank0.host,
        # every rank on rank 0's host: the host-side client's roll stops, starts and gates it in one call
        "one_host": all(r.host == rank0.host for r in server.ranks),
        "units": [r.unit for r in server.ranks], "port": server.port,
        "worker_url": server.url, "worker": worker_entry(server),
        "health_url": http(rank0.address, server.port, "/health"),    # where the engine binds
        "load_url": http(rank0.address, server.port, "/get_load"),
        "auth_file": rank0.auth_file,    # the key the running engine checks, read on its host
    }


# The repair (k31deploy.oncall.recover, roles/k31_redeploy) drains, restarts and re-adds with the same fields.
server_step = _step


def _chunks(steps: list[dict[str, Any]], batch: int) -> list[list[dict[str, Any]]]:
    """Per role: the first server alone (the canary), then `batch` servers at a time."""
    out: list[list[dict[str, Any]]] = []
    for role in ROLES:
        group = [s for s in steps if s["role"] == role]
        if group:
            out.append(group[:1])
            out += [group[i:i + batch] for i in range(1, len(group), batch)]
    return out


def rollout(doc: Plan | dict[str, Any], targets: list[str] | None = None, batch: int = 1) -> dict[str, Any]:
    """What the redeploy playbook iterates over: hosts in order, `serial` batch sizes, one step per server."""
    try:
        batch = int(batch)
    except (TypeError, ValueError):
        batch = 0
    if batch < 1:
        raise K31Error("k31_redeploy_batch must be a whole number of 1 or more (servers restarted at a time)")
    plan = Plan.of(doc)
    if isinstance(targets, str):
        targets = [t for t in targets.replace(",", " ").split() if t]
    by_name = {s.name: s for s in plan.servers}
    named = expand_targets(plan, targets)
    decodes = [n for n in named if by_name[n].role == "decode"]
    followers = [p for p in paired_prefills(plan) if p not in named] if decodes else []
    steps = [_step(by_name[n], "target") for n in named if by_name[n].role == "decode"]
    steps += [_step(s, "target" if s.name in named else "pd-rule")
              for s in plan.servers if s.role == "prefill" and (s.name in named or s.name in followers)]
    steps += [_step(by_name[n], "target") for n in named if by_name[n].role == "unified"]

    router = plan.router
    drain = plan.router_kind == "sglang"
    all_decodes = [s.name for s in plan.servers if s.role == "decode"]
    # A restarted decode waits out of the router until its prefills restarted (no request meets a stale
    # mapping) -- possible only while a decode this run leaves alone keeps serving.
    hold = drain and bool(decodes) and any(d not in decodes for d in all_decodes)

    notes = []
    if decodes:
        prefills = paired_prefills(plan)
        notes.append(f"{', '.join(decodes)} restart{'s' if len(decodes) == 1 else ''}: the paired prefill "
                     f"server{'s' if len(prefills) != 1 else ''} {', '.join(prefills)} then restart once "
                     f"{'it is' if len(decodes) == 1 else 'they are'} healthy again, because {RULE}"
                     + (f" (added: {', '.join(followers)})" if followers else ""))
        notes.append(f"{', '.join(decodes)} stay{'s' if len(decodes) == 1 else ''} out of the router until "
                     "those prefills restarted" if hold else
                     "every decode server restarts, so each rejoins the router after its health gate; until the "
                     "prefills restarted, requests through it may meet a stale mapping")
    if plan.router_kind == "dynamo":
        notes.append("router kind dynamo: each worker drains itself -- on SIGTERM it leaves discovery, finishes its "
                     "in-flight requests and then exits (dynamo.sglang's graceful shutdown), so rank 0 is stopped "
                     "first and the stop waits for it (k31_engine_dynamo_stop_timeout)")

    chunks = _chunks(steps, batch)
    return {
        "steps": {s["name"]: s for s in steps},
        "order": [s["name"] for s in steps],
        "hosts": [h for chunk in chunks for s in chunk for h in s["hosts"]],
        "serial": [sum(len(s["hosts"]) for s in chunk) for chunk in chunks] or [1],
        "host_server": {h: s["name"] for s in steps for h in s["hosts"]},
        "decodes": decodes,
        "followers": followers,
        "hold_decodes": hold,
        "hold_hosts": [h for s in steps if s["role"] == "prefill" for h in s["hosts"]] if decodes else [],
        "router": {"kind": router.kind, "host": router.host, "port": router.port, "url": router_url(router),
                   **({"auth": router_auth(router.unit)} if drain else {})} if router else None,
        "drain": drain,
        "silence": silence(plan, [st["name"] for st in steps]),
        "notes": notes,
    }


def silence(plan: Plan, servers: list[str]) -> dict[str, Any] | None:
    """The Alertmanager silence a redeploy holds over the servers it restarts (planned restarts page nobody;
    `k31 status` lists what it holds back): created when the rollout starts, expired when it finishes, and
    ending by itself if the run is lost. None without monitoring."""
    if not plan.monitoring or not servers:
        return None
    pattern = "|".join(re.escape(name) for name in servers)
    return {"host": plan.monitoring.host, "url": f"{api_url(plan, 'alertmanager')}/api/v2/silences",
            "matchers": [{"name": "k31_server", "value": f"^(?:{pattern})$", "isRegex": True, "isEqual": True}],
            "comment": f"k31 redeploy of {', '.join(servers)}"}


def follow_config(doc: Plan | dict[str, Any], host: str, **settings: Any) -> dict[str, Any] | None:
    """The k31-pd-follow watcher's config for `host`: None unless it runs a prefill rank of a PD plan."""
    plan = Plan.of(doc)
    prefills = [s for s in plan.servers if s.role == "prefill"]
    decodes = [s for s in plan.servers if s.role == "decode"]
    mine = [(i, s, r) for i, s in enumerate(prefills) for r in s.ranks if r.host == host]
    if not mine or not decodes:
        return None
    router = plan.router
    drains = []
    for _, server, rank in mine:
        if rank.node_rank == 0 and router and router.kind == "sglang":
            drains.append({"router": router_url(router),
                           "router_ca": router.tls["ca"] if router.tls else None,
                           "worker_url": server.url, "worker": worker_entry(server),
                           "health": http(rank.address, server.port, "/health"),
                           "load": http(rank.address, server.port, "/get_load")})
    own = {s.name for _, s, _ in mine}
    return {
        "units": [r.unit for _, _, r in mine],
        "index": min(i for i, _, _ in mine),
        "peers": [s.url for s in prefills if s.name not in own] if drains else [],
        "decodes": [{"name": d.name, "health": http(d.ranks[0].address, d.port, "/health")} for d in decodes],
        "drains": drains,
        **settings,
    }


# -- one server step of the rolling play (roles/k31_redeploy/tasks/server.yml) --------------------------------

def step_mode(step: dict[str, Any], done: list[dict[str, Any]]) -> str:
    """What this step does, from the steps before it: `rollout` while every earlier server took the change;
    after a failure (failure cap 0) `skip`, except a prefill the PD rule still owes a restart because a decode
    of this run restarted (it keeps the old decode's Mooncake mapping): `restart`, as it is."""
    if all(d["status"] == "ok" for d in done):
        return "rollout"
    if step["role"] == "prefill" and any(d["role"] == "decode" and _yes(d["restarted"]) for d in done):
        return "restart"
    return "skip"


def _yes(value: Any) -> bool:
    """A step result's flag, which Ansible may hand over as its text ("False")."""
    return value.strip().lower() in ("true", "yes", "1") if isinstance(value, str) else bool(value)


def step_files(ranks: list[dict[str, Any]], etc_dir: str, stage_dir: str) -> list[dict[str, str]]:
    """Each rank's env file, launch script, unit and API-key file: the live path, where the prepare play staged
    the new version (the live path below `stage_dir`), and the `.prev` copy a roll-back restores."""
    out = []
    for rank in ranks:
        unit = rank["unit"]
        lives = [f"{etc_dir}/{unit}.env", f"{etc_dir}/{unit}.sh", f"/etc/systemd/system/{unit}.service"]
        lives += [rank["auth_file"]] if rank.get("auth_file") else []
        out += [{"live": live, "staged": stage_dir + live, "prev": f"{etc_dir}/{live.rsplit('/', 1)[-1]}.prev"}
                for live in lives]
    return out


def idle_spec(step: dict[str, Any], timeout: Any, not_before: Any = 0) -> dict[str, Any]:
    """What rank 0's stop waits for first (probe.wait_idle's spec): not before the epoch `not_before` (the grace
    after the router let the server go), then no request in flight on the engine's /get_load, read with the key
    the running engine checks (its own key file), up to `timeout` seconds."""
    return {"load_url": step["load_url"], "auth_file": step.get("auth_file") or "", "timeout": int(timeout),
            "not_before": float(not_before)}


def gate_args(step: dict[str, Any], units: list[str], **gate: Any) -> list[str]:
    """The health gate's arguments (k31-engine-gate, oncall/gate.py) after a restart on the server's rank-0 host:
    rank 0's /health as the target, `units` (that host's ranks of it) watched for a crash loop."""
    return launch.gate_args([(step["units"][0], step["health_url"])], units, **gate)


def step_status(mode: str, reachable: bool, went: bool, failed: bool, rollback_failed: bool) -> str:
    """skipped | unreachable | failed | ok | rolled_back: a step that did not go (its server could not be drained
    or prepared) failed; one that failed its gate rolled back unless the roll-back failed too (a restart for the
    PD rule has nothing to roll back to)."""
    if mode == "skip":
        return "skipped"
    if not reachable:
        return "unreachable"
    if not went:
        return "failed"
    if not failed:
        return "ok"
    return "rolled_back" if mode == "rollout" and not rollback_failed else "failed"


def hold_now(rollout: dict[str, Any], done: list[dict[str, Any]]) -> list[str]:
    """Prefill hosts whose k31-pd-follow watcher a step holds: those of prefills this run has not restarted yet
    (it restarts them itself, drained; a watcher would race it)."""
    restarted = {d["host"] for d in done if d["role"] == "prefill" and _yes(d["restarted"])}
    return [h for h in dict.fromkeys(rollout["hold_hosts"]) if h not in restarted]


def held(step: dict[str, Any], rollout: dict[str, Any], status: str) -> bool:
    """Whether a decode that came back stays out of the router until its prefills restarted (finish re-adds it)."""
    return step["role"] == "decode" and bool(rollout["hold_decodes"]) and status in ("ok", "rolled_back")


def step_report(result: dict[str, Any]) -> str:
    """One line per server step: its status and time, and why where it did not take the change."""
    line = f"{result['server']}: {result['status']} in {result['seconds']} s"
    if _yes(result.get("held")):
        line += " (held out of the router until its prefills restarted)"
    if result["status"] == "rolled_back":
        line += ("; rolled back to the previous unit, env file and launch script, which serve again. Why: "
                 + result["error"])
    elif result["status"] == "failed":
        line += f"; {result['error']} {result.get('rollback_error', '')}"
    elif result["status"] == "unreachable":
        line += "; unreachable: left out of the router, every other server keeps serving"
    return line


NOT_READDED = "restarted and answers /health, but was not re-added to the router: "


def outcomes(rollout: dict[str, Any], results: dict[str, dict[str, Any]],
             rejoin_errors: list[str] | tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Each server's outcome in rollout order: its rank-0 host's step result (`results`: host -> result), or
    "not reached" where the run stopped before it. A decode held out of the router whose re-add at the end failed
    (`rejoin_errors`: "server: why") failed: it waits out of the router, healthy."""
    why: dict[str, list[str]] = {}
    for error in rejoin_errors:
        name, _, reason = str(error).partition(": ")
        why.setdefault(name, []).append(reason)
    out = []
    for name in rollout["order"]:
        step = rollout["steps"][name]
        o = dict(results.get(step["rank0_host"]) or {
            "server": name, "role": step["role"], "status": "not reached", "held": False, "restarted": False,
            "error": "", "seconds": 0})
        if _yes(o.get("held")) and name in why:
            o.update(status="failed", error=NOT_READDED + "; ".join(why[name]))
        out.append(o)
    return out


def report(outcome: list[dict[str, Any]]) -> list[str]:
    """The run's last word per server: status, time, and whether the PD rule restarted it."""
    return [f"{o['server']}: {o['status']} ({o['seconds']} s"
            + (", restarted for the PD rule" if o.get("reason") == "pd-rule" else "") + ")" for o in outcome]


def incomplete(outcome: list[dict[str, Any]]) -> str:
    """Why the redeploy fails ("" when every server took the change), with what the on-call engineer does next."""
    bad = [o for o in outcome if o["status"] != "ok"]
    if not bad:
        return ""
    parts = [f"{o['server']} {o['status']}" + (f" ({o['error'].split(' Last log lines:')[0]})" if o["error"] else "")
             for o in bad]
    text = f"redeploy incomplete: {'; '.join(parts)}. "
    if any(o["status"] == "unreachable" for o in outcome):
        text += "Unreachable servers stay out of the router; every other server keeps serving. "
    if any(re.search("not re-added|not drained|draining it", o["error"]) for o in outcome):
        text += ("Servers restarted but not re-added wait out of the router; k31 status -i INV --repair re-adds them "
                 "(restarting their prefills first where the PD rule owes it) once the router answers. ")
    return text + "See k31 status -i INV."
