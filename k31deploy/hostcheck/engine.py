"""What SGLang build a serving image (or venv) carries, checked against the plan's engine section.

The probe runs inside the image with its own python3 (`docker run --rm --network=none --entrypoint
python3 IMAGE -c PROBE`) and prints JSON: the installed sglang version and every distribution that
registers a SGLang general plugin (entry-point group `sglang.srt.plugins`, where sgl-amd-mono registers
the monokernel's 'amd' backend). `check()` says what the plan needs that the image lacks.
"""

from __future__ import annotations

import json
from typing import Any

PROBE = """\
import json, importlib.metadata as md
try:
    version = md.version("sglang")
except md.PackageNotFoundError:
    version = None
plugins = sorted({ep.dist.name for ep in md.entry_points(group="sglang.srt.plugins") if ep.dist})
print(json.dumps({"sglang": version, "plugins": plugins}))
"""


def probe_args() -> list[str]:
    """python3's arguments that run the probe (after the interpreter or the image's entry point)."""
    return ["-c", PROBE]


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def check(output: str, engine: dict[str, Any]) -> dict[str, Any]:
    """The probe's output against the plan's `engine` section (its `version`: the build's release, None for the
    branch, whose version k31 cannot know)."""
    try:
        found = json.loads(output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"ok": False, "found": None, "problems": [f"the engine probe printed no JSON: {output[-200:]!r}"]}
    problems = []
    if not found.get("sglang"):
        problems.append("SGLang is not installed")
    want = engine.get("version")
    if want and found.get("sglang") and found["sglang"] != want:
        problems.append(f"it carries SGLang {found['sglang']}, but engine_build={engine['build']} is {want}: "
                        f"set engine_build to the image's build")
    have = {_norm(p) for p in found.get("plugins", [])}
    for plugin in engine.get("plugins", []):
        if _norm(plugin) not in have:
            problems.append(f"it lacks the {plugin} plugin the plan needs (registered SGLang plugins: "
                            f"{', '.join(sorted(have)) or 'none'})")
    return {"ok": not problems, "found": found, "problems": problems}
