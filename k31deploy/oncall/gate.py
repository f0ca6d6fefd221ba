#!/usr/bin/python3
"""k31-engine-gate: wait until every rank 0 of this host answers /health; fail at once on a crash loop.

Run on the engine host after k31 (re)started its ranks (k31_engine, and k31_redeploy's restart and roll-back):
one command per host instead of a controller round trip per probe. It probes every quarter second for the first
two seconds and every second up to --quick seconds (a restart that loads nothing new answers within seconds), then
every --interval seconds (a model load takes minutes), until --timeout. It fails early, naming the unit, when a
watched unit is `failed` or systemd has restarted it --max-restarts times since the gate began (Restart=on-failure:
an image whose entry point exits, a flag the engine refuses), or stays inactive for a second (a clean exit, which
systemd does not restart):
waiting out an hour's health timeout would only delay the roll-back. A restart by k31
or by hand resets NRestarts to 0; only systemd's own restarts count.

Health URLs are the ranks' cluster addresses, probed by the host-side client installed beside it (k31_probe.py).
Prints one JSON line -- {"ok", "seconds", "healthy", "reason"} -- and exits 0 when every target answered, 1
otherwise.

    k31-engine-gate --timeout 3600 --quick 10 --interval 5 --max-restarts 3 \\
        --target k31-decode0-r0=http://10.0.0.2:30000/health --watch k31-decode0-r0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The host-side client (k31deploy/oncall/probe.py), installed beside this file: its HTTP calls never go through a
# proxy the environment names, since health URLs are the ranks' cluster addresses.
sys.dont_write_bytecode = True    # leave nothing beside the files k31 installed
sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
import k31_probe  # noqa: E402


def unit_state(unit: str) -> tuple[str, int]:
    """(ActiveState, NRestarts) as systemd reports them; ('', 0) when it cannot say."""
    props = k31_probe.unit_props(unit, ("ActiveState", "NRestarts"))
    try:
        return props.get("ActiveState", ""), int(props.get("NRestarts") or 0)
    except ValueError:
        return props.get("ActiveState", ""), 0


# A restart that loads nothing new answers within a second or two: probing that often costs one local request.
FIRST_POLL, FIRST_FOR = 0.25, 2.0
STOPPED_FOR = 1.0


def answers(url: str, timeout: float) -> bool:
    return k31_probe.health(url, timeout) == "up"    # 503 while loading: not yet


def gate(targets: dict[str, str], watch: list[str], *, timeout: float, quick: float, interval: float,
         max_restarts: int, probe_timeout: float = 5.0, clock=time.monotonic, sleep=time.sleep,
         probe=answers, state=unit_state) -> dict:
    began = clock()
    base = {unit: state(unit)[1] for unit in watch}
    pending = dict(targets)
    healthy: list[str] = []
    stopped: dict[str, float] = {}  # unit -> since when every poll saw it inactive

    def result(ok: bool, reason: str = "") -> dict:
        return {"ok": ok, "seconds": round(clock() - began, 1), "healthy": healthy, "reason": reason}

    while True:
        for unit, url in list(pending.items()):
            if probe(url, probe_timeout):
                healthy.append(unit)
                del pending[unit]
        if not pending:
            return result(True)
        for unit in watch:
            active, restarts = state(unit)
            if active == "failed":
                return result(False, f"{unit} failed (systemd stopped restarting it)")
            # A clean exit is not restarted (Restart=on-failure). One poll could fall between a restart's stop
            # and start, so inactive counts only when it lasted a second (seen at polls that far apart).
            if active != "inactive":
                stopped.pop(unit, None)
            elif clock() - stopped.setdefault(unit, clock()) >= STOPPED_FOR:
                return result(False, f"{unit} stopped (inactive) and systemd does not restart it")
            if restarts - base[unit] >= max_restarts > 0:
                return result(False, f"{unit} exited and was restarted by systemd {restarts - base[unit]} times "
                                     f"since the gate began (a crash loop)")
        elapsed = clock() - began
        if elapsed >= timeout:
            return result(False, f"{', '.join(pending)} did not answer /health within {timeout:g} s")
        cadence = FIRST_POLL if elapsed < FIRST_FOR else 1.0 if elapsed < quick else interval
        sleep(max(0.0, min(cadence, timeout - elapsed)))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="k31-engine-gate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--quick", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--max-restarts", type=int, default=3, help="0: never fail early")
    parser.add_argument("--target", action="append", default=[], metavar="UNIT=URL")
    parser.add_argument("--watch", action="append", default=[], metavar="UNIT")
    args = parser.parse_args(argv)
    targets = dict(t.split("=", 1) for t in args.target)
    if not targets or any(not url.startswith(("http://", "https://")) for url in targets.values()):
        parser.error("give one or more --target UNIT=http(s)://...")
    out = gate(targets, args.watch, timeout=args.timeout, quick=args.quick, interval=args.interval,
               max_restarts=args.max_restarts)
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
