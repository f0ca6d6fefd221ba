"""What the engine-acceptance lane recorded: real SGLang's verdict on every planned command line.

The lane (scripts/engine-lane, on a GPU machine) parses and resolves each planned server's rank-0 command
with a real SGLang build and records accepted / refused (the engine's message) / not reached, keyed by a
digest of the command with its site-specific values (hosts, model paths, NICs) normalised away. This
module reads that record (data/engine/<build>.lane.json) and puts its verdict on each server of a plan.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from functools import cache
from typing import Any

from k31deploy.engine.cli import ENGINE_DIR

# Values that differ per site and not per recipe cell: what the digest sees instead.
PATH_FLAGS = {"--model-path": "<model>", "--speculative-draft-model-path": "<draft>",
              "--disaggregation-ib-device": "<ib>", "--config": "<auth-config>"}
TPU_NOTE = "the TPU launcher (benchmark.tpu.launch_server) is not sglang.launch_server; the lane does not run it"


@cache
def record(build: str) -> dict[str, Any] | None:
    """data/engine/<build>.lane.json, or None where the lane never ran for that build."""
    path = ENGINE_DIR / f"{build}.lane.json"
    if not path.exists():
        return None
    with path.open(encoding="utf-8") as fh:
        return json.load(fh)


def normalise(plan: dict[str, Any], server: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """Rank 0's engine flags (after the launcher) and env with hosts and paths replaced by markers."""
    rank = server["ranks"][0]
    addresses = {h for s in plan["servers"] for r in s["ranks"] for h in (r["host"], r["address"])}
    for other in (plan.get("router"), plan.get("mooncake_master")):
        if other:
            addresses |= {other["host"], other["address"]}
    pattern = re.compile("|".join(re.escape(a) for a in sorted(addresses, key=len, reverse=True)))

    def scrub(text: str) -> str:
        return pattern.sub("<addr>", text)

    argv = rank["argv"]
    start = next(i for i, t in enumerate(argv) if t.startswith("--"))
    out: list[str] = []
    for i, token in enumerate(argv[start:], start):
        prev = argv[i - 1]
        if prev in PATH_FLAGS:
            out.append(PATH_FLAGS[prev])
        elif prev in ("--host", "--dist-init-addr"):
            out.append(re.sub(r"^.*?(:\d+)?$", lambda m: "<addr>" + (m.group(1) or ""), token))
        else:
            out.append(scrub(token))
    env = {k: scrub(v) for k, v in sorted(rank["env"].items())}
    return out, env


def digest(argv: list[str], env: dict[str, str], group: str) -> str:
    text = json.dumps({"argv": argv, "env": env, "group": group}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def group_of(platform: dict[str, Any], family: dict[str, Any]) -> tuple[str, list[int] | None]:
    """The lane process a platform's servers run in: the compute capability SGLang is shown there
    (the target's; a ROCm family's lane stand-in), or the lane machine's own."""
    cap = platform.get("compute_capability") or family.get("lane_compute_capability")
    return (f"sm{cap[0]}{cap[1]}", cap) if cap else ("device", None)


def server_digest(plan: dict[str, Any], server: dict[str, Any], platform: dict[str, Any],
                  family: dict[str, Any]) -> str:
    argv, env = normalise(plan, server)
    return digest(argv, env, group_of(platform, family)[0])


def _core(message: str) -> str:
    """A refusal without argparse's choice list (its quoting differs between Python versions)."""
    return " ".join(message.split(" (choose from")[0].split())


def _explained(plan: dict[str, Any], server: str, message: str) -> bool:
    """Whether the plan already says why (a branch-only feature or flag value the server uses, warned
    about): the same refusal, or argparse refusing the same flag (its wording varies by value type)."""
    return any(b["server"] == server and (_core(b["refusal"]) in _core(message)
                                          or (b.get("flag") and message.startswith(f"argument {b['flag']}:")))
               for b in plan["engine"]["branch_only"])


def label(case: str, server: str) -> str:
    return f"{case}#{server}"


def cell_verdict(build: str, platform: str, role: str, strategy: str, today: str | None) -> dict[str, Any]:
    """The lane's verdict on a catalog cell's own server (what `k31 catalog` shows), given the digest the
    cell's command has today: accepted, refused (the engine's message), stale, or not checked."""
    rec = record(build)
    if platform == "tpu7x":
        return {"result": "not-reached", "message": TPU_NOTE}
    key = rec and rec["labels"].get(label(f"{platform}/{role}/{strategy}", f"{role}0"))
    if not key:
        return {"result": "unchecked", "message": f"the engine lane has no record of this cell for {build}"}
    if key != today:
        return {"result": "stale", "message": f"its command changed since the lane ran ({rec['date']})"}
    found = rec["results"][key]
    return {"result": found["result"], "message": found.get("message"), "checked": rec["date"]}


def annotate(plan: dict[str, Any], platform: dict[str, Any], family: dict[str, Any], build: str,
             base_digest: Callable[[str, str], str | None]) -> list[str]:
    """Set each server's `engine_check` from the lane's record of `build`; return the plan's warnings.

    base_digest(role, strategy) is the digest the server's catalog cell has today (its default knobs),
    so a record made before the cell's command changed reads as stale.
    """
    rec = record(build)
    warnings: list[str] = []
    for server in plan["servers"]:
        if plan["platform"] == "tpu7x":
            server["engine_check"] = {"build": build, "result": "not-reached", "message": TPU_NOTE}
            continue
        if rec is None:
            server["engine_check"] = {"build": build, "result": "unchecked",
                                      "message": f"the engine lane has not run for {build}"}
            continue
        check: dict[str, Any] = {"build": build, "checked": rec["date"]}
        found = rec["results"].get(server_digest(plan, server, platform, family))
        base = label(f"{plan['platform']}/{server['role']}/{server['strategy']}", f"{server['role']}0")
        if found:
            check.update(result=found["result"], message=found.get("message"))
            if found["result"] == "refused" and not _explained(plan, server["name"], found["message"]):
                warnings.append(f"{server['name']}: SGLang {rec['version']} refused this command in the engine "
                                f"lane ({rec['date']}): {found['message']}")
        elif rec["labels"].get(base) != base_digest(server["role"], server["strategy"]):
            check.update(result="stale", message=f"{base} changed since the lane checked it on {rec['date']}")
            warnings.append(f"{server['name']}: SGLang {rec['version']}'s verdict on this cell is stale: its "
                            f"command changed since the engine lane ran ({rec['date']}); re-run "
                            f"scripts/engine-lane")
        else:
            nearest = rec["results"][rec["labels"][base]]
            check.update(result="unchecked", nearest={"case": base, "result": nearest["result"]})
        server["engine_check"] = check
    return warnings
