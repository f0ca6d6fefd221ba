#!/usr/bin/env python3
"""TCP connect to every port of a plan's port table, and to ports no service uses, all at once.

Reads the plan (JSON) on stdin; prints one JSON line per target: {host, address, port, service, open,
expected, ok}. Run from a machine outside the deployment (the controller): with k31's firewall, only the
client endpoint (the router or Dynamo frontend, else each unified server's rank 0) may answer there.
"""

import concurrent.futures
import json
import socket
import sys

UNUSED = (9, 2000, 31000)    # ports no k31 service plans: closed everywhere


def addresses(plan):
    found = {r["host"]: r["address"] for s in plan["servers"] for r in s["ranks"]}
    for part in (plan.get("router"), plan.get("mooncake_master")):
        if part:
            found[part["host"]] = part.get("public_address") or part["address"]
    return found


def endpoints(plan):
    router = plan.get("router")
    if router:
        return {(router["host"], router["port"])}
    return {(s["ranks"][0]["host"], s["port"]) for s in plan["servers"] if s["role"] == "unified"}


def try_connect(address, port, timeout=2.0):
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def main():
    plan = json.load(sys.stdin)
    where, public = addresses(plan), endpoints(plan)
    targets = [(p["host"], n, p["service"]) for p in plan["ports"]
               for n in range(p["port"], p.get("port_last", p["port"]) + 1)]    # a range: each of its ports
    targets += [(host, port, "unplanned") for host in where for port in UNUSED]
    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(lambda t: try_connect(where[t[0]], t[1]), targets))
    for (host, port, service), is_open in zip(targets, answers, strict=True):
        expected = (host, port) in public
        print(json.dumps({"host": host, "address": where[host], "port": port, "service": service,
                          "open": is_open, "expected": expected, "ok": is_open == expected}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
