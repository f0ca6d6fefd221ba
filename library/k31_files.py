#!/usr/bin/python
"""k31_files: write many small files, owned by root, in one module run (a role's rendered files and unit files).

The template and copy actions cost one or two module runs per file and host; a host's engine ranks have a dozen
files. The contents are rendered on the controller (k31_unit's lookups); this writes each one that differs,
atomically (a temporary file beside it, checked by its `validate` command, then renamed), fixes mode and group,
and reports which files changed (`changed_files`, for the units' restarts) with a diff per file under --diff.
Nothing is written under --check. The result never repeats the contents: the records stay small, and the
includer runs the files that hold a secret in a task of their own with no_log.
"""

from __future__ import annotations

import grp
import os
import tempfile

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: k31_files
short_description: Write a list of root-owned files in one run; report which changed
description:
  - Each file is written only when its content, mode or owner differs; a new content goes to a temporary file in
    the same directory, is checked by C(validate) when given, then renamed over the old one.
  - Missing directories are created (root, C(dir_mode)); C(dirs) are created or fixed first with their own mode
    and group. A file's content is C(content), or the bytes of C(src), a file on the host (never shown in a diff).
    Supports check mode and diff mode.
options:
  files:
    description: The files.
    type: list
    elements: dict
    required: true
    suboptions:
      dest: {description: Absolute path., type: str, required: true}
      content: {description: The whole text of the file (or C(src))., type: str}
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
"""

RETURN = r"""
changed_files:
  description: >-
    The files written or whose mode or group was fixed, and with C(fix_parents) the directories fixed (under
    --check, those that would be).
  type: list
  elements: str
  returned: always
"""


def _names(module: AnsibleModule) -> dict:
    """What the result says it was called with: the files' names (the default would echo every content)."""
    named = {"files": [f["dest"] for f in module.params["files"]]}
    if module.params["dirs"]:
        named["dirs"] = [d["path"] for d in module.params["dirs"]]
    return {"module_args": named}


def _gid(module: AnsibleModule, path: str, group: str, changed: list[str]) -> int:
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        module.fail_json(msg=f"{path}: its group {group} does not exist on this host", changed_files=changed,
                         invocation=_names(module))
        raise    # fail_json exits


def _own_dir(module: AnsibleModule, path: str, mode: int, gid: int, changed: list[str], create: int | None = None
             ) -> None:
    """Make the directory root's with mode and group; a missing one is made (with mode `create` for the folders
    above it) when `create` is given, else left alone. Noted in changed; nothing done under --check."""
    st = os.stat(path) if os.path.isdir(path) else None
    if st is None and create is None:
        return
    if st is not None and (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (mode, 0, gid):
        return
    changed.append(path)
    if not module.check_mode:
        if st is None:
            os.makedirs(path, mode=create, exist_ok=True)
        os.chmod(path, mode)
        os.chown(path, 0, gid)


def _write(module: AnsibleModule, dest: str, data: bytes, mode: int, gid: int, validate: str | None,
           dir_mode: int) -> None:
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
            rc, out, err = module.run_command(validate % tmp if "%s" in validate else f"{validate} {tmp}")
            if rc != 0:
                module.fail_json(msg=f"{dest}: its new content failed `{validate}` (rc {rc}): {(err or out).strip()}",
                                 changed_files=[], invocation=_names(module))
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "files": {"type": "list", "elements": "dict", "required": True, "options": {
                "dest": {"type": "str", "required": True},
                "content": {"type": "str"},
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
        },
        supports_check_mode=True,
        no_log=True,    # the host's journal gets no copy of the contents
    )
    dir_mode = int(module.params["dir_mode"], 8)
    changed: list[str] = []
    diffs: list[dict[str, str]] = []
    for spec in module.params["dirs"]:
        path, mode = spec["path"], int(spec["mode"], 8)
        if not os.path.isabs(path):
            module.fail_json(msg=f"{path}: a directory's path must be absolute", changed_files=changed,
                             invocation=_names(module))
        _own_dir(module, path, mode, _gid(module, path, spec["group"], changed), changed, create=dir_mode)
    if module.params["fix_parents"]:
        for parent in sorted({os.path.dirname(f["dest"]) for f in module.params["files"]}):
            _own_dir(module, parent, dir_mode, 0, changed)
    for spec in module.params["files"]:
        dest, mode = spec["dest"], int(spec["mode"], 8)
        if not os.path.isabs(dest):
            module.fail_json(msg=f"{dest}: a file's dest must be an absolute path", changed_files=changed,
                             invocation=_names(module))
        gid = _gid(module, dest, spec["group"], changed)
        if (spec["content"] is None) == (spec["src"] is None):
            module.fail_json(msg=f"{dest}: a file takes one of content and src", changed_files=changed,
                             invocation=_names(module))
        if spec["src"] is not None:
            try:
                with open(spec["src"], "rb") as f:
                    data = f.read()
            except OSError as e:
                module.fail_json(msg=f"{dest}: its src {spec['src']} cannot be read ({e.strerror})",
                                 changed_files=changed, invocation=_names(module))
        else:
            data = spec["content"].encode("utf-8")
        try:
            st = os.stat(dest)
            with open(dest, "rb") as f:
                before = f.read()
        except FileNotFoundError:
            st, before = None, None
        if before == data and st is not None and (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (mode, 0, gid):
            continue
        changed.append(dest)
        if before != data and module._diff and spec["src"] is None:
            diffs.append({"before_header": dest, "after_header": dest,
                          "before": before.decode("utf-8", "replace") if before is not None else "",
                          "after": spec["content"]})
        if module.check_mode:
            continue
        if before != data:
            _write(module, dest, data, mode, gid, spec.get("validate"), dir_mode)
        else:
            os.chmod(dest, mode)
            os.chown(dest, 0, gid)
    module.exit_json(changed=bool(changed), changed_files=changed, **({"diff": diffs} if module._diff else {}),
                     invocation=_names(module))


if __name__ == "__main__":
    main()
