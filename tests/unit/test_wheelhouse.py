"""The wheelhouse: pinned sets, "already complete" detection, and the offline pip command lines."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from packaging.version import Version

from k31deploy import wheelhouse as wh
from k31deploy.commands import wheelhouse as wh_command
from k31deploy.errors import K31Error


def wheel_name(pin: wh.Pin, tag: str = "py3-none-any") -> str:
    return f"{pin.name.replace('-', '_')}-{pin.version}-{tag}.whl"


def fill(directory: Path, pins, tag: str = "py3-none-any") -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for pin in pins:
        (directory / wheel_name(pin, tag)).write_bytes(b"")


class FakePip:
    """Stands in for pip: records argv and 'downloads' an empty wheel per requested pin."""

    def __init__(self, code: int = 0, create: bool = True):
        self.calls: list[list[str]] = []
        self.code = code
        self.create = create

    def __call__(self, argv: list[str]) -> int:
        self.calls.append(argv)
        if self.create and "download" in argv:
            dest = Path(argv[argv.index("--dest") + 1])
            requested = [a for a in argv if re.fullmatch(r"[a-z0-9-]+==[^=]+", a)]
            fill(dest, [wh.Pin(*a.split("==")) for a in requested])
        return self.code


# -- requirement files ------------------------------------------------------------------------


def test_parse_requirements_reads_pins_and_canonicalises_names():
    text = "# header\n\nFoo_Bar==1.2.0  # why\nbaz.qux==2026.9.0\n"
    assert wh.parse_requirements(text) == [wh.Pin("foo-bar", "1.2.0"), wh.Pin("baz-qux", "2026.9.0")]


@pytest.mark.parametrize(
    "line",
    ["foo>=1.0", "foo", "foo==1.0,<2", "foo[extra]==1.0", "foo==1.0; python_version < '3.12'", "!!"],
)
def test_parse_requirements_rejects_anything_but_one_exact_pin(line):
    with pytest.raises(K31Error, match="line 2"):
        wh.parse_requirements(f"ok==1\n{line}\n", source="x.txt")


def test_shipped_sets_pin_one_version_per_package():
    for set_name in wh.SETS:
        pins = wh.set_pins(set_name)
        names = [p.name for p in pins]
        assert len(names) == len(set(names)), f"{set_name} pins a package twice"


def test_shipped_sets_hold_what_the_nodes_run():
    router = set(wh.set_pins("router"))
    dynamo = set(wh.set_pins("dynamo"))
    assert wh.Pin("sglang-router", "0.3.2") in router
    nodeps = wh.parse_requirements((wh.DATA_DIR / "dynamo.nodeps.txt").read_text())
    assert nodeps == [wh.Pin("ai-dynamo", "1.6.1"), wh.Pin("ai-dynamo-runtime", "1.6.1")]
    # field notes §5: the runtime deps the offline recipe installs, plus tokenizers for the tiny model
    dynamo_names = {p.name for p in dynamo}
    assert {"pydantic", "uvloop", "msgspec", "pyyaml", "packaging", "pyzmq", "tokenizers"} <= dynamo_names
    # the aisimulate dependency is what breaks an ordinary install; openai is a test-side client only
    assert not {"aisimulate", "openai"} & (dynamo_names | {p.name for p in router})
    # the Mooncake store master is a binary in the transfer-engine wheel; none of its Python deps
    assert wh.set_pins("mooncake") == [wh.Pin("mooncake-transfer-engine", "0.3.13.post1")]
    assert wh.SETS["mooncake"] == (("mooncake.nodeps.txt", True),)


def test_dynamo_pydantic_pin_honours_the_runtime_bound():
    pydantic = next(p for p in wh.set_pins("dynamo") if p.name == "pydantic")
    assert Version("2.10.6") <= Version(pydantic.version) <= Version("2.13.5")


def test_set_names_expands_all_and_rejects_unknown():
    assert wh.set_names("all") == ["router", "dynamo", "mooncake"]
    assert wh.set_names("dynamo") == ["dynamo"]
    with pytest.raises(K31Error, match="router, dynamo, mooncake or all"):
        wh.set_names("vllm")


# -- target platform ---------------------------------------------------------------------------


def test_platform_tags_cover_bookworm_glibc_and_no_newer():
    x86 = wh.platform_tags("x86_64")
    assert {
        "manylinux_2_36_x86_64",
        "manylinux_2_28_x86_64",
        "manylinux2014_x86_64",
        "manylinux1_x86_64",
    } <= set(x86)
    assert "manylinux_2_37_x86_64" not in x86
    arm = wh.platform_tags("aarch64")
    assert {"manylinux_2_36_aarch64", "manylinux2014_aarch64"} <= set(arm)
    assert not any(t.endswith("x86_64") for t in arm)
    assert "manylinux1_aarch64" not in arm


@pytest.mark.parametrize(("machine", "arch"), [("x86_64", "x86_64"), ("AMD64", "x86_64"), ("arm64", "aarch64")])
def test_host_arch_maps_machine_names(machine, arch):
    assert wh.host_arch(machine) == arch


def test_host_arch_rejects_other_cpus():
    with pytest.raises(K31Error, match="x86_64, aarch64"):
        wh.host_arch("riscv64")


# -- "already complete" detection ---------------------------------------------------------------

PINS = [wh.Pin("alpha", "1.0"), wh.Pin("beta-pkg", "2.3.1"), wh.Pin("gamma", "0.9")]


def test_complete_folder_has_nothing_missing(tmp_path):
    fill(tmp_path, PINS)
    assert wh.missing_pins(PINS, tmp_path, "x86_64") == []


def test_absent_folder_misses_everything(tmp_path):
    assert wh.missing_pins(PINS, tmp_path / "nope", "x86_64") == PINS


@pytest.mark.parametrize(
    ("tag", "counts"),
    [
        ("cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64", True),
        ("cp310-abi3-manylinux_2_28_x86_64", True),  # abi3 from an older CPython
        ("cp311-cp311-manylinux1_x86_64", True),
        ("cp311-cp311-manylinux_2_39_x86_64", False),  # needs a newer glibc than bookworm's
        ("cp311-cp311-manylinux_2_17_aarch64", False),  # other CPU
        ("cp312-cp312-manylinux_2_17_x86_64", False),  # other Python
        ("cp311-cp311-musllinux_1_2_x86_64", False),
        ("cp311-cp311-macosx_11_0_arm64", False),
    ],
)
def test_only_wheels_a_bookworm_node_can_install_count(tmp_path, tag, counts):
    fill(tmp_path, PINS[:2])
    fill(tmp_path, PINS[2:], tag=tag)
    assert wh.missing_pins(PINS, tmp_path, "x86_64") == ([] if counts else PINS[2:])


def test_other_version_of_a_pinned_package_does_not_count(tmp_path):
    fill(tmp_path, [PINS[0], PINS[1], wh.Pin("gamma", "0.8")])
    assert wh.missing_pins(PINS, tmp_path, "x86_64") == [PINS[2]]


def test_equal_versions_spelled_differently_count(tmp_path):
    fill(tmp_path, [wh.Pin("alpha", "1.0.0"), *PINS[1:]])
    assert wh.missing_pins(PINS, tmp_path, "x86_64") == []


# -- build ------------------------------------------------------------------------------------


def test_download_command_targets_the_nodes_not_the_controller(tmp_path):
    argv = wh.download_command(PINS, tmp_path, "aarch64", python="/py")
    assert argv[:4] == ["/py", "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(argv)
    assert argv[argv.index("--python-version") + 1] == "3.11"
    assert argv[argv.index("--implementation") + 1] == "cp"
    platforms = [argv[i + 1] for i, a in enumerate(argv) if a == "--platform"]
    assert platforms == wh.platform_tags("aarch64")
    assert argv[argv.index("--dest") + 1] == str(tmp_path)
    assert argv[-3:] == ["alpha==1.0", "beta-pkg==2.3.1", "gamma==0.9"]


def test_build_downloads_only_what_is_missing_then_nothing(tmp_path):
    pins = wh.set_pins("dynamo")
    fill(tmp_path, pins[:5])
    pip, said = FakePip(), []
    wh.build("dynamo", tmp_path, "x86_64", run=pip, say=said.append)
    assert len(pip.calls) == 1
    requested = {a for a in pip.calls[0] if "==" in a}
    assert requested == {str(p) for p in pins[5:]}
    assert (tmp_path / "dynamo.txt").read_text() == (wh.DATA_DIR / "dynamo.txt").read_text()
    assert (tmp_path / "dynamo.nodeps.txt").is_file()

    again, said = FakePip(), []
    wh.build("dynamo", tmp_path, "x86_64", run=again, say=said.append)
    assert again.calls == []
    assert "nothing downloaded" in said[0]


def test_build_all_covers_both_sets(tmp_path):
    pip = FakePip()
    wh.build("all", tmp_path, "x86_64", run=pip, say=lambda _: None)
    assert wh.missing_pins(wh.set_pins("router") + wh.set_pins("dynamo"), tmp_path, "x86_64") == []
    assert {"router.txt", "dynamo.txt", "dynamo.nodeps.txt"} <= {p.name for p in tmp_path.iterdir()}


def test_build_reports_a_failed_download(tmp_path):
    with pytest.raises(K31Error, match=r"exit 1\).*copy a wheelhouse"):
        wh.build("router", tmp_path, "x86_64", run=FakePip(code=1), say=lambda _: None)


def test_build_reports_wheels_pip_did_not_deliver(tmp_path):
    with pytest.raises(K31Error, match=r"still lacks .*sglang-router==0\.3\.2"):
        wh.build("router", tmp_path, "x86_64", run=FakePip(create=False), say=lambda _: None)


# -- install ----------------------------------------------------------------------------------


def test_install_commands_use_only_the_wheelhouse(tmp_path):
    venv, house = tmp_path / "venv", tmp_path / "house"
    deps, nodeps = wh.install_commands("dynamo", venv, house)
    for argv in (deps, nodeps):
        assert argv[:4] == [str(venv / "bin" / "python"), "-m", "pip", "install"]
        assert "--no-index" in argv
        assert argv[argv.index("--find-links") + 1] == str(house)
    assert deps[-2:] == ["-r", str(house / "dynamo.txt")] and "--no-deps" not in deps
    assert nodeps[-2:] == ["-r", str(house / "dynamo.nodeps.txt")] and "--no-deps" in nodeps
    (router,) = wh.install_commands("router", venv, house)
    assert router[-2:] == ["-r", str(house / "router.txt")] and "--no-deps" not in router


def complete_house(path: Path, set_name: str) -> Path:
    wh.build(set_name, path, wh.host_arch(), run=FakePip(), say=lambda _: None)
    return path


def test_install_refuses_an_incomplete_wheelhouse(tmp_path):
    house = complete_house(tmp_path / "house", "dynamo")
    victim = next(house.glob("tokenizers-*.whl"))
    victim.unlink()
    pip = FakePip()
    with pytest.raises(K31Error, match=r"tokenizers==.*k31 wheelhouse build --set dynamo"):
        wh.install("dynamo", tmp_path / "venv", house, run=pip, say=lambda _: None)
    assert pip.calls == []


def test_install_refuses_a_wheelhouse_without_its_requirement_files(tmp_path):
    house = complete_house(tmp_path / "house", "router")
    (house / "router.txt").unlink()
    with pytest.raises(K31Error, match=r"first: router\.txt"):
        wh.install("router", tmp_path / "venv", house, run=FakePip(), say=lambda _: None)


def test_install_creates_the_venv_runs_pip_offline_then_skips(tmp_path, monkeypatch):
    house = complete_house(tmp_path / "house", "dynamo")
    venv = tmp_path / "venv"
    checked = []
    monkeypatch.setattr(wh, "check_python", checked.append)

    def pip(argv):
        if argv[1:3] == ["-m", "venv"]:
            (venv / "bin").mkdir(parents=True)
            (venv / "bin" / "python").write_text("")
            (venv / "bin" / "pip").write_text("")
        return 0

    calls = []
    wh.install(
        "dynamo",
        venv,
        house,
        python="/usr/bin/python3",
        run=lambda a: calls.append(a) or pip(a),
        say=lambda _: None,
    )
    assert checked == ["/usr/bin/python3"]
    assert calls[0] == ["/usr/bin/python3", "-m", "venv", "--clear", str(venv)]
    assert calls[1:] == wh.install_commands("dynamo", venv, house)

    again = FakePip()
    said = []
    wh.install("dynamo", venv, house, run=again, say=said.append)
    assert again.calls == []
    assert "nothing installed" in said[0]


def test_a_venv_cut_short_before_pip_is_made_again(tmp_path, monkeypatch):
    house = complete_house(tmp_path / "house", "router")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")    # `python -m venv` killed before ensurepip ran
    monkeypatch.setattr(wh, "check_python", lambda _: None)
    pip = FakePip()
    wh.install("router", venv, house, python="/usr/bin/python3", run=pip, say=lambda _: None)
    assert pip.calls[0] == ["/usr/bin/python3", "-m", "venv", "--clear", str(venv)]


def test_install_reinstalls_when_the_pins_change(tmp_path, monkeypatch):
    house = complete_house(tmp_path / "house", "router")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / "bin" / "pip").write_text("")
    (venv / ".k31-wheelhouse-router").write_text("sglang-router==0.3.1\n")
    pip = FakePip()
    wh.install("router", venv, house, run=pip, say=lambda _: None)
    assert pip.calls == wh.install_commands("router", venv, house)


def test_install_reports_a_failing_pip(tmp_path):
    house = complete_house(tmp_path / "house", "router")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    (tmp_path / "venv" / "bin" / "pip").write_text("")
    with pytest.raises(K31Error, match="offline pip install of set router"):
        wh.install("router", tmp_path / "venv", house, run=FakePip(code=1), say=lambda _: None)


def test_install_names_an_interpreter_that_does_not_run(tmp_path):
    house = complete_house(tmp_path / "house", "router")
    with pytest.raises(K31Error, match=r"--python /nonexistent/python3 is not runnable.*CPython 3\.11"):
        wh.install("router", tmp_path / "venv", house, python="/nonexistent/python3", say=lambda _: None)


def test_install_takes_one_set(tmp_path):
    with pytest.raises(K31Error, match="router, dynamo"):
        wh.install("all", tmp_path / "venv", tmp_path, run=FakePip(), say=lambda _: None)


# -- command line -----------------------------------------------------------------------------


def parse(argv):
    parser = argparse.ArgumentParser(prog="k31")
    wh_command.register(parser.add_subparsers(required=True))
    return parser.parse_args(argv)


def test_cli_build_passes_set_dest_and_arch(tmp_path, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(wh, "build", lambda choice, dest, arch: seen.update(c=choice, d=dest, a=arch) or dest)
    args = parse(["wheelhouse", "build", "--set", "router", "--dest", str(tmp_path), "--arch", "arm64"])
    assert args.func(args) == 0
    assert seen == {"c": "router", "d": tmp_path, "a": "aarch64"}
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path)


def test_cli_build_defaults_to_all_sets_in_the_state_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("K31_STATE_DIR", str(tmp_path))
    seen = {}
    monkeypatch.setattr(wh, "build", lambda choice, dest, arch: seen.update(c=choice, d=dest) or dest)
    args = parse(["wheelhouse", "build"])
    args.func(args)
    assert seen == {"c": "all", "d": tmp_path / "wheelhouse"}


def test_cli_install_needs_set_and_venv():
    with pytest.raises(SystemExit):
        parse(["wheelhouse", "install", "--set", "dynamo"])
    args = parse(["wheelhouse", "install", "--set", "dynamo", "--venv", "v", "--from", "h"])
    assert (args.set_name, args.venv, args.source) == ("dynamo", Path("v"), Path("h"))


def test_pack_is_one_reproducible_tar_whose_digest_tracks_the_set(tmp_path):
    import tarfile

    fill(tmp_path, wh.set_pins("router"))
    path, digest, changed = wh.pack("router", tmp_path, "x86_64")
    assert changed and path == tmp_path / "packs" / "router.tar"
    first = path.read_bytes()
    again = wh.pack("router", tmp_path, "x86_64")
    assert again == (path, digest, False) and path.read_bytes() == first       # nothing rewritten
    with tarfile.open(path) as tar:
        names = tar.getnames()
        assert "router.txt" in names and len(names) == len(wh.set_pins("router")) + 1
        assert {m.mtime for m in tar.getmembers()} == {0}
    (tmp_path / wheel_name(wh.set_pins("router")[0])).write_bytes(b"rebuilt")   # a wheel changed size
    _, new_digest, changed = wh.pack("router", tmp_path, "x86_64")
    assert changed and new_digest != digest


def test_pack_refuses_an_incomplete_set(tmp_path):
    fill(tmp_path, wh.set_pins("router")[1:])
    with pytest.raises(K31Error, match=r"lacks .* of set router; run `k31 wheelhouse build --set router`"):
        wh.pack("router", tmp_path, "x86_64")
