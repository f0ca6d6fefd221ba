"""Env files and launch scripts k31 renders: no value can start a new line (k31deploy.envfile and every
roles/*/templates/*.env.j2), and the engine script echoes no command into a comment."""

from __future__ import annotations

import importlib.util
import random
import shlex
import subprocess
from pathlib import Path

import jinja2
import pytest
from ansible.errors import AnsibleFilterError
from ansible.plugins.filter.core import FilterModule as AnsibleCore

from k31deploy import envfile
from k31deploy.errors import K31Error
from k31deploy.recipe import resolve

ROOT = Path(__file__).resolve().parents[2]
ENV_TEMPLATES = sorted(ROOT.glob("roles/*/templates/*.env.j2"))


def systemd_read(text: str) -> dict[str, str]:
    """systemd's EnvironmentFile parser (src/basic/env-file.c, parse_env_file_internal), state for state."""
    env: dict[str, str] = {}
    state, key, value, last_ws = "PRE_KEY", "", "", None
    for c in text + "\n":
        if state == "PRE_KEY":
            if c in "#;":
                state = "COMMENT"
            elif c not in " \t\n\r":
                state, key = "KEY", c
        elif state == "KEY":
            if c in "\n\r":
                state, key = "PRE_KEY", ""
            elif c == "=":
                state, value, last_ws = "PRE_VALUE", "", None
            else:
                key += c
        elif state in ("PRE_VALUE", "VALUE"):
            if c in "\n\r":
                if state == "VALUE" and last_ws is not None:
                    value = value[:last_ws]
                env[key.strip()] = value
                state, key = "PRE_KEY", ""
            elif c == "\\":
                state, last_ws = "VALUE_ESCAPE", None
            elif state == "PRE_VALUE" and c == "'":
                state = "SQ"
            elif state == "PRE_VALUE" and c == '"':
                state = "DQ"
            elif state == "PRE_VALUE" and c in " \t":
                pass
            else:    # trailing whitespace of an unquoted value is cut at the end of the line
                last_ws = (len(value) if last_ws is None else last_ws) if c in " \t" else None
                state, value = "VALUE", value + c
        elif state == "VALUE_ESCAPE":
            state = "VALUE"
            if c not in "\n\r":
                value += c
        elif state == "SQ":
            state, value = ("PRE_VALUE", value) if c == "'" else ("SQ", value + c)
        elif state == "DQ":
            if c == '"':
                state = "PRE_VALUE"
            elif c == "\\":
                state = "DQ_ESCAPE"
            else:
                value += c
        elif state == "DQ_ESCAPE":
            state = "DQ"
            value += c if c in '"\\`$' else ("" if c == "\n" else "\\" + c)
        elif state == "COMMENT":
            if c == "\\":
                state = "COMMENT_ESCAPE"    # before v254 the next line continued the comment
            elif c in "\n\r":
                state = "PRE_KEY"
        elif state == "COMMENT_ESCAPE":
            state = "COMMENT"
    return env


def docker_read(text: str) -> dict[str, str]:
    """docker / podman --env-file: each line verbatim after the first '=' (podman pkg/env ParseFile)."""
    env = {}
    for line in text.split("\n"):
        line = line.lstrip(" \t")
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.lstrip(" \t")] = value
    return env


PORTABLE = ["1", "", "http://[fd00::9]:2379", "=x", "a b", "a#b", "x;y", "$HOME", "`id`", "24,24,24,21",
            "/models/Kimi-K3.1-Pro", "hf_AbC123", "ünïcode", "a'b", 'a"b', "{\"0\": \"mlx5_0\"}"]
QUOTED = [" lead", "trail ", "'quoted'", '"dq"', "back\\slash", "\\", "a\\nb", " "]
CONTROLS = ["\n", "\r", "\x00", "\x1b", "\t", "\x85", "\u2028", "\x7f"]


@pytest.mark.parametrize("value", PORTABLE)
def test_plain_values_are_written_as_they_are_and_read_alike_by_systemd_and_docker(value):
    line = envfile.line("K", value, container=True)
    assert line == f"K={value}"
    assert systemd_read(line) == docker_read(line) == envfile.parse([line]) == {"K": value}


@pytest.mark.parametrize("value", QUOTED)
def test_other_values_are_quoted_for_systemd_and_refused_where_docker_reads_too(value):
    line = envfile.line("K", value)
    assert line.startswith('K="') and "\n" not in line
    assert systemd_read(line) == envfile.parse([line]) == {"K": value}
    with pytest.raises(K31Error, match=r"^the value of K \(not shown\) starts or ends with whitespace"):
        envfile.line("K", value, container=True)


def test_random_values_keep_their_meaning_or_are_refused():
    rng = random.Random(31)
    alphabet = "ab =#;'\"\\$`\t\n\r\x00\x1b{}:/,"
    for _ in range(3000):
        value = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
        for container in (False, True):
            try:
                line = envfile.line("K", value, container)
            except K31Error:
                assert any(c in value for c in "\n\r\x00\x1b\t\\'\"") or value != value.strip(" \t"), repr(value)
                continue
            text = f"# c\n{line}\nNEXT=1\n"
            assert systemd_read(text) == envfile.parse([text]) == {"K": value, "NEXT": "1"}, repr(value)
            if container:
                assert docker_read(text) == {"K": value, "NEXT": "1"}, repr(value)


@pytest.mark.parametrize("char", CONTROLS)
def test_control_characters_are_refused_without_echoing_the_value(char):
    with pytest.raises(K31Error) as info:
        envfile.line("K31_ROUTER_API_KEY", f"s3cret{char}LD_PRELOAD=/tmp/x.so")
    message = str(info.value)
    assert message.startswith("the value of K31_ROUTER_API_KEY contains the control character")
    assert "s3cret" not in message and "LD_PRELOAD" not in message and "\n" not in message


@pytest.mark.parametrize("key", ["A B", "1A", "A=B", "A\nB", "", "-A"])
def test_bad_variable_names_are_refused(key):
    with pytest.raises(K31Error, match=r"^env file variable name '.*' is not valid"):
        envfile.line(key, "1")


@pytest.mark.parametrize("text", ["ok", "a\nB=1", "a\\", "a\r\nB=1", "x\\\\", "\u2028B=1"])
def test_comments_stay_on_their_line(text):
    safe = envfile.comment(text)
    rendered = f"# {safe}\nNEXT=1\n"
    assert "\n" not in safe and "\r" not in safe and "\u2028" not in safe
    assert systemd_read(rendered) == {"NEXT": "1"}    # also with pre-v254 comment continuation


# -- the templates -----------------------------------------------------------------------------------

def k31_filters(plugin: str = "k31") -> dict:
    """The filters of filter_plugins/PLUGIN.py, as Ansible loads them."""
    spec = importlib.util.spec_from_file_location(f"{plugin}_filter", ROOT / f"filter_plugins/{plugin}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FilterModule().filters()


def render(template: Path, **context) -> str:
    env = jinja2.Environment(trim_blocks=True, undefined=jinja2.StrictUndefined)    # Ansible's template settings
    env.filters.update(AnsibleCore().filters())
    env.filters.update(k31_filters())
    return env.from_string(template.read_text()).render(ansible_managed="Ansible managed", **context)


def template_context(plan: dict, env: dict[str, str], runtime: str = "container") -> dict:
    server = plan["servers"][0]
    rank = {**server["ranks"][0], "env": env}
    host_env = "MC_GID_INDEX=3\nSGLANG_HOST_IP=10.0.0.1\n\n"    # each file, then a newline
    return {
        "k31_unit_context": {"server": server, "rank": rank},
        "_k31_engine_host": {"host-env": {"rc": 0, "text": host_env}},    # k31_engine's read, by section
        "k31_engine_extra_env": {}, "k31_engine_hf_token": "", "k31_engine_runtime": runtime,
        "k31_engine_etc_dir": "/etc/k31", "k31_engine_standin_load_seconds": 1, "k31_engine_standin_model_dir": "/m",
        "_k31_dynamo_plan": {"env": env}, "k31_dynamo_runtime": runtime, "k31_dynamo_state_dir": "/var/lib/k31/dynamo",
        "k31_dynamo_nats_token": "t" * 64, "k31_engine_nats_token": "t" * 64,
        "_k31_router_plan": {"env": env}, "k31_router_runtime": runtime, "k31_router_api_key": "",
        "k31_router_control_plane_key": "",
        "_k31_mnnvl_env": env, "_k31_mnnvl_addresses": ["10.0.0.1", "10.0.0.2"], "inventory_hostname": "t0",
        "_k31_model_env": env, "_k31_model_items": [{"dest": "/models/k31"}],
        "_k31_rdma_choice": {"env": env, "ports": [{"device": "mlx5_0"}], "left_out": ["mlx5_1: down"]},
    }


PLAN = resolve({"platform": "mi355x", "agents": 92})


def test_every_env_template_is_covered():
    assert {t.parent.parent.name for t in ENV_TEMPLATES} == {
        "k31_engine", "k31_router", "k31_dynamo", "k31_mnnvl", "k31_model", "k31_rdma"}


@pytest.mark.parametrize("template", ENV_TEMPLATES, ids=lambda t: t.name)
def test_env_templates_write_what_both_parsers_read(template):
    env = {"A": "1", "URL": "http://[fd00::9]:2379", "SPACES": "a b"}
    text = render(template, **template_context(PLAN, env))
    read = systemd_read(text)
    assert env.items() <= read.items() and docker_read(text).items() >= env.items()
    assert all(line.startswith("#") or "=" in line for line in text.splitlines() if line)


@pytest.mark.parametrize("template", ENV_TEMPLATES, ids=lambda t: t.name)
@pytest.mark.parametrize("char", ["\n", "\r", "\x00"])
def test_env_templates_refuse_a_value_that_would_start_a_new_line(template, char):
    with pytest.raises(AnsibleFilterError, match=r"^error: the value of A contains the control character"):
        render(template, **template_context(PLAN, {"A": f"1{char}LD_PRELOAD=/tmp/x.so"}))


def test_secrets_and_extras_in_env_files_are_checked_too():
    engine = ROOT / "roles/k31_engine/templates/engine.env.j2"
    context = template_context(PLAN, {"A": "1"})
    with pytest.raises(AnsibleFilterError, match=r"the value of HF_TOKEN contains the control character \\n \(value "):
        render(engine, **{**context, "k31_engine_hf_token": "hf_x\n"})
    with pytest.raises(AnsibleFilterError, match=r"the value of X"):
        render(engine, **{**context, "k31_engine_extra_env": {"X": "1\nLD_PRELOAD=/x"}})
    router = ROOT / "roles/k31_router/templates/router.env.j2"
    with pytest.raises(AnsibleFilterError, match=r"the value of K31_ROUTER_API_KEY \(not shown\) starts or ends"):
        render(router, **{**template_context(PLAN, {}), "k31_router_api_key": "key "})
    venv = render(router, **{**template_context(PLAN, {}, runtime="venv"), "k31_router_api_key": 'k"e\\y '})
    assert systemd_read(venv)["K31_ROUTER_API_KEY"] == 'k"e\\y '


def test_host_env_files_merge_into_the_engine_env_file():
    engine = ROOT / "roles/k31_engine/templates/engine.env.j2"
    rank_env = PLAN["servers"][0]["ranks"][0]["env"]
    text = render(engine, **template_context(PLAN, rank_env))
    assert systemd_read(text) == {"MC_GID_INDEX": "3", "SGLANG_HOST_IP": "10.0.0.1", **rank_env}
    assert text.splitlines()[1] == "# k31-prefill0-r0: prefill high-throughput rank 0 (from the resolved plan)"


def test_the_engine_script_echoes_no_command_into_a_comment(tmp_path):
    """A newline in an argv value used to end the comment that echoed the command, and the rest ran as root.
    The script now runs the command once, each argument quoted whole."""
    pwned = tmp_path / "pwned"
    plan = resolve({"platform": "mi355x", "agents": 92, "image": "reg/k31:rocm10"})
    server = plan["servers"][0]
    rank = dict(server["ranks"][0])
    rank["argv"] = [*rank["argv"], "--served-model-name", f"m\ntouch {pwned}\n"]    # as if past validation
    script = render(ROOT / "roles/k31_engine/templates/engine.sh.j2",
                    k31_unit_context={"server": server, "rank": rank},
                    _k31_plan=plan, k31_engine_runtime="container",
                    k31_engine_etc_dir="/etc/k31", k31_engine_container_cli="docker", k31_engine_venv="/opt/k31/venv",
                    _k31_engine_container_extra_flags=[], k31_engine_pinned_image="")
    comments = [line for line in script.splitlines() if line.startswith("#")]
    assert not any("--served-model-name" in line or "sglang" in line for line in comments)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" > {tmp_path}/argv\n')
    (bin_dir / "docker").chmod(0o755)
    path = tmp_path / "engine.sh"
    path.write_text(script)
    subprocess.run(["bash", str(path)], check=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert not pwned.exists()
    argv = (tmp_path / "argv").read_text().split("\0")[:-1]
    assert argv[-2:] == ["--served-model-name", f"m\ntouch {pwned}\n"] and argv[0] == "run"


def test_dynamo_workers_env_files_carry_their_control_plane_secrets_and_others_none():
    engine = ROOT / "roles/k31_engine/templates/engine.env.j2"
    dynamo = resolve({"platform": "b300", "topology": "pd", "prefill_strategy": "low-latency",
                      "max_running_requests": 8})
    rank_env = dynamo["servers"][0]["ranks"][0]["env"]
    read = systemd_read(render(engine, **template_context(dynamo, rank_env)))
    assert read["NATS_AUTH_TOKEN"] == "t" * 64
    assert not [key for key in read if key.startswith("ETCD_AUTH")]    # etcd's PEM: read by the launch script
    sglang = systemd_read(render(engine, **template_context(PLAN, PLAN["servers"][0]["ranks"][0]["env"])))
    assert "NATS_AUTH_TOKEN" not in sglang


def engine_read(tmp_path: Path, runtime: str, family: str = "cuda") -> dict:
    """Run k31_engine's one read of the host (tasks/main.yml, its script in vars/main.yml) as the task renders it,
    with a fake container CLI and getent first on PATH; its sections as the role parses them."""
    import jinja2.nativetypes
    import yaml

    (task,) = [t for t in yaml.safe_load((ROOT / "roles/k31_engine/tasks/main.yml").read_text())
               if t["name"].startswith("Read the host settings")]
    assert (task["changed_when"], task["check_mode"]) == (False, False)
    assert task["failed_when"] == "_k31_engine_read.rc != 0 or _k31_engine_host['host-env'].rc | default(1) != 0"
    role_vars = yaml.safe_load((ROOT / "roles/k31_engine/vars/main.yml").read_text())
    env = jinja2.nativetypes.NativeEnvironment()
    env.filters.update(AnsibleCore().filters())
    assert task["vars"]["ansible_ssh_use_tty"] is False    # raw: what it prints is parsed, so no tty
    command = env.from_string(task["ansible.builtin.raw"]).render(
        _k31_engine_read_script=role_vars["_k31_engine_read_script"], k31_engine_runtime=runtime,
        k31_engine_container_cli=str(tmp_path / "bin/podman"), k31_engine_pinned_image="reg/k31@sha256:" + "a" * 64,
        _k31_plan={"hardware": {"family": family}}, k31_engine_host_env_files=["rdma", "model", "mnnvl"],
        k31_engine_etc_dir=str(tmp_path))
    argv = shlex.split(command)    # the host's shell splits the raw command into the read's argv
    assert argv[:2] == ["sh", "-c"] and argv[7] == "{{.Id}}" and argv[9] == "/opt/k31/src/.k31-bundle"
    argv[9] = str(tmp_path / ".k31-bundle")    # where the test put it
    done = subprocess.run(["/bin/sh", "-c", shlex.join(argv)], capture_output=True, text=True, check=True,
                          env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
    return k31_filters("k31_hostcheck")["k31_probe_sections"](done.stdout)


def fake_tools(tmp_path: Path, image_present: bool) -> None:
    (tmp_path / "bin").mkdir()
    podman = tmp_path / "bin/podman"
    podman.write_text('#!/bin/sh\nprintf "%s\\n" "$*" > "$(dirname "$0")/argv"\n'
                      + ('echo sha256:feed\n' if image_present else 'echo "Error: no such image" >&2; exit 125\n'))
    getent = tmp_path / "bin/getent"
    getent.write_text('#!/bin/sh\n[ "$*" = "group render" ] && echo render:x:109:\n')
    for tool in (podman, getent):
        tool.chmod(0o755)


def test_the_engines_read_of_the_host_settings_keeps_each_files_lines_apart_and_skips_a_missing_file(tmp_path):
    """k31_engine reads rdma.env, model.env and mnnvl.env with one command; its host-env section, parsed as one
    text, is what the files say in that order (a later file wins), even when a file's last line has no newline."""
    (tmp_path / "rdma.env").write_text("# Ansible managed\nMC_GID_INDEX=3\nNCCL_IB_HCA=mlx5_0")    # no newline
    (tmp_path / "mnnvl.env").write_text("NCCL_IB_HCA=mlx5_1\nK31_MNNVL=1\n")
    fake_tools(tmp_path, image_present=True)
    read = engine_read(tmp_path, "venv")
    assert set(read) == {"host-env"} and read["host-env"]["rc"] == 0
    assert envfile.parse([read["host-env"]["text"]]) == {"MC_GID_INDEX": "3", "NCCL_IB_HCA": "mlx5_1",
                                                          "K31_MNNVL": "1"}
    engine = ROOT / "roles/k31_engine/templates/engine.env.j2"
    context = {**template_context(PLAN, {}), "_k31_engine_host": read}
    assert systemd_read(render(engine, **context))["NCCL_IB_HCA"] == "mlx5_1"
    # there, but cat cannot read it (an I/O error): the section says so, and the task fails on it
    (tmp_path / "model.env").write_text("A=1\n")
    (tmp_path / "bin/cat").write_text('#!/bin/sh\ncase "$2" in *model.env) echo "cat: I/O error" >&2; exit 1;; esac\n'
                                      'exec /bin/cat "$@"\n')
    (tmp_path / "bin/cat").chmod(0o755)
    read = engine_read(tmp_path, "venv")["host-env"]
    assert read["rc"] != 0 and "I/O error" in read["text"]


def test_the_engines_read_says_which_bundle_the_standin_runs(tmp_path):
    fake_tools(tmp_path, image_present=True)
    assert engine_read(tmp_path, "standin")["bundle"]["rc"] != 0            # a fresh host: copy and unpack it
    (tmp_path / ".k31-bundle").write_text("d" * 64 + "\n")
    read = engine_read(tmp_path, "standin")
    assert set(read) == {"host-env", "bundle"} and read["bundle"]["text"].strip() == "d" * 64
    assert envfile.parse([read["host-env"]["text"]]) == {}


def test_the_engines_read_checks_the_pinned_image_and_on_rocm_the_render_group(tmp_path):
    fake_tools(tmp_path, image_present=False)
    read = engine_read(tmp_path, "container")
    assert set(read) == {"host-env", "image"}          # CUDA: no render group
    assert read["image"]["rc"] == 125 and "no such image" in read["image"]["text"]
    assert (tmp_path / "bin/argv").read_text().split() == ["image", "inspect", "--format", "{{.Id}}",
                                                           "reg/k31@sha256:" + "a" * 64]
    (tmp_path / "bin/podman").write_text("#!/bin/sh\necho sha256:feed\n")
    read = engine_read(tmp_path, "container", family="rocm")
    assert read["image"] == {"rc": 0, "text": "sha256:feed\n"}
    assert read["render-group"]["rc"] == 0 and read["render-group"]["text"].split(":")[2] == "109"
