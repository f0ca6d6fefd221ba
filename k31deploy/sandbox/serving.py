"""The sandbox's stand-in serving image and its registry.

The image (data/sandbox/serving) is built locally FROM the debootstrap'd sandbox base -- nothing can be pulled
here -- and carries the CPU stand-in behind the real image's entry point shape (`python3 -m
sglang.launch_server ARGS`). A shape with `registry: HOST` runs Debian's docker-registry (the CNCF
distribution registry) on that node; the image is pushed there and deploys pull it by digest. Each
`revision` is a build of its own (a new digest of the same code: what an image roll rolls), and `broken`
builds one whose entry point exits at once (what a roll-back must survive).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from k31deploy.bundle import write_bundle
from k31deploy.errors import K31Error
from k31deploy.sandbox import DATA_DIR, image, podman

SERVING_REPO = "localhost/k31-standin-serving"
SERVING_DIR = DATA_DIR / "serving"
REGISTRY_PORT = 5000
# The repository deploys pull from, on the registry node.
REGISTRY_REPO = "standin/sglang-serving"
# Debian's docker-registry ships a config with htpasswd auth and no users; the sandbox's registry takes
# anonymous pulls and pushes on the sandbox network only (its nodes and the controller).
REGISTRY_CONFIG = """\
# k31 sandbox registry (k31 sandbox up): anonymous, plain HTTP on the sandbox network only.
version: 0.1
log:
  fields:
    service: registry
storage:
  filesystem:
    rootdirectory: /var/lib/docker-registry
  delete:
    enabled: true
http:
  addr: {address}:{port}
health:
  storagedriver:
    enabled: true
"""


@dataclass(frozen=True)
class Pushed:
    """An image in the sandbox registry: `ref` (repo@sha256:...) is what a deploy runs."""

    tag: str          # the registry tag it was pushed under (repo:tag)
    digest: str       # sha256:... of its manifest
    local: str        # the controller's local image it was pushed from

    @property
    def ref(self) -> str:
        return f"{self.tag.rsplit(':', 1)[0]}@{self.digest}"

    def to_dict(self) -> dict[str, str]:
        return {"tag": self.tag, "digest": self.digest, "ref": self.ref, "local": self.local}


def variant(revision: int, broken: bool) -> str:
    if revision < 1:
        raise K31Error(f"--revision must be 1 or more (got {revision})")
    return f"r{revision}" + ("-broken" if broken else "")


def serving_tag(bundle_digest: str, revision: int, broken: bool) -> str:
    """Local tag: the base, every recipe file, the k31deploy bundle and the variant are in it."""
    parts = [("base", image.base_tag().encode()), ("bundle", bundle_digest.encode()),
             ("variant", variant(revision, broken).encode())]
    parts += [(str(p.relative_to(SERVING_DIR)), p.read_bytes()) for p in sorted(SERVING_DIR.rglob("*"))
              if p.is_file() and "__pycache__" not in p.parts]
    return f"{SERVING_REPO}:{image.recipe_hash(parts)}"


def build(lock_dir: Path, revision: int = 1, broken: bool = False, log=print) -> str:
    """The stand-in serving image's local tag, built where missing (the base too)."""
    with tempfile.TemporaryDirectory(prefix="k31-serving-ctx-") as context:
        ctx = Path(context)
        _, digest = write_bundle(ctx / "k31deploy.tar")
        tag = serving_tag(digest, revision, broken)
        if podman.run("image", "exists", tag, check=False).returncode == 0:
            return tag
        image.ensure_base(lock_dir, log)
        for path in SERVING_DIR.iterdir():
            (shutil.copytree if path.is_dir() else shutil.copy)(path, ctx / path.name)
        log(f"building the stand-in serving image {tag} ({variant(revision, broken)})")
        podman.run("build", "--pull=never", "--build-arg", f"BASE={image.base_tag()}",
                   "--label", f"k31.standin.revision={revision}", "--label", f"k31.standin.broken={int(broken)}",
                   "--env", f"K31_STANDIN_BROKEN={int(broken)}", "-t", tag, context)
        labels = podman.json_out("image", "inspect", tag)[0].get("Labels") or {}
        if labels.get("k31.standin.revision") != str(revision):
            raise K31Error(f"podman build of {tag} did not take its revision label (got {labels}); "
                           f"remove the image and build again")
    return tag


def registry_config(address: str) -> str:
    return REGISTRY_CONFIG.format(address=address, port=REGISTRY_PORT)


def registries_conf(address: str) -> str:
    """containers-registries.conf(5) drop-in for the nodes: the sandbox registry speaks plain HTTP."""
    return (f"# k31 sandbox (k31 sandbox up): the sandbox registry speaks plain HTTP on the sandbox network.\n"
            f"[[registry]]\nlocation = \"{address}:{REGISTRY_PORT}\"\ninsecure = true\n")


def wait_registry(address: str, timeout: float = 60.0) -> None:
    url = f"http://{address}:{REGISTRY_PORT}/v2/"
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=3) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.5)
    raise K31Error(f"the sandbox registry at {url} did not answer within {timeout:.0f} s ({last})")


def push(local: str, address: str, revision: int, broken: bool, directory: Path) -> Pushed:
    """Push `local` to the sandbox registry; the digest is the registry's own (podman push --digestfile)."""
    tag = f"{address}:{REGISTRY_PORT}/{REGISTRY_REPO}:{variant(revision, broken)}"
    digest_file = directory / f"digest-{variant(revision, broken)}"
    podman.run("push", "--tls-verify=false", "--digestfile", str(digest_file), local, f"docker://{tag}")
    digest = digest_file.read_text().strip()
    if not digest.startswith("sha256:"):
        raise K31Error(f"podman push of {tag} wrote no sha256 digest (got {digest!r})")
    return Pushed(tag=tag, digest=digest, local=local)


def save(local: str, path: Path, name: str) -> dict[str, str]:
    """A `podman save` archive of `local` under `name` (the plan's image name), for k31_image_source=tarball;
    returns the archive's path and the image ID a load must give."""
    path.parent.mkdir(parents=True, exist_ok=True)
    podman.run("tag", local, name)
    try:
        if path.exists():
            path.unlink()
        podman.run("save", "--format", "docker-archive", "-o", str(path), name)
    finally:
        podman.run("untag", local, name, check=False)
    image_id = podman.json_out("image", "inspect", local)[0]["Id"]
    return {"tarball": str(path), "name": name, "id": f"sha256:{image_id.removeprefix('sha256:')}"}


def record(directory: Path, pushed: Pushed, revision: int, broken: bool) -> None:
    """What `k31 sandbox image` pushed, newest last (images.json beside the inventory)."""
    path = directory / "images.json"
    entries = json.loads(path.read_text()) if path.is_file() else []
    entries.append({**pushed.to_dict(), "revision": revision, "broken": broken})
    path.write_text(json.dumps(entries, indent=1) + "\n")
