"""The node image, built locally (no registry): a debootstrap'd base brought in with `podman import`,
then `podman build` FROM it. Both are tagged by a hash of their recipe, so an unchanged recipe is
never rebuilt and a changed one always is."""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml

from k31deploy.errors import K31Error
from k31deploy.sandbox import DATA_DIR, podman

BASE_REPO = "localhost/k31-sandbox-base"
NODE_REPO = "localhost/k31-sandbox"
NESTED_REPO = "localhost/k31-sandbox-nested"
IMAGE_LABEL = "k31.sandbox.image"
BASE_RECIPE = "base.yaml"
# The build context of the node image; every byte of these files is in its tag.
NODE_RECIPE = ("Containerfile", "k31-ssh-host-keys.service")
# Nodes that run containers (shapes with nested: true): built FROM the node image; every file is in its tag.
NESTED_DIR = "nested"
NESTED_RECIPE = ("Containerfile", "containers.conf", "k31-sandbox-runc")
DEFAULT_MIRROR = "http://deb.debian.org/debian"


def recipe_hash(parts: Iterable[tuple[str, bytes]]) -> str:
    digest = hashlib.sha256()
    for name, content in parts:
        digest.update(name.encode() + b"\0" + len(content).to_bytes(8, "big") + content)
    return digest.hexdigest()[:12]


def base_tag(data_dir: Path = DATA_DIR) -> str:
    # The architecture is part of the recipe: debootstrap builds for the controller's own.
    parts = [("arch", platform.machine().encode()), (BASE_RECIPE, (data_dir / BASE_RECIPE).read_bytes())]
    return f"{BASE_REPO}:{recipe_hash(parts)}"


def node_tag(data_dir: Path = DATA_DIR) -> str:
    parts = [("base", base_tag(data_dir).encode())]
    parts += [(name, (data_dir / name).read_bytes()) for name in NODE_RECIPE]
    return f"{NODE_REPO}:{recipe_hash(parts)}"


def nested_tag(data_dir: Path = DATA_DIR) -> str:
    parts = [("node", node_tag(data_dir).encode())]
    parts += [(name, (data_dir / NESTED_DIR / name).read_bytes()) for name in NESTED_RECIPE]
    return f"{NESTED_REPO}:{recipe_hash(parts)}"


@dataclass(frozen=True)
class Source:
    uri: str
    suites: tuple[str, ...]
    signed_by: str | None = None


def parse_one_line_sources(text: str) -> list[Source]:
    """`deb [options] URI SUITE COMPONENT...` lines of sources.list."""
    sources = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line.startswith("deb "):
            continue
        words = line.split()[1:]
        options: dict[str, str] = {}
        if words and words[0].startswith("["):
            opts = []
            while words:
                word = words.pop(0)
                opts.append(word.strip("[]"))
                if word.endswith("]"):
                    break
            options = dict(opt.split("=", 1) for opt in opts if "=" in opt)
        if len(words) >= 2:
            sources.append(Source(uri=words[0], suites=(words[1],), signed_by=options.get("signed-by")))
    return sources


def parse_deb822_sources(text: str) -> list[Source]:
    """Paragraphs of a `.sources` file (deb822), skipping disabled ones and non-binary types."""
    sources = []
    for paragraph in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = None
        for raw in paragraph.splitlines():
            if raw.startswith("#") or not raw.strip():
                continue
            if raw[0] in " \t" and key:
                fields[key] += " " + raw.strip()
            elif ":" in raw:
                key, value = raw.split(":", 1)
                key = key.strip().lower()
                fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled", "yes").lower() == "no":
            continue
        suites = tuple(fields.get("suites", "").split())
        sources += [Source(uri, suites, fields.get("signed-by")) for uri in fields.get("uris", "").split()]
    return sources


def apt_sources(etc_apt: Path = Path("/etc/apt")) -> list[Source]:
    """Every enabled binary source, in apt's order; files apt itself ignores are ignored too."""
    sources = []
    main_list = etc_apt / "sources.list"
    if main_list.is_file():
        sources += parse_one_line_sources(main_list.read_text())
    parts = etc_apt / "sources.list.d"
    for path in sorted(parts.glob("*")) if parts.is_dir() else []:
        if path.suffix == ".list":
            sources += parse_one_line_sources(path.read_text())
        elif path.suffix == ".sources":
            sources += parse_deb822_sources(path.read_text())
    return sources


def debian_mirror(suite: str, sources: list[Source]) -> Source:
    """The machine's mirror for `suite` itself (not -updates or -security); deb.debian.org if none."""
    override = os.environ.get("K31_SANDBOX_MIRROR")
    if override:
        return Source(uri=override, suites=(suite,))
    for source in sources:
        if suite in source.suites:
            return source
    return Source(uri=DEFAULT_MIRROR, suites=(suite,))


def _exists(tag: str) -> bool:
    return podman.run("image", "exists", tag, check=False).returncode == 0


def _build_base(tag: str, log: Callable[[str], None]) -> None:
    recipe = yaml.safe_load((DATA_DIR / BASE_RECIPE).read_text())
    mirror = debian_mirror(recipe["suite"], apt_sources())
    log(f"building base image {tag} with debootstrap from {mirror.uri} (about a minute)")
    with tempfile.TemporaryDirectory(prefix="k31-sandbox-base-", dir="/var/tmp") as work:
        rootfs = Path(work) / "rootfs"
        argv = ["debootstrap", f"--variant={recipe['variant']}", f"--include={','.join(recipe['include'])}"]
        if mirror.signed_by and Path(mirror.signed_by).is_file():
            argv.append(f"--keyring={mirror.signed_by}")
        argv += [recipe["suite"], str(rootfs), mirror.uri]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            raise podman.failure("debootstrap", proc)
        excludes = [f"--exclude={pattern}" for pattern in recipe["exclude"]]
        tar = subprocess.Popen(
            ["tar", "-C", str(rootfs), "--numeric-owner", *excludes, "-c", "."], stdout=subprocess.PIPE
        )
        try:
            podman.run("import", "--change", f"LABEL {IMAGE_LABEL}=base", "-", tag, stdin=tar.stdout)
        finally:
            tar.stdout.close()
            if tar.wait() != 0:
                raise K31Error(f"tar of the debootstrap tree failed (exit {tar.returncode})")


def _build_node(tag: str, base: str, log: Callable[[str], None]) -> None:
    log(f"building node image {tag} FROM {base} (about a minute)")
    with tempfile.TemporaryDirectory(prefix="k31-sandbox-ctx-") as context:
        for name in NODE_RECIPE:
            shutil.copy(DATA_DIR / name, Path(context) / name)
        podman.run("build", "--pull=never", "--build-arg", f"BASE={base}", "-t", tag, context)


def _build_nested(tag: str, node: str, log: Callable[[str], None]) -> None:
    log(f"building nested-container node image {tag} FROM {node} (about half a minute)")
    with tempfile.TemporaryDirectory(prefix="k31-sandbox-nested-") as context:
        for name in NESTED_RECIPE:
            shutil.copy(DATA_DIR / NESTED_DIR / name, Path(context) / name)
        podman.run("build", "--pull=never", "--build-arg", f"NODE={node}", "-t", tag, context)


def ensure_base(lock_dir: Path, log: Callable[[str], None]) -> str:
    """The base image's tag, built where missing."""
    base = base_tag()
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / "image.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _exists(base):
            _build_base(base, log)
    return base


def ensure_image(lock_dir: Path, log: Callable[[str], None], nested: bool = False) -> str:
    """The node image's tag (the nested-container node image's with `nested`), building the base, the node
    image and the nested one only where missing."""
    node, base = node_tag(), base_tag()
    want = nested_tag() if nested else node
    lock_dir.mkdir(parents=True, exist_ok=True)
    # Concurrent `up`s would build the same tag twice; one waits for the other instead.
    with open(lock_dir / "image.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _exists(want):
            return want
        if not _exists(node):
            if not _exists(base):
                _build_base(base, log)
            _build_node(node, base, log)
        if nested:
            _build_nested(want, node, log)
    return want


def purge_images() -> tuple[list[str], list[str]]:
    """Remove every sandbox image no container uses; returns (removed, kept in use)."""
    removed, kept = [], []
    # Node images first: a base cannot go while an image built FROM it exists.
    for repo in (NESTED_REPO, "localhost/k31-standin-serving", NODE_REPO, BASE_REPO):
        listed = podman.json_out("images", "--filter", f"reference={repo}", "--format", "json")
        for image in listed:
            for name in image.get("Names") or [image["Id"]]:
                proc = podman.run("rmi", name, check=False)
                (removed if proc.returncode == 0 else kept).append(name)
    return removed, kept
