"""`python3 -m sglang.launch_server ARGS`: the k31 CPU stand-in (k31deploy.standin) with the same argv."""

import os
import runpy
import sys

if os.environ.get("K31_STANDIN_BROKEN", "0") == "1":
    print("k31 stand-in image built BROKEN=1: the entry point exits at once", file=sys.stderr)
    sys.exit(3)
runpy.run_module("k31deploy.standin", run_name="__main__", alter_sys=True)
