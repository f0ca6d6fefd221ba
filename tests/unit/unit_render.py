"""Render the systemd units a role's k31_unit include writes, as roles/k31_unit does: each item of the include's
`k31_unit_contexts` becomes `k31_unit_context`, the include's `k31_unit_name` and `k31_unit_service` are templated
with it (natively, as Ansible templates a whole-expression value), then k31_unit's one service template."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import jinja2.nativetypes
import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVICE_TEMPLATE = ROOT / "roles/k31_unit/templates/k31.service.j2"


def unit_include(tasks_file: Path) -> dict[str, Any]:
    """The one task of `tasks_file` that hands k31_unit a service."""
    (task,) = [t for t in yaml.safe_load(tasks_file.read_text()) if "k31_unit_service" in (t.get("vars") or {})]
    return task


def native(value: Any, context: dict[str, Any], filters: dict[str, Any]) -> Any:
    if isinstance(value, dict):
        return {k: native(v, context, filters) for k, v in value.items()}
    if isinstance(value, list):
        return [native(v, context, filters) for v in value]
    if not isinstance(value, str) or ("{{" not in value and "{%" not in value):
        return value    # Ansible leaves a string without Jinja as it is (the native render makes "" None)
    env = jinja2.nativetypes.NativeEnvironment(undefined=jinja2.StrictUndefined)
    env.filters.update(filters)
    return env.from_string(value).render(**context)


def render_units(tasks_file: Path, filters: dict[str, Any] | None = None, watched: tuple[str, ...] = (),
                 **context: Any) -> dict[str, str]:
    """{unit name: the unit file's text} for every unit the include in `tasks_file` writes; `watched` is what
    k31_unit's digest read printed for the include's k31_unit_watch (sha256sum's lines)."""
    filters = filters or {}
    task_vars = unit_include(tasks_file)["vars"]
    scope = {**context, **{k: v for k, v in task_vars.items() if k.startswith("_")}}
    scope = {**scope, **{k: native(v, scope, filters) for k, v in scope.items() if k in task_vars}}
    contexts = native(task_vars.get("k31_unit_contexts", [{}]), scope, filters)
    text = SERVICE_TEMPLATE.read_text(encoding="utf-8")
    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined)
    out = {}
    for item in contexts:
        here = {**scope, "k31_unit_context": item}
        name = native(task_vars["k31_unit_name"], here, filters)
        service = native(task_vars["k31_unit_service"], here, filters)
        out[name] = env.from_string(text).render(ansible_managed="Ansible managed",
                                                 _k31_unit={"name": name, "service": service,
                                                            "watch": list(watched)})
    return out
