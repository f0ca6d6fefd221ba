"""`python -m k31deploy.standin.dynamo <the SGLang flags dynamo.sglang would get>`.

The sandbox's stand-in for a `dynamo.sglang` worker: it checks the flags exactly as the engine
stand-in does (unknown flag: exit 2), then becomes Dynamo's own CPU engine simulator,
`dynamo.mocker`, which registers with the real frontend like a real worker (field notes §5).
"""

from __future__ import annotations

import os
import sys

from k31deploy.standin.parser import parse_args
from k31deploy.standin.server import record


def mocker_command(argv: list[str], model_dir: str) -> list[str]:
    args = parse_args(argv)
    cmd = [sys.executable, "-m", "dynamo.mocker", "--model-path", model_dir,
           "--model-name", args.served_model_name or args.model_path, "--engine-type", "sglang",
           "--speedup-ratio", "0",
           # SGLang's default block size of 1 makes the shared chat-template prefix look cached
           # everywhere, and the KV router then sends every request to one worker.
           "--block-size", "16"]
    if args.disaggregation_mode in ("prefill", "decode"):
        cmd += ["--disaggregation-mode", args.disaggregation_mode]
    # Prefill workers register as {ns}.prefill.generate, which switches the frontend into
    # disaggregated mode (field notes §5); the discovery and event plane follow the plan's env.
    component = "prefill" if args.disaggregation_mode == "prefill" else "backend"
    cmd += ["--endpoint", f"dyn://dynamo.{component}.generate"]
    if os.environ.get("ETCD_ENDPOINTS"):
        cmd += ["--discovery-backend", "etcd"]
    if os.environ.get("NATS_SERVER"):
        cmd += ["--event-plane", "nats"]
    return cmd


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    record(argv, os.environ.get("K31_STANDIN_RECORD"))
    model_dir = os.environ.get("K31_STANDIN_MODEL_DIR")
    if not model_dir:
        print("error: K31_STANDIN_MODEL_DIR must name the tiny model directory the mocker serves", file=sys.stderr)
        return 2
    if parse_args(argv).node_rank >= 1:
        # Ranks >= 1 of a multi-node server register nothing with Dynamo; like SGLang's, they only
        # answer /health (here on the worker's system port).
        cmd = [sys.executable, "-m", "k31deploy.standin", *argv, "--host", "0.0.0.0",
               "--port", os.environ.get("DYN_SYSTEM_PORT", "30000")]
        os.environ.pop("K31_STANDIN_RECORD", None)    # the record above holds the planned argv
        os.execv(cmd[0], cmd)
    cmd = mocker_command(argv, model_dir)
    # The mocker reports healthy on DYN_SYSTEM_PORT only when told to start ready (field notes §5).
    os.environ.setdefault("DYN_SYSTEM_STARTING_HEALTH_STATUS", "ready")
    os.execv(cmd[0], cmd)
    return 1    # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main())
