"""The engine-acceptance lane: real SGLang parses and resolves every planned server's command line.

For each case of CASES.json (written by `python -m k31deploy.lane_cases write`, which `scripts/engine-lane
prepare` runs: the normalised rank-0 argv and env of every planned server, grouped by the device capability its
target platform has), this runs what
`python -m sglang.launch_server` runs before it loads weights: `load_plugins()`,
`prepare_server_args(argv)` (argparse), `ServerArgs.resolve_once()` (every `arg_groups/*_hook.py`) and
`check_server_args()`, against a Kimi-K3 model directory built from SGLang's own `KimiK3Config` with the
recipe's shape. One process per capability group: SGLang caches what it reads of the device.

    python3 resolve.py CASES.json OUT.json             # every group, each in a child process
    python3 resolve.py CASES.json OUT.json --group G   # one group, in this process (what a child runs)

K31_LANE_EMULATE_CUDA=1 makes torch report one H200 on a machine without a GPU: a trial run that shows how
far each case gets before a GPU run is spent on it. Its results are marked and cannot be ingested.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import logging
import os
import platform
import re
import subprocess
import sys
import time
import traceback

MODEL_DIR = "/tmp/k31-lane/kimi-k3"
DRAFT_DIR = "/tmp/k31-lane/kimi-k3-dflash"
# What k31's engine auth file holds (a 0600 YAML that --config merges): placeholder keys here.
AUTH_CONFIG = "/tmp/k31-lane/auth.yaml"

# The recipe's shape (seed Tuning notes: SGLANG_PP_LAYER_PARTITION=24,24,24,21 covers 93 layers). Kimi-K3
# interleaves KDA (linear) layers with an MLA layer every fourth; dims are Kimi-K2's MLA/MoE dims.
LAYERS = 93
FULL_ATTN = [i for i in range(1, LAYERS + 1) if i % 4 == 0]
TEXT = dict(
    vocab_size=163840, hidden_size=7168, intermediate_size=18432, num_hidden_layers=LAYERS,
    num_attention_heads=64, num_key_value_heads=64, head_dim=128, moe_intermediate_size=2048,
    num_experts=384, num_experts_per_token=8, num_shared_experts=1, first_k_dense_replace=1,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    max_position_embeddings=1048576, model_type="kimi_linear",
    linear_attn_config={"kda_layers": [i for i in range(1, LAYERS + 1) if i not in FULL_ATTN],
                        "full_attn_layers": FULL_ATTN, "num_heads": 64, "head_dim": 128,
                        "short_conv_kernel_size": 4},
)


def write_models() -> None:
    """config.json of the target and of the DFLASH draft (no weights: resolution reads configs only)."""
    from sglang.srt.configs.kimi_k3 import KimiK3Config

    os.makedirs(MODEL_DIR, exist_ok=True)
    os.makedirs(DRAFT_DIR, exist_ok=True)
    cfg = KimiK3Config(text_config=dict(TEXT)).to_dict()
    cfg["architectures"] = ["KimiK3ForConditionalGeneration"]
    with open(f"{MODEL_DIR}/config.json", "w", encoding="utf-8") as fh:
        json.dump(cfg, fh)
    # The draft's own layer list must stay inside its own layer count (transformers' KimiLinear config
    # indexes it), or every check after the draft's config load is hidden behind an IndexError.
    draft = dict(cfg["text_config"], architectures=["DFlash2DraftModel"], num_hidden_layers=2,
                 num_target_layers=LAYERS)
    draft["linear_attn_config"] = dict(draft["linear_attn_config"], kda_layers=[1], full_attn_layers=[2])
    with open(f"{DRAFT_DIR}/config.json", "w", encoding="utf-8") as fh:
        json.dump(draft, fh)
    with open(AUTH_CONFIG, "w", encoding="utf-8") as fh:
        fh.write("api-key: lane-api-key\nadmin-api-key: lane-admin-api-key\n")


def concrete(argv: list[str]) -> tuple[list[str], list[str]]:
    """The case's normalised argv with this machine's model directories and a loopback dist-init, and
    notes on what the lane machine cannot check."""
    subst = {"<model>": MODEL_DIR, "<draft>": DRAFT_DIR, "<addr>": "127.0.0.1", "<auth-config>": AUTH_CONFIG}
    out, notes = [], []
    skip = False
    for i, token in enumerate(argv):
        if skip:
            skip = False
            continue
        if token == "--disaggregation-ib-device" and i + 1 < len(argv) and argv[i + 1] == "<ib>":
            # SGLang reads /sys/class/infiniband for the named NIC at resolution; the lane machine has none.
            notes.append("--disaggregation-ib-device left out: the lane machine has no InfiniBand NIC")
            skip = True
            continue
        for key, value in subst.items():
            token = token.replace(key, value)
        out.append(token)
    return out, notes


def emulate_cuda() -> None:
    """A trial run on a machine with no GPU: torch reports one H200. Results say so; ingest refuses them."""
    import torch

    class Props:
        name, major, minor = "NVIDIA H200 (emulated)", 9, 0
        total_memory, multi_processor_count = 143771 * 2**20, 132

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_name = lambda *a, **k: Props.name
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: Props()
    torch.cuda.mem_get_info = lambda *a, **k: (140 * 2**30, Props.total_memory)
    torch.version.cuda = torch.version.cuda or "13.0"


def fake_capability(capability: list[int] | None) -> None:
    """Report the target's compute capability (B300/GB300 10.3, B200/GB200 10.0) on this GPU."""
    if not capability:
        return
    import torch

    cap = tuple(capability)
    torch.cuda.get_device_capability = lambda *a, **k: cap


def run_group(cases: list[dict], capability: list[int] | None) -> dict[str, dict]:
    if os.environ.get("K31_LANE_EMULATE_CUDA"):
        emulate_cuda()
    fake_capability(capability)
    write_models()
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    load_plugins()
    results = {}
    for case in cases:
        saved = dict(os.environ)
        os.environ.update({k: v.replace("<addr>", "127.0.0.1") for k, v in case["env"].items()})
        log = io.StringIO()
        handler = logging.StreamHandler(log)    # SGLang's warnings (deprecations) go through logging
        logging.getLogger().addHandler(handler)
        started = time.monotonic()
        stage = "parse"
        result: dict = {}
        argv, notes = concrete(case["argv"])
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                args = prepare_server_args(argv)
                stage = "resolve"
                args.resolve_once()
                stage = "check"
                args.check_server_args()
            result = {"result": "accepted"}
        except SystemExit as exc:    # argparse: the message is on stderr
            lines = [ln for ln in log.getvalue().splitlines() if "error:" in ln]
            result = {"result": "refused", "stage": stage,
                      "message": (lines[-1].split("error:", 1)[1].strip() if lines else f"exit {exc.code}")}
        except BaseException as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            # A refusal is SGLang's own check failing. A module this machine lacks, or a failure while
            # importing a (stubbed) package, says nothing about the engine: the case was not reached.
            last = frames[-1] if frames else None
            own = last is not None and "/sglang/" in last.filename and last.name != "<module>"
            cause = exc.__cause__ or exc.__context__
            verdict = "refused" if own and not isinstance(exc, ImportError) and not _environmental(cause) \
                else "not-reached"
            result = {"result": verdict, "stage": stage,
                      "message": f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:600],
                      "where": [f"{f.filename.split('site-packages/')[-1].split('/tmp/')[-1]}:{f.lineno}:{f.name}"
                                for f in frames[-3:]]}
        finally:
            logging.getLogger().removeHandler(handler)
            os.environ.clear()
            os.environ.update(saved)
        warnings = sorted({re.sub(r"\x1b\[[0-9;]*m", "", ln).split("]", 1)[-1].strip()[:300]
                           for ln in log.getvalue().splitlines() if "deprecat" in ln.lower()})
        if warnings:
            result["deprecations"] = warnings
        if notes:
            result["notes"] = notes
        result["seconds"] = round(time.monotonic() - started, 2)
        results[case["hash"]] = result
        print(f"{case['labels'][0]}: {result['result']} {result.get('message', '')[:200]}", file=sys.__stderr__,
              flush=True)
    return results


def _environmental(exc: BaseException | None) -> bool:
    """An exception SGLang wrapped that came from the lane machine (a missing or stubbed package)."""
    if exc is None:
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return isinstance(exc, ImportError) or any(f.name == "<module>" for f in frames)


def machine() -> dict:
    info = {"python": platform.python_version(), "host": platform.machine()}
    try:
        import importlib.metadata as md

        import torch

        info["torch"] = torch.__version__
        info["sglang"] = md.version("sglang")
        if os.environ.get("K31_LANE_EMULATE_CUDA"):
            info["emulated_cuda"] = True
        elif torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["real_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as exc:
        info["error"] = repr(exc)
    return info


def main() -> int:
    cases_path, out_path = sys.argv[1], sys.argv[2]
    with open(cases_path, encoding="utf-8") as fh:
        doc = json.load(fh)
    groups: dict[str, list[dict]] = {}
    for case in doc["cases"]:
        groups.setdefault(case["group"], []).append(case)
    if "--group" in sys.argv:
        group = sys.argv[sys.argv.index("--group") + 1]
        cases = groups[group]
        results = run_group(cases, cases[0].get("capability"))
        stubs = sorted(sys.modules["sitecustomize"].STUBBED) if "sitecustomize" in sys.modules else []
        with open(out_path, "w", encoding="utf-8") as fh:
            json.dump({"results": results, "stubbed": stubs}, fh)
        return 0
    merged: dict[str, dict] = {}
    stubbed: set[str] = set()
    for group, cases in groups.items():
        part = f"{out_path}.{group}.json"
        proc = subprocess.run([sys.executable, __file__, cases_path, part, "--group", group], check=False)
        if proc.returncode == 0 and os.path.exists(part):
            with open(part, encoding="utf-8") as fh:
                got = json.load(fh)
            merged.update(got["results"])
            stubbed.update(got["stubbed"])
            os.remove(part)
        for case in cases:    # a crashed group still says what it did not reach, and why
            merged.setdefault(case["hash"], {"result": "not-reached",
                                             "message": f"the {group} group's process exited {proc.returncode}"})
    out = {"date": datetime.date.today().isoformat(), "machine": machine(), "stubbed": sorted(stubbed),
           "results": merged}
    with open(out_path, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=1)
    counts: dict[str, int] = {}
    for r in merged.values():
        counts[r["result"]] = counts.get(r["result"], 0) + 1
    print(f"engine lane: {len(merged)} argv: {counts}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
