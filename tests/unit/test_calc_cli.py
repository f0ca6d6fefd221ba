"""`k31 calc` through the real CLI entry point (k31deploy.cli.main)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k31deploy import cli
from k31deploy.commands.calc import FIGURES
from k31deploy.memory import GB, Options, calc
from k31deploy.recipe import iter_cells, resolve

CELLS = list(iter_cells())


@pytest.fixture
def k31(monkeypatch, capsys):
    """Run `k31 ARGS...` in-process; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(cli, "COMMAND_MODULES",
                        tuple(dict.fromkeys((*cli.COMMAND_MODULES, "k31deploy.commands.calc"))))

    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = cli.main(list(args))
        except SystemExit as exc:     # argparse usage errors
            code = exc.code
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def sparse_checkpoint(root: Path, total: int) -> Path:
    root.mkdir()
    with (root / "model-00001.safetensors").open("wb") as fh:
        fh.truncate(total)
    return root


def test_table_shows_every_figure_with_its_derivation(k31):
    code, out, err = k31("calc", "--platform", "mi355x", "--agents", "92", "--weights-gb-per-gpu", "220",
                         "--context-length", "100000")
    assert code == 0 and not err
    for text in ("prefill0: prefill high-throughput TP8 · DCP8", "decode0: decode high-throughput",
                 "KV tokens per server", "largest concurrency", "--max-mamba-cache-size",
                 "--mamba-full-memory-ratio", "host pinned per node", "host DRAM per node",
                 "18.9 KB MLA + indexer", "52 MB at TP8", "host node0: needs"):
        assert text in out
    # each figure's line ends with the line saying how it was derived
    report, _ = calc(resolve({"platform": "mi355x", "agents": 92}),
                     Options(weights_gb_per_gpu=220, context_length=100000))
    lines = out.splitlines()
    for s in report["servers"]:
        m = s["memory"]
        block = lines[lines.index(next(x for x in lines if x.startswith(f"{s['name']}:"))):]
        for key, label, _ in FIGURES:
            if key in m["derivation"]:
                row = next(x for x in block if x.startswith(f"  {label} "))
                assert row.endswith(m["derivation"][key]), (key, row)


def test_json_is_the_memory_model_of_the_same_plan(k31):
    code, out, _ = k31("calc", "--platform", "mi355x", "--agents", "56", "--weights-gb-per-gpu", "210",
                       "--json")
    assert code == 0
    expected, _ = calc(resolve({"platform": "mi355x", "agents": 56}), Options(weights_gb_per_gpu=210))
    assert json.loads(out) == json.loads(json.dumps(expected))
    (server,) = json.loads(out)["servers"]
    assert server["memory"]["max_running_requests"] == 64


def test_mem_fraction_goes_through_the_plan(k31):
    code, out, _ = k31("calc", "--platform", "mi355x", "--agents", "56", "--mem-fraction-static", "0.8",
                       "--json")
    m = json.loads(out)["servers"][0]["memory"]
    assert code == 0 and m["mem_fraction_static"] == 0.8
    assert "argv" in m["derivation"]["mem_fraction_static"]
    # the seed's MI35x single-node rule still applies
    code, _, err = k31("calc", "--platform", "mi355x", "--agents", "56", "--mem-fraction-static", "0.88")
    assert code == 2 and "GTT" in err


def test_concurrency_and_checkpoint(k31, tmp_path):
    ckpt = sparse_checkpoint(tmp_path / "ckpt", 1600 * GB)
    code, out, _ = k31("calc", "--platform", "b300", "--set", "max_running_requests=64", "--checkpoint",
                       str(ckpt), "--concurrency", "16", "--json")
    m = json.loads(out)["servers"][0]["memory"]
    assert code == 0
    assert m["weights_bytes"] == 200 * GB and m["max_running_requests"] == 16
    assert m["recommended_max_mamba_cache_size"] == 16 * 3


def test_unfit_plan_prints_the_numbers_then_refuses(k31):
    code, out, err = k31("calc", "--platform", "mi355x", "--agents", "92", "--weights-gb-per-gpu", "230",
                         "--context-length", "200000")
    assert code == 2
    assert "decode0" in out and "fits" in out
    (line,) = err.strip().splitlines()
    assert line.startswith("error: decode0") and "max_running_requests=92" in line and "at most" in line


def test_host_tier_verdict_against_the_nodes_dram(k31):
    code, out, _ = k31("calc", "--platform", "mi355x", "--agents", "56", "--weights-gb-per-gpu", "220",
                       "--host-dram-gb", "500")
    assert code == 0 and "host node0: needs" in out and "DOES NOT FIT" in out


@pytest.mark.parametrize("args,needle", [
    (["--mem-fraction-static", "1.5"], "--mem-fraction-static"),
    (["--mem-fraction-static", "0"], "--mem-fraction-static"),
    (["--mem-fraction-static", "-0.2"], "--mem-fraction-static"),
    (["--weights-gb-per-gpu", "0"], "--weights-gb-per-gpu"),
    (["--weights-gb-per-gpu", "-3"], "--weights-gb-per-gpu"),
    (["--weights-gb-per-gpu", "400"], "larger than"),
    (["--context-length", "0"], "--context-length"),
    (["--concurrency", "-1"], "--concurrency"),
    (["--host-dram-gb", "0"], "--host-dram-gb"),
    (["--checkpoint", "/nonexistent/k31-ckpt"], "--checkpoint"),
    (["--draft-checkpoint", "/tmp"], "--draft-checkpoint"),
])
def test_bad_input_exits_2_with_one_line(k31, args, needle):
    code, out, err = k31("calc", "--platform", "mi355x", "--agents", "56", *args)
    assert code == 2 and not out
    (line,) = err.strip().splitlines()
    assert line.startswith("error: ") and needle in line


def test_weights_given_twice_is_a_usage_error(k31):
    code, _, err = k31("calc", "--platform", "b300", "--weights-gb-per-gpu", "100", "--checkpoint", "/tmp")
    assert code == 2 and "not allowed with" in err


def test_unknown_platform_exits_2(k31):
    code, _, err = k31("calc", "--platform", "a100")
    assert code == 2 and err.startswith("error: platform=a100")


def cell_args(platform: str, role: str, strategy: str, cell: dict) -> list[str]:
    args = ["--platform", platform]
    if platform != "tpu7x":
        args += ["--set", "max_running_requests=32"]
    if role == "unified":
        return [*args, "--unified-strategy", strategy]
    args += ["--topology", "pd"]
    return [*args, "--set", "wide_ep=true"] if cell.get("knob") else [*args, f"--{role}-strategy", strategy]


@pytest.mark.parametrize("platform,role,strategy,cell", CELLS, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CELLS])
def test_every_catalog_cell_resolves_through_calc(k31, platform, role, strategy, cell):
    code, out, err = k31("calc", *cell_args(platform, role, strategy, cell), "--weights-gb-per-gpu", "60",
                         "--json")
    assert code == 0, err
    report = json.loads(out)
    (served,) = [s for s in report["servers"] if s["role"] == role]
    assert served["strategy"] == strategy or cell.get("knob")
    assert served["memory"]["kv_tokens"] > 0 and served["memory"]["fits"] is True
    code, out, err = k31("calc", *cell_args(platform, role, strategy, cell))
    assert code == 0 and "weights per GPU" in out and "unknown" in out
