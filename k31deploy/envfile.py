"""Env files k31 writes under /etc/k31: one `KEY=VALUE` line per variable, and nothing a value holds can
start another line.

Two parsers read these files. systemd (`EnvironmentFile=`, src/basic/env-file.c) strips whitespace around
an unquoted value, takes a backslash as an escape, and honours single and double quotes at the start of a
value. docker and podman (`--env-file`) take everything after the first `=` verbatim, up to the newline.
So a line means the same to both only when its value has no control character, no leading or trailing
whitespace, no leading quote and no backslash: such values are written as they are. Any other value is
written double-quoted for systemd; in a file docker or podman also reads (`container=True`) it is refused,
since they would keep the quotes. Control characters (a newline starts a new assignment, e.g. LD_PRELOAD)
are refused everywhere, without echoing the value (it may be a secret).
"""

from __future__ import annotations

import re
from typing import Any

from k31deploy.errors import K31Error
from k31deploy.validate import CONTROL, shown

KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)


def _portable(value: str) -> bool:
    return value == value.strip(" \t") and not value.startswith(("'", '"')) and "\\" not in value


def line(key: Any, value: Any, container: bool = False) -> str:
    """One `KEY=VALUE` line for an env file (without the newline)."""
    key = str(key)
    if not KEY.fullmatch(key):
        raise K31Error(f"env file variable name '{shown(key)}' is not valid; valid: letters, digits and '_', not "
                       f"starting with a digit")
    text = "" if value is None else str(value)
    found = CONTROL.search(text)
    if found:
        raise K31Error(f"the value of {key} contains the control character {shown(found.group())} (value not shown), "
                       f"and none may be in an env file (a newline would start a new assignment); valid: one line "
                       f"of printable characters")
    if _portable(text):
        return f"{key}={text}"
    if container:
        raise K31Error(f"the value of {key} (not shown) starts or ends with whitespace, starts with a quote or holds a "
                       f"backslash, which systemd's EnvironmentFile and docker/podman --env-file read differently; "
                       f"valid: a value without those, or a venv runtime (systemd alone reads the file)")
    return f'{key}="' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def comment(text: Any) -> str:
    """Text for a `# ...` line: control characters escaped (a newline would end the comment) and backslashes
    doubled (systemd before v254 continued a comment ending in one onto the next line)."""
    return CONTROL.sub(lambda m: shown(m.group()), str(text).replace("\\", "\\\\"))


def parse(texts: list[str]) -> dict[str, str]:
    """KEY=VALUE lines of env files as `line` writes them (comments and blanks skipped), later files winning."""
    env: dict[str, str] = {}
    for text in texts:
        for raw in text.split("\n"):
            key, sep, value = raw.strip().partition("=")
            if not sep or not key or key.startswith(("#", ";")):
                continue
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = re.sub(r"\\([\\\"`$])", r"\1", value[1:-1])
            elif len(value) >= 2 and value[0] == value[-1] == "'":
                value = value[1:-1]
            env[key.strip()] = value
    return env
