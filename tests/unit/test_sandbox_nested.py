"""Nested-container sandbox nodes: the runc wrapper's adjustments, stand-in device nodes, the serving image's
registry settings and the shape fields."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import resource
from pathlib import Path

import pytest

from k31deploy.errors import K31Error
from k31deploy.sandbox import DATA_DIR, cluster, serving
from k31deploy.sandbox.shapes import resolve_shape


def nested_script(name):
    """A Python script of data/sandbox/nested, loaded as a module."""
    path = DATA_DIR / "nested" / name
    module_name = name.replace("-", "_")
    loader = importlib.machinery.SourceFileLoader(module_name, str(path))
    spec = importlib.util.spec_from_loader(module_name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def wrapper():
    return nested_script("k31-sandbox-runc")


def test_the_runc_wrapper_adds_a_cgroup_namespace_and_lowers_only_limits_past_the_hard_limit():
    runc = wrapper()
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    config = {"linux": {"namespaces": [{"type": "pid"}]},
              "process": {"rlimits": [{"type": "RLIMIT_MEMLOCK", "hard": 2**64 - 1, "soft": 2**64 - 1},
                                      {"type": "RLIMIT_CORE", "hard": 0, "soft": 0}]}}
    notes = runc.adjust(config)
    assert {"type": "cgroup"} in config["linux"]["namespaces"] and "cgroup namespace added" in notes
    memlock = config["process"]["rlimits"][0]
    want = runc.UNLIMITED if hard == resource.RLIM_INFINITY else hard
    assert memlock["hard"] == memlock["soft"] == want
    assert config["process"]["rlimits"][1] == {"type": "RLIMIT_CORE", "hard": 0, "soft": 0}
    assert runc.adjust(config) == []            # a second pass changes nothing


def test_the_runc_wrapper_finds_the_bundle_only_for_create_and_run():
    runc = wrapper()
    assert runc.bundle(["--root", "/r", "create", "--bundle", "/b/ctr/userdata", "id"]) == "/b/ctr/userdata"
    assert runc.bundle(["create", "--bundle=/x", "id"]) == "/x"
    assert runc.bundle(["--root", "/r", "state", "id"]) is None


def test_stand_in_devices_are_null_devices_and_rocm_gpus_belong_to_render():
    script = cluster.devices_script(cluster.STANDIN_DEVICES["rocm"], "rocm")
    assert "groupadd --system render" in script
    assert "mknod -m 0660 /dev/kfd c 1 3" in script and "chgrp render /dev/kfd" in script
    assert "mknod -m 0666 /dev/infiniband/uverbs0 c 1 3" in script
    assert "chgrp render /dev/infiniband/uverbs0" not in script
    cuda = cluster.devices_script(cluster.STANDIN_DEVICES["cuda"], "cuda")
    assert "/dev/nvidia-caps-imex-channels/channel0" in cuda and "render" not in cuda


def test_the_container_shape_is_nested_with_its_registry_and_container_runtime():
    shape = resolve_shape("mi355x-1p1d-container", None)
    assert shape.nested and shape.registry == "router0"
    assert shape.role_vars["k31_engine_runtime"] == "container"
    assert cluster.platform_family(shape) == "rocm"
    plain = resolve_shape("mi355x-1p1d", None)
    assert not plain.nested and plain.registry is None


def test_a_registry_must_be_a_host_of_a_nested_shape(tmp_path):
    path = tmp_path / "shapes.yaml"
    path.write_text("s:\n  knobs: {platform: mi355x}\n  registry: nowhere\n  nested: true\n"
                    "  hosts: [{name: a, groups: [k31_unified]}]\n")
    with pytest.raises(K31Error, match=r"shape s: registry 'nowhere' must be one of its hosts \(a\)"):
        resolve_shape("s", None, path)


def test_a_pushed_image_is_run_by_digest_and_variants_are_named():
    pushed = serving.Pushed(tag="10.0.0.1:5000/k31/standin-serving:r2", digest="sha256:" + "c" * 64, local="x")
    assert pushed.ref == "10.0.0.1:5000/k31/standin-serving@sha256:" + "c" * 64
    assert serving.variant(2, True) == "r2-broken"
    with pytest.raises(K31Error, match="--revision must be 1 or more"):
        serving.variant(0, False)
    assert 'location = "10.0.0.1:5000"' in serving.registries_conf("10.0.0.1")
    assert "addr: 10.0.0.1:5000" in serving.registry_config("10.0.0.1")


def test_the_runc_wrapper_lowers_the_rlimits_of_exec_too():
    runc = wrapper()
    assert runc.process_file(["--root", "/r", "exec", "--process", "/tmp/p.json", "id"]) == "/tmp/p.json"
    assert runc.process_file(["create", "--bundle", "/b", "id"]) is None
    spec = {"rlimits": [{"type": "RLIMIT_MEMLOCK", "hard": 2**64 - 1, "soft": 2**64 - 1}]}
    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    assert bool(runc.lower_rlimits(spec)) == (hard != resource.RLIM_INFINITY)


def test_the_gb300_container_shape_loads_its_image_from_a_tarball(tmp_path):
    shape = resolve_shape("gb300-nvl72-container", None)
    assert shape.nested and shape.tarball and shape.registry is None
    assert shape.role_vars["k31_image_source"] == "tarball"
    assert cluster.platform_family(shape) == "cuda"
    assert {h.server for h in shape.hosts} == {"unified0"} and len(shape.hosts) == 2
    path = tmp_path / "shapes.yaml"
    path.write_text("s:\n  knobs: {platform: gb300}\n  tarball: true\n  hosts: [{name: a, groups: [k31_unified]}]\n")
    with pytest.raises(K31Error, match=r"shape s: tarball must be true or false, needs nested: true"):
        resolve_shape("s", None, path)


def test_the_fanout_container_shape_repeats_nested_tarball_nodes():
    shape = resolve_shape("fanout-container", 3)
    assert shape.nested and shape.tarball and shape.registry is None
    assert shape.role_vars["k31_image_source"] == "tarball"
    assert [h.name for h in shape.hosts] == ["unified0", "unified1", "unified2"]
    assert len(resolve_shape("fanout-container", None).hosts) == 4


def test_the_stand_in_nvidia_ctk_writes_and_lists_cdi_specs_of_the_kinds_k31_asks_for(tmp_path, monkeypatch, capsys):
    ctk = nested_script("nvidia-ctk")
    nodes = ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm",
             "/dev/nvidia-caps-imex-channels/channel0"]
    real_glob = ctk.glob.glob
    monkeypatch.setattr(ctk.glob, "glob", lambda pattern: [
        n for n in nodes if n.startswith(pattern.rstrip("*"))] if pattern.startswith("/dev/") else real_glob(pattern))
    monkeypatch.setattr(ctk.os.path, "exists", lambda p: p in nodes)
    monkeypatch.setattr(ctk, "SPEC_DIRS", (str(tmp_path),))
    from k31deploy import launch

    for kind, args in launch.CDI_GENERATE.items():
        out = str(tmp_path / args[-1].split("/")[-1])
        assert ctk.main([*args[:-1], f"--output={out}"]) == 0
        assert ctk.json.loads(Path(out).read_text())["kind"] == kind
    capsys.readouterr()
    assert ctk.main(["cdi", "list"]) == 0
    assert capsys.readouterr().out.split() == [
        "nvidia.com/imex-channel=0", "nvidia.com/gpu=0", "nvidia.com/gpu=1", "nvidia.com/gpu=all"]
    assert ctk.main(["cdi", "generate", "--mode=wsl", "--output=x"]) == 2
