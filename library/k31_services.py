#!/usr/bin/python
"""k31_services: bring a host's systemd units to their states in one module run.

ansible.builtin.systemd_service looped over a role's units costs one module run (a Python start and several
systemctl calls) per unit and host; a deploy starts or restarts a handful of units on every host. This reads every
unit's enabled and active states with one `systemctl show`, reloads systemd once when asked, then enables, starts,
restarts or reloads each unit as its state says -- `restarted` and `reloaded` start an inactive unit instead (a unit
just installed gets one start, not a start and then a restart) -- and reports which units it acted on. Check mode
reports what it would do and does nothing.
"""

from __future__ import annotations

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: k31_services
short_description: Enable and start, restart or reload a list of systemd units in one run
description:
  - Every unit is enabled. C(started) starts an inactive unit; C(restarted) restarts an active one and starts an
    inactive one; C(reloaded) reloads an active one and starts an inactive one.
  - The units are handled in the order given; the first that fails ends the run with its name and systemctl's
    message. Supports check mode.
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
"""

RETURN = r"""
acted:
  description: The units enabled, started, restarted or reloaded (under --check, those that would be), as NAME ACTION.
  type: list
  elements: str
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


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "units": {"type": "list", "elements": "dict", "required": True, "options": {
                "name": {"type": "str", "required": True},
                "state": {"type": "str", "choices": ["started", "restarted", "reloaded"], "default": "started"},
            }},
            "daemon_reload": {"type": "bool", "default": False},
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

    if module.params["daemon_reload"]:
        systemctl("daemon-reload")
        acted.append("systemd daemon-reload")
    if not units:
        module.exit_json(changed=bool(acted), acted=acted)
    states = _states(module, [u["name"] for u in units])
    for unit in units:
        name, want = unit["name"], unit["state"]
        enabled, active = states[name]
        if enabled not in ("enabled", "static", "alias", "indirect", "generated", "transient"):
            systemctl("enable", "--", f"{name}.service")
            acted.append(f"{name} enabled")
        if active not in ("active", "reloading", "activating"):
            systemctl("start", "--", f"{name}.service")
            acted.append(f"{name} started")
        elif want == "restarted":
            systemctl("restart", "--", f"{name}.service")
            acted.append(f"{name} restarted")
        elif want == "reloaded":
            systemctl("reload", "--", f"{name}.service")
            acted.append(f"{name} reloaded")
    module.exit_json(changed=bool(acted), acted=acted)


if __name__ == "__main__":
    main()
