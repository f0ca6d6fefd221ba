"""Pinned wheels for what the nodes run, fetched once on the controller and installed with no index.

Nodes never reach a package index: the controller downloads every wheel a set needs into one folder
(``state_dir()/wheelhouse`` by default), and nodes install from that folder alone::

    pip install --no-index --find-links WHEELHOUSE -r WHEELHOUSE/router.txt
    pip install --no-index --find-links WHEELHOUSE -r WHEELHOUSE/dynamo.txt
    pip install --no-index --find-links WHEELHOUSE --no-deps -r WHEELHOUSE/dynamo.nodeps.txt

A production site without internet uses the same path: run ``k31 wheelhouse build`` on any machine
that reaches PyPI and copy the folder to the site (it carries its requirement files, so it is
self-contained); ``k31 wheelhouse install --from COPY`` and the playbooks then need no network.

The sets live in ``k31deploy/data/wheelhouse/`` as requirement files that pin every wheel, transitive
dependencies included, so "already complete" is a check of file names and a re-run downloads nothing.
Wheels target the nodes, not the controller: Debian 12 (glibc 2.36), CPython 3.11, x86_64 or aarch64.
pip is told that platform explicitly (``--platform``/``--python-version``), so a controller with
another Python or CPU builds the right folder; ``--only-binary`` keeps sdists (and their build steps)
off the nodes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import Version

from k31deploy.errors import K31Error
from k31deploy.paths import state_dir

DATA_DIR = Path(__file__).parent / "data" / "wheelhouse"
# set -> its requirement files in install order, each with whether pip installs it with --no-deps
SETS: dict[str, tuple[tuple[str, bool], ...]] = {
    "router": (("router.txt", False),),
    "dynamo": (("dynamo.txt", False), ("dynamo.nodeps.txt", True)),
    "mooncake": (("mooncake.nodeps.txt", True),),
}
ARCHES = ("x86_64", "aarch64")
PYTHON_VERSION = (3, 11)
GLIBC_MINOR = 36  # Debian 12 bookworm ships glibc 2.36
_MACHINE_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}
# PEP 600 names have legacy aliases that wheel files still use.
_LEGACY_MANYLINUX = {
    "x86_64": {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"},
    "aarch64": {17: "manylinux2014"},
}

Runner = Callable[[list[str]], int]


@dataclass(frozen=True, order=True)
class Pin:
    name: str  # canonical (PEP 503) name
    version: str

    def __str__(self) -> str:
        return f"{self.name}=={self.version}"


def set_names(choice: str) -> list[str]:
    """The sets `choice` stands for: one set name, or "all"."""
    if choice == "all":
        return list(SETS)
    if choice not in SETS:
        raise K31Error(f"wheelhouse set {choice!r} is unknown; choose one of {', '.join(SETS)} or all")
    return [choice]


def parse_requirements(text: str, source: str = "<text>") -> list[Pin]:
    """Pins of a requirement file; every line must pin exactly one version (`name==version`)."""
    pins = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement as exc:
            raise K31Error(f"{source} line {number}: {line!r} is not a requirement ({exc})") from None
        specs = list(req.specifier)
        if req.marker or req.extras or req.url or len(specs) != 1 or specs[0].operator != "==":
            raise K31Error(f"{source} line {number}: {line!r} must pin one version as name==version")
        pins.append(Pin(canonicalize_name(req.name), specs[0].version))
    return pins


def requirement_files(set_name: str) -> list[str]:
    return [name for name, _no_deps in SETS[set_name]]


def set_pins(set_name: str, directory: Path = DATA_DIR) -> list[Pin]:
    pins: list[Pin] = []
    for name in requirement_files(set_name):
        path = directory / name
        pins += parse_requirements(path.read_text(), source=str(path))
    return sorted(set(pins))


def host_arch(machine: str | None = None) -> str:
    arch = (machine or platform.machine()).lower()
    arch = _MACHINE_ALIASES.get(arch, arch)
    if arch not in ARCHES:
        raise K31Error(f"wheelhouse architecture {arch!r} is unsupported; choose one of {', '.join(ARCHES)}")
    return arch


def platform_tags(arch: str) -> list[str]:
    """Platform tags a Debian 12 node of `arch` accepts, newest glibc first."""
    oldest = 5 if arch == "x86_64" else 17
    tags = []
    for minor in range(GLIBC_MINOR, oldest - 1, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        if minor in _LEGACY_MANYLINUX[arch]:
            tags.append(f"{_LEGACY_MANYLINUX[arch][minor]}_{arch}")
    return tags


def supported_tags(arch: str) -> frozenset[Tag]:
    platforms = platform_tags(arch)
    interpreter = f"cp{PYTHON_VERSION[0]}{PYTHON_VERSION[1]}"
    return frozenset(
        [
            *cpython_tags(PYTHON_VERSION, abis=[interpreter], platforms=platforms),
            *compatible_tags(PYTHON_VERSION, interpreter=interpreter, platforms=platforms),
        ]
    )


def wheels_present(directory: Path, arch: str) -> set[Pin]:
    """Pins for which `directory` holds a wheel a node of `arch` can install."""
    tags = supported_tags(arch)
    found = set()
    for path in directory.glob("*.whl") if directory.is_dir() else ():
        try:
            name, version, _build, wheel_tags = parse_wheel_filename(path.name)
        except InvalidWheelFilename:
            continue
        if wheel_tags & tags:
            found.add(Pin(name, str(version)))
    return found


def missing_pins(pins: Iterable[Pin], directory: Path, arch: str) -> list[Pin]:
    present = {(p.name, Version(p.version)) for p in wheels_present(directory, arch)}
    return [p for p in pins if (p.name, Version(p.version)) not in present]


def download_command(pins: Iterable[Pin], dest: Path, arch: str, python: str = sys.executable) -> list[str]:
    platform_args = [arg for tag in platform_tags(arch) for arg in ("--platform", tag)]
    return [
        python, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
        "--no-deps", "--only-binary=:all:",
        "--implementation", "cp", "--python-version", ".".join(map(str, PYTHON_VERSION)),
        *platform_args, "--dest", str(dest), *map(str, pins),
    ]  # fmt: skip


def install_commands(set_name: str, venv: Path, wheelhouse: Path) -> list[list[str]]:
    """pip command lines that install `set_name` into `venv` from `wheelhouse` alone."""
    base = [str(venv / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check", "--no-index",
            "--find-links", str(wheelhouse)]  # fmt: skip
    return [
        [*base, *(["--no-deps"] if no_deps else []), "-r", str(wheelhouse / name)] for name, no_deps in SETS[set_name]
    ]


def default_wheelhouse() -> Path:
    return state_dir() / "wheelhouse"


def _run(argv: list[str]) -> int:
    return subprocess.run(argv, check=False).returncode


def build(
    choice: str,
    dest: Path,
    arch: str,
    run: Runner = _run,
    say: Callable[[str], None] = print,
) -> Path:
    """Fill `dest` with every pinned wheel of the chosen sets; download only what is missing."""
    dest.mkdir(parents=True, exist_ok=True)
    for set_name in set_names(choice):
        pins = set_pins(set_name)
        missing = missing_pins(pins, dest, arch)
        if missing:
            say(f"wheelhouse {set_name} ({arch}): downloading {len(missing)} of {len(pins)} pinned wheels")
            code = run(download_command(missing, dest, arch))
            if code != 0:
                raise K31Error(
                    f"pip download for wheelhouse set {set_name} failed (exit {code}); this needs a package "
                    f"index: on a site without one, copy a wheelhouse built elsewhere to {dest}"
                )
            still = missing_pins(pins, dest, arch)
            if still:
                lacking = ", ".join(map(str, still))
                raise K31Error(f"wheelhouse {dest} still lacks {lacking} after pip download")
        else:
            say(f"wheelhouse {set_name} ({arch}): all {len(pins)} pinned wheels present, nothing downloaded")
        for name in requirement_files(set_name):
            _copy_whole(DATA_DIR / name, dest / name)
    return dest


def _copy_whole(src: Path, dest: Path) -> None:
    """Copy unless identical, through a temporary file: a deploy beside this build may be reading it."""
    data = src.read_bytes()
    if dest.exists() and dest.read_bytes() == data:
        return
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, dest)


def check_python(python: str) -> None:
    """The venv's interpreter must be the CPython the wheels were fetched for."""
    want = ".".join(map(str, PYTHON_VERSION))
    code = "import sys; print('%d.%d' % sys.version_info[:2])"
    try:
        probe = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
        found = probe.stdout.strip() if probe.returncode == 0 else "not runnable"
    except OSError:
        found = "not runnable"
    if found != want:
        raise K31Error(f"--python {python} is {found}; the wheelhouse holds wheels for CPython {want}, give that")


def _stamp(venv: Path, set_name: str) -> Path:
    return venv / f".k31-wheelhouse-{set_name}"


def install(
    set_name: str,
    venv: Path,
    wheelhouse: Path,
    python: str = sys.executable,
    run: Runner = _run,
    say: Callable[[str], None] = print,
) -> Path:
    """Install `set_name` into `venv` (created with `python` if absent) from `wheelhouse`, offline."""
    if set_name not in SETS:
        raise K31Error(f"wheelhouse set {set_name!r} cannot be installed; choose one of {', '.join(SETS)}")
    pins = set_pins(set_name)
    stamp = _stamp(venv, set_name)
    wanted = "".join(f"{p}\n" for p in pins)
    if (venv / "bin" / "python").exists() and stamp.exists() and stamp.read_text() == wanted:
        say(f"venv {venv} already has wheelhouse set {set_name}, nothing installed")
        return venv
    missing = missing_pins(pins, wheelhouse, host_arch())
    absent_files = [n for n in requirement_files(set_name) if not (wheelhouse / n).is_file()]
    if missing or absent_files:
        lacking = [*map(str, missing), *absent_files]
        raise K31Error(
            f"wheelhouse {wheelhouse} lacks {len(lacking)} file(s) of set {set_name} (first: {lacking[0]}); "
            f"run `k31 wheelhouse build --set {set_name}` or copy a complete wheelhouse there"
        )
    # A venv whose creation was cut short has python but no pip: made again (--clear) rather than used.
    if not (venv / "bin" / "python").exists() or not (venv / "bin" / "pip").exists():
        check_python(python)
        if run([python, "-m", "venv", "--clear", str(venv)]) != 0:
            raise K31Error(f"could not create a venv at {venv} with {python}")
    for argv in install_commands(set_name, venv, wheelhouse):
        code = run(argv)
        if code != 0:
            raise K31Error(f"offline pip install of set {set_name} into {venv} failed (exit {code})")
    stamp.write_text(wanted)
    say(f"venv {venv}: installed wheelhouse set {set_name} ({len(pins)} wheels) with no index")
    return venv


def problem(set_name: str, wheelhouse: Path, arch: str) -> str | None:
    """Why the playbooks could not pack `set_name` out of `wheelhouse` for `arch` nodes, in one sentence naming
    the command that fixes it; None when every pinned wheel is there. The validate play asks this before any
    host is touched (k31 wheelhouse pack would otherwise fail on the first host that installs the set)."""
    if set_name not in SETS:
        raise K31Error(f"wheelhouse set {set_name!r} is unknown; choose one of {', '.join(SETS)}")
    fix = f"run `k31 wheelhouse build --set {set_name} --dest {wheelhouse}` (or copy a complete wheelhouse there)"
    if not wheelhouse.is_dir():
        return f"wheelhouse {wheelhouse} does not exist; {fix}"
    pins = set_pins(set_name)
    missing = missing_pins(pins, wheelhouse, arch)
    if missing:
        return (f"wheelhouse {wheelhouse} lacks {len(missing)} of the {len(pins)} pinned {arch} wheels of set "
                f"{set_name} (first: {missing[0]}); {fix}")
    return None


def set_wheels(set_name: str, wheelhouse: Path, arch: str) -> list[Path]:
    """The wheel files of `wheelhouse` that a set's pins name (the set must be complete)."""
    wanted = {(p.name, Version(p.version)) for p in set_pins(set_name)}
    tags = supported_tags(arch)
    files = []
    for path in sorted(wheelhouse.glob("*.whl")):
        with contextlib.suppress(InvalidWheelFilename):
            name, version, _build, wheel_tags = parse_wheel_filename(path.name)
            if (name, version) in wanted and wheel_tags & tags:
                files.append(path)
    missing = missing_pins(set_pins(set_name), wheelhouse, arch)
    if missing:
        raise K31Error(f"wheelhouse {wheelhouse} lacks {missing[0]} of set {set_name}; "
                       f"run `k31 wheelhouse build --set {set_name}`")
    return files


def pack(set_name: str, wheelhouse: Path, arch: str) -> tuple[Path, str, bool]:
    """One reproducible tar of a set's wheels and requirement files, for copying to nodes in one go.

    Returns (path, digest, changed). The digest names the set's content (file names, sizes and the
    requirement files), so a node that recorded it after installing needs neither copy nor install.
    """
    if set_name not in SETS:
        raise K31Error(f"wheelhouse set {set_name!r} cannot be packed; choose one of {', '.join(SETS)}")
    files = [*set_wheels(set_name, wheelhouse, arch), *(DATA_DIR / n for n in requirement_files(set_name))]
    manifest = hashlib.sha256()
    for path in files:
        manifest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        if path.suffix == ".txt":
            manifest.update(path.read_bytes())
    digest = manifest.hexdigest()[:16]
    dest = wheelhouse / "packs" / f"{set_name}.tar"
    stamp = dest.with_suffix(".digest")
    if dest.is_file() and stamp.is_file() and stamp.read_text() == digest:
        return dest, digest, False
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            info = tar.gettarinfo(str(path), arcname=path.name)
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with path.open("rb") as fh:
                tar.addfile(info, fh)
    tmp.replace(dest)
    stamp.write_text(digest)
    return dest, digest, True
