"""What k31_monitoring changes on a host, from one read-only probe of it (roles/k31_monitoring/tasks/services.yml):
the files whose digest differs from the plan's, the packages missing, the units not enabled and running, and
then which units restart (new arguments or certificates), reload (new configuration) or only start.

Layer: consumers (docs/architecture.md); pure Python over the probe's lines, config.files()'s output and the plan.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from typing import Any

from k31deploy.monitoring.config import ready_urls
from k31deploy.plan import Plan

OURS = "/etc/k31/monitoring"     # k31's own configuration: readable by group prometheus only
ARGS = "/etc/default/"           # each unit's arguments: a change restarts the unit
NO_RELOAD = ("prometheus-node-exporter",)   # reads only its arguments; Debian's unit has no ExecReload
TLS_COPIES = tuple(f"{OURS}/tls/{name}" for name in ("ca.crt", "host.crt", "host.key"))   # the units' certificate
_DIGEST = re.compile(r"^([0-9a-f]{64})  (/.*)$")


def host_state(lines: Iterable[str], files: Mapping[str, str], units: Iterable[str]) -> dict[str, Any]:
    """The probe's lines (`installed U`, `unit U ENABLED ACTIVE`, sha256sum's `DIGEST  PATH`, `tls-stale NAME`,
    `pki-present`) against the plan's files and units: {stale: paths to write, missing: packages to install,
    idle: units not enabled and active, tls_stale, pki_present}."""
    lines = list(lines)
    have = {m[2]: m[1] for m in map(_DIGEST.match, lines) if m}
    installed = {line.split(" ", 1)[1] for line in lines if line.startswith("installed ")}
    return {
        "stale": [p for p, text in files.items() if have.get(p) != hashlib.sha256(text.encode()).hexdigest()],
        "missing": [u for u in units if u not in installed],
        "idle": [line.split(" ")[1] for line in lines
                 if line.startswith("unit ") and not re.fullmatch(r"unit \S+ enabled active", line)],
        "tls_stale": any(line.startswith("tls-stale ") for line in lines),
        "pki_present": "pki-present" in lines,
    }


def _ours(path: str) -> bool:
    return path == OURS or path.startswith(OURS + "/")


def folders(files: Iterable[str]) -> list[dict[str, str]]:
    """The folders the files go in (and the certificate copies' and the textfile collector's), k31's own
    readable by group prometheus only; /etc/default is the distribution's."""
    paths = {OURS, f"{OURS}/tls", "/var/lib/k31/textfile"}
    paths.update(p.rsplit("/", 1)[0] for p in files if not p.startswith(ARGS))
    return [{"path": p, "mode": "0750" if _ours(p) else "0755", "group": "prometheus" if _ours(p) else "root"}
            for p in sorted(paths)]


def writes(stale: Iterable[str], files: Mapping[str, str]) -> list[dict[str, str]]:
    """library/k31_files.py's entries for the stale files: k31's configuration 0640 group prometheus, the rest
    (the units' arguments) 0644 root."""
    return [{"dest": p, "content": files[p], "group": "prometheus" if _ours(p) else "root",
             "mode": "0640" if _ours(p) else "0644"} for p in stale]


def unit_actions(units: Iterable[str], files: Iterable[str]) -> list[dict[str, Any]]:
    """library/k31_files.py's units: each started, restarted where its arguments (/etc/default, every unit's: one
    changed restarts all of them, as their shared certificate copies do) changed, reloaded where k31's configuration
    did (not the node exporter: it has no reload and reads only its arguments). k31_files decides from what its run,
    and the runs it is told of, changed."""
    files = list(files)
    restart_on = [p for p in files if p.startswith(ARGS)] + list(TLS_COPIES)
    reload_on = [p for p in files if not p.startswith(ARGS)]
    return [{"name": u, "state": "started", "restart_on": restart_on,
             "reload_on": [] if u in NO_RELOAD else reload_on} for u in units]


# Where Alertmanager's configuration goes: with receivers it names their keys (a webhook's, PagerDuty's).
ALERTMANAGER = f"{OURS}/alertmanager.yml"
# What a configuration is checked with before the units load it (the monitoring host only).
CHECKS = (("promtool", "check", "config", f"{OURS}/prometheus.yml"),
          ("amtool", "check-config", ALERTMANAGER))


def run(doc: Plan | Mapping[str, Any], host: str, have: Mapping[str, Any], files: Mapping[str, str],
        units: Iterable[str], secret_receivers: bool, check_mode: bool, ready_timeout: int) -> dict[str, Any]:
    """What the role's one write (library/k31_files.py) does on `host`, from host_state's `have`:

    writing   whether anything is written (a stale file or stale certificate copies);
    dirs      the folders, where it writes;
    files     the certificate's copies where they are stale (not in a dry run before k31_pki put the host's
              certificate there), then every stale file but Alertmanager's when it names receivers' keys,
    secret    that one, for a no_log run of its own;
    checked   whether the host runs Prometheus or Alertmanager, whose configuration is checked (`checks`) between
              the writes and the units' start, so they start in a run of their own;
    units     each unit for k31_files (unit_actions);
    wait      the URLs to wait for on the cluster address with the host's certificate, only after a change."""
    plan = Plan.of(doc)
    if not plan.pki:
        raise ValueError("monitoring needs the cluster CA (the plan's pki), which this plan has not")
    units = list(units)
    secret = ALERTMANAGER if secret_receivers else ""
    write = writes(have["stale"], files)
    writing = bool(have["stale"]) or bool(have["tls_stale"])
    copies = [{"src": src, "dest": dest, "mode": mode, "group": "prometheus"}
              for src, dest, mode in zip((plan.pki.ca, plan.pki.cert, plan.pki.key), TLS_COPIES,
                                         ("0644", "0644", "0640"), strict=True)]
    changed = bool(have["idle"]) or writing
    checked = "prometheus" in units or "prometheus-alertmanager" in units
    return {
        "writing": writing,
        "dirs": folders(files) if writing else [],
        "files": (copies if have["tls_stale"] and (have["pki_present"] or not check_mode) else [])
                 + [w for w in write if w["dest"] != secret],
        "secret": [w for w in write if w["dest"] == secret],
        "checked": checked,
        "checks": [list(c) for c in CHECKS] if "prometheus" in units else [],
        "units": unit_actions(units, files),
        "wait": {"urls": ready_urls(plan, host) if changed else [], "ca": plan.pki.ca, "cert": plan.pki.cert,
                 "key": plan.pki.key, "timeout": int(ready_timeout)},
    }
