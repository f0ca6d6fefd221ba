"""The molecule scenarios on the sandbox: create, check (a dry run on fresh hosts that must write
nothing), converge, idempotence (zero changes), verify, destroy; b300-l3 adds a dry run after deploy
that must predict zero changes.

Each verify asserts real behaviour: units and env files match the plan, engines run exactly the
planned flags, requests go through the real router / Dynamo frontend (molecule/*/verify.yml). mi355x-1p1d
deploys with a vaulted router key and HF token: its verify searches the nodes' command lines and journals,
`k31 deploy -vvv` / `k31 redeploy -vvv` run records and `k31 logs` output, and here every command line of
the machine (the nodes are its containers) is watched for either secret for the whole scenario.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cmdline_watch import CmdlineWatch
from recaps import changed

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


@pytest.mark.parametrize("scenario", ["mi355x-1p1d", "gb300-pd", "b300-l3", "mi355x-1p1d-container"])
def test_scenario(scenario):
    molecule = shutil.which("molecule", path=str(Path(sys.executable).parent)) or shutil.which("molecule")
    assert molecule, "molecule is not installed (pip install -e '.[test]')"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "ANSIBLE_FORCE_COLOR": "0", "PY_COLORS": "0", "NO_COLOR": "1"}
    secrets = scenario_secrets(scenario)
    with CmdlineWatch(*secrets, pause=0.05) if secrets else contextlib.nullcontext() as watch:
        # One stream, so molecule's step lines (its log) stay in order with the playbooks' recaps.
        done = subprocess.run([molecule, "test", "-s", scenario], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=1200, check=False)
    output = done.stdout
    assert done.returncode == 0, f"molecule test -s {scenario} failed:\n{output[-6000:]}"
    if secrets:
        assert watch.scans > 100 and not watch.hits, f"command lines held a secret: {sorted(watch.hits)}"
    for step in ("check", "side_effect", "converge", "idempotence", "verify"):
        assert f"{step}: Executed: Successful" in output, f"{step} did not run:\n{output[-3000:]}"
    checks = check_recaps(output)
    # The first dry run is on fresh hosts (side_effect proved it wrote nothing); b300-l3 runs a
    # second one on the deployed cluster, which must predict no change.
    fresh = {host: n for host, n in (checks or [{}])[0].items() if host != "localhost"}
    assert fresh and all(fresh.values()), f"a dry run on fresh hosts must predict changes on every node: {checks}"
    if scenario == "b300-l3":
        assert len(checks) == 2 and not any(checks[1].values()), f"--check after deploy predicted changes: {checks}"


def scenario_secrets(scenario: str) -> list[str]:
    """The values of the scenario's vaulted secrets (decrypted here, never passed on a command line)."""
    vault = ROOT / "molecule" / scenario / "secrets.vault.yml"
    if not vault.is_file():
        return []
    from ansible.constants import DEFAULT_VAULT_ID_MATCH
    from ansible.parsing.vault import VaultLib, VaultSecret

    password = (vault.parent / "vault-password").read_bytes().strip()
    plain = VaultLib([(DEFAULT_VAULT_ID_MATCH, VaultSecret(password))]).decrypt(vault.read_bytes())
    return [str(v) for v in yaml.safe_load(plain).values()]


def check_recaps(output: str) -> list[dict[str, int]]:
    """Per molecule `check` step, the changed= count of every host in its PLAY RECAP."""
    steps = re.findall(r"> check\] Executing$(.*?)> check\] Executed", output, flags=re.S | re.M)
    return [changed(step) for step in steps]
