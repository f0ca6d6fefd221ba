"""Pre-flight checks (k31deploy.hostcheck.checks) over captured tool output and resolved plans: every
failure names host, check, found and expected; all hosts' failures are reported together."""

import json
import re
from pathlib import Path

import pytest

from k31deploy.errors import K31Error
from k31deploy.hostcheck import Settings, evaluate, report, system
from k31deploy.memory import GB, Options, host_memory_need, server_memory
from k31deploy.recipe import resolve

FIX = Path(__file__).parent / "fixtures" / "hostcheck"
H200 = FIX / "nvidia-h200"
SANDBOX = system.sections((FIX / "collect-sandbox-debian12.txt").read_text())
SYNCED = (FIX / "timedatectl-show-sandbox.txt").read_text().replace("NTPSynchronized=no", "NTPSynchronized=yes")


def h200_probes() -> dict[str, system.Section]:
    """The H200 machine's captures under the names the collect script gives its probes."""
    rc = json.loads((H200 / "rc.json").read_text())
    names = {"os-release": "os-release", "nvidia-query": "query-gpu", "nvidia-header": "nvidia-smi-q",
             "meminfo": "meminfo", "ulimit-l": "ulimit-l", "df-model": "df-plain", "proc-devices": "proc-devices",
             "rdma-link": "rdma-link", "ibv-devinfo": "ibv_devinfo", "timedatectl": "timedatectl",
             "imex-channel": "imex"}
    files = {"nvidia-header": "nvidia-smi-q-head.txt", "df-model": "df-plain.txt", "ibv-devinfo": "ibv_devinfo.txt"}
    probes = {probe: system.Section(rc[capture], (H200 / files.get(probe, f"{capture}.txt")).read_text())
              for probe, capture in names.items()}
    probes["kernel"] = system.Section(0, (H200 / "uname-r.txt").read_text())
    return probes


def mi355x_probes(**override: str) -> dict[str, system.Section]:
    """An MI355X node: documented / composed AMD and RDMA output, the H200 machine's 126 GiB of RAM."""
    probes = {**SANDBOX, **{k: h200_probes()[k] for k in ("meminfo", "df-model", "ulimit-l")}}
    for name, fixture in (("amd-static", "amd-smi-static-mi355x.json"), ("amd-version", "amd-smi-version-rocm10.txt"),
                          ("gtt", "gtt-sysfs.txt"), ("rdma-link", "rdma-link.txt"), ("rdma-sysfs", "rdma-sysfs.txt")):
        probes[name] = system.Section(0, (FIX / fixture).read_text())
    probes["timedatectl"] = system.Section(0, SYNCED)
    probes.update({k: system.Section(0, v) for k, v in override.items()})
    return probes


def by_check(result: dict) -> dict[str, dict]:
    return {r["check"]: r for r in result["checks"]}


def test_h200_capture_against_an_h200_plan():
    plan = resolve({"platform": "h200", "model_path": "/models/K"})
    result = evaluate(plan, "node0", h200_probes())
    c = by_check(result)
    assert c["gpu_count"]["status"] == "fail"
    assert (c["gpu_count"]["found"], c["gpu_count"]["expected"]) == ("1 GPUs", "8 GPUs per HGX H200")
    assert c["gpu_model"]["status"] == "pass" and c["gpu_model"]["found"] == "NVIDIA H200"
    assert c["gpu_memory"]["status"] == "pass"
    assert c["gpu_driver"] == {**c["gpu_driver"], "status": "pass", "found": "580.159.04"}
    assert c["cuda_version"]["status"] == "pass" and "CUDA 13.0" in c["cuda_version"]["found"]
    # TP16 · EP16 spans two nodes: RDMA is required, and this machine has none.
    assert c["rdma_ports"]["status"] == "fail" and c["rdma_ports"]["found"] == "no RDMA devices"
    assert c["memlock"]["status"] == "pass"
    assert c["host_memory"]["status"] == "pass"                  # no HiCache tier: nothing pinned
    assert c["time_sync"]["status"] == "skip" and "command not found" in c["time_sync"]["found"]
    assert result["facts"]["cuda_version"] == "13.0"
    assert result["facts"]["mem_total_bytes"] == 131981020 * 1024


def test_rdma_is_required_where_kv_leaves_the_node():
    sections = {**mi355x_probes(), "rdma-link": system.Section(0, ""), "rdma-sysfs": system.Section(0, "")}
    for knobs, required in (({"agents": 16}, False), ({"agents": 16, "kv_offload": "mooncake"}, True),
                            ({"agents": 92}, True)):
        c = by_check(evaluate(resolve({"platform": "mi355x", "model_path": "/models/K", **knobs}), "node0", sections))
        assert c["rdma_ports"]["found"] == "no RDMA devices"
        assert c["rdma_ports"]["status"] == ("fail" if required else "pass"), (knobs, c["rdma_ports"])


def test_h200_capture_against_a_gb300_tray():
    plan = resolve({"platform": "gb300", "topology": "pd", "model_path": "/models/K", "max_running_requests": 64})
    c = by_check(evaluate(plan, "node2", h200_probes()))
    assert (c["gpu_count"]["status"], c["gpu_count"]["expected"]) == ("fail", "4 GPUs per GB300 NVL72 tray")
    assert (c["gpu_model"]["status"], c["gpu_model"]["expected"]) == ("fail", "GB300 (gb300)")
    assert c["gpu_memory"]["status"] == "fail"                   # 141 GB, not 288 GB
    assert c["cuda_version"]["status"] == "pass"                 # 13.0 >= 12.9
    # The driver knows IMEX channels (major 242 in /proc/devices); channel0 is made by k31_mnnvl.
    assert c["imex_channel"]["status"] == "fix" and "k31_mnnvl" in c["imex_channel"]["note"]
    assert c["rdma_ports"]["status"] == "pass"                   # NVL72: MNNVL carries it, RDMA optional


def test_sandbox_capture_skips_hardware_with_the_reason():
    plan = resolve({"platform": "gb300", "topology": "pd", "max_running_requests": 64})
    result = evaluate(plan, "node0", SANDBOX, {"require_gpu": False})
    c = by_check(result)
    for check in ("gpu_count", "gpu_model", "gpu_memory", "gpu_driver", "cuda_version", "imex_channel"):
        assert c[check]["status"] == "skip"
        assert "k31_preflight_require_gpu is false" in c[check]["note"]
    assert c["os"]["status"] == "pass" and "Debian GNU/Linux 12" in c["os"]["found"]
    assert c["memlock"]["status"] == "skip"                      # no RDMA devices
    assert not [r for r in result["checks"] if r["status"] == "fail"]


def test_router_host_gets_only_host_checks():
    plan = resolve({"platform": "mi355x", "agents": 92})
    result = evaluate(plan, "elsewhere", SANDBOX, {"require_gpu": False})
    assert [r["check"] for r in result["checks"]] == ["os", "time_sync", "engine"]


def test_too_little_ram_for_the_hicache_tier_is_refused_with_host_check_found_expected():
    plan = resolve({"platform": "mi355x", "agents": 92, "model_path": "/models/K"})
    need = host_memory_need(plan, "node0", Options(weights_gb_per_gpu=220))
    result = evaluate(plan, "node0", mi355x_probes(), {"weights_gb_per_gpu": 220})
    mem = by_check(result)["host_memory"]
    assert mem["status"] == "fail" and mem["host"] == "node0" and mem["check"] == "host_memory"
    assert mem["found"] == "135.1 GB MemTotal"
    assert mem["expected"].startswith(f">= {need / 1e12:.4g} TB (prefill0 kv_offload=hicache")
    assert need > 1e12                                           # the seed's ~1.5 TB per node
    rep = report([result])
    assert not rep["ok"]
    assert any(line.startswith("FAIL node0 | host_memory: found 135.1 GB MemTotal; expected >=")
               for line in rep["lines"])
    # The decode node runs no host tier: the same RAM is plenty.
    assert by_check(evaluate(plan, "node1", mi355x_probes(), {"weights_gb_per_gpu": 220}))["host_memory"]["status"] \
        == "pass"


def test_gtt_limit_against_the_pinned_pools_per_gpu():
    plan = resolve({"platform": "mi355x", "agents": 92, "model_path": "/models/K"})
    pinned = server_memory(plan, plan["servers"][0], Options(weights_gb_per_gpu=220))["host_pinned_bytes_per_gpu"]
    c = by_check(evaluate(plan, "node0", mi355x_probes(), {"weights_gb_per_gpu": 220}))
    assert c["gtt_limit"]["status"] == "pass"                    # 1.5 TiB per card
    small = "".join(f"/sys/class/drm/card{i}/device/mem_info_gtt_total:{100 * GB}\n" for i in range(8))
    c = by_check(evaluate(plan, "node0", mi355x_probes(gtt=small), {"weights_gb_per_gpu": 220}))
    assert c["gtt_limit"]["status"] == "fail" and c["gtt_limit"]["found"] == "100 GB (smallest card)"
    assert c["gtt_limit"]["expected"].startswith(f">= {pinned / 1e9:.4g} GB per GPU")


def test_amd_gpus_and_rocm_version():
    plan = resolve({"platform": "mi355x", "agents": 92, "model_path": "/models/K"})
    c = by_check(evaluate(plan, "node1", mi355x_probes()))
    assert [c[k]["status"] for k in ("gpu_count", "gpu_model", "gpu_memory", "gpu_driver", "rocm_version")] == \
        ["pass"] * 5
    old = by_check(evaluate(plan, "node1", mi355x_probes(**{"amd-version": (FIX / "amd-smi-version-rocm641.txt")
                                                            .read_text()})))
    assert old["rocm_version"]["status"] == "fail"
    assert (old["rocm_version"]["found"], old["rocm_version"]["expected"]) == (
        "ROCm 6.4.1", "ROCm 10 or newer (seed AMD MI350X / MI355X)")
    mi300a = by_check(evaluate(plan, "node1", mi355x_probes(**{"amd-static": (FIX / "amd-smi-static-mi300a.json")
                                                               .read_text()})))
    assert mi300a["gpu_count"]["found"] == "1 GPUs" and mi300a["gpu_model"]["found"] == "AMD Instinct MI300A"
    assert mi300a["gpu_model"]["status"] == mi300a["gpu_memory"]["status"] == "fail"


def test_rdma_required_on_the_1p1d_and_memlock_fixable_or_not():
    plan = resolve({"platform": "mi355x", "agents": 92, "model_path": "/models/K"})
    limited = mi355x_probes(**{"ulimit-l": "8192\n", "capeff": "CapEff:\t000001ffffffffff\n"})
    c = by_check(evaluate(plan, "node1", limited))
    assert c["rdma_ports"]["status"] == "pass" and "mlx5_2/1 DOWN" in c["rdma_ports"]["found"]
    assert (c["memlock"]["status"], c["memlock"]["found"]) == ("fix", "8192 KiB")
    # In a container (the sandbox capture's capability mask) k31_rdma could not raise it: refuse.
    c = by_check(evaluate(plan, "node1", mi355x_probes(**{"ulimit-l": "8192\n"})))
    assert c["memlock"]["status"] == "fail"
    down = mi355x_probes(**{"rdma-link": "link mlx5_0/1 state DOWN physical_state DISABLED netdev e0\n",
                            "rdma-sysfs": ""})
    c = by_check(evaluate(plan, "node1", down))
    assert (c["rdma_ports"]["status"], c["rdma_ports"]["found"]) == ("fail", "mlx5_0/1 DOWN")


def test_disk_for_the_weights():
    plan = resolve({"platform": "mi355x", "agents": 92, "model_path": "/models/K"})
    avail = 68700766208                                          # the H200 capture's free bytes
    c = by_check(evaluate(plan, "node1", mi355x_probes(), {"model_gb": 600}))
    assert c["disk"]["status"] == "fail" and c["disk"]["expected"].startswith(">= 600 GB")
    assert c["disk"]["found"].startswith("68.7 GB free on /")
    sizes = f"model {avail // 2} 0 /models/K\n"
    c = by_check(evaluate(plan, "node1", mi355x_probes(sizes=sizes), {"model_gb": 100}))
    assert c["disk"]["status"] == "pass"                         # half of it is already staged
    c = by_check(evaluate(plan, "node1", mi355x_probes(**{"sizes": "model-source 50000000000 49000000000 /nfs/K\n"})))
    assert c["disk"]["status"] == "pass" and "the staging source" in c["disk"]["expected"]
    assert by_check(evaluate(plan, "node1", mi355x_probes()))["disk"]["status"] == "skip"


def test_weights_measured_from_staged_safetensors_size_the_host_tier():
    plan = resolve({"platform": "mi355x", "agents": 92, "model_path": "/models/K"})
    sizes = f"model-source {220 * 8 * GB + 5} {220 * 8 * GB} /nfs/K\n"      # TP8: 220 GB per GPU
    c = by_check(evaluate(plan, "node0", mi355x_probes(sizes=sizes)))
    need = host_memory_need(plan, "node0", Options(weights_gb_per_gpu=220))
    assert c["host_memory"]["status"] == "fail"
    assert "the safetensors measured on this host" in c["host_memory"]["expected"]
    assert f"{need / 1e12:.4g} TB" in c["host_memory"]["expected"]
    unknown = by_check(evaluate(plan, "node0", mi355x_probes()))["host_memory"]
    assert unknown["status"] == "skip" and "k31_preflight_weights_gb_per_gpu" in unknown["note"]


def test_time_sync_unsynchronised_fails():
    plan = resolve({"platform": "mi355x", "agents": 92})
    probes = {**SANDBOX, "timedatectl": system.Section(0, (FIX / "timedatectl-show-sandbox.txt").read_text())}
    c = by_check(evaluate(plan, "elsewhere", probes, {"require_gpu": False}))
    assert (c["time_sync"]["status"], c["time_sync"]["found"]) == ("fail", "timedatectl: NTPSynchronized=no, NTP=no")


def test_report_collects_every_host_failures_first():
    plan = resolve({"platform": "mi355x", "agents": 92, "model_path": "/models/K"})
    results = [evaluate(plan, "node0", mi355x_probes(), {"weights_gb_per_gpu": 220}),
               evaluate(plan, "node1", mi355x_probes(**{"amd-version": "AMDSMI Tool: 1 | ROCm version: 7.0.2\n"})),
               evaluate(plan, "router", SANDBOX, {"require_gpu": False})]
    rep = report(results)
    failing = {(r["host"], r["check"]) for r in rep["failures"]}
    assert {("node0", "host_memory"), ("node1", "rocm_version")} <= failing
    assert rep["lines"][: len(rep["failures"])] == [line for line in rep["lines"] if line.startswith("FAIL ")]
    assert set(rep["hosts"]) == {"node0", "node1", "router"}
    assert rep["counts"]["fail"] == len(rep["failures"])


def test_unknown_setting_is_refused():
    with pytest.raises(K31Error, match="require_gpus unknown"):
        Settings.from_mapping({"require_gpus": False})


@pytest.mark.parametrize(("role", "tasks", "sections"), [
    ("k31_firewall", "vars/main.yml", {"firewalld", "nftables", "k31-table"}),
    ("k31_pki", "tasks/certificate.yml", {"host-cert"}),
])
def test_roles_read_sections_the_preflight_probe_prints(role, tasks, sections):
    """k31_rdma (its ports), k31_firewall (its backend's state) and k31_pki (the host's certificate) read
    pre-flight's probe of the same run (k31_preflight_probe, or k31_preflight's probe.yml, which they include when
    pre-flight was not run) instead of probing again: every section they read is one collect.sh prints, and the
    probe is what they read."""
    roles = Path(__file__).resolve().parents[2] / "roles"
    probed = set(re.findall(r"^probe (\S+)", (roles / "k31_preflight/files/collect.sh").read_text(), re.M))
    text = (roles / role / tasks).read_text()
    var = f"_{role}_probe"
    read = set(re.findall(rf"{var}\['([\w-]+)'\]", text)) | set(re.findall(rf"{var}\.(\w+)", text))
    assert read == sections and read <= probed
    assert re.search(rf'{var}: "{{{{ k31_preflight_probe.stdout \| k31_probe_sections }}}}"', text)
    assert any("tasks_from: probe" in f.read_text() for f in (roles / role / "tasks").glob("*.yml"))
    assert "register: k31_preflight_probe" in (roles / "k31_preflight/tasks/probe.yml").read_text()


def test_k31_rdma_reads_the_preflight_probe_through_rdma_choose():
    """k31_rdma hands pre-flight's probe (or its own run of probe.yml) to k31_rdma_choice; rdma.choose reads the
    sections collect.sh prints (the ports, their GIDs, the session's capabilities)."""
    import inspect

    from k31deploy.hostcheck import rdma
    roles = Path(__file__).resolve().parents[2] / "roles"
    probed = set(re.findall(r"^probe (\S+)", (roles / "k31_preflight/files/collect.sh").read_text(), re.M))
    read = set(re.findall(r'text\("([\w-]+)"', inspect.getsource(rdma.choose)))
    assert read == {"rdma-sysfs", "rdma-link", "capeff"} and read <= probed
    text = (roles / "k31_rdma/tasks/main.yml").read_text()
    assert re.search(r"k31_preflight_probe\.stdout \| k31_rdma_choice\(", text)
    assert "tasks_from: probe" in text
