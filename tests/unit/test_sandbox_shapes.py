"""Sandbox shapes: data in shapes.yaml, resolved without podman."""

from pathlib import Path

import pytest
import yaml

from k31deploy.errors import K31Error
from k31deploy.sandbox.shapes import DEFAULT_SHAPE, GROUPS, load_shapes, resolve_shape

KNOBS_FILE = Path(__file__).resolve().parents[2] / "k31deploy" / "data" / "knobs.yaml"


def _groups(shape):
    return {group: [h.name for h in shape.hosts if group in h.groups] for group in GROUPS}


def test_mi355x_1p1d_has_prefill_decode_and_router_nodes():
    shape = resolve_shape("mi355x-1p1d", None)
    assert [h.name for h in shape.hosts] == ["prefill0", "decode0", "router0"]
    groups = _groups(shape)
    assert groups["k31_prefill"] == ["prefill0"]
    assert groups["k31_decode"] == ["decode0"]
    assert groups["k31_router"] == ["router0"]
    assert groups["k31_unified"] == []
    assert shape.knobs == {"platform": "mi355x", "agents": 92}
    assert all(h.server is None for h in shape.hosts)


def test_default_shape_is_mi355x_1p1d():
    assert resolve_shape(None, None).name == DEFAULT_SHAPE == "mi355x-1p1d"


def test_mi355x_single_is_one_unified_node_for_16_agents():
    shape = resolve_shape("mi355x-single", None)
    assert [(h.name, h.groups) for h in shape.hosts] == [("unified0", ("k31_unified",))]
    assert shape.knobs == {"platform": "mi355x", "topology": "unified", "agents": 16}


def test_gb300_pd_has_two_two_tray_servers_and_a_dynamo_frontend():
    shape = resolve_shape("gb300-pd", None)
    servers = {h.name: h.server for h in shape.hosts}
    assert servers == {
        "prefill0-t0": "prefill0",
        "prefill0-t1": "prefill0",
        "decode0-t0": "decode0",
        "decode0-t1": "decode0",
        "router0": None,
    }
    assert _groups(shape)["k31_router"] == ["router0"]
    assert shape.knobs == {
        "platform": "gb300",
        "topology": "pd",
        "router": "dynamo",
        "prefill_strategy": "low-latency",
        "decode_strategy": "balanced",
        "speculative": "dflash",
        "max_running_requests": 64,
    }


@pytest.mark.parametrize("nodes", [2, 8, 16])
def test_nodes_alone_means_fanout_of_unified_hosts(nodes):
    shape = resolve_shape(None, nodes)
    assert shape.name == "fanout"
    assert [h.name for h in shape.hosts] == [f"unified{i}" for i in range(nodes)]
    assert all(h.groups == ("k31_unified",) for h in shape.hosts)
    assert shape.knobs == {"platform": "mi355x", "agents": 16}


def test_fanout_without_nodes_uses_its_default_count():
    assert len(resolve_shape("fanout", None).hosts) == 2


@pytest.mark.parametrize(
    ("shape", "nodes", "message"),
    [
        ("nope", None, "choose one of mi355x-1p1d, .*mi355x-single, gb300-pd, .*fanout"),
        ("gb300-pd", 4, "--nodes applies only to fanout"),
        ("fanout", 0, "--nodes must be between 1 and 64"),
        (None, 65, "--nodes must be between 1 and 64"),
    ],
)
def test_bad_choices_name_the_setting_and_the_valid_choices(shape, nodes, message):
    with pytest.raises(K31Error, match=message.replace("-", r"\-")):
        resolve_shape(shape, nodes)


@pytest.mark.parametrize(
    ("hosts", "message"),
    [
        ([{"name": "a", "groups": ["k31_gpu"]}], "must be among k31_unified"),
        ([{"name": "a", "groups": []}], "must be among"),
        ([{"name": "A_b", "groups": ["k31_unified"]}], "lowercase letters"),
        ([{"name": "a", "groups": ["k31_unified"]}] * 2, "lists a host name twice"),
        ([], "has no hosts"),
    ],
)
def test_malformed_shapes_file_is_refused(tmp_path, hosts, message):
    path = tmp_path / "shapes.yaml"
    path.write_text(yaml.safe_dump({"broken": {"knobs": {"platform": "mi355x"}, "hosts": hosts}}))
    with pytest.raises(K31Error, match=message):
        resolve_shape("broken", None, path)


def test_every_shape_knob_is_a_recipe_knob_with_a_valid_value():
    """Shapes become inventory vars `k31_<knob>`; an unknown knob or value would fail resolution."""
    knobs = yaml.safe_load(KNOBS_FILE.read_text())
    for name, spec in load_shapes().items():
        for knob, value in (spec.get("knobs") or {}).items():
            assert knob in knobs, f"shape {name}: {knob} is not a recipe knob"
            if "choices" in knobs[knob]:
                assert value in knobs[knob]["choices"], f"shape {name}: {knob}={value}"
