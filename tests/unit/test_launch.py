"""How planned processes are wrapped per runtime, the stand-in bundle, and the plan-derived targets."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from k31deploy import bundle, launch
from k31deploy.errors import K31Error
from k31deploy.oncall import rollout
from k31deploy.recipe import resolve
from k31deploy.standin.dynamo import dynamo_parsers, parser_conflict
from k31deploy.standin.parser import parse_args

MI_PD = {"platform": "mi355x", "agents": 92, "image": "reg/k31:rocm10", "model_path": "/models/kimi"}


def rank0(plan, role):
    return next(s for s in plan["servers"] if s["role"] == role)["ranks"][0]


def test_container_command_carries_family_flags_env_file_mounts_and_the_planned_argv():
    plan = resolve(MI_PD)
    rank = rank0(plan, "decode")
    cmd = launch.engine_command(plan, rank, "container", env_file="/etc/k31/x.env",
                                mounts=launch.model_mounts(plan))
    assert cmd[:5] == ["docker", "run", "--rm", "--name", "k31-decode0-r0"]
    for flag in ("--device=/dev/kfd", "--device=/dev/infiniband", "--cap-add=IPC_LOCK", "--network=host"):
        assert flag in cmd
    assert cmd[cmd.index("--env-file") + 1] == "/etc/k31/x.env"
    assert "/models/kimi:/models/kimi:ro" in cmd
    image_at = cmd.index("reg/k31:rocm10")
    assert cmd[image_at + 1:] == rank["argv"]


def test_dynamo_workers_take_their_request_plane_port_at_start_and_containers_get_it_by_name():
    plan = resolve({"platform": "gb300", "topology": "pd", "image": "reg/k31:cuda", "max_running_requests": 8})
    rank = rank0(plan, "decode")
    assert launch.start_env(rank) == [
        f'DYN_TCP_RPC_PORT="$(/usr/local/lib/k31/k31-request-port {rank["unit"]} {rank["address"]} 29110 29125)"; '
        f'export DYN_TCP_RPC_PORT']
    cmd = launch.engine_command(plan, rank, "container", env_file="/etc/k31/x.env")
    assert cmd[cmd.index("DYN_TCP_RPC_PORT") - 1] == "-e"
    sglang = rank0(resolve(MI_PD), "decode")
    assert sglang["request_plane_ports"] is None and launch.start_env(sglang) == []
    with pytest.raises(K31Error, match=r"request_plane_ports \[9, 3\] is not valid"):
        launch.start_env({**rank, "request_plane_ports": [9, 3]})


def test_rocm_hosts_add_their_numeric_render_group():
    plan = resolve(MI_PD)
    cmd = launch.engine_command(plan, rank0(plan, "decode"), "container", env_file="e",
                                extra_flags=["--group-add", "110"])
    assert cmd[cmd.index("110") - 1] == "--group-add" and cmd.index("110") < cmd.index("reg/k31:rocm10")


def test_podman_reaches_nvidia_gpus_through_cdi():
    plan = resolve({"platform": "b300", "image": "reg/k31:cuda", "max_running_requests": 8})
    cmd = launch.engine_command(plan, rank0(plan, "unified"), "container", env_file="e", container_cli="podman")
    assert "--gpus" not in cmd and cmd[cmd.index("--device") + 1] == "nvidia.com/gpu=all"


def test_gb300_multinode_containers_get_the_imex_channel():
    plan = resolve({"platform": "gb300", "image": "reg/k31:cuda", "max_running_requests": 8})
    assert "NVIDIA_IMEX_CHANNELS=0" in plan["container_flags"]
    assert "NVIDIA_IMEX_CHANNELS=0" not in resolve({"platform": "b300", "max_running_requests": 8})["container_flags"]


def test_runtime_refusals():
    plan = resolve({**MI_PD, "image": "<K31_MI35X_IMAGE>"})
    with pytest.raises(K31Error, match="image is <K31_MI35X_IMAGE>"):
        launch.engine_command(plan, rank0(plan, "decode"), "container", env_file="e")
    with pytest.raises(K31Error, match="k31_engine_runtime=vm is not valid; valid choices: container, venv, standin"):
        launch.engine_command(plan, rank0(plan, "decode"), "vm", env_file="e")
    tpu = resolve({"platform": "tpu7x"})
    assert launch.engine_command(tpu, rank0(tpu, "unified"), "venv", env_file="e")[0] == "/opt/k31/venv/bin/python3"


def test_venv_and_standin_replace_only_the_interpreter_or_module():
    plan = resolve(MI_PD)
    rank = rank0(plan, "prefill")
    venv = launch.engine_command(plan, rank, "venv", env_file="e", venv="/opt/sglang")
    assert venv == ["/opt/sglang/bin/python3", *rank["argv"][1:]]
    standin = launch.engine_command(plan, rank, "standin", env_file="e")
    assert standin[1:3] == ["-m", "k31deploy.standin"] and standin[3:] == rank["argv"][3:]
    dyn = resolve({"platform": "gb300", "topology": "pd", "max_running_requests": 8})
    assert launch.engine_command(dyn, rank0(dyn, "decode"), "standin", env_file="e")[2] == "k31deploy.standin.dynamo"


def test_host_ranks_endpoint_and_metrics_targets():
    plan = resolve(MI_PD)
    (mine,) = launch.host_ranks(plan, "node1")
    assert mine["server"]["role"] == "decode" and mine["health_url"] == "http://node1:30100/health"
    assert "ranks" not in mine["server"] and mine["rank"]["unit"] == "k31-decode0-r0"
    assert launch.endpoint(plan) == "http://node0:8000/v1"
    assert launch.endpoint(resolve({"platform": "mi355x", "agents": 16})) == "http://node0:30000/v1"
    targets = launch.metrics_targets(plan)
    assert [g["targets"] for g in targets["k31-engines"]] == [["node0:30000"], ["node1:30100"]]
    assert targets["k31-router"][0]["targets"] == ["node0:29000"]


def test_dynamo_workers_get_dynamos_parsers_and_the_stand_in_takes_their_argv():
    plan = resolve({"platform": "gb300", "topology": "pd", "max_running_requests": 8})
    for server in plan["servers"]:
        rank = server["ranks"][0]
        argv, env = rank["argv"], rank["env"]
        assert argv[:3] == ["python3", "-m", "dynamo.sglang"]
        # dynamo.sglang exits 1 with both tool-call parsers; the frontend parses with the Dynamo ones
        assert "--tool-call-parser" not in argv and argv[argv.index("--reasoning-parser") + 1] == "kimi_k3"
        assert env["DYN_REASONING_PARSER"] == env["DYN_TOOL_CALL_PARSER"] == "kimi_k3"
        reasoning, tool_call, rest = dynamo_parsers(argv[3:], env)
        assert (reasoning, tool_call, rest) == ("kimi_k3", "kimi_k3", argv[3:])
        assert parser_conflict(parse_args(rest).tool_call_parser, tool_call) is None
        assert parse_args(rest).disaggregation_mode == server["role"]
    with pytest.raises(SystemExit) as info:
        parse_args([*argv[3:], "--not-a-flag"])
    assert info.value.code == 2


def test_bundle_is_reproducible_and_has_no_bytecode(tmp_path: Path):
    first, second = tmp_path / "a.tar", tmp_path / "b.tar"
    changed, digest = bundle.write_bundle(first)
    assert changed is True
    assert bundle.write_bundle(first) == (False, digest)   # unchanged content: not rewritten
    bundle.write_bundle(second)
    assert first.read_bytes() == second.read_bytes()
    with tarfile.open(first) as tar:
        names = tar.getnames()
        assert "k31deploy/standin/server.py" in names and "k31deploy/data/flags.yaml" in names
        assert "k31deploy/recipe/resolver.py" not in names      # nodes get only what they run
        assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
        assert {m.mtime for m in tar.getmembers()} == {0}


def test_service_command_per_runtime():
    pd = resolve(MI_PD)
    router = pd["router"]["argv"]
    assert launch.service_command(router, "venv", unit="k31-router", image=None, venv="/opt/k31/router") == [
        "/opt/k31/router/bin/python3", *router[1:]]
    seed = resolve({"platform": "gb300", "topology": "pd", "router": "sglang", "speculative": "none"})["router"]
    seed_cmd = launch.service_command(seed["argv"], "venv", unit="k31-router", image=None, venv="/v")
    assert seed_cmd == ["/v/bin/sgl-router", *seed["argv"][1:]]
    master = ["mooncake_master", "--rpc_port=50051"]
    assert launch.service_command(master, "venv", unit="m", image=None, venv="/opt/mc") == [
        "/opt/mc/bin/mooncake_master", "--rpc_port=50051"]
    cmd = launch.service_command(router, "container", unit="k31-router", image="reg/k31:rocm10", venv="/v",
                                 container_cli="podman", env_file="/etc/k31/k31-router.env")
    assert cmd[:7] == ["podman", "run", "--rm", "--name", "k31-router", "--network=host", "--env-file"]
    assert cmd[cmd.index("reg/k31:rocm10") + 1:] == router
    with pytest.raises(K31Error, match="image is <K31_MI35X_IMAGE>"):
        launch.service_command(router, "container", unit="k31-router", image="<K31_MI35X_IMAGE>", venv="/v")
    with pytest.raises(K31Error, match="runtime vm is not valid; valid choices: container, venv"):
        launch.service_command(router, "vm", unit="k31-router", image=None, venv="/v")


DIGEST_A = "sha256:" + "a" * 64
DIGEST_B = "sha256:" + "b" * 64


def test_a_known_digest_pins_the_image_without_its_tag():
    assert launch.pinned_image("reg:5000/k31/serving:r1", DIGEST_A) == f"reg:5000/k31/serving@{DIGEST_A}"
    assert launch.pinned_image("reg:5000/k31/serving", DIGEST_A) == f"reg:5000/k31/serving@{DIGEST_A}"
    assert launch.pinned_image(f"reg:5000/k31/serving@{DIGEST_A}") == f"reg:5000/k31/serving@{DIGEST_A}"
    assert launch.pinned_image(f"reg/k31@{DIGEST_A}", DIGEST_A) == f"reg/k31@{DIGEST_A}"
    assert launch.pinned_image("reg:5000/k31/serving:r1") == "reg:5000/k31/serving:r1"
    assert launch.pinned_image("reg:5000/k31/serving:r1", "") == "reg:5000/k31/serving:r1"


def test_bad_or_conflicting_digests_are_refused_naming_the_setting():
    with pytest.raises(K31Error, match=r"k31_image_digest='sha256:xyz' is not valid; valid: sha256:"):
        launch.pinned_image("reg/k31:1", "sha256:xyz")
    with pytest.raises(K31Error, match=r"k31_image names digest .* but k31_image_digest is .*; set one of them"):
        launch.pinned_image(f"reg/k31@{DIGEST_A}", DIGEST_B)
    with pytest.raises(K31Error, match=r"k31_image='reg/k31@md5:1' is not valid"):
        launch.pinned_image("reg/k31@md5:1")


def test_units_run_the_pinned_image_not_the_plans_tag():
    plan = resolve(MI_PD)
    rank = rank0(plan, "decode")
    pinned = launch.pinned_image(plan["image"], DIGEST_A)
    cmd = launch.engine_command(plan, rank, "container", env_file="e", container_cli="podman", image=pinned)
    assert pinned in cmd and plan["image"] not in cmd
    assert cmd[cmd.index(pinned) + 1:] == rank["argv"]


def test_podman_drops_shm_size_under_host_ipc_and_keeps_every_other_rocm_flag():
    plan = resolve(MI_PD)
    flags = plan["container_flags"]
    assert "--ipc=host" in flags and "--shm-size" in flags
    cmd = launch.engine_command(plan, rank0(plan, "decode"), "container", env_file="e", container_cli="podman")
    assert "--shm-size" not in cmd and "16G" not in cmd
    kept = [f for i, f in enumerate(flags) if f != "--shm-size" and (i == 0 or flags[i - 1] != "--shm-size")]
    at = cmd.index(kept[0])
    assert cmd[at:at + len(kept)] == kept
    docker = launch.engine_command(plan, rank0(plan, "decode"), "container", env_file="e")
    assert docker[docker.index("--shm-size") + 1] == "16G"
    assert launch._container_flags(["--shm-size=8g", "--ipc=host"], "podman") == ["--ipc=host"]
    assert launch._container_flags(["--shm-size", "8g"], "podman") == ["--shm-size", "8g"]


GB_NVL72 = {"platform": "gb300", "topology": "unified", "max_running_requests": 32, "image": "reg/k31:cuda"}


def test_podman_reaches_nvidia_gpus_and_the_imex_channel_through_cdi_devices():
    plan = resolve(GB_NVL72)
    flags = plan["container_flags"]
    assert flags[:2] == ["--gpus", "all"] and "NVIDIA_IMEX_CHANNELS=0" in flags
    rank = rank0(plan, "unified")
    podman = launch.engine_command(plan, rank, "container", env_file="e", container_cli="podman")
    # podman 4 ignores --gpus: the GPUs and the IMEX channel are CDI devices; the variable stays as planned
    assert "--gpus" not in podman
    assert podman[podman.index("NVIDIA_IMEX_CHANNELS=0") - 1] == "--env"
    devices = [podman[i + 1] for i, flag in enumerate(podman) if flag == "--device"]
    assert devices == ["nvidia.com/gpu=all", "nvidia.com/imex-channel=0"]
    assert launch.cdi_devices(flags, "podman") == devices
    # docker's nvidia runtime takes --gpus and NVIDIA_IMEX_CHANNELS itself: the plan's flags unchanged
    docker = launch.engine_command(plan, rank, "container", env_file="e")
    assert docker[docker.index("--gpus"):docker.index("--gpus") + len(flags)] == flags
    assert launch.cdi_devices(flags, "docker") == []
    # several channels, one device each; ROCm's device paths are no CDI devices
    assert launch.cdi_devices(["-e", "NVIDIA_IMEX_CHANNELS=0,1"], "podman") == [
        "nvidia.com/imex-channel=0", "nvidia.com/imex-channel=1"]
    assert launch.cdi_devices(resolve(MI_PD)["container_flags"], "podman") == []
    # every kind the flags ask for has a way to write its spec
    assert {d.split("=")[0] for d in devices} <= set(launch.CDI_GENERATE)


def test_the_platform_family_comes_from_the_plan():
    assert resolve(MI_PD)["hardware"]["family"] == "rocm"
    assert resolve({"platform": "gb300", "topology": "pd", "agents": 64})["hardware"]["family"] == "cuda"
    assert resolve({"platform": "gb300", "topology": "pd", "agents": 64})["hardware"] == {
        "family": "cuda", "runtime": "CUDA", "form": "GB300 NVL72 tray", "gpus_per_node": 4, "nvl72": True}


def test_a_hosts_health_gate_targets_its_rank_0s_and_watches_every_rank():
    """The deploy's gate (k31_engine) and the redeploy's (rollout.gate_args) are the same arguments: rank 0's unit
    and /health on its cluster address as a target, the host's ranks watched; a host with no rank 0 has no gate."""
    plan = resolve({"platform": "gb300", "topology": "pd", "max_running_requests": 64})    # 2-node servers
    gate = {"timeout": 3600, "quick": 10, "interval": 5, "max_restarts": 3}
    server = plan["servers"][0]
    first, second = (launch.host_ranks(plan, r["host"]) for r in server["ranks"][:2])
    rank0 = server["ranks"][0]
    url = f"http://{rank0['address']}:{server['port']}/health"
    assert launch.host_gate(first, **gate) == [
        launch.ENGINE_GATE, "--timeout", "3600", "--quick", "10", "--interval", "5", "--max-restarts", "3",
        f"--target={rank0['unit']}={url}", f"--watch={rank0['unit']}"]
    assert launch.host_gate(second, **gate) == []
    step = rollout.server_step(server, "target")
    assert rollout.gate_args(step, [rank0["unit"]], **gate) == launch.host_gate(first, **gate)[1:]


def test_docker_daemon_json_keeps_the_sites_keys_and_adds_k31s():
    """k31_container_runtime's daemon.json: the site's keys stay, nested ones merge key by key, k31 sets the
    containers' ulimits and, on NVIDIA hosts, the nvidia runtime (the default only when asked)."""
    site = {"log-driver": "journald", "runtimes": {"crun": {"path": "/usr/bin/crun"}},
            "default-ulimits": {"core": {"Name": "core", "Soft": 0, "Hard": 0},
                                "nofile": {"Name": "nofile", "Soft": 1024, "Hard": 1024}}}
    want = launch.docker_daemon(site, nvidia=True, nvidia_default=False, memlock=-1, nofile=1048576)
    assert want["log-driver"] == "journald" and "default-runtime" not in want
    assert want["runtimes"] == {"crun": {"path": "/usr/bin/crun"},
                                "nvidia": {"path": "nvidia-container-runtime", "args": []}}
    assert want["default-ulimits"] == {"core": {"Name": "core", "Soft": 0, "Hard": 0},
                                       "nofile": {"Name": "nofile", "Soft": 1048576, "Hard": 1048576},
                                       "memlock": {"Name": "memlock", "Soft": -1, "Hard": -1}}
    assert site["default-ulimits"]["nofile"]["Soft"] == 1024    # the input is not changed
    assert launch.docker_daemon({}, True, True, -1, 1048576)["default-runtime"] == "nvidia"
    plain = launch.docker_daemon({}, nvidia=False, nvidia_default=True, memlock=-1, nofile=65536)
    assert set(plain) == {"default-ulimits"}    # no GPU: no nvidia runtime, default or not
    # a second converge finds what it wrote: nothing to change
    assert launch.docker_daemon(want, True, False, -1, 1048576) == want


def test_the_docker_daemon_filter_reads_ansibles_text_flags_and_numbers():
    import importlib.util
    path = Path(__file__).resolve().parents[2] / "filter_plugins/k31.py"
    spec = importlib.util.spec_from_file_location("k31_filter", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    daemon = module.FilterModule().filters()["k31_docker_daemon"]
    want = daemon(None, "True", "False", "-1", "1048576")    # set_fact may hand flags and numbers over as text
    assert want == launch.docker_daemon({}, True, False, -1, 1048576) and "default-runtime" not in want
