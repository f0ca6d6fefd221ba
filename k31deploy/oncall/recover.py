"""What an interrupted `k31 redeploy` left behind, and what a repair does about it (pure decisions, used by
`k31 status [--repair]`, playbooks/repair.yml and the start of every redeploy).

A redeploy stopped halfway (Ctrl-C, a lost controller) can leave servers healthy but drained out of the
router, decodes held out until their prefills restart (the seed's PD rule: the prefill keeps the old
decode's Mooncake mapping), and the prefill hosts' k31-pd-follow watchers held for up to
k31_redeploy_hold_seconds. The repair, in this order: waits for servers that are still loading (and starts
ranks the redeploy had stopped), restarts -- drained -- every running prefill that started before a healthy
decode last started, re-adds healthy servers the router does not list (a decode only once no running prefill
is older than it), then releases the watchers' holds.

Why the repair restarts stale prefills itself rather than releasing the watcher to do it: the watcher keeps
its evidence (it saw the decode go down and come back) in memory only, and only if it polled during the
restart; a watcher restarted since, or a decode back between two polls, leaves nothing pending, and the
prefill would keep the stale mapping. The repair compares start times, so it does not depend on that, and can
say when it is done. The watchers stay held while it works, and afterwards find the prefill started after
the decode came back, so they do not restart it a second time.

Redeploys and repairs take a lock on one host (the router's, else the first server's rank 0): a JSON record
of who holds it and until when. Its expiry is renewed at every server step (k31_redeploy_hold_seconds, the
longest one step may take), so a lost controller's lock ends by itself; a controller that finds its own
earlier run's process gone takes the lock over at once.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from k31deploy.oncall.rollout import gate_args, idle_spec
from k31deploy.plan import Plan

LOCK_PATH = "/run/k31/redeploy.lock"
HOLD_PATH = "/run/k31/pd-follow.hold"
# Start times from different hosts' clocks (NTP-synchronised): a prefill counts as restarted after a decode
# only when it started this much later, so a small skew errs on the side of one more (drained) restart.
CLOCK_SLACK_S = 1.0


def lock_host(doc: Plan | dict[str, Any]) -> str:
    """Where the redeploy lock lives: the router's host (every drain goes through it), else the first server."""
    plan = Plan.of(doc)
    return plan.router.host if plan.router else plan.servers[0].ranks[0].host


def utc(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


# -- the lock -------------------------------------------------------------------------------------------

def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _proc_start(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with the pid, it names one process, not a reuse."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def playbook_pid(start: int | None = None) -> int:
    """The ansible-playbook process this code runs under (templating runs in its forked workers), else
    this process: the one whose life says whether the run holding the lock is still going."""
    pid: int | None = start or os.getpid()
    while pid and pid > 1:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            break
        if any(os.path.basename(a.decode(errors="replace")) == "ansible-playbook" for a in argv[:2]):
            return pid
        pid = _parent(pid)
    return os.getpid()


def controller() -> dict[str, str]:
    """This controller: its name and boot (a rebooted controller's old processes are all gone)."""
    return {"controller": socket.gethostname(), "boot": _boot_id()}


def new_owner(what: str, seconds: float, now: float | None = None, pid: int | None = None) -> dict[str, Any]:
    """The record a run writes into the lock."""
    now = time.time() if now is None else now
    pid = pid or playbook_pid()
    return {"id": secrets.token_hex(8), **controller(), "pid": pid, "pid_start": _proc_start(pid), "what": what,
            "started": round(now, 3), "expires": round(now + float(seconds), 3)}


def renew(owner: dict[str, Any], seconds: float, now: float | None = None) -> dict[str, Any]:
    now = time.time() if now is None else now
    return {**owner, "expires": round(now + float(seconds), 3)}


def lock_text(owner: dict[str, Any]) -> str:
    return json.dumps(owner, sort_keys=True)


def alive(pid: int, pid_start: int | None) -> bool:
    return bool(pid) and _proc_start(pid) is not None and (pid_start is None or _proc_start(pid) == pid_start)


def lock_verdict(text: str | None, host: str, me: dict[str, Any] | None = None, now: float | None = None,
                 is_alive=alive) -> dict[str, Any]:
    """free | ours | stale | live, with one sentence. `me`: this controller (and this run's owner id)."""
    now = time.time() if now is None else now
    me = me or controller()
    text = (text or "").strip()
    if not text:
        return {"state": "free", "owner": None, "message": f"no redeploy holds the lock on {host}"}
    try:
        owner = json.loads(text)
        expires = float(owner["expires"])
    except (ValueError, KeyError, TypeError):
        return {"state": "stale", "owner": None, "message": f"the lock on {host} is unreadable; taken over"}
    who = (f"{owner.get('what') or 'a redeploy'} from {owner.get('controller')} (pid {owner.get('pid')}, "
           f"since {utc(float(owner.get('started') or 0))})")
    if me.get("id") and owner.get("id") == me["id"]:
        return {"state": "ours", "owner": owner, "message": f"this run holds the lock on {host}"}
    if now >= expires:
        return {"state": "stale", "owner": owner, "message": f"{who}: its lock on {host} expired at {utc(expires)}"}
    if owner.get("controller") == me.get("controller"):
        if owner.get("boot") != me.get("boot"):
            return {"state": "stale", "owner": owner,
                    "message": f"{who}: this controller rebooted since, the run is gone"}
        if not is_alive(int(owner.get("pid") or 0), owner.get("pid_start")):
            return {"state": "stale", "owner": owner,
                    "message": f"{who}: its process is gone (interrupted or killed)"}
        return {"state": "live", "owner": owner,
                "message": f"{who} is still running on this controller; let it finish or stop it (Ctrl-C)"}
    return {"state": "live", "owner": owner,
            "message": f"{who} holds the lock on {host} until {utc(expires)}; if that controller is gone for good "
                       f"its lock ends by itself then (or remove {LOCK_PATH} on {host})"}


# -- what the hosts say ---------------------------------------------------------------------------------

def _epoch(info: dict[str, Any], clock: dict[str, float] | None) -> float | None:
    mono = float(info.get("started_monotonic") or 0)
    if not mono or not clock:
        return None
    return float(clock["time"]) - (float(clock["monotonic"]) - mono)


def server_states(doc: Plan | dict[str, Any], answers: dict[str, dict[str, Any]], health_timeout: float,
                  ) -> dict[str, dict[str, Any]]:
    """Per server: state (healthy | loading | stopped | broken | unknown), when its ranks started (epochs:
    the earliest and the latest rank), whether the router lists it (None: unknown), and why."""
    plan = Plan.of(doc)
    router = plan.router
    listed: dict[str, bool] | None = None
    if router and router.kind == "sglang":
        unit = answers.get(router.host, {}).get("units", {}).get(router.unit, {})
        if isinstance(unit.get("workers"), list):
            listed = {w.get("url"): w.get("healthy") is not False for w in unit["workers"]}
    out: dict[str, dict[str, Any]] = {}
    for server in plan.servers:
        rows, starts, why = [], [], ""
        for rank in server.ranks:
            answer = answers.get(rank.host, {})
            if "units" not in answer:
                rows.append(None)
                continue
            info = answer["units"].get(rank.unit, {"active": "absent"})
            rows.append(info)
            when = _epoch(info, answer.get("clock")) if info.get("active") == "active" else None
            if when is not None:
                starts.append(when)
        health = (rows[0] or {}).get("health")
        uptime = min((r.get("uptime_s") or 0.0) for r in rows if r) if all(rows) else None
        if not all(rows):
            state, why = "unknown", "a host of it is unreachable"
        elif all(r.get("active") == "active" for r in rows):
            if health == 200:
                state = "healthy"
            elif uptime is not None and uptime < health_timeout:
                state, why = "loading", f"rank 0 /health answers {health} {uptime:.0f} s after its start"
            else:
                state, why = "broken", f"rank 0 /health answers {health} after {uptime or 0:.0f} s"
        elif any(r.get("active") in ("failed", "absent") for r in rows) or any(r.get("active") == "activating"
                                                                                for r in rows):
            state, why = "broken", ", ".join(f"{r.get('unit', '?')} {r.get('active')}" for r in rows
                                             if r.get("active") != "active")
        else:    # inactive, stopped cleanly: what a redeploy does between its drain and its start
            state, why = "stopped", "stopped (not failed)"
        url = server.url
        out[server.name] = {
            "role": server.role, "state": state, "why": why,
            "first_start": min(starts) if starts and len(starts) == len(rows) else None,
            "last_start": max(starts) if starts else None,
            "in_router": (url in listed and listed[url]) if listed is not None else None,
            "listed_unhealthy": listed is not None and url in listed and not listed[url],
        }
    return out


def holds(answers: dict[str, dict[str, Any]], now: float) -> dict[str, dict[str, Any]]:
    """Hold files on hosts: {host: {until, live}}; an expired one holds nothing but is still left over."""
    return {h: {"until": a["pd_follow_hold"]["until"], "live": now < float(a["pd_follow_hold"]["until"])}
            for h, a in answers.items() if isinstance(a.get("pd_follow_hold"), dict)}


def stale_prefills(states: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """{prefill: [decodes it predates]}: running prefills whose oldest rank started before a healthy decode
    last started (the PD rule; the router pairs every prefill with every decode). A decode still loading
    counts once it is healthy: the rule restarts prefills after the decode is back, not before."""
    decodes = {n: s["last_start"] for n, s in states.items()
               if s["role"] == "decode" and s["state"] == "healthy" and s["last_start"] is not None}
    out: dict[str, list[str]] = {}
    for name, s in states.items():
        if s["role"] != "prefill" or s["state"] not in ("healthy", "loading") or s["first_start"] is None:
            continue
        older = sorted(d for d, t in decodes.items() if s["first_start"] + CLOCK_SLACK_S < t)
        if older:
            out[name] = older
    return out


def decide(doc: Plan | dict[str, Any], answers: dict[str, dict[str, Any]], now: float | None = None,
           health_timeout: float = 3600.0, skip: list[str] | tuple = ()) -> dict[str, Any]:
    """What a repair does now, in order:

    start    servers whose ranks are all stopped cleanly (a redeploy stopped them and was interrupted);
    wait     servers loading (or just started) -- after these two the repair looks again and takes the rest
             from that second look, when the started and loaded servers have their start times and health;
    restart  stale prefills (drained, one at a time);
    readd    healthy servers the router does not list: prefills and unified servers, then decodes, which
             no running prefill predates once `restart` is done;
    release  hosts whose k31-pd-follow hold file is still there (live or expired);
    left     servers the repair cannot bring back, with why (broken, unreachable, router unreadable).

    `skip`: servers a redeploy is about to roll anyway (it starts and gates them itself: a target stuck
    loading must not hold up the redeploy that fixes it).
    """
    now = time.time() if now is None else now
    plan = Plan.of(doc)
    states = server_states(plan, answers, health_timeout)
    drain = plan.router_kind == "sglang"
    start = [n for n, s in states.items() if s["state"] == "stopped" and n not in skip]
    wait = [n for n, s in states.items() if s["state"] == "loading" and n not in skip]
    stale = stale_prefills(states)
    left: list[dict[str, str]] = []
    readd: list[str] = []
    if drain and states and all(s["in_router"] is None for s in states.values()):
        left.append({"server": "router", "why": "the router's worker list could not be read"})
    elif drain:
        order = [n for n, s in states.items() if s["role"] != "decode"] + \
                [n for n, s in states.items() if s["role"] == "decode"]
        # A prefill nobody could look at may still run on a decode's old mapping: no decode goes back meanwhile.
        unseen = [n for n, s in states.items() if s["role"] == "prefill" and s["state"] == "unknown"]
        for name in order:
            s = states[name]
            if s["in_router"] is not False or s["state"] != "healthy" or name in stale:
                continue
            if s["role"] == "decode" and unseen:
                left.append({"server": name, "why": f"kept out of the router: prefill {', '.join(unseen)} could "
                                                    "not be checked for the decode's old mapping"})
                continue
            readd.append(name)
    for name, s in states.items():
        if s["state"] in ("broken", "unknown") and name not in skip:
            left.append({"server": name, "why": s["why"]})
    held = holds(answers, now)
    release = sorted(held)
    doc = {"states": states, "start": start, "wait": wait, "restart": sorted(stale), "stale": stale,
           "readd": readd, "release": release, "holds": held, "left": left}
    doc["nothing"] = not (start or wait or stale or readd or release)
    doc["summary"] = summary(doc)
    return doc


def readd_now(doc: dict[str, Any], failed: list[str]) -> list[str]:
    """The servers the repair re-adds once its prefill restarts ran: all of `readd`, but no decode when one of
    those restarts failed (`failed`: a prefill may still map the decode's old KV: the decodes wait out)."""
    if not failed:
        return list(doc["readd"])
    return [n for n in doc["readd"] if doc["states"][n]["role"] != "decode"]


def release_now(doc: dict[str, Any], prefill_hosts: list[str]) -> list[str]:
    """Hosts whose k31-pd-follow hold the repair removes: those it found, and every prefill host it held itself
    while restarting prefills."""
    return list(dict.fromkeys(doc["release"] + (list(prefill_hosts) if doc["restart"] else [])))


def incomplete(doc: dict[str, Any], failed: list[str]) -> str:
    """Why the repair fails ("" when it brought everything back), one sentence."""
    why = list(failed) + [f"{x['server']}: {x['why']}" for x in doc["left"]]
    if not why:
        return ""
    tail = "; decodes left out of the router until their prefills restart" if failed else ""
    return f"repair incomplete: {'; '.join(why)}{tail}. See k31 status -i INV."


def summary(doc: dict[str, Any]) -> list[str]:
    """What the repair does, one line each, in the order it does it."""
    lines = []
    if doc["start"]:
        lines.append(f"start {', '.join(doc['start'])} (stopped by an interrupted redeploy), then gate on /health")
    if doc["wait"]:
        lines.append(f"wait for {', '.join(doc['wait'])} to answer /health (loading)")
    for name, decodes in sorted(doc["stale"].items()):
        lines.append(f"restart {name}, drained: it started before {', '.join(decodes)} last started and keeps "
                     "the old decode's Mooncake mapping (the PD rule)")
    if doc["readd"]:
        lines.append(f"re-add {', '.join(doc['readd'])} to the router (healthy, not listed)")
    if doc["release"]:
        lines.append(f"release the k31-pd-follow hold on {', '.join(doc['release'])}")
    lines += [f"left as it is: {x['server']}: {x['why']}" for x in doc["left"]]
    if doc["nothing"]:
        lines.insert(0, "nothing to repair: every healthy server is in the router and no watcher is held")
    return lines


def problems(doc: Plan | dict[str, Any], answers: dict[str, dict[str, Any]], verdict: dict[str, Any],
             now: float | None = None) -> list[str]:
    """`k31 status`'s problems about an interrupted redeploy: drained healthy servers and held watchers,
    each saying whether the running redeploy accounts for it or which command repairs it."""
    now = time.time() if now is None else now
    running = verdict["state"] == "live"
    fix = ("a redeploy is running: " + verdict["message"]) if running else \
        "no redeploy is running: k31 status --repair re-adds it"
    out = []
    plan = Plan.of(doc)
    states = server_states(plan, answers, 3600.0)
    for name, s in states.items():
        if s["state"] == "healthy" and s["in_router"] is False:
            out.append(f"{name}: healthy but out of the router ({fix})")
    held = holds(answers, now)
    order = plan.engine_hosts
    for host in sorted(held, key=lambda h: order.index(h) if h in order else len(order)):
        hold = held[host]
        if hold["live"]:
            out.append(f"{host}: k31-pd-follow held until {utc(hold['until'])} ("
                       + ("by the running redeploy)" if running else
                          "left by an interrupted redeploy: k31 status --repair releases it)"))
    return out


def _host_calls(step: dict[str, Any], drain: dict[str, Any] | None, gate: dict[str, Any]) -> dict[str, list]:
    """A plain restart's stop and start specs per host (probe.step, nothing staged): {"stop": [[host, spec], ...]
    rank 0's host first, its stop waiting for the requests in flight where the server was drained (`drain`:
    idle_spec's timeout and not_before); "start": rank 0's host last, where the health gate (`gate`: timeout, quick,
    interval, max_restarts) waits for /health while the other hosts' ranks are already up}."""
    hosts = list(dict.fromkeys([step["rank0_host"], *step["hosts"]]))
    units = {h: [u for host, u in zip(step["hosts"], step["units"], strict=True) if host == h] for h in hosts}

    def spec(host: str, **extra: Any) -> dict[str, Any]:
        return {"units": units[host], "files": [], "stage_dir": "", "rollout": False, **extra}

    rank0 = step["rank0_host"]
    idle = {"idle": idle_spec(step, **drain)} if drain else {}
    return {"stop": [[rank0, spec(rank0, **idle)]] + [[h, spec(h)] for h in hosts[1:]],
            "start": [[h, spec(h)] for h in hosts[1:]]
                     + [[rank0, spec(rank0, gate=gate_args(step, units[rank0], **gate))]]}


def restart_calls(step: dict[str, Any], drain: dict[str, Any] | None, gate: dict[str, Any]) -> dict[str, list]:
    """A plain restart of one server (a stale prefill the repair restarts for the PD rule) as the host-side client's
    calls, the redeploy's own: {"stop": [[host, call, spec], ...], "start": [...]}, each list in order. A server on
    one host is one `roll` (its stop, then its start and gate) and nothing to start after; one on several hosts
    stops on every host, rank 0's first, before any starts, rank 0's last and gated there (_host_calls)."""
    calls = _host_calls(step, drain, gate)
    if len(calls["stop"]) == 1:
        (host, stop), (_, start) = calls["stop"][0], calls["start"][0]
        return {"stop": [[host, "roll", {**stop, "gate": start["gate"], "start": True}]], "start": []}
    return {"stop": [[h, "stop", spec] for h, spec in calls["stop"]],
            "start": [[h, "start", spec] for h, spec in calls["start"]]}


def resume_calls(doc: dict[str, Any], steps: dict[str, dict[str, Any]], gate: dict[str, Any]) -> list[list]:
    """What brings back the servers an interrupted redeploy stopped (decide's `start`) and waits for those loading
    (`wait`): each server's start calls (_host_calls: rank 0's host last, gated there), as [host, spec, whether
    it starts a stopped server]. A loading server's start is systemd's no-op for an active unit: it only gates."""
    return [[host, spec, name in doc["start"]] for name in [*doc["start"], *doc["wait"]]
            for host, spec in _host_calls(steps[name], None, gate)["start"]]
