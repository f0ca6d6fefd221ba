"""k31deploy.hostcheck parsers against real tool output (fixtures/hostcheck/README.md says where each
capture came from: captured, documented or composed)."""

import json
from pathlib import Path

import pytest

from k31deploy.hostcheck import gpu, mnnvl, rdma, system

FIX = Path(__file__).parent / "fixtures" / "hostcheck"
H200 = FIX / "nvidia-h200"


def read(name: str) -> str:
    return (FIX / name).read_text()


# -- captured on the NVIDIA H200 machine ------------------------------------------------------------------

def test_nvidia_query_h200():
    (g,) = gpu.parse_nvidia_query((H200 / "query-gpu.txt").read_text())
    assert g == gpu.Gpu(0, "NVIDIA H200", 143771.0, "580.159.04", "00000000:00:06.0")


def test_nvidia_query_rejects_a_line_of_other_fields():
    with pytest.raises(ValueError, match="expected 5"):
        gpu.parse_nvidia_query("0, NVIDIA H200, 143771\n")


@pytest.mark.parametrize("name", ["nvidia-smi-q-head.txt", "nvidia-smi.txt"])
def test_nvidia_header_h200(name):
    header = gpu.parse_nvidia_header((H200 / name).read_text())
    assert header["driver_version"] == "580.159.04"
    assert header["cuda_version"] == "13.0"


def test_nvidia_q_counts_attached_gpus():
    assert gpu.parse_nvidia_header((H200 / "nvidia-smi-q-head.txt").read_text())["attached_gpus"] == "1"


def test_meminfo_h200_in_bytes():
    mem = system.parse_meminfo((H200 / "meminfo.txt").read_text())
    assert mem["MemTotal"] == 131981020 * 1024
    assert mem["MemAvailable"] == 131476360 * 1024
    assert mem["HugePages_Total"] == 0            # a count, not kB


def test_ulimit_unlimited_and_numbers():
    assert system.parse_ulimit((H200 / "ulimit-l.txt").read_text()) is None
    assert system.parse_ulimit("8192\n") == 8192
    with pytest.raises(ValueError):
        system.parse_ulimit("bash: ulimit: bad\n")


def test_df_h200():
    df = system.parse_df((H200 / "df-plain.txt").read_text())
    assert df == {"filesystem": "/dev/vda", "size": 270553174016, "used": 17288171520, "avail": 68700766208,
                  "mount": "/"}


def test_proc_devices_h200_gives_the_imex_channel_major():
    devices = system.parse_proc_devices((H200 / "proc-devices.txt").read_text())
    assert devices["nvidia-caps-imex-channels"] == 242
    assert devices["nvidia"] == 195
    assert "virtblk" not in devices             # a block device


def test_os_release_h200():
    assert system.parse_os_release((H200 / "os-release.txt").read_text())["PRETTY_NAME"] == "Ubuntu 24.04.3 LTS"


def test_missing_tools_on_h200_are_rc_127():
    rc = json.loads((H200 / "rc.json").read_text())
    assert rc["rdma-link"] == rc["timedatectl"] == rc["ibv_devinfo"] == system.MISSING
    sec = system.Section(rc["timedatectl"], (H200 / "timedatectl.txt").read_text())
    assert sec.missing and not sec.ok
    assert system.time_sync(sec, None) == (None, "timedatectl: bash: line 1: timedatectl: command not found")


# -- the collect script's own output, captured on a sandbox node ------------------------------------------------

def test_sections_of_the_sandbox_capture():
    probes = system.sections(read("collect-sandbox-debian12.txt"))
    assert probes["kernel"] == system.Section(0, "6.18.44-fc-v857")
    assert probes["systemd"].text == "running"
    assert probes["nvidia-query"].missing and probes["amd-static"].missing
    assert probes["rdma-link"].rc == 1 and "NETLINK_RDMA" in probes["rdma-link"].text
    assert probes["rdma-sysfs"] == system.Section(0, "")
    assert system.parse_ulimit(probes["ulimit-l"].text) == 8192
    assert system.parse_df(probes["df-model"].text)["mount"] == "/"
    mask = system.parse_capeff(probes["capeff"].text)
    assert not system.has_capability(mask, system.CAP_SYS_RESOURCE)   # a container: rlimits cannot be raised
    assert system.has_capability(mask, 0)                               # CAP_CHOWN
    assert system.parse_ip_addr(probes["ip-addr"].text)[0]["ifname"] == "lo"
    synced, how = system.time_sync(probes["timedatectl"], probes["chrony"])
    assert synced is None and "Failed to connect to bus" in how


def test_section_cut_off_reads_rc_minus_one():
    probes = system.sections("### k31:a\nx\n### k31:a rc=0\n### k31:b\npartial\n")
    assert probes == {"a": system.Section(0, "x"), "b": system.Section(-1, "partial")}


def test_timedatectl_sandbox_unsynchronised():
    sec = system.Section(0, read("timedatectl-show-sandbox.txt"))
    assert system.time_sync(sec, None) == (False, "timedatectl: NTPSynchronized=no, NTP=no")
    text = read("timedatectl-show-sandbox.txt").replace("NTPSynchronized=no", "NTPSynchronized=yes")
    synced = system.Section(0, text)
    assert system.time_sync(synced, None)[0] is True


def test_chrony_tracking_documented():
    synced, how = system.time_sync(system.Section(127, "not found"), system.Section(0, read("chronyc-tracking.txt")))
    assert synced is True and how == "chronyc tracking: Leap status Normal"
    unsynced = read("chronyc-tracking.txt").replace("Leap status     : Normal", "Leap status     : Not synchronised")
    assert system.time_sync(None, system.Section(0, unsynced))[0] is False


# -- AMD (documented / composed) ----------------------------------------------------------------------------------

def test_amd_smi_static_documented_mi300a_list_shape():
    (g,) = gpu.parse_amd_smi_static(read("amd-smi-static-mi300a.json"))
    assert (g.index, g.name, g.memory_mib, g.driver, g.bus_id) == (0, "AMD Instinct MI300A", 96434, "6.10.10",
                                                                   "0000:01:00.0")


def test_amd_smi_static_gpu_data_shape_mi355x():
    gpus = gpu.parse_amd_smi_static(read("amd-smi-static-mi355x.json"))
    assert [g.index for g in gpus] == list(range(8))
    assert {g.name for g in gpus} == {"AMD Instinct MI355X"}
    assert {g.memory_mib for g in gpus} == {294912}


@pytest.mark.parametrize(("size", "mib"), [({"value": 1024, "unit": "GB"}, 1024 * 1024), ("96434 MB", 96434),
                                           ({"value": 1 << 30, "unit": "B"}, 1024), ("N/A", 0.0)])
def test_amd_vram_units(size, mib):
    doc = json.dumps([{"gpu": 0, "asic": {"market_name": "x"}, "vram": {"size": size}}])
    assert gpu.parse_amd_smi_static(doc)[0].memory_mib == mib


@pytest.mark.parametrize(("name", "rocm", "major"), [("amd-smi-version-changelog.txt", "N/A", None),
                                                     ("amd-smi-version-rocm641.txt", "6.4.1", (6, 4, 1)),
                                                     ("amd-smi-version-rocm10.txt", "10.0.0", (10, 0, 0))])
def test_amd_smi_version(name, rocm, major):
    version = gpu.parse_amd_smi_version(read(name))
    assert version["rocm"] == rocm
    assert gpu.version_tuple(version["rocm"]) == major
    assert version["library"] and version["tool"]


def test_gtt_sysfs():
    gtt = gpu.parse_gtt(read("gtt-sysfs.txt"))
    assert len(gtt["cards"]) == 8 and set(gtt["cards"].values()) == {1536 * (1 << 30)}
    assert gtt["gttsize_mib"] == -1
    assert gpu.parse_gtt("grep: /sys/class/drm/card*/device/mem_info_gtt_total: No such file or directory\n") == \
        {"cards": {}, "gttsize_mib": None}


# -- RDMA (composed in the tools' formats; documented mlnx_qos) ----------------------------------------------

def test_rdma_link_text():
    ports = rdma.parse_rdma_link(read("rdma-link.txt"))
    assert [(p.name, p.state, p.netdev) for p in ports] == [
        ("mlx5_0/1", "ACTIVE", "ens1f0np0"), ("mlx5_1/1", "ACTIVE", "ens2f0np0"),
        ("mlx5_2/1", "DOWN", "ens3f0np0"), ("mlx5_3/1", "ACTIVE", None)]
    assert ports[2].physical_state == "DISABLED"


def test_rdma_link_old_format_and_json_agree():
    old = rdma.parse_rdma_link(read("rdma-link-old.txt"))
    js = rdma.parse_rdma_link(read("rdma-link.json"))
    assert [(p.name, p.state, p.netdev) for p in old] == [(p.name, p.state, p.netdev) for p in js] == [
        ("mlx5_0/1", "ACTIVE", "ens1f0np0"), ("mlx5_1/1", "DOWN", "ens2f0np0")]


def test_ibv_devinfo():
    ports = rdma.parse_ibv_devinfo(read("ibv_devinfo.txt"))
    assert [(p.name, p.state, p.link_layer) for p in ports] == [("mlx5_0/1", "ACTIVE", "Ethernet"),
                                                                ("mlx5_2/1", "DOWN", "Ethernet")]


def test_sysfs_gids():
    parsed = rdma.parse_sysfs(read("rdma-sysfs.txt"))
    states = {p.name: (p.state, p.link_layer) for p in parsed["ports"]}
    assert states["mlx5_0/1"] == ("ACTIVE", "Ethernet") and states["mlx5_3/1"] == ("ACTIVE", "InfiniBand")
    v2 = [g for g in parsed["gids"] if g.device == "mlx5_0" and g.type == "RoCE v2"]
    assert [(g.index, g.ipv4, g.netdev) for g in v2] == [(1, None, "ens1f0np0"), (3, "10.0.0.11", "ens1f0np0")]


def test_select_by_host_ip_picks_the_one_nic_carrying_it():
    parsed = rdma.parse_sysfs(read("rdma-sysfs.txt"))
    ports = rdma.merge_ports(rdma.parse_rdma_link(read("rdma-link.txt")), parsed["ports"])
    chosen = rdma.select(ports, parsed["gids"], "10.1.0.11")
    assert [(p["device"], p["gid_index"]) for p in chosen["ports"]] == [("mlx5_1", 3), ("mlx5_3", None)]
    assert chosen["gid_index"] == 3
    assert chosen["ports"][0]["netdev"] == "ens2f0np0"          # the port's (rdma link) or the GID's netdev
    assert "mlx5_0/1: no RoCE v2 GID for 10.1.0.11" in chosen["left_out"]
    assert "mlx5_2/1: state DOWN" in chosen["left_out"]
    env = rdma.rdma_env(chosen, "10.1.0.11")
    assert env == {"SGLANG_HOST_IP": "10.1.0.11", "NCCL_IB_HCA": "=mlx5_1:1,mlx5_3:1",
                   "MOONCAKE_DEVICE": "mlx5_1,mlx5_3", "NCCL_IB_GID_INDEX": "3", "MC_GID_INDEX": "3"}


def test_select_by_fabric_cidrs_takes_every_rail_that_is_up():
    parsed = rdma.parse_sysfs(read("rdma-sysfs.txt"))
    chosen = rdma.select(parsed["ports"], parsed["gids"], "192.168.1.5", ["10.0.0.0/16", "10.1.0.0/16", "10.2.0.0/16"])
    assert chosen["devices"] == ["mlx5_0", "mlx5_1", "mlx5_3"]     # mlx5_2 is down
    assert rdma.select(parsed["ports"], parsed["gids"], "192.168.1.5")["devices"] == ["mlx5_3"]  # IB only


def test_mlnx_qos_documented():
    qos = rdma.parse_mlnx_qos(read("mlnx_qos.txt"))
    assert qos == {"trust": "dscp", "pfc": [1, 0, 1, 0, 0, 0, 1, 1]}
    assert rdma.pfc_vector([3]) == [0, 0, 0, 1, 0, 0, 0, 0]


# -- IMEX (composed in the documented layout) ----------------------------------------------------------------

IPS = ["10.20.0.10", "10.20.0.11", "10.20.0.12", "10.20.0.13"]


def test_imex_ctl_all_connected():
    status = mnnvl.parse_imex_ctl(read("imex-ctl-N.txt"))
    assert [n["ip"] for n in status["nodes"]] == IPS and status["domain_state"] == "UP"
    assert len(status["matrix"]) == 4
    assert mnnvl.imex_ready(status, IPS) == (True, "4 nodes connected, domain UP")


def test_imex_ctl_degraded_names_every_problem():
    ready, reason = mnnvl.imex_ready(mnnvl.parse_imex_ctl(read("imex-ctl-N-degraded.txt")), IPS)
    assert not ready
    assert "10.20.0.13 UNAVAILABLE" in reason and "node 0 not connected to 3" in reason
    assert "domain state DEGRADED" in reason


def test_imex_ready_needs_every_expected_node():
    ready, reason = mnnvl.imex_ready(mnnvl.parse_imex_ctl(read("imex-ctl-N.txt")), [*IPS, "10.20.0.14"])
    assert not ready and reason == "10.20.0.14 not listed"


def test_imex_nodes_config_refuses_repeats():
    assert mnnvl.nodes_config(IPS[:2]) == "10.20.0.10\n10.20.0.11\n"
    with pytest.raises(ValueError, match="repeat"):
        mnnvl.nodes_config([IPS[0], IPS[0]])


def test_imex_config_keys_replace_in_place_and_append():
    packaged = ("# Description: peer port\nSERVER_PORT=50000\nIMEX_CMD_ENABLED=0\n# other\nLOG_LEVEL=4\n"
                "IMEX_CMD_ENABLED=0\n")
    out = mnnvl.set_config_keys(packaged, {"IMEX_CMD_ENABLED": "1", "IMEX_CMD_PORT": "50005", "SERVER_PORT": "50000"})
    assert out == ("# Description: peer port\nSERVER_PORT=50000\nIMEX_CMD_ENABLED=1\n# other\nLOG_LEVEL=4\n"
                   "IMEX_CMD_PORT=50005\n")
    assert mnnvl.set_config_keys(out, {"IMEX_CMD_ENABLED": "1"}) == out
    assert mnnvl.set_config_keys("", {"A": "1"}) == "A=1\n"
