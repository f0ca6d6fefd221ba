#!/usr/bin/python
"""k31_files: write many small files, owned by root, in one module run (a role's rendered files and unit files), then
bring the systemd units they serve to their states in the same run.

The template and copy actions cost one or two module runs per file and host; a host's engine ranks have a dozen
files. The contents are rendered on the controller (k31_unit's lookups); this writes each one that differs,
atomically (a temporary file beside it, checked by its `validate` command, then renamed), fixes mode and group,
and reports which files changed (`changed_files`, for the units' restarts) with a diff per file under --diff.
Nothing is written under --check. The result never repeats the contents: the records stay small, and the
includer runs the files that hold a secret in a task of their own with no_log.

`units` then does what ansible.builtin.systemd_service looped over a role's units would, with one `systemctl show`
for all of them: every unit enabled (one `systemctl enable --no-reload`), systemd reloaded once where a unit file
changed in this run (or when asked, or after enabling), then each unit started, restarted or reloaded -- restarted
where a file it names in `restart_on` (or its unit file) changed, in this run or in an earlier one the includer
lists in `changed` (the no_log run of the secret files), reloaded where one of its `reload_on` files did; an
inactive unit is started instead, once. With `wait` it then polls the units' HTTPS endpoints with the host's
cluster certificate until each answers 200. Files and their units in one module run, where a write and a start
cost two per role and host: every module run is a Python start on the host, and a deploy runs them on every host
at once.
"""

from __future__ import annotations

import base64
import binascii
import grp
import http.client
import os
import ssl
import tempfile
import time
import urllib.error
import urllib.request

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: k31_files
short_description: Write a list of root-owned files in one run, then start the units they serve; report what changed
description:
  - Each file is written only when its content, mode or owner differs; a new content goes to a temporary file in
    the same directory, is checked by C(validate) when given, then renamed over the old one.
  - Missing directories are created (root, C(dir_mode)); C(dirs) are created or fixed first with their own mode
    and group. A file's content is C(content), C(content_base64) (bytes; never shown in a diff), or the bytes of
    C(src), a file on the host (never shown in a diff).
  - Then C(units), in the order given; the first that fails ends the run with its name and systemctl's message.
    Every unit is enabled (those that are not, with one C(systemctl enable --no-reload), then one daemon-reload).
    C(started) starts an inactive unit; C(restarted) restarts an active one and starts an inactive one;
    C(reloaded) reloads an active one and starts an inactive one.
  - Supports check mode (nothing written or started; the result says what would be) and diff mode.
options:
  files:
    description: The files.
    type: list
    elements: dict
    default: []
    suboptions:
      dest: {description: Absolute path., type: str, required: true}
      content: {description: The whole text of the file (or C(content_base64) or C(src))., type: str}
      content_base64: {description: "The file's bytes, base64 (a tarball); never shown in a diff.", type: str}
      src: {description: "A file on the host to copy (a certificate); its content is never shown in a diff.", type: str}
      mode: {description: Octal mode as a string (C(0600))., type: str, required: true}
      group: {description: "Its group (a service's, to read it); root owns it.", type: str, default: root}
      validate: {description: A command run on the new file before it replaces the old (C(%s) is its path)., type: str}
  dirs:
    description: Directories to create or fix first (root's, with their mode and group), before the files.
    type: list
    elements: dict
    default: []
    suboptions:
      path: {description: Absolute path., type: str, required: true}
      mode: {description: Octal mode as a string., type: str, required: true}
      group: {description: Its group., type: str, default: root}
  dir_mode:
    description: Mode of the directories this creates.
    type: str
    default: "0755"
  fix_parents:
    description: Also make each file's existing directory root's with C(dir_mode) (a role's own directories).
    type: bool
    default: false
  units:
    description: The systemd units to bring to their states after the files, in this order.
    type: list
    elements: dict
    default: []
    suboptions:
      name: {description: The unit's name (without .service)., type: str, required: true}
      state: {description: What to do when none of its files changed., type: str,
              choices: [started, restarted, reloaded], default: started}
      unit_file: {description: "Its unit file: when this run changes it, systemd reloads once and the unit restarts.",
                  type: str}
      restart_on: {description: "Files (dests) whose change restarts it, in this run or listed in C(changed).",
                   type: list, elements: str, default: []}
      reload_on: {description: "Files whose change reloads it (unless one of C(restart_on) changed too).",
                  type: list, elements: str, default: []}
  unit_files:
    description: >-
      The unit files among this run's files, those of units a later run starts too (an engine's prefills): one
      changed here reloads systemd once in this run, before any unit starts, whether or not this run starts its unit.
    type: list
    elements: str
    default: []
  changed:
    description: >-
      Files an earlier run changed (the no_log run of the secret files): they restart or reload their units too.
    type: list
    elements: str
    default: []
  daemon_reload:
    description: Reload systemd before the units even where no unit file changed in this run.
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
changed_files:
  description: >-
    The files written or whose mode or group was fixed, and with C(fix_parents) the directories fixed (under
    --check, those that would be).
  type: list
  elements: str
  returned: always
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


def _names(module: AnsibleModule) -> dict:
    """What the result says it was called with: the files' and units' names (the default would echo every content)."""
    named: dict = {"files": [f["dest"] for f in module.params["files"]]}
    if module.params["dirs"]:
        named["dirs"] = [d["path"] for d in module.params["dirs"]]
    if module.params["units"]:
        named["units"] = [u["name"] for u in module.params["units"]]
    return {"module_args": named}


class _Run:
    """What the run did so far, for its result and for a failure's."""

    def __init__(self, module: AnsibleModule) -> None:
        self.module = module
        self.changed: list[str] = []
        self.acted: list[str] = []

    def fail(self, msg: str, **extra) -> None:
        self.module.fail_json(msg=msg, changed_files=self.changed, acted=self.acted, invocation=_names(self.module),
                              **extra)


def _gid(run: _Run, path: str, group: str) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        run.fail(f"{path}: its group {group} does not exist on this host")
        raise    # fail_json exits


def _own_dir(run: _Run, path: str, mode: int, gid: int, create: int | None = None) -> None:
    """Make the directory root's with mode and group; a missing one is made (with mode `create` for the folders
    above it) when `create` is given, else left alone. Noted in changed; nothing done under --check."""
    st = os.stat(path) if os.path.isdir(path) else None
    if st is None and create is None:
        return
    if st is not None and (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (mode, 0, gid):
        return
    run.changed.append(path)
    if not run.module.check_mode:
        if st is None:
            os.makedirs(path, mode=create, exist_ok=True)
        os.chmod(path, mode)
        os.chown(path, 0, gid)


def _write(run: _Run, dest: str, data: bytes, mode: int, gid: int, validate: str | None, dir_mode: int) -> None:
    parent = os.path.dirname(dest)
    if not os.path.isdir(parent):
        os.makedirs(parent, mode=dir_mode)
        os.chmod(parent, dir_mode)    # makedirs' mode is masked by the umask
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(dest)}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.chown(tmp, 0, gid)
        if validate:
            rc, out, err = run.module.run_command(validate % tmp if "%s" in validate else f"{validate} {tmp}")
            if rc != 0:
                run.fail(f"{dest}: its new content failed `{validate}` (rc {rc}): {(err or out).strip()}")
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _data(run: _Run, spec: dict) -> bytes:
    """The file's bytes: its content, its base64 content, or its src on the host (exactly one of them)."""
    dest = spec["dest"]
    given = [k for k in ("content", "content_base64", "src") if spec[k] is not None]
    if len(given) != 1:
        run.fail(f"{dest}: a file takes one of content, content_base64 and src")
    if spec["src"] is not None:
        try:
            with open(spec["src"], "rb") as f:
                return f.read()
        except OSError as e:
            run.fail(f"{dest}: its src {spec['src']} cannot be read ({e.strerror})")
    if spec["content_base64"] is not None:
        try:
            return base64.b64decode(spec["content_base64"], validate=True)
        except binascii.Error as e:
            run.fail(f"{dest}: its content_base64 is not base64 ({e})")
    return spec["content"].encode("utf-8")


def _files(run: _Run) -> list[dict[str, str]]:
    """Write the dirs and files that differ; the diffs under --diff."""
    module = run.module
    dir_mode = int(module.params["dir_mode"], 8)
    diffs: list[dict[str, str]] = []
    for spec in module.params["dirs"]:
        path, mode = spec["path"], int(spec["mode"], 8)
        if not os.path.isabs(path):
            run.fail(f"{path}: a directory's path must be absolute")
        _own_dir(run, path, mode, _gid(run, path, spec["group"]), create=dir_mode)
    if module.params["fix_parents"]:
        for parent in sorted({os.path.dirname(f["dest"]) for f in module.params["files"]}):
            _own_dir(run, parent, dir_mode, 0)
    for spec in module.params["files"]:
        dest, mode = spec["dest"], int(spec["mode"], 8)
        if not os.path.isabs(dest):
            run.fail(f"{dest}: a file's dest must be an absolute path")
        gid = _gid(run, dest, spec["group"])
        data = _data(run, spec)
        try:
            st = os.stat(dest)
            with open(dest, "rb") as f:
                before = f.read()
        except FileNotFoundError:
            st, before = None, None
        if before == data and st is not None and (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (mode, 0, gid):
            continue
        run.changed.append(dest)
        if before != data and module._diff and spec["content"] is not None:
            diffs.append({"before_header": dest, "after_header": dest,
                          "before": before.decode("utf-8", "replace") if before is not None else "",
                          "after": spec["content"]})
        if module.check_mode:
            continue
        if before != data:
            _write(run, dest, data, mode, gid, spec.get("validate"), dir_mode)
        else:
            os.chmod(dest, mode)
            os.chown(dest, 0, gid)
    return diffs


def _states(run: _Run, names: list[str]) -> dict[str, tuple[str, str]]:
    """Each unit's (UnitFileState, ActiveState) from one systemctl show."""
    rc, out, err = run.module.run_command(["systemctl", "show", "--property=UnitFileState,ActiveState", "--",
                                           *(f"{n}.service" for n in names)])
    if rc != 0:
        run.fail(f"systemctl show failed (rc {rc}): {err.strip()}")
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
        run.fail(f"systemctl show answered for {len(states)} of {len(names)} units")
    return dict(zip(names, states, strict=True))


def _units(run: _Run) -> None:
    """Enable every unit, reload systemd once where needed, then start, restart or reload each as its files say."""
    module = run.module
    units = module.params["units"]
    written = set(run.changed)    # this run's: a unit file changed here needs systemd's reload
    changed = written | set(module.params["changed"])
    unit_files = {*module.params["unit_files"], *(u["unit_file"] for u in units if u["unit_file"])}
    reload = module.params["daemon_reload"] or bool(written & unit_files)
    if not units and not reload:
        return

    def systemctl(*argv: str) -> None:
        if module.check_mode:
            return
        rc, out, err = module.run_command(["systemctl", *argv])
        if rc != 0:
            run.fail(f"systemctl {' '.join(argv)} failed (rc {rc}): {(err or out).strip()}")

    states = _states(run, [u["name"] for u in units]) if units else {}
    # One enable for every unit that needs it, without the daemon-reload each `systemctl enable` does: the one
    # reload below covers the new links and the new unit files alike (one fresh unit cost two reloads, two cost three).
    to_enable = [u["name"] for u in units
                 if states[u["name"]][0] not in ("enabled", "static", "alias", "indirect", "generated", "transient")]
    if to_enable:
        systemctl("enable", "--no-reload", "--", *(f"{name}.service" for name in to_enable))
        run.acted.extend(f"{name} enabled" for name in to_enable)
    if reload or to_enable:
        systemctl("daemon-reload")
        run.acted.append("systemd daemon-reload")
    for unit in units:
        name, want = unit["name"], unit["state"]
        if unit["unit_file"] in changed or changed.intersection(unit["restart_on"]):
            want = "restarted"
        elif want == "started" and changed.intersection(unit["reload_on"]):
            want = "reloaded"
        if states[name][1] not in ("active", "reloading", "activating"):
            systemctl("start", "--", f"{name}.service")
            run.acted.append(f"{name} started")
        elif want == "restarted":
            systemctl("restart", "--", f"{name}.service")
            run.acted.append(f"{name} restarted")
        elif want == "reloaded":
            systemctl("reload", "--", f"{name}.service")
            run.acted.append(f"{name} reloaded")


def _wait(run: _Run, spec: dict) -> float:
    """Poll every URL until it answers 200 or spec's timeout passes; fail naming the ones that did not and why."""
    began = time.monotonic()
    try:
        context = ssl.create_default_context(cafile=spec["ca"])
        context.load_cert_chain(spec["cert"], spec["key"])
    except OSError as e:    # ssl.SSLError is one
        run.fail(f"the cluster certificate to wait with cannot be loaded: {e}", waited=0.0)
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
            run.fail(f"not answering within {spec['timeout']} s: {why}", waited=round(time.monotonic() - began, 1))
        if pending:
            time.sleep(0.5)
    return round(time.monotonic() - began, 1)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "files": {"type": "list", "elements": "dict", "default": [], "options": {
                "dest": {"type": "str", "required": True},
                "content": {"type": "str"},
                "content_base64": {"type": "str"},
                "src": {"type": "str"},
                "mode": {"type": "str", "required": True},
                "group": {"type": "str", "default": "root"},
                "validate": {"type": "str"},
            }},
            "dirs": {"type": "list", "elements": "dict", "default": [], "options": {
                "path": {"type": "str", "required": True},
                "mode": {"type": "str", "required": True},
                "group": {"type": "str", "default": "root"},
            }},
            "dir_mode": {"type": "str", "default": "0755"},
            "fix_parents": {"type": "bool", "default": False},
            "units": {"type": "list", "elements": "dict", "default": [], "options": {
                "name": {"type": "str", "required": True},
                "state": {"type": "str", "choices": ["started", "restarted", "reloaded"], "default": "started"},
                "unit_file": {"type": "str"},
                "restart_on": {"type": "list", "elements": "str", "default": []},
                "reload_on": {"type": "list", "elements": "str", "default": []},
            }},
            "unit_files": {"type": "list", "elements": "str", "default": []},
            "changed": {"type": "list", "elements": "str", "default": []},
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
        no_log=True,    # the host's journal gets no copy of the contents
    )
    run = _Run(module)
    diffs = _files(run)
    _units(run)
    wait = module.params["wait"]
    waited = _wait(run, wait) if wait and wait["urls"] and not module.check_mode else 0.0
    module.exit_json(changed=bool(run.changed or run.acted), changed_files=run.changed, acted=run.acted,
                     waited=waited, **({"diff": diffs} if module._diff else {}), invocation=_names(module))


if __name__ == "__main__":
    main()
