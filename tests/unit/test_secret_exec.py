"""Secrets the router takes only as a flag stay out of argv: k31-secret-exec (roles/k31_router/files/) adds the
flag in-process, and launch.service_command starts the router through it (or refuses a binary)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k31deploy import launch
from k31deploy.errors import K31Error
from k31deploy.recipe import resolve

SCRIPT = Path(__file__).resolve().parents[2] / "roles" / "k31_router" / "files" / "k31-secret-exec.py"
spec = importlib.util.spec_from_file_location("k31_secret_exec", SCRIPT)
secret_exec = importlib.util.module_from_spec(spec)
spec.loader.exec_module(secret_exec)

KEY = "k31-unit-key-9f3c"
LAUNCHER = "/usr/local/lib/k31/k31-secret-exec.py"
MI_PD = {"platform": "mi355x", "agents": 92, "image": "reg/k31:rocm10", "model_path": "/models/kimi"}
# A stand-in program: records what it was given, starts a child, waits to be stopped.
PROGRAM = """
import json, os, subprocess, sys, time
child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('K31_ROUTER_API_KEY', ''))"],
                       capture_output=True, text=True).stdout.strip()
with open(os.environ["K31_TEST_OUT"], "w") as fh:
    json.dump({"argv": sys.argv[1:], "env": os.environ.get("K31_ROUTER_API_KEY", ""), "child_env": child}, fh)
time.sleep(60)
"""


def test_parse_takes_flag_variable_pairs_then_the_module_and_its_arguments():
    assert secret_exec.parse(["--flag-from-env", "--api-key", "K", "-m", "mod", "--port", "1"]) == (
        [("--api-key", "K")], "mod", ["--port", "1"])


@pytest.mark.parametrize(("argv", "why"), [
    (["-m", "mod"], "no --flag-from-env given"),
    (["--flag-from-env", "--api-key"], "needs a flag"),
    (["--flag-from-env", "api-key", "K", "-m", "mod"], "needs a flag"),
    (["--flag-from-env", "--api-key", "K", "mod"], "-m MODULE must follow"),
])
def test_parse_refuses_a_malformed_command_line(argv, why):
    with pytest.raises(ValueError, match=why):
        secret_exec.parse(argv)


def test_secret_flags_take_the_value_out_of_the_environment():
    env = {"K31_ROUTER_API_KEY": "-starts-with-dash", "OTHER": "x"}
    assert secret_exec.secret_flags([("--api-key", "K31_ROUTER_API_KEY")], env) == ["--api-key=-starts-with-dash"]
    assert env == {"OTHER": "x"}
    with pytest.raises(ValueError, match="K31_ROUTER_API_KEY is unset or empty"):
        secret_exec.secret_flags([("--api-key", "K31_ROUTER_API_KEY")], {"K31_ROUTER_API_KEY": "  "})


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def test_a_real_process_gets_the_flag_while_its_cmdline_and_children_never_see_the_key(tmp_path):
    (tmp_path / "k31_fake_router.py").write_text(PROGRAM)
    out = tmp_path / "seen.json"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "K31_ROUTER_API_KEY": KEY, "K31_TEST_OUT": str(out)}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--flag-from-env", "--api-key", "K31_ROUTER_API_KEY",
                             "-m", "k31_fake_router", "--port", "8000"], env=env)
    try:
        deadline = time.monotonic() + 20
        while not out.exists() and time.monotonic() < deadline:
            assert proc.poll() is None, "the launcher exited"
            time.sleep(0.05)
        seen = __import__("json").loads(out.read_text())
        cmdline = _cmdline(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert seen["argv"] == ["--port", "8000", f"--api-key={KEY}"]
    assert seen["env"] == "" and seen["child_env"] == ""
    assert cmdline[1:] == [str(SCRIPT), "--flag-from-env", "--api-key", "K31_ROUTER_API_KEY",
                           "-m", "k31_fake_router", "--port", "8000"]
    assert not any(KEY in arg for arg in cmdline)


def test_the_launcher_refuses_to_start_a_program_without_its_secret(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "K31_ROUTER_API_KEY"}
    done = subprocess.run([sys.executable, str(SCRIPT), "--flag-from-env", "--api-key", "K31_ROUTER_API_KEY",
                           "-m", "json.tool"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.startswith("k31-secret-exec: error: K31_ROUTER_API_KEY is unset or empty")


def test_service_command_starts_a_keyed_router_through_the_launcher_per_runtime():
    router = resolve(MI_PD)["router"]["argv"]
    secrets = {"--api-key": "K31_ROUTER_API_KEY"}
    wrapped = ["--flag-from-env", "--api-key", "K31_ROUTER_API_KEY", "-m", *router[2:]]
    venv = launch.service_command(router, "venv", unit="k31-router", image=None, venv="/opt/k31/router",
                                  secret_flags=secrets)
    assert venv == ["/opt/k31/router/bin/python3", LAUNCHER, *wrapped]
    cmd = launch.service_command(router, "container", unit="k31-router", image="reg/k31:rocm10", venv="/v",
                                 env_file="/etc/k31/k31-router.env", secret_flags=secrets)
    assert cmd[cmd.index("-v") + 1] == f"{LAUNCHER}:{LAUNCHER}:ro"
    assert cmd[cmd.index("reg/k31:rocm10") + 1:] == ["python3", LAUNCHER, *wrapped]
    # No secret: the plan's command as it is.
    assert launch.service_command(router, "container", unit="k31-router", image="reg/k31:rocm10", venv="/v",
                                  secret_flags={})[-len(router):] == router


def test_service_command_refuses_a_keyed_binary_rather_than_put_the_key_in_argv():
    seed = resolve({"platform": "gb300", "topology": "pd", "router": "sglang", "speculative": "none"})["router"]
    assert seed["argv"][0] == "sgl-router"
    with pytest.raises(K31Error, match=r"sgl-router takes --api-key only on its command line.*/proc/<pid>/cmdline"):
        launch.service_command(seed["argv"], "venv", unit="k31-router", image=None, venv="/v",
                               secret_flags={"--api-key": "K31_ROUTER_API_KEY"})


@pytest.mark.parametrize("knobs,override,handed", [
    (MI_PD, {}, ["--api-key", "--control-plane-api-keys"]),
    # the plan decides, not the dialect's name
    (MI_PD, {"secret_exec": False}, ["--api-key"]),
    # the seed's binary: the catalog's dialect says its keys cannot be handed over in-process, so the control-plane
    # key is not (the validate play refuses an API key with it before this renders)
    ({"platform": "gb300", "topology": "pd", "router": "sglang", "speculative": "none"}, {}, []),
])
def test_router_script_hands_over_the_keys_the_plans_dialect_can_take_in_process(knobs, override, handed):
    """router.sh.j2 asks the plan (catalog router.dialects.*.secret_exec) whether the control-plane key goes to the
    router, not the dialect's name; it hands the launcher only the variables' names."""
    import shlex

    import jinja2

    router = {**resolve(knobs)["router"], **override}
    seen = {}

    def command(argv, runtime, unit, image, venv, cli, env_file, secret_flags, launcher, mounts):
        seen["secret_flags"] = secret_flags
        return argv

    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined)
    env.filters.update({"combine": lambda a, b: {**a, **b}, "quote": shlex.quote, "k31_router_command": command})
    template = env.from_string((SCRIPT.parents[1] / "templates" / "router.sh.j2").read_text())
    text = template.render(ansible_managed="x", _k31_router_plan=router, _k31_plan={"image": None},
                           k31_router_etc_dir="/etc/k31", k31_router_runtime="venv", k31_router_venv="/v",
                           k31_router_container_cli="podman", k31_router_secret_exec=LAUNCHER,
                           k31_router_api_key=KEY if "--api-key" in handed else "",
                           k31_router_control_plane_key="cp-key")
    assert list(seen["secret_flags"]) == handed
    assert KEY not in text and "cp-key" not in text
