"""Tree fan-out for staging the weights (k31_model_fanout=tree) and the serving image's archive
(k31_image_fanout=tree): which host copies from which, round by round; and what k31_model stages on a host, what
its rsync dry run found different and the peer-copy job's arguments (stage_items, differing, peer_args).

Every host that holds a verified copy is a source. In round r each source hands the model to one host that
lacks it, so the number of holders doubles each round: N hosts take about log2(N + 1) rounds instead of N
copies out of one seed host's link. The schedule is deterministic: sources in a fixed order (the seed first,
then hosts that already held a verified copy, then hosts in the order they got theirs), targets in the
order the hosts are given (the play's inventory order). `from_controller` schedules one file that starts on the
controller: it goes to one host only, which then seeds the tree.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from k31deploy.errors import K31Error


def rounds(hosts: Iterable[str], seed: str, have: Iterable[str] = ()) -> dict[str, Any]:
    """{rounds: n, hosts: {host: {round, source, after}}} for each host of `hosts` not in `have`.

    Rounds need no barrier: a host starts once every host in its `after` has finished -- its source, where that
    was staged in this run (it must hold a verified copy), and the host its source served in the round before
    (a source serves one host at a time).

    `seed` holds the source directories (it may be one of `hosts`, or a host outside them); `have` are hosts
    whose copy already matches the seed's. The seed's own copy (seed in `hosts`, not in `have`) is a local
    one in round 1 (source: itself) and takes no network slot: the seed serves its source directory.
    """
    hosts = list(dict.fromkeys(hosts))
    have = set(have)
    unknown = sorted(have - set(hosts))
    if not seed:
        raise K31Error("tree staging needs a seed host (k31_model_seed_host) holding the source directories")
    if unknown:
        raise K31Error(f"hosts {', '.join(unknown)} are said to hold a copy but are not staging hosts")
    plan: dict[str, dict[str, Any]] = {}
    if seed in hosts and seed not in have:
        plan[seed] = {"round": 1, "source": seed, "after": []}
    holders = [seed, *(h for h in hosts if h in have and h != seed)]
    missing = [h for h in hosts if h not in have and h != seed]
    last: dict[str, str] = {}    # the host each source served last
    n = 1 if plan else 0
    r = 0
    while missing:
        r += 1
        for source in list(holders):
            if not missing:
                break
            target = missing.pop(0)
            after = [source] if source in plan and source != seed else []
            after += [last[source]] if source in last else []
            plan[target] = {"round": r, "source": source, "after": list(dict.fromkeys(after))}
            last[source] = target
            holders.append(target)
        n = max(n, r)
    return {"rounds": n, "hosts": plan}



def from_controller(hosts: Iterable[str], need: Iterable[str], hold: Iterable[str]) -> dict[str, Any]:
    """{seed, controller, rounds, hosts}: the tree for one file the controller holds (the image archive).

    `need` are the hosts that need the file, `hold` the hosts whose copy already matches the controller's (they
    are sources from the start and copy nothing). The seed is the first host holding a copy; only where none does
    is it the first host needing one, and then (controller: true) it gets the file from the controller before the
    rounds start -- the controller's link carries one copy whatever the host count. `rounds` and `hosts` are
    `rounds(...)`'s, the seed (a holder by then) not among them: a host in `need` and `hold` copies nothing.
    """
    hosts = list(dict.fromkeys(hosts))
    need, hold = set(need), set(hold)
    unknown = sorted((need | hold) - set(hosts))
    if unknown:
        raise K31Error(f"hosts {', '.join(unknown)} are said to need or hold the file but are not staging hosts")
    holders = [h for h in hosts if h in hold]
    receivers = [h for h in hosts if h in need and h not in hold]
    if not receivers:
        return {"seed": "", "controller": False, "rounds": 0, "hosts": {}}
    seed = holders[0] if holders else receivers[0]
    have = holders or [seed]
    plan = rounds([h for h in hosts if h in have or h in receivers], seed, have)
    return {"seed": seed, "controller": not holders, **plan}


# -- the weights' copy on each host (roles/k31_model) ---------------------------------------------------------------

VERIFIED = "/var/lib/k31/verified"    # the manifest each copy last checked out against (a re-run hashes nothing)


def stage_items(wanted: Iterable[dict[str, Any]], source: str) -> dict[str, Any]:
    """What k31_model stages on a host: {items, why_not}. `wanted` is the model and, with DFLASH, the draft, each
    {name, dest (the plan's path), src (its source directory), repo, manifest}; an item is staged where its dest is
    an absolute path and, unless it comes from the hub, it has a source directory. Each staged item also carries
    `sums` (its manifest, by default SHA256SUMS in the copy) and `stamp` (where its last verified manifest's digest
    is kept)."""
    wanted = list(wanted)
    if not source:
        return {"items": [],
                "why_not": ["k31_model_source is unset: engines read model_path as it is (nothing staged)"]}
    local = [w for w in wanted if str(w.get("dest") or "").startswith("/")]
    why_not = [f"{w['name']}: its path in the plan is not a local directory" for w in wanted if w not in local]
    if source != "hub":
        why_not += [f"{w['name']}: no source directory (k31_model_source_dir, k31_model_draft_source_dir)"
                    for w in local if not w.get("src")]
        local = [w for w in local if w.get("src")]
    items = [{**w, "sums": w.get("manifest") or f"{w['dest']}/SHA256SUMS",
              "stamp": f"{VERIFIED}/{w['dest'].replace('/', '_')}.sha256"} for w in local]
    return {"items": items, "why_not": why_not}


def differing(results: Iterable[dict[str, Any]]) -> list[str]:
    """The items an itemized rsync dry run (a looped task's results) found different from the source: any line
    but a directory's timestamp (`.d`)."""
    return [r["item"]["name"] for r in results
            if not r.get("skipped") and any(not line.startswith(".d") for line in r.get("stdout_lines") or [])]


def peer_args(me: dict[str, Any], items: Iterable[dict[str, Any]], pending: Iterable[str], seed: str) -> list[str]:
    """k31-stage-from-peer.sh's item arguments for one host of the tree (`me`: rounds()'s entry for it): per item
    that differs, SRC/ DEST/ MANIFEST STAMP. A host fed by the seed reads the seed's source directory, one fed by a
    peer the copy that peer staged (at the same path)."""
    from_seed = me.get("source", "") == seed
    pending = set(pending)
    return [arg for i in items if i["name"] in pending
            for arg in ((i["src"] if from_seed else i["dest"]) + "/", i["dest"] + "/", i["sums"], i["stamp"])]
