#!/bin/bash
# k31 pre-flight probes. Read-only: it changes nothing on the host. Each probe prints its output between
# "### k31:NAME" and "### k31:NAME rc=N"; k31deploy.hostcheck parses them (a missing tool is rc 127).
# Arguments: MODEL_DIR DRAFT_DIR MODEL_SOURCE_DIR DRAFT_SOURCE_DIR HOST_CERT ("-" where there is none).
# The other roles of the same run read their sections rather than probe again (roles/k31_preflight/tasks/probe.yml).
export PATH="$PATH:/usr/sbin:/sbin:/opt/rocm/bin"
export LC_ALL=C SYSTEMD_COLORS=0

probe() {
  local name=$1
  shift
  echo "### k31:$name"
  (set -o pipefail; eval "$*") 2>&1
  echo "### k31:$name rc=$?"
}

# The nearest existing directory at or above $1, for df (the model directory may not exist yet).
existing() {
  local p=${1:-/}
  while [ ! -e "$p" ] && [ "$p" != / ]; do p=$(dirname "$p"); done
  echo "$p"
}

# LABEL TOTAL_BYTES SAFETENSORS_BYTES PATH for each directory that exists.
sizes() {
  local label path total st
  while [ $# -ge 2 ]; do
    label=$1 path=$2
    shift 2
    [ "$path" != - ] && [ -d "$path" ] || continue
    total=$(du -sbL "$path" 2>/dev/null | cut -f1)
    st=$(find -L "$path" -name '*.safetensors' -type f -printf '%s\n' 2>/dev/null | awk '{s+=$1} END {print s+0}')
    echo "$label ${total:-0} ${st:-0} $path"
  done
}

model=${1:--} draft=${2:--} model_src=${3:--} draft_src=${4:--} cert=${5:--}
ib=/sys/class/infiniband

probe os-release cat /etc/os-release
probe kernel uname -r
probe systemd systemctl is-system-running
probe capeff grep CapEff /proc/self/status
probe nvidia-query nvidia-smi --query-gpu=index,name,memory.total,driver_version,pci.bus_id \
  --format=csv,noheader,nounits
probe nvidia-header "nvidia-smi -q | head -n 12"
probe amd-static amd-smi static --json
probe amd-version amd-smi version
probe gtt "grep -H . /sys/class/drm/card*/device/mem_info_gtt_total /sys/module/amdgpu/parameters/gttsize"
probe rdma-link rdma link show
probe ibv-devinfo ibv_devinfo
probe rdma-sysfs "grep -H . $ib/*/ports/*/state $ib/*/ports/*/link_layer 2>/dev/null;
  grep -H . $ib/*/ports/*/gids/* 2>/dev/null | grep -v ':0000:0000:0000:0000:0000:0000:0000:0000\$';
  grep -H . $ib/*/ports/*/gid_attrs/types/* $ib/*/ports/*/gid_attrs/ndevs/* 2>/dev/null; true"
probe ulimit-l ulimit -l
probe meminfo cat /proc/meminfo
probe df-model df -P -B1 "$(existing "$model")"
probe sizes sizes model "$model" draft "$draft" model-source "$model_src" draft-source "$draft_src"
probe timedatectl timedatectl show
probe chrony chronyc -n tracking
probe proc-devices cat /proc/devices
probe imex-channel ls -l /dev/nvidia-caps-imex-channels/channel0
probe ip-addr ip -o -4 addr show
# k31_firewall's backends: firewalld's state (auto picks it), nftables installed, k31's table loaded
probe firewalld systemctl is-active firewalld
probe nftables "dpkg-query -W -f='\${db:Status-Status}\n' nftables"
probe k31-table "nft list table inet k31 >/dev/null"
# k31_pki: the host's certificate (public; its renewal is decided on the controller)
probe host-cert 'if [ "$cert" != - ]; then cat -- "$cert"; fi'
