#!/usr/bin/python
"""k31_services: bring a host's systemd units to their states in one module run.

ansible.builtin.systemd_service looped over a role's units costs one module run (a Python start and several
systemctl calls) per unit and host; a deploy starts or restarts a handful of units on every host. This reads every
unit's enabled and active states with one `systemctl show`, enables those that are not with one call, reloads
systemd once (when asked, or after enabling), then starts, restarts or reloads each unit as its state says --
`restarted` and `reloaded` start an inactive unit instead (a unit just installed gets one start, not a start and
then a restart) -- and reports which units it acted on. Check mode reports what it would do and does nothing.
With `wait` it then polls the units' HTTPS endpoints with the host's cluster certificate until each answers 200,
in the same run (a uri task looped over them costs one more module run per host and endpoint, and deploys start
every host's units at once).
"""

from __future__ import annotations

import http.client
import ssl
import time
import urllib.error
import urllib.request

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: k31_services
short_description: Enable and start, restart or reload a list of systemd units in one run
description:
  - Every unit is enabled (those that are not, with one C(systemctl enable --no-reload), then one daemon-reload).
    C(started) starts an inactive unit; C(restarted) restarts an active one and starts an inactive one;
    C(reloaded) reloads an active one and starts an inactive one.
  - The units are started, restarted or reloaded in the order given; the first that fails ends the run with its
    name and systemctl's message. Supports check mode.
options:
  units:
    description: The units.
    type: list
    elements: dict
    required: true
    suboptions:
      name: {description: The unit's name (without .service)., type: str, required: true}
      state: {description: What to do., type: str, choices: [started, restarted, reloaded], default: started}
  daemon_reload:
    description: Run systemctl daemon-reload first (a unit file changed).
    type: bool
    default: false
  wait:
    description: >-
      After the units: HTTPS URLs that must answer 200 within C(timeout) seconds, fetched with mutual TLS (C(ca)
      verifies the server, C(cert) and C(key) are the client's). Skipped under --check.
    type: dict
    suboptions:
      urls: {description: The URLs., type: list, elements: str, default: []}
      ca: {description: The CA certificate that verifies the servers., type: str, required: true}
      cert: {description: The client certificate., type: str, required: true}
      key: {description: The client key., type: str, required: true}
      timeout: {description: Seconds to wait for all of them., type: int, default: 60}
"""

RETURN = r"""
acted:
  description: The units enabled, started, restarted or reloaded (under --check, those that would be), as NAME ACTION.
  type: list
  elements: str
  returned: always
waited:
  description: Seconds until every URL of C(wait) answered (0 when there was nothing to wait for).
  type: float
  returned: always
"""


def _states(module: AnsibleModule, names: list[str]) -> dict[str, tuple[str, str]]:
    """Each unit's (UnitFileState, ActiveState) from one systemctl show."""
    rc, out, err = module.run_command(["systemctl", "show", "--property=UnitFileState,ActiveState", "--",
                                       *(f"{n}.service" for n in names)])
    if rc != 0:
        module.fail_json(msg=f"systemctl show failed (rc {rc}): {err.strip()}", acted=[])
    states: list[tuple[str, str]] = []
    record: dict[str, str] = {}
    for line in [*out.splitlines(), ""]:
        if line.strip():
            key, _, value = line.partition("=")
            record[key] = value
        elif record:
            states.append((record.get("UnitFileState", ""), record.get("ActiveState", "")))
            record = {}
    if len(states) != len(names):
        module.fail_json(msg=f"systemctl show answered for {len(states)} of {len(names)} units", acted=[])
    return dict(zip(names, states, strict=True))


def _wait(module: AnsibleModule, spec: dict, acted: list[str]) -> float:
    """Poll every URL until it answers 200 or spec's timeout passes; fail naming the ones that did not and why."""
    began = time.monotonic()
    try:
        context = ssl.create_default_context(cafile=spec["ca"])
        context.load_cert_chain(spec["cert"], spec["key"])
    except OSError as e:    # ssl.SSLError is one
        module.fail_json(msg=f"the cluster certificate to wait with cannot be loaded: {e}", acted=acted, waited=0.0)
    # cluster addresses, never through a proxy the host's environment names (as k31_probe.py asks them)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))
    pending = {url: "not asked yet" for url in spec["urls"]}
    deadline = began + spec["timeout"]
    while pending:
        for url in list(pending):
            try:
                with opener.open(url, timeout=5) as resp:
                    if resp.status == 200:
                        del pending[url]
                        continue
                    pending[url] = f"HTTP {resp.status}"
            except urllib.error.HTTPError as e:
                pending[url] = f"HTTP {e.code}"
            except (OSError, http.client.HTTPException) as e:    # refused, TLS, timeout, a cut answer
                pending[url] = str(getattr(e, "reason", e)) or type(e).__name__
        if pending and time.monotonic() >= deadline:
            why = "; ".join(f"{url}: {reason}" for url, reason in pending.items())
            module.fail_json(msg=f"not answering within {spec['timeout']} s: {why}", acted=acted,
                             waited=round(time.monotonic() - began, 1))
        if pending:
            time.sleep(0.5)
    return round(time.monotonic() - began, 1)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "units": {"type": "list", "elements": "dict", "required": True, "options": {
                "name": {"type": "str", "required": True},
                "state": {"type": "str", "choices": ["started", "restarted", "reloaded"], "default": "started"},
            }},
            "daemon_reload": {"type": "bool", "default": False},
            "wait": {"type": "dict", "options": {
                "urls": {"type": "list", "elements": "str", "default": []},
                "ca": {"type": "str", "required": True},
                "cert": {"type": "str", "required": True},
                "key": {"type": "str", "required": True, "no_log": False},
                "timeout": {"type": "int", "default": 60},
            }},
        },
        supports_check_mode=True,
    )
    units = module.params["units"]
    acted: list[str] = []

    def systemctl(*argv: str) -> None:
        if module.check_mode:
            return
        rc, out, err = module.run_command(["systemctl", *argv])
        if rc != 0:
            module.fail_json(msg=f"systemctl {' '.join(argv)} failed (rc {rc}): {(err or out).strip()}", acted=acted)

    states = _states(module, [u["name"] for u in units]) if units else {}
    # One enable for every unit that needs it, without the daemon-reload each `systemctl enable` does: the one
    # reload below covers the new links and the new unit files alike (one fresh unit cost two reloads, two cost three).
    to_enable = [u["name"] for u in units
                 if states[u["name"]][0] not in ("enabled", "static", "alias", "indirect", "generated", "transient")]
    if to_enable:
        systemctl("enable", "--no-reload", "--", *(f"{name}.service" for name in to_enable))
        acted.extend(f"{name} enabled" for name in to_enable)
    if module.params["daemon_reload"] or to_enable:
        systemctl("daemon-reload")
        acted.append("systemd daemon-reload")
    for unit in units:
        name, want = unit["name"], unit["state"]
        active = states[name][1]
        if active not in ("active", "reloading", "activating"):
            systemctl("start", "--", f"{name}.service")
            acted.append(f"{name} started")
        elif want == "restarted":
            systemctl("restart", "--", f"{name}.service")
            acted.append(f"{name} restarted")
        elif want == "reloaded":
            systemctl("reload", "--", f"{name}.service")
            acted.append(f"{name} reloaded")
    wait = module.params["wait"]
    waited = _wait(module, wait, acted) if wait and wait["urls"] and not module.check_mode else 0.0
    module.exit_json(changed=bool(acted), acted=acted, waited=waited)


if __name__ == "__main__":
    main()
