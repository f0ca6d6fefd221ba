#!/usr/bin/python3
"""k31-pd-follow: the seed's PD restart rule for restarts nobody planned.

The seed: the prefill keeps the old decode's Mooncake mapping, so a decode restart must be followed by a
prefill restart. `k31 redeploy` orders that itself; this watcher covers the rest -- a decode that crashed
and came back through systemd's Restart=on-failure, or one an operator restarted by hand.

Design (why it runs here): nodes hold no SSH keys to each other and the router host cannot restart units
elsewhere, so the watcher runs on every PREFILL host and restarts only that host's own prefill units. It
polls each paired decode's /health over the cluster network (the path KV transfer uses anyway). A decode
that was seen up, then down (nothing listening: its process was gone; an error status after that is it
loading), then up again has restarted. One that only answers an error status for a while (a busy SGLang's
/health times out its probe generation and says 503) or stops answering (a hung host, a network cut) is the
same process and has not: restarting prefills for it would cost a model load each. Once it is healthy, the
local prefill units are restarted unless they already started after the decode came back (k31 redeploy's own
prefill pass does that). While /run/k31/pd-follow.hold exists (k31 redeploy writes it; its text is the seconds it holds
for, counted from its mtime) the watcher waits for the redeploy's drained restart instead of racing it.
Rank 0 of a prefill is drained through the SGLang router's worker API first and re-added after its
/health gate; prefill servers take turns (index x stagger seconds) so they are not all out at once.
Python standard library only, and the host-side client installed beside it (k31_probe.py, from
k31deploy/oncall/probe.py): it runs on hosts that have nothing else of k31.
"""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time

sys.dont_write_bytecode = True    # leave nothing beside the files k31 installed
sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
import k31_probe  # noqa: E402

DEFAULT_CONFIG = "/etc/k31/pd-follow.json"


def log(message: str) -> None:
    print(f"k31-pd-follow: {message}", flush=True)


class Host:
    """What the watcher does to the world; replaced by a fake in the unit tests."""

    def __init__(self, keys: dict[str, str] | None = None, timeout: float = 3.0, ca: str | None = None):
        # "router": the router's control-plane key (its worker API); "engine": the engines' API key (/get_load)
        self.keys = keys or {}
        self.timeout = timeout
        # An https router (public_tls) is verified against the site's CA file where k31 installed one, else
        # against the host's trust store: the control-plane key goes only to the router's own certificate.
        self.tls = ssl.create_default_context(cafile=ca if ca and os.path.exists(ca) else None)

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def request(self, method: str, url: str, body: dict | None = None, key: str = "router") -> tuple[int, object]:
        headers = {"Authorization": f"Bearer {self.keys[key]}"} if self.keys.get(key) else {}
        answer = k31_probe.request(url, method, body, headers, self.timeout,
                                   self.tls if url.startswith("https:") else None)
        return answer["status"], answer.get("json")

    def health(self, url: str) -> str:
        """up, error, down or silent (k31_probe.health): only down says the process went away."""
        return k31_probe.health(url, self.timeout)

    def healthy(self, url: str) -> bool:
        return self.health(url) == "up"

    def started_at(self, unit: str) -> float:
        """When the unit's main process started, on the monotonic clock (0 when it is not running)."""
        prop = "ExecMainStartTimestampMonotonic"
        return int(k31_probe.unit_props(unit, (prop,)).get(prop) or 0) / 1e6

    def restart(self, units: list[str]) -> None:
        subprocess.run(["systemctl", "restart", *units], check=True)

    def held(self, path: str) -> bool:
        try:
            with open(path, encoding="utf-8") as fh:
                seconds = float(fh.read().strip() or 0)
            return time.time() < os.stat(path).st_mtime + seconds
        except (OSError, ValueError):
            return False


class Follower:
    def __init__(self, config: dict, host: Host):
        self.cfg = config
        self.host = host
        self.state = {d["name"]: "unknown" for d in config["decodes"]}
        self.pending: float | None = None   # monotonic time a decode was seen healthy again after a restart
        self.because: list[str] = []
        self.last_restart: dict | None = None

    def poll(self) -> bool:
        """One round; True when it restarted the local prefill units."""
        now = self.host.now()
        for decode in self.cfg["decodes"]:
            name, was = decode["name"], self.state[decode["name"]]
            seen = self.host.health(decode["health"])
            if seen == "up":
                if was == "down":
                    log(f"decode {name} answers /health again after a restart")
                    self.pending = now
                    self.because = sorted({*self.because, name})
                self.state[name] = "up"
            elif seen == "down" and was in ("up", "error"):
                log(f"decode {name} is down (nothing answers on its /health port)")
                self.state[name] = "down"
            elif seen == "error" and was == "up":
                # Still down after a restart is loading; from up it is the same process, unhealthy for now.
                log(f"decode {name} answers /health with an error status (the same process: no restart)")
                self.state[name] = "error"
        if self.pending is None:
            return False
        if self.host.held(self.cfg.get("hold_file", "/run/k31/pd-follow.hold")):
            return False
        if all(self.host.started_at(u) > self.pending for u in self.cfg["units"]):
            log(f"{', '.join(self.cfg['units'])} already restarted after {', '.join(self.because)}")
            self._clear()
            return False
        # Another decode still down: wait for it (one restart for both), but not forever.
        waiting = [n for n, s in self.state.items() if s == "down"]
        if waiting and now - self.pending < float(self.cfg.get("settle_seconds", 60)):
            return False
        if now - self.pending < self.cfg.get("index", 0) * float(self.cfg.get("stagger_seconds", 10)):
            return False
        self._restart()
        return True

    def _clear(self) -> None:
        self.pending = None
        self.because = []

    def _restart(self) -> None:
        units, because = self.cfg["units"], ", ".join(self.because)
        log(f"restarting {', '.join(units)}: decode {because} restarted and the prefill keeps the old decode's "
            "Mooncake mapping (seed)")
        for drain in self.cfg.get("drains", []):
            # Prefill servers take turns: the others must be back in the router before this one leaves it.
            self._wait("the other prefill servers to be back in the router", lambda d=drain: self._peers_back(d),
                       float(self.cfg.get("health_timeout", 3600)))
            self._drain(drain)
        self.host.restart(units)
        self._clear()
        for drain in self.cfg.get("drains", []):
            self._rejoin(drain)
        self.last_restart = {"units": units, "because": because, "at": time.time()}
        log(f"restarted {', '.join(units)}")

    def _call(self, method: str, url: str, body: dict | None) -> tuple[int, object]:
        return self.host.request(method, url, body)

    def _peers_back(self, drain: dict) -> bool:
        listed = {w.get("url") for w in k31_probe.router_workers(self._call, drain["router"]) or []
                  if w.get("is_healthy", True)}
        return set(self.cfg.get("peers", [])) <= listed

    def _wait(self, what: str, done, timeout: float) -> bool:
        if k31_probe.wait_for(done, timeout, self.host.now, self.host.sleep, float(self.cfg.get("poll_seconds", 1))):
            return True
        log(f"gave up waiting for {what} after {timeout:g} s")
        return False

    def _drain(self, drain: dict) -> None:
        timeout = float(self.cfg.get("drain_timeout", 120))
        why = k31_probe.drain(self._call, drain["router"], drain["worker_url"], timeout, self.host.now, self.host.sleep)
        if why:
            log(f"draining {drain['worker_url']}: {why}")
        why = k31_probe.idle(self._call_engine, drain["load"], timeout, float(self.cfg.get("poll_seconds", 1)),
                             self.host.now, self.host.sleep)
        if why:
            log(why)

    def _call_engine(self, method: str, url: str, body: dict | None) -> tuple[int, object]:
        return self.host.request(method, url, body, key="engine")

    def _rejoin(self, drain: dict) -> None:
        if not self._wait(f"{drain['health']} to answer 200", lambda: self.host.healthy(drain["health"]),
                          float(self.cfg.get("health_timeout", 3600))):
            return  # left out of the router: a prefill that never came back must not take requests
        body = dict(drain["worker"])    # the router's entry for this prefill (rollout.worker_entry)
        # The router calls a worker it is given with that worker's api_key (its /model_info): the engines' key, as
        # the router's own --api-key gives the workers it starts with. Without it /v1/models says "unknown".
        if self.cfg.get("engine_api_key"):
            body["api_key"] = self.cfg["engine_api_key"]
        why = k31_probe.rejoin(self._call, drain["router"], body, float(self.cfg.get("drain_timeout", 120)),
                               self.host.now, self.host.sleep)
        log(f"re-adding {drain['worker_url']} to the router: {why}" if why
            else f"re-added {drain['worker_url']} to the router")

    def snapshot(self) -> dict:
        return {"decodes": dict(self.state), "pending": self.pending is not None, "because": self.because,
                "held": self.host.held(self.cfg.get("hold_file", "/run/k31/pd-follow.hold")),
                "last_restart": self.last_restart}


def main(argv: list[str]) -> int:
    path = argv[1] if len(argv) > 1 else DEFAULT_CONFIG
    with open(path, encoding="utf-8") as fh:
        config = json.load(fh)
    follower = Follower(config, Host({"router": config.get("router_api_key", ""),
                                      "engine": config.get("engine_api_key", "")},
                                     ca=next((d["router_ca"] for d in config["drains"] if d.get("router_ca")), None)))
    state_file = config.get("state_file", "/run/k31/pd-follow.state.json")
    log(f"watching {', '.join(d['name'] for d in config['decodes'])} for {', '.join(config['units'])}")
    last = None
    while True:
        try:
            follower.poll()
        except (OSError, subprocess.CalledProcessError) as exc:
            log(f"error: {exc}")  # keep watching: the next round retries
        snap = follower.snapshot()
        if snap != last:
            os.makedirs(os.path.dirname(state_file), exist_ok=True)
            with open(f"{state_file}.tmp", "w", encoding="utf-8") as fh:
                json.dump(snap, fh)
            os.replace(f"{state_file}.tmp", state_file)
            last = snap
        time.sleep(float(config.get("poll_seconds", 1)))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
