"""The image / venv engine probe: it runs in a real Python, reads real distribution metadata, and the
check refuses an image without the plan's released build or the plugins the plan needs."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from k31deploy.hostcheck import engine
from k31deploy.recipe import resolve

_spec = importlib.util.spec_from_file_location(
    "k31_hostcheck_filters", Path(__file__).resolve().parents[2] / "filter_plugins" / "k31_hostcheck.py")
_plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_plugin)
k31_engine_check, k31_engine_probe = _plugin.k31_engine_check, _plugin.k31_engine_probe


def dist(site: Path, name: str, version: str, entry_points: str = "") -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_points:
        (info / "entry_points.txt").write_text(entry_points)


def probe(site: Path) -> str:
    argv = k31_engine_probe([sys.executable, "-I"])    # -I: only the site below, not the test venv
    code = f"import sys; sys.path.insert(0, {str(site)!r}); exec({argv[-1]!r})"
    return subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def site(tmp_path: Path) -> Path:
    return tmp_path / "site"


def test_probe_reads_the_sglang_version_and_its_plugins(site):
    dist(site, "sglang", "0.5.23")
    dist(site, "sgl-amd-mono", "1.0", "[sglang.srt.plugins]\namd_mono = sgl_amd_mono:register\n")
    dist(site, "unrelated", "2.0", "[console_scripts]\nx = y:z\n")
    assert probe(site).strip() == '{"sglang": "0.5.23", "plugins": ["sgl-amd-mono"]}'
    assert k31_engine_probe(["docker", "run", "IMG"])[:4] == ["docker", "run", "IMG", "-c"]


def test_the_monokernel_plan_needs_the_plugin_in_the_image(site):
    plan = resolve({"platform": "mi355x", "agents": 4})
    assert plan["engine"]["plugins"] == ["sgl-amd-mono"]
    dist(site, "sglang", "0.5.24.dev0+kimi")
    result = k31_engine_check(probe(site), plan)
    assert not result["ok"]
    assert result["problems"] == ["it lacks the sgl-amd-mono plugin the plan needs (registered SGLang plugins: none)"]
    dist(site, "sgl_amd_mono", "1.0", "[sglang.srt.plugins]\namd_mono = sgl_amd_mono:register\n")
    assert k31_engine_check(probe(site), plan) == {
        "ok": True, "found": {"sglang": "0.5.24.dev0+kimi", "plugins": ["sgl_amd_mono"]}, "problems": []}


def test_a_released_build_must_be_the_images_version(site):
    plan = resolve({"platform": "b300", "engine_build": "sglang-0.5.23", "max_running_requests": 8})
    dist(site, "sglang", "0.5.22")
    (problem,) = k31_engine_check(probe(site), plan)["problems"]
    assert problem == ("it carries SGLang 0.5.22, but engine_build=sglang-0.5.23 is 0.5.23: set engine_build to "
                       "the image's build")


def test_no_sglang_or_no_json_is_a_failure(site):
    site.mkdir()
    plan = resolve({"platform": "b300", "max_running_requests": 8})
    assert k31_engine_check(probe(site), plan)["problems"] == ["SGLang is not installed"]
    bad = engine.check("Traceback ...", plan["engine"])
    assert not bad["ok"] and bad["problems"][0].startswith("the engine probe printed no JSON")
