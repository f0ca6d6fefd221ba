"""The molecule scenarios on the sandbox: create, converge, idempotence (zero changes), verify, destroy.

Each verify asserts real behaviour: units and env files match the plan, engines run exactly the
planned flags, requests go through the real router / Dynamo frontend (molecule/*/verify.yml).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


@pytest.mark.parametrize("scenario", ["mi355x-1p1d", "gb300-pd", "b300-l3"])
def test_scenario(scenario):
    molecule = shutil.which("molecule", path=str(Path(sys.executable).parent)) or shutil.which("molecule")
    assert molecule, "molecule is not installed (pip install -e '.[test]')"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "ANSIBLE_FORCE_COLOR": "0", "PY_COLORS": "0", "NO_COLOR": "1"}
    done = subprocess.run([molecule, "test", "-s", scenario], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"molecule test -s {scenario} failed:\n{output[-6000:]}"
    for step in ("converge", "idempotence", "verify"):
        assert f"{step}: Executed: Successful" in output, f"{step} did not run:\n{output[-3000:]}"
