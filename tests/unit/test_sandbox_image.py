"""Image recipe hashing and apt mirror discovery, without podman or debootstrap."""

import shutil

import pytest
import yaml

from k31deploy.sandbox import DATA_DIR
from k31deploy.sandbox.image import (
    BASE_RECIPE,
    DEFAULT_MIRROR,
    NODE_RECIPE,
    Source,
    apt_sources,
    base_tag,
    debian_mirror,
    node_tag,
    parse_deb822_sources,
    parse_one_line_sources,
    recipe_hash,
)


@pytest.fixture
def recipe(tmp_path):
    for name in (BASE_RECIPE, *NODE_RECIPE):
        shutil.copy(DATA_DIR / name, tmp_path / name)
    return tmp_path


def test_tags_are_stable_for_an_unchanged_recipe(recipe):
    assert base_tag(recipe) == base_tag(DATA_DIR) == base_tag(recipe)
    assert node_tag(recipe) == node_tag(DATA_DIR)
    assert base_tag().startswith("localhost/k31-sandbox-base:")
    assert node_tag().startswith("localhost/k31-sandbox:")


@pytest.mark.parametrize("name", NODE_RECIPE)
def test_node_recipe_change_rebuilds_node_but_reuses_base(recipe, name):
    before_base, before_node = base_tag(recipe), node_tag(recipe)
    with open(recipe / name, "a") as f:
        f.write("\n# changed\n")
    assert base_tag(recipe) == before_base
    assert node_tag(recipe) != before_node


def test_base_recipe_change_rebuilds_both(recipe):
    before_base, before_node = base_tag(recipe), node_tag(recipe)
    data = yaml.safe_load((recipe / BASE_RECIPE).read_text())
    data["include"].append("less")
    (recipe / BASE_RECIPE).write_text(yaml.safe_dump(data))
    assert base_tag(recipe) != before_base
    assert node_tag(recipe) != before_node


def test_recipe_hash_separates_names_from_contents():
    assert recipe_hash([("a", b"bc")]) != recipe_hash([("ab", b"c")])
    assert recipe_hash([("a", b""), ("b", b"x")]) != recipe_hash([("a", b"x"), ("b", b"")])


def test_host_keys_never_enter_the_image():
    base = yaml.safe_load((DATA_DIR / BASE_RECIPE).read_text())
    assert "./etc/ssh/ssh_host_*" in base["exclude"]
    containerfile = (DATA_DIR / "Containerfile").read_text()
    assert "rm -f /etc/ssh/ssh_host_*" in containerfile
    assert "ssh-keygen" not in containerfile
    unit = (DATA_DIR / "k31-ssh-host-keys.service").read_text()
    assert "Before=ssh.service" in unit and "ssh-keygen -A" in unit


def test_one_line_sources():
    text = """\
# deb http://commented.example/debian bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/k.gpg] http://mirror.example/debian bookworm main contrib
deb-src http://src.example/debian bookworm main
deb http://security.example/debian-security bookworm-security main  # trailing comment
"""
    assert parse_one_line_sources(text) == [
        Source("http://mirror.example/debian", ("bookworm",), "/usr/share/keyrings/k.gpg"),
        Source("http://security.example/debian-security", ("bookworm-security",), None),
    ]


def test_deb822_sources():
    text = """\
Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.example/debian http://alt.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb-src
URIs: http://src.example/debian
Suites: bookworm

Types: deb
URIs: http://off.example/debian
Suites: bookworm
Enabled: no
"""
    keyring = "/usr/share/keyrings/debian-archive-keyring.gpg"
    assert parse_deb822_sources(text) == [
        Source("http://deb.example/debian", ("bookworm", "bookworm-updates"), keyring),
        Source("http://alt.example/debian", ("bookworm", "bookworm-updates"), keyring),
    ]


def test_apt_sources_reads_what_apt_reads(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text("deb http://one.example/debian bookworm-updates main\n")
    (tmp_path / "sources.list.d" / "b.sources").write_text(
        "Types: deb\nURIs: http://two.example/debian\nSuites: bookworm\nComponents: main\n"
    )
    (tmp_path / "sources.list.d" / "a.list").write_text("deb http://three.example/debian trixie main\n")
    (tmp_path / "sources.list.d" / "c.list.disabled-by-farm").write_text(
        "deb http://ignored.example/debian bookworm main\n"
    )
    uris = [source.uri for source in apt_sources(tmp_path)]
    assert uris == ["http://one.example/debian", "http://three.example/debian", "http://two.example/debian"]
    # The suite itself wins over -updates and other releases.
    assert debian_mirror("bookworm", apt_sources(tmp_path)).uri == "http://two.example/debian"


def test_mirror_fallback_and_override(monkeypatch):
    monkeypatch.delenv("K31_SANDBOX_MIRROR", raising=False)
    other = [Source("http://x.example/debian", ("trixie",))]
    assert debian_mirror("bookworm", other).uri == DEFAULT_MIRROR
    monkeypatch.setenv("K31_SANDBOX_MIRROR", "http://local.example/debian")
    assert debian_mirror("bookworm", other).uri == "http://local.example/debian"
