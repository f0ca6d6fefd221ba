"""The validation layer (k31deploy.recipe.validate): every string and number that reaches a host is checked
against an allow-list for its kind; control characters are refused everywhere; numbers are finite and in
range; nothing a user can type gives a traceback."""

from __future__ import annotations

import contextlib
import json
import math

import pytest

from k31deploy.errors import K31Error
from k31deploy.recipe import knob_specs, parse_sets, resolve
from k31deploy.recipe.validate import CONTROL, FORMATS

PD = {"platform": "mi355x", "agents": 92}
CONTROLS = ["\n", "\r", "\x00", "\x1b", "\t", "\x7f", "\x85", "\u2028"]


def refused(match: str, knobs: dict, hosts=None) -> str:
    with pytest.raises(K31Error, match=match) as info:
        resolve(knobs, hosts)
    message = str(info.value)
    assert "\n" not in message and not CONTROL.search(message), message
    return message


def test_every_string_knob_has_a_format_with_an_allow_list():
    for name, spec in knob_specs().items():
        if spec["type"] == "str":
            assert spec.get("format") in FORMATS, name


@pytest.mark.parametrize("knob,value", [
    ("image", "reg/k31:rocm10"), ("image", "registry.example.com:5000/team/k31-serving:2026.11-rocm10"),
    ("image", "localhost/k31:dev"), ("image", "k31"), ("image", f"reg/k31@sha256:{'a' * 64}"),
    ("image", f"reg/k31:v1@sha256:{'0' * 64}"), ("image", "[fd00::1]:5000/k31:v1"), ("image", "<K31_MI35X_IMAGE>"),
    ("model_path", "/models/Kimi-K3.1-Pro"), ("model_path", "/models/Kimi-K3.1-Pro/"), ("model_path", "org/name"),
    ("model_path", "moonshotai/Kimi-K3.1-Pro"), ("draft_model_path", "/nvme/k31/draft@v2"),
    ("draft_model_path", "z-lab/Kimi-K3.1-Dflash2-Preview"),
    ("disaggregation_ib_device", "mlx5_0"), ("disaggregation_ib_device", "mlx5_0,mlx5_1,bnxt_re0"),
    ("disaggregation_ib_device", '{"0": "mlx5_0,mlx5_1", "1": "mlx5_2"}'),
    ("disaggregation_ib_device", "/etc/k31/ib-map.json"),
])
def test_valid_strings_pass_unchanged(knob, value):
    plan = resolve({**PD, knob: value})
    assert plan["knobs"][knob] == value


def test_a_yaml_mapping_for_the_ib_device_map_becomes_its_json():
    plan = resolve({**PD, "disaggregation_ib_device": {0: "mlx5_0", "1": "mlx5_1"}})
    argv = plan["servers"][0]["ranks"][0]["argv"]
    assert json.loads(argv[argv.index("--disaggregation-ib-device") + 1]) == {"0": "mlx5_0", "1": "mlx5_1"}


@pytest.mark.parametrize("knob,value,valid", [
    ("image", "Reg/K31", "OCI image reference"), ("image", "reg/k31 latest", "OCI image reference"),
    ("image", "reg/k31:$(id)", "OCI image reference"), ("image", "reg/k31@sha256:abc", "64 hex digits"),
    ("image", "reg/k31;rm -rf /", "OCI image reference"), ("image", "<OTHER>", "placeholder <K31_IMAGE>"),
    ("image", "--privileged", "OCI image reference"), ("image", "", "OCI image reference"),
    ("model_path", "./models/k31", "Hugging Face id"), ("model_path", "/models/../etc", "no . or .. components"),
    ("model_path", "/models/k31:/etc", "no spaces, ':' or ','"), ("model_path", "/models/my model", "absolute path"),
    ("model_path", "models/k31/x", "Hugging Face id"), ("model_path", "org/--bad", "Hugging Face id"),
    ("model_path", "~/k31", "Hugging Face id"), ("model_path", "/", "absolute path"),
    ("draft_model_path", "/d'x", "absolute path"), ("draft_model_path", "$HOME/d", "absolute path"),
    ("disaggregation_ib_device", "mlx5_0 mlx5_1", "comma list"), ("disaggregation_ib_device", "mlx5_0,", "comma"),
    ("disaggregation_ib_device", '{"a": "mlx5_0"}', "per-GPU JSON map"),
    ("disaggregation_ib_device", '{"0": ["mlx5_0"]}', "per-GPU JSON map"),
    ("disaggregation_ib_device", "{}", "per-GPU JSON map"), ("disaggregation_ib_device", "{bad json", "JSON map"),
    ("disaggregation_ib_device", "map.json", "absolute path"), ("disaggregation_ib_device", "$(reboot)", "RDMA"),
])
def test_strings_outside_their_allow_list_are_refused(knob, value, valid):
    message = refused(rf"^{knob}=.* \(settings\) is not valid; valid: ", {**PD, knob: value})
    assert valid in message


def test_pp_layer_partition_grammar_then_the_recipe_rule():
    gb300_pp = {"platform": "gb300", "topology": "pd", "prefill_strategy": "high-throughput",
                "max_running_requests": 8}
    refused(r"pp_layer_partition=24;24 .*comma-separated layer counts", {**gb300_pp, "pp_layer_partition": "24;24"})
    refused(r"pp_layer_partition=24,24 must be 4 positive layer counts", {**gb300_pp, "pp_layer_partition": "24,24"})
    assert resolve({**gb300_pp, "pp_layer_partition": "23,24,24,22"})["knobs"]["pp_layer_partition"] == "23,24,24,22"


@pytest.mark.parametrize("char", CONTROLS)
@pytest.mark.parametrize("knob", sorted(knob_specs()))
def test_control_characters_are_refused_in_every_knob(knob, char):
    """Through --set and the inventory alike; the message shows the character escaped, on one line."""
    for value in (f"x{char}LD_PRELOAD=/tmp/x.so", f"8{char}"):
        with pytest.raises(K31Error) as info:
            parse_sets([f"{knob}={value}"])
        message = str(info.value)
        assert message.startswith(f"{knob}=") and "contains the control character" in message, message
        assert "\n" not in message and not CONTROL.search(message)
        refused(rf"^{knob}=.*\(settings\) is not valid: it contains the control character", {**PD, knob: value})


def test_control_characters_in_knob_names_stay_escaped():
    with pytest.raises(K31Error, match=r"unknown knob 'image\\nX' \(--set\)") as info:
        parse_sets(["image\nX=1"])
    assert "\n" not in str(info.value)


FLOAT_KNOBS = sorted(k for k, s in knob_specs().items() if s["type"] == "float")
INT_KNOBS = sorted(k for k, s in knob_specs().items() if s["type"] == "int")


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "NaN", "1e400", math.inf, -math.inf, math.nan, 10**400])
@pytest.mark.parametrize("knob", FLOAT_KNOBS)
def test_float_knobs_must_be_finite(knob, value):
    """hicache_ratio=inf used to be emitted; mamba_full_memory_ratio=inf was a traceback."""
    refused(rf"^{knob}=.* is not valid; expected a finite number", {**PD, knob: value})


@pytest.mark.parametrize("value,match", [
    ("inf", "expected a whole number"), (math.inf, "expected a whole number"), (math.nan, "expected a whole number"),
    ("1e400", "expected a whole number"), ("2.5", "expected a whole number"), (2.5, "expected a whole number"),
    (2**31, "out of range; it must be .*<= (2147483647|65535)$"), ("99999999999999999999999", "out of range"),
    (-(2**40), "out of range"), ("9" * 5000, "expected a whole number"),
])
@pytest.mark.parametrize("knob", INT_KNOBS)
def test_int_knobs_are_whole_numbers_in_range(knob, value, match):
    refused(rf"^{knob}=.*{match}", {**PD, knob: value})


def test_ranges_from_knobs_yaml():
    refused(r"dist_init_port=70000 \(settings\) is out of range; it must be >= 1 and <= 65535",
            {"platform": "gb300", "dist_init_port": 70000, "max_running_requests": 8})
    refused(r"hicache_ratio=1.0 .*must be > 1.0", {**PD, "hicache_ratio": 1.0})
    refused(r"mem_fraction_static=0.0 .*must be > 0 and <= 1.0", {**PD, "mem_fraction_static": "0"})


ODD = ["", " ", "inf", "-inf", "nan", "1e400", "-1", "0", "1", "2", "65536", "0x10", "1_000", " 8 ", "3.5", "-0.0",
       "true", "no", "none", "null", "ü", "a" * 5000, "9" * 5000, "${PATH}", "$(id)", "`id`", "'", '"', "\\", "%s",
       "{}", "[]", '{"0": "mlx5_0"}', "/", "//", "../..", "<K31_IMAGE>", "-", "--tp-size",
       math.inf, -math.inf, math.nan, 10**400, -(10**40), 2**31, 0.5, 1e308, -1, 0, 1, True, False,
       [], [1], {}, {"a": 1}, (1,), b"bytes", object()]
BASES = [PD, {"platform": "mi355x", "agents": 16}, {"platform": "gb300", "topology": "pd", "max_running_requests": 8},
         {"platform": "b300", "kv_offload": "mooncake", "max_running_requests": 8}, {"platform": "tpu7x"}]


@pytest.mark.parametrize("knob", sorted(knob_specs()))
def test_odd_values_for_every_knob_are_refused_or_planned_never_a_traceback(knob):
    for base in BASES:
        for value in ODD:
            try:
                plan = resolve({**base, knob: value})
            except K31Error as exc:
                assert "\n" not in str(exc) and not CONTROL.search(str(exc)), (knob, value, str(exc))
                continue
            text = json.dumps(plan, allow_nan=False)    # a plan never carries inf/nan
            assert not CONTROL.search(text.encode().decode("unicode_escape")), (knob, value)
        for value in ODD:
            if isinstance(value, str):
                with contextlib.suppress(K31Error):
                    parse_sets([f"{knob}={value}"])
