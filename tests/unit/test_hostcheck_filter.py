"""filter_plugins/k31_hostcheck.py: the playbooks' door to k31deploy.hostcheck, fed what the roles collect."""

import importlib.util
from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError

from k31deploy.memory import Options, host_memory_need
from k31deploy.recipe import resolve

ROOT = Path(__file__).resolve().parents[2]
FIX = Path(__file__).parent / "fixtures" / "hostcheck"
SANDBOX_OUT = (FIX / "collect-sandbox-debian12.txt").read_text()

_spec = importlib.util.spec_from_file_location("k31_hostcheck_filters", ROOT / "filter_plugins" / "k31_hostcheck.py")
plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plugin)
FILTERS = plugin.FilterModule().filters()


def test_every_filter_has_its_doc_file():
    for name in FILTERS:
        assert (ROOT / "filter_plugins" / f"{name}.yml").is_file(), name


def test_preflight_checks_and_report_with_an_unreachable_host():
    plan = resolve({"platform": "gb300", "topology": "pd", "max_running_requests": 64})
    result = FILTERS["k31_preflight_checks"](SANDBOX_OUT, plan, "node0", {"require_gpu": False})
    hostvars = {"node0": {"_k31_preflight_result": result}, "node1": {}}
    rep = FILTERS["k31_preflight_report"](["node0", "node1"], hostvars)
    assert not rep["ok"]
    assert rep["failures"] == [{"host": "node1", "check": "probe", "status": "fail", "found": "no pre-flight result",
                                "expected": "the host answers the probe", "note": "unreachable, or the probe failed"}]
    assert any(line.startswith("SKIP node0 | gpu_count, gpu_model, gpu_memory, gpu_driver, cuda_version")
               and "k31_preflight_require_gpu is false" in line for line in rep["lines"])


def test_bad_setting_is_a_filter_error_naming_the_host():
    plan = resolve({"platform": "gb300", "topology": "pd", "max_running_requests": 64})
    with pytest.raises(AnsibleFilterError, match="error: node0: pre-flight setting"):
        FILTERS["k31_preflight_checks"](SANDBOX_OUT, plan, "node0", {"require_gpus": False})


def test_host_memory_need_matches_the_planner():
    plan = resolve({"platform": "mi355x", "agents": 92})
    assert FILTERS["k31_host_memory_need"](plan, "node0", 220) == host_memory_need(
        plan, "node0", Options(weights_gb_per_gpu=220))
    assert FILTERS["k31_host_memory_need"](plan, "node1") == 0
    with pytest.raises(AnsibleFilterError, match="weights per GPU"):
        FILTERS["k31_host_memory_need"](plan, "node0")


def _probe(**sections: str) -> str:
    """Probe output with these sections (rc 0), as the collect script prints them."""
    return "".join(f"### k31:{name}\n{text.rstrip()}\n### k31:{name} rc=0\n" for name, text in sections.items())


def test_rdma_choice_gives_the_env_the_summary_and_the_memlock_verdict():
    sysfs, link = (FIX / "rdma-sysfs.txt").read_text(), (FIX / "rdma-link.txt").read_text()
    root = "CapEff:\t000001ffffffffff"    # every capability: CAP_SYS_RESOURCE (bit 24) among them
    chosen = FILTERS["k31_rdma_choice"](_probe(**{"rdma-sysfs": sysfs, "rdma-link": link, "capeff": root}),
                                        "10.0.0.11", [])
    assert chosen["env"]["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_3:1"
    assert chosen["env"]["MC_GID_INDEX"] == "3"
    assert len(chosen["all_ports"]) == 4 and not chosen["unmatched"] and chosen["can_raise_limits"]
    assert chosen["summary"].startswith("RDMA ports: mlx5_0, mlx5_3; left out: ")
    # the site's GID index and extra variables win over what was found
    site = FILTERS["k31_rdma_choice"](_probe(**{"rdma-sysfs": sysfs}), "10.0.0.11", [], 5, {"NCCL_IB_TC": 106})
    assert (site["env"]["NCCL_IB_GID_INDEX"], site["env"]["MC_GID_INDEX"], site["env"]["NCCL_IB_TC"]) == ("5", "5",
                                                                                                          "106")
    # a container: no CAP_SYS_RESOURCE (bit 24 clear)
    boxed = FILTERS["k31_rdma_choice"](_probe(**{"rdma-sysfs": sysfs, "capeff": "CapEff:\t00000000a80425fb"}),
                                       "10.0.0.11")
    assert not boxed["can_raise_limits"]
    # active RoCE ports, none with a GID for this address (and no InfiniBand port): what k31_rdma_require_match
    # refuses
    roce = "\n".join(line for line in sysfs.splitlines() if "/mlx5_3/" not in line)
    assert FILTERS["k31_rdma_choice"](_probe(**{"rdma-sysfs": roce}), "10.9.9.9")["unmatched"]
    assert not FILTERS["k31_rdma_choice"](_probe(**{"rdma-sysfs": roce}), "10.0.0.11")["unmatched"]
    with pytest.raises(AnsibleFilterError, match="k31_rdma_fabric_cidrs"):
        FILTERS["k31_rdma_choice"](_probe(**{"rdma-sysfs": sysfs}), "10.0.0.11", ["10.0.0.0/99"])
    empty = FILTERS["k31_rdma_choice"](SANDBOX_OUT, "10.231.101.10")
    assert empty["ports"] == [] and empty["env"] == {"SGLANG_HOST_IP": "10.231.101.10"}
    assert empty["summary"].startswith("skipped: no RDMA devices") and not empty["unmatched"]


def test_imex_filters():
    plan = resolve({"platform": "gb300", "topology": "pd", "max_running_requests": 64})
    assert FILTERS["k31_imex_domain"](plan) == ["node0", "node1", "node2", "node3"]
    assert FILTERS["k31_imex_domain"](resolve({"platform": "mi355x", "agents": 92})) == []
    ips = ["10.20.0.10", "10.20.0.11", "10.20.0.12", "10.20.0.13"]
    assert FILTERS["k31_imex_nodes_config"](ips) == "".join(f"{ip}\n" for ip in ips)
    status = FILTERS["k31_imex_status"]((FIX / "imex-ctl-N-degraded.txt").read_text(), ips)
    assert not status["ready"] and status["domain_state"] == "DEGRADED"
    assert FILTERS["k31_mlnx_qos"]((FIX / "mlnx_qos.txt").read_text())["trust"] == "dscp"
    assert FILTERS["k31_pfc_vector"](["3"]) == [0, 0, 0, 1, 0, 0, 0, 0]


def test_the_plan_names_the_hub_ids_a_hub_download_fetches():
    plan = resolve({"platform": "mi355x", "agents": 92})
    ids = {"model": plan["model"], "draft": plan["draft_model"]}
    assert ids == {"model": "moonshotai/Kimi-K3.1-Pro", "draft": "z-lab/Kimi-K3.1-Dflash2-Preview"}
