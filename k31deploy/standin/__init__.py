"""CPU stand-in for `sglang.launch_server`: takes the real argv, serves SGLang's HTTP surface and the
PD bootstrap contract, so the real router and the playbooks run without GPUs (sandbox, CI)."""
