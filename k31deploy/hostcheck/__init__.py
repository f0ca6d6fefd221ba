"""Host checks: parsers for what host tools print (nvidia-smi, amd-smi, rdma, ibv_devinfo, /proc, df,
timedatectl ...) and the pre-flight checks built on them. Pure Python over captured text, so every
parser is tested against real output kept in tests/unit/fixtures/hostcheck/."""

from k31deploy.hostcheck.checks import Settings, evaluate, report

__all__ = ["Settings", "evaluate", "report"]
