"""Tree fan-out for staging the weights (k31_model_fanout=tree): which host copies from which, round by round.

Every host that holds a verified copy is a source. In round r each source hands the model to one host that
lacks it, so the number of holders doubles each round: N hosts take about log2(N + 1) rounds instead of N
copies out of one seed host's link. The schedule is deterministic: sources in a fixed order (the seed first,
then hosts that already held a verified copy, then hosts in the order they got theirs), targets in the
order the hosts are given (the play's inventory order).
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

