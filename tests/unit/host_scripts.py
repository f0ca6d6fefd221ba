"""Load a script k31 installs on hosts (k31deploy/oncall/*.py, roles/*/files) as a module, the way it runs there:
beside the host-side client it imports as k31_probe (k31deploy/oncall/probe.py, installed as
/usr/local/lib/k31/k31_probe.py)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from k31deploy.oncall import probe

ROLES = Path(__file__).resolve().parents[2] / "roles"
ONCALL = Path(probe.__file__).resolve().parent


def load(path: Path, name: str) -> ModuleType:
    sys.modules.setdefault("k31_probe", probe)
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
