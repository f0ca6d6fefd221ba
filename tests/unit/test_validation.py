"""The validation layer (k31deploy.validate): every string and number that reaches a host is checked
against an allow-list for its kind; control characters are refused everywhere; numbers are finite and in
range; nothing a user can type gives a traceback."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import yaml
from ansible.errors import AnsibleFilterError

from k31deploy.cli import main
from k31deploy.errors import K31Error
from k31deploy.recipe import Host, from_mapping, knob_specs, parse_sets, resolve
from k31deploy.recipe.hosts import INTERNAL_ROLES, PLAYBOOK_VARS, role_variables
from k31deploy.validate import CONTROL, FORMATS

ROOT = Path(__file__).resolve().parents[2]

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


# -- hosts: names, addresses, server names -----------------------------------------------------------

def inv(*specs: tuple[str, str, dict]) -> list[Host]:
    return [from_mapping(name, [group], dict(vars_)) for name, group, vars_ in specs]


def pd_hosts(**overrides: dict) -> list[Host]:
    specs = {"p0": ("k31_prefill", {"ansible_host": "10.0.0.1"}), "d0": ("k31_decode", {"ansible_host": "10.0.0.2"}),
             "r0": ("k31_router", {"ansible_host": "10.0.0.9"})}
    return inv(*((name, group, {**vars_, **overrides.get(name, {})}) for name, (group, vars_) in specs.items()))


@pytest.mark.parametrize("value", ["10.0.0.1", "fd00::1", "node-1.cluster.internal", "gpu_node_1", "NODE1",
                                   "::ffff:10.0.0.1", "node0.cluster."])
def test_valid_addresses(value):
    plan = resolve(PD, pd_hosts(d0={"ansible_host": value}))
    assert plan["servers"][1]["ranks"][0]["address"] == value


@pytest.mark.parametrize("value,match", [
    ("10.0.0.2\nLD_PRELOAD=/tmp/evil.so", r"ansible_host=10.0.0.2\\nLD_PRELOAD=/tmp/evil.so \(host d0\) is not "
                                          r"valid: it contains the control character \\n"),
    ("[fd00::1]", r"ansible_host=\[fd00::1\] \(host d0\) is not a valid host address \(write it without brackets\)"),
    ("10.0.0.256", "not a valid host address"), ("10.0.1", "not a valid host address"),
    ("fe80::1%eth0", "not a valid host address"), ("node 1", "not a valid host address"),
    ("-oProxyCommand=x", "not a valid host address"), ("node1;reboot", "not a valid host address"),
    ("a" * 64 + ".example", "not a valid host address"),
    ("http://node1", "not a valid host address"),
])
def test_bad_addresses_are_refused(value, match):
    refused(match, PD, pd_hosts(d0={"ansible_host": value}))


def test_a_host_name_is_its_address_without_ansible_host():
    refused(r"host d:0=d:0 \(its name: no ansible_host is set\) is not a valid host address",
            PD, inv(("p0", "k31_prefill", {}), ("d:0", "k31_decode", {"k31_server": "d0"}), ("r0", "k31_router", {})))


@pytest.mark.parametrize("name", ["node 1", "node\n1", "-node", "node/1", "nöde", ""])
def test_bad_inventory_host_names_are_refused(name):
    hosts = inv(("p0", "k31_prefill", {}), (name, "k31_decode", {"ansible_host": "10.0.0.2"}), ("r0", "k31_router", {}))
    refused(r"inventory host name '.*' is not valid; valid: 1-253 letters", PD, hosts)


@pytest.mark.parametrize("server", ["d 0", "d0\nExecStartPre=/bin/sh", "../d0", "d/0", "-d0", "a" * 64, "d0;x"])
def test_bad_server_names_are_refused(server):
    refused(r"server name '.*' of host d0 \(k31_server, or the host name when unset\) is not valid: it names systemd "
            r"units", PD, pd_hosts(d0={"k31_server": server}))


def test_a_host_named_by_an_ipv6_address_needs_a_server_name():
    hosts = inv(("p0", "k31_prefill", {}), ("fd00::2", "k31_decode", {}), ("r0", "k31_router", {}))
    refused(r"server name 'fd00::2' of host fd00::2 .* is not valid", PD, hosts)
    hosts[1].vars["k31_server"] = "d0"
    assert resolve(PD, hosts)["servers"][1]["ranks"][0]["address"] == "fd00::2"


@pytest.mark.parametrize("server", ["decode", "prefill", "unified", "router"])
def test_server_names_may_not_be_redeploy_role_targets(server):
    refused(rf"server name '{server}' of host d0 .* is also a target name of k31 redeploy", PD,
            pd_hosts(d0={"k31_server": server}))


def test_one_server_name_on_two_roles_is_refused():
    """The redeploy order would break: one name, two servers, one unit name."""
    refused(r"k31_server=s0 names a prefill server \(p0\) and a decode server \(d0\); server names must be unique "
            r"across roles", PD, pd_hosts(p0={"k31_server": "s0"}, d0={"k31_server": "s0"}))


@pytest.mark.parametrize("ranks", [(0.5, 1), (True, 0), ("a", 0), (0, [1])])
def test_node_ranks_are_whole_numbers(ranks):
    hosts = inv(*((f"t{i}", "k31_unified", {"k31_server": "u0", "k31_node_rank": r}) for i, r in enumerate(ranks)),
                ("fe", "k31_router", {}))
    refused(r"k31_node_rank of server u0 must", {"platform": "gb300", "max_running_requests": 8}, hosts)


# -- role variables against roles/*/meta/argument_specs.yml ------------------------------------------

def test_a_typo_of_a_role_variable_is_refused_like_a_typo_of_a_knob():
    message = refused(r"unknown inventory variable 'k31_router_api_kye' on host r0; did you mean k31_router_api_key",
                      PD, pd_hosts(r0={"k31_router_api_kye": "s3cr3t-value"}))
    assert "k31_router's variables are k31_router_api_key, " in message and "s3cr3t-value" not in message
    refused(r"unknown inventory variable 'k31_enigne_runtime' on host d0; did you mean k31_engine_runtime\?",
            PD, pd_hosts(d0={"k31_enigne_runtime": "standin"}))
    refused(r"unknown inventory variable 'k31_status_anything' on host d0; recipe knobs are k31_<knob>",
            PD, pd_hosts(d0={"k31_status_anything": 1}))
    # an internal role's variables are set by the roles that include it, never by an inventory
    refused(r"unknown inventory variable 'k31_unit_name' on host d0; recipe knobs are k31_<knob>",
            PD, pd_hosts(d0={"k31_unit_name": "k31-x"}))


def test_role_variable_values_are_checked_against_their_choices():
    refused(r"k31_engine_runtime=containr \(host d0\) is not valid; valid choices: container, venv, standin "
            r"\(roles/k31_engine/meta/argument_specs.yml\)", PD, pd_hosts(d0={"k31_engine_runtime": "containr"}))
    refused(r"k31_model_source=s3 \(host d0\) is not valid; valid choices: '', path, rsync, hub",
            PD, pd_hosts(d0={"k31_model_source": "s3"}))
    ok = {"k31_engine_runtime": "standin", "k31_model_source": "", "k31_router_api_key": "x",
          "k31_engine_container_cli": "{{ cli }}", "k31_reboot_ok": True, "k31_teardown_purge": False}
    assert resolve(PD, pd_hosts(d0=ok))["servers"][1]["ranks"][0]["host"] == "d0"


@pytest.mark.parametrize("var,value,valid", [
    # strings a root-run shell task, unit or script holds unquoted (runtime_venv.yml's pip, ExecStart's script)
    ("k31_engine_venv", "/opt/k31/venv$(reboot)", "a path of letters"),
    ("k31_engine_sglang_src", "/src;reboot", "a path of letters"),
    ("k31_engine_etc_dir", "/bin/sh -c id>/tmp/pwned #", "a path of letters"),
    ("k31_wheelhouse_venv", '/opt/"$(reboot)"', "a path of letters"),
    ("k31_redeploy_follow_python", "/usr/bin/python3 -c x", "a path of letters"),
    # types Ansible would refuse only once the role starts, after the roles before it changed hosts
    ("k31_engine_health_timeout", "soon", "a whole number, 0 or more"),
    ("k31_engine_stop_timeout", -60, "a whole number, 0 or more"),
    ("k31_engine_health_timeout", True, "a whole number, 0 or more"),
    ("k31_firewall_ssh_port", 1000000000000, "a whole number"),
    ("k31_firewall_ssh_port", 0, "a port, 1 to 65535"),
    ("k31_container_runtime_memlock", -2, "a whole number, 0 or more, or -1 for unlimited"),
    ("k31_reboot_ok", "maybe", "true or false"),
    ("k31_engine_extra_env", "notadict", "a mapping"),
    ("k31_preflight_model_gb", "1e400", "a finite number, 0 or more"),
    ("k31_firewall_ssh_sources", ["0.0.0.0/0; id"], "a list of IP networks"),
    ("k31_firewall_ssh_sources", "10.0.0.0/8 x", "a list of IP networks"),
    ("k31_rdma_fabric_cidrs", ["fd00::/64", "eth0"], "a list of IP networks"),
    ("k31_engine_host_env_files", ["../../etc/shadow"], "a list of names"),
    ("k31_stamp_paths", ["/etc/k31", "/etc/$(id)"], "a list of paths"),
])
def test_role_variable_values_are_checked_against_their_types_before_any_host(var, value, valid):
    message = refused(rf"^{re.escape(var)}=.* \(host d0\) is not valid; valid: {re.escape(valid)}",
                      PD, pd_hosts(d0={var: value}))
    assert message.endswith(("/meta/argument_specs.yml)", "(playbooks/prepare.yml)"))


@pytest.mark.parametrize("rule", [
    {"ports": "9100\n}\ntable inet evil {", "sources": ["10.0.0.0/8"]},    # a statement of its own in nftables
    {"ports": "9100", "proto": "tcp; drop"},
    {"ports": "9100", "sources": ["10.0.0.0/8 accept"]},
    {"ports": "9100", "comment": "x\ny"},
    {"ports": "9100", "prot": "udp"},
    "9100",
])
def test_a_site_firewall_rule_nftables_would_not_take_as_written_is_refused(rule):
    refused(r"^k31_firewall_extra=.* \(host d0\) is not valid; valid: a list of \{ports: ",
            PD, pd_hosts(d0={"k31_firewall_extra": [rule]}))


@pytest.mark.parametrize("var,value", [("k31_cluster_address", "0.0.0.0"), ("k31_cluster_address", "::"),
                                       ("ansible_host", "0.0.0.0"), ("k31_cluster_address", "239.1.1.1")])
def test_a_wildcard_or_multicast_bind_address_is_refused(var, value):
    refused(rf"^{var}={re.escape(value)} \(host d0\) is not valid: internal services bind the host's cluster "
            r"address, .*valid: the host's own IP or name$", PD, pd_hosts(d0={var: value}))


def test_role_variable_values_of_the_right_type_pass_as_ini_and_yaml_give_them():
    ok = {"k31_engine_health_timeout": "600", "k31_engine_stop_timeout": 0, "k31_container_runtime_memlock": -1,
          "k31_firewall_ssh_port": "2222", "k31_reboot_ok": "yes", "k31_engine_venv": "/opt/k31/venv-2",
          "k31_engine_wheelhouse": ".k31/wheelhouse", "k31_engine_sglang_src": "", "k31_preflight_model_gb": "1500.5",
          "k31_firewall_ssh_sources": ["10.0.0.0/8", "fd00::/64", "192.0.2.7"], "k31_rdma_fabric_cidrs": "10.1.0.0/16",
          "k31_engine_host_env_files": ["rdma", "model"], "k31_engine_extra_env": {"NCCL_SOCKET_IFNAME": "eth0"},
          "k31_engine_etc_dir": "{{ site_etc }}",
          "k31_firewall_extra": [{"ports": "9100-9102,443", "proto": "udp", "sources": ["10.0.0.0/8"], "comment": "x"},
                                 {"ports": "8443"}]}
    assert resolve(PD, pd_hosts(d0=ok))["servers"]


def test_an_extra_env_value_the_container_runtime_cannot_read_is_refused_where_it_runs():
    value = {"A": 'x"y\\z'}
    refused(r"^k31_engine_extra_env \(host d0\) is not valid: the value of A .*docker/podman --env-file",
            PD, pd_hosts(d0={"k31_engine_extra_env": value}))
    assert resolve(PD, pd_hosts(d0={"k31_engine_extra_env": value, "k31_engine_runtime": "venv"}))["servers"]
    refused(r"^k31_engine_extra_env \(host d0\) is not valid: the value of A is a list",
            PD, pd_hosts(d0={"k31_engine_extra_env": {"A": [1]}}))


def test_every_role_variable_the_specs_declare_is_known_and_playbook_variables_are_real():
    names = role_variables()
    for path in ROOT.glob("roles/*/defaults/main.yml"):
        known = names
        if path.parts[-3] in INTERNAL_ROLES:    # no inventory sets them: checked against the role's own specs
            specs = yaml.safe_load((path.parents[1] / "meta/argument_specs.yml").read_text())["argument_specs"]
            known = {name for entry in specs.values() for name in entry.get("options") or {}}
        for var in yaml.safe_load(path.read_text()) or {}:
            assert var in known, (path, var)
    for var, spec in PLAYBOOK_VARS.items():
        assert var in (ROOT / spec["source"]).read_text(), (var, spec)
    knobs = {f"k31_{k}" for k in knob_specs()}
    for path in [ROOT / "deploy.yml", *ROOT.glob("playbooks/*.yml")]:
        for var in re.findall(r"\b(k31_\w+) *\| *default\(", path.read_text()):
            assert var in names or var in PLAYBOOK_VARS or var in knobs, (path.name, var)


# -- the CLI and the Ansible filter refuse the same way ------------------------------------------------

def test_cli_refuses_a_newline_in_an_inventory_address_with_one_line(tmp_path, capsys):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {
        "vars": {"k31_platform": "mi355x", "k31_agents": 92},
        "children": {"k31_prefill": {"hosts": {"p0": {"ansible_host": "10.0.0.1\nLD_PRELOAD=/tmp/x.so"}}},
                     "k31_decode": {"hosts": {"d0": {}}}, "k31_router": {"hosts": {"r0": {}}}}}}))
    for extra in ([], ["--deploy"], ["--json"]):
        assert main(["plan", "-i", str(inventory), *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        assert err.startswith(r"error: ansible_host=10.0.0.1\nLD_PRELOAD=/tmp/x.so (host p0) is not valid")


def test_cli_templates_inventory_values_as_a_playbook_would(tmp_path, capsys):
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {
        "vars": {"k31_platform": "mi355x", "k31_agents": 92, "base": "/models", "k31_model_path": "{{ base }}/k31"},
        "children": {"k31_prefill": {"hosts": {"p0": {"ansible_host": "10.0.0.{{ 1 + 1 }}"}}},
                     "k31_decode": {"hosts": {"d0": {}}}, "k31_router": {"hosts": {"r0": {}}}}}}))
    assert main(["plan", "-i", str(inventory), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["knobs"]["model_path"] == "/models/k31" and plan["servers"][0]["ranks"][0]["address"] == "10.0.0.2"


def filter_k31_plan():
    """The validate play's k31_plan filter, loaded as Ansible loads filter_plugins/k31.py."""
    spec = importlib.util.spec_from_file_location("k31_filter", ROOT / "filter_plugins/k31.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.FilterModule().filters()["k31_plan"]


def test_the_filter_refuses_what_the_cli_refuses():
    k31_plan = filter_k31_plan()
    groups = {"all": ["p0", "d0", "r0"], "k31_prefill": ["p0"], "k31_decode": ["d0"], "k31_router": ["r0"]}
    base = {"k31_platform": "mi355x", "k31_agents": 92}
    cases = [({"d0": {"ansible_host": "10.0.0.2\nX=1"}}, {}, r"ansible_host=10.0.0.2\nX=1 (host d0)"),
             ({"r0": {"k31_router_api_kye": "k"}}, {}, "unknown inventory variable 'k31_router_api_kye'"),
             ({"d0": {"k31_model_path": "/m\nX=1"}}, {}, r"model_path=/m\nX=1 (inventory)"),
             ({}, {"model_path": "/m\nX=1"}, r"model_path=/m\nX=1 (settings)"),
             ({}, {"hicache_ratio": "inf"}, "hicache_ratio='inf' (settings) is not valid"),
             ({"p0": {"k31_server": "s"}, "d0": {"k31_server": "s"}}, {}, "k31_server=s names a prefill server")]
    for extra, settings, sentence in cases:
        hostvars = {h: {**base, **extra.get(h, {})} for h in groups["all"]}
        error = k31_plan(groups, hostvars, settings, on_error="return")["error"]
        assert error.startswith(sentence) and "\n" not in error, error
        with pytest.raises(AnsibleFilterError, match=r"^error: "):
            k31_plan(groups, hostvars, settings)


def test_the_filter_refuses_a_mistyped_k31_group_as_the_cli_does():
    k31_plan = filter_k31_plan()
    groups = {"all": ["p0", "d0", "r0"], "k31_prefil": ["p0"], "k31_decode": ["d0"], "k31_router": ["r0"]}
    hostvars = {h: {"k31_platform": "mi355x", "k31_agents": 92} for h in groups["all"]}
    error = k31_plan(groups, hostvars, {}, on_error="return")["error"]
    assert error.startswith("group k31_prefil of the inventory is not a k31 group, so its hosts (p0) would be left "
                            "out; did you mean k31_prefill?"), error


def test_role_variable_strings_carry_no_control_characters_and_secrets_are_not_echoed():
    refused(r"^k31_engine_etc_dir=/etc/k31\\n \(host d0\) is not valid: it contains the control character \\n",
            PD, pd_hosts(d0={"k31_engine_etc_dir": "/etc/k31\n"}))
    message = refused(r"^k31_router_api_key=\(value not shown: a secret\) \(host r0\) is not valid: .*printf",
                      PD, pd_hosts(r0={"k31_router_api_key": "s3cret\n"}))
    assert "s3cret" not in message
    refused(r"^k31_rdma_host_ip=eth0 \(host d0\) is not valid; valid: an IPv4 or IPv6 address",
            PD, pd_hosts(d0={"k31_rdma_host_ip": "eth0"}))
    assert resolve(PD, pd_hosts(d0={"k31_rdma_host_ip": "fd00::2", "k31_mnnvl_address": ""}))["servers"]


@pytest.mark.parametrize("var", ["ansible_host", "k31_server", "k31_node_rank", "k31_engine_runtime",
                                 "k31_router_api_key", "k31_rdma_host_ip", "k31_engine_extra_env"])
def test_odd_host_variables_are_refused_or_planned_never_a_traceback(var):
    for value in ODD:
        try:
            resolve(PD, pd_hosts(d0={var: value}))
        except K31Error as exc:
            assert "\n" not in str(exc) and not CONTROL.search(str(exc)), (var, value, str(exc))
    for name in ODD:
        try:
            resolve(PD, [from_mapping(name, ["k31_decode"], {"ansible_host": "10.0.0.2"}) if isinstance(name, str)
                         else from_mapping(str(name), ["k31_decode"], {}), *pd_hosts()[::2]])
        except K31Error as exc:
            assert "\n" not in str(exc), (name, str(exc))


def test_extra_env_entries_are_checked_before_any_host():
    refused(r"^k31_engine_extra_env \(host d0\) is not valid: the value of NCCL_DEBUG contains the control character",
            PD, pd_hosts(d0={"k31_engine_extra_env": {"NCCL_DEBUG": "INFO\nLD_PRELOAD=/x.so"}}))
    refused(r"^k31_rdma_extra_env \(host d0\) is not valid: env file variable name 'A B' is not valid",
            PD, pd_hosts(d0={"k31_rdma_extra_env": {"A B": "1"}}))
    assert resolve(PD, pd_hosts(d0={"k31_engine_extra_env": {"NCCL_DEBUG": "INFO"}}))["servers"]


def test_odd_knob_names_from_a_settings_mapping_are_refused():
    for name in (1, None, "", " ", "a\x00", ("t",)):
        with pytest.raises(K31Error, match=r"^unknown knob '.*' \(settings\); "):
            resolve({**PD, name: 1})
