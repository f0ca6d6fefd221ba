"""k31deploy.staging: the tree fan-out schedule k31_model follows with k31_model_fanout=tree, its filter, and the
knob's validation."""

from __future__ import annotations

import importlib.util
import math
import shutil
from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError

from k31deploy.errors import K31Error
from k31deploy.recipe import from_mapping, resolve
from k31deploy.staging import differing, from_controller, peer_args, rounds, stage_items

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("k31_staging_filters",
                                               ROOT / "roles/k31_model/filter_plugins/k31_staging.py")
plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plugin)
FILTERS = plugin.FilterModule().filters()


def hosts(n: int) -> list[str]:
    return [f"n{i}" for i in range(n)]


def test_seed_among_the_hosts_doubles_the_holders_each_round():
    got = rounds(hosts(8), "n0")
    assert got["rounds"] == 3
    assert got["hosts"] == {
        "n0": {"round": 1, "source": "n0", "after": []},    # the seed's own copy is local
        "n1": {"round": 1, "source": "n0", "after": []},
        # no barrier between rounds: a host starts after its source (staged in this run) and after the host its
        # source served before it, so a source's link carries one copy at a time
        "n2": {"round": 2, "source": "n0", "after": ["n1"]}, "n3": {"round": 2, "source": "n1", "after": ["n1"]},
        "n4": {"round": 3, "source": "n0", "after": ["n2"]}, "n5": {"round": 3, "source": "n1", "after": ["n1", "n3"]},
        "n6": {"round": 3, "source": "n2", "after": ["n2"]}, "n7": {"round": 3, "source": "n3", "after": ["n3"]},
    }


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 9, 16, 17, 100])
def test_about_log2_rounds_and_every_source_holds_a_copy_before_it_serves(n):
    for seed_inside in (True, False):
        names = hosts(n)
        seed = names[0] if seed_inside else "seed"
        got = rounds(names, seed)
        assert set(got["hosts"]) == set(names)
        # holders after r rounds: 2**r (seed included), so n hosts (+ an outside seed) need ceil(log2(...)) rounds
        assert got["rounds"] == max(1, math.ceil(math.log2(n + (0 if seed_inside else 1))))
        done = {seed: 0}
        for host in sorted(got["hosts"], key=lambda h: got["hosts"][h]["round"]):
            step = got["hosts"][host]
            if host != seed:    # the seed serves its source directories from the start
                assert done[step["source"]] < step["round"], (host, step)
                assert all(done[h] < step["round"] for h in step["after"]), (host, step)
                done[host] = step["round"]
        per_round = {}
        for host, step in got["hosts"].items():
            if host != step["source"]:
                per_round.setdefault((step["round"], step["source"]), []).append(host)
        assert all(len(targets) == 1 for targets in per_round.values()), per_round    # one copy per source per round


def test_hosts_already_holding_a_copy_are_sources_from_the_first_round():
    got = rounds(hosts(8), "n0", have=["n0", "n5"])
    assert got["rounds"] == 2
    assert "n5" not in got["hosts"] and "n0" not in got["hosts"]
    assert got["hosts"]["n1"] == {"round": 1, "source": "n0", "after": []}
    assert got["hosts"]["n2"] == {"round": 1, "source": "n5", "after": []}    # n5 held a verified copy already
    assert got["hosts"]["n4"] == {"round": 2, "source": "n5", "after": ["n2"]}
    assert rounds(hosts(4), "n0", have=hosts(4)) == {"rounds": 0, "hosts": {}}


def test_deterministic_whatever_the_duplicates():
    assert rounds(["a", "b", "a", "c"], "s") == rounds(["a", "b", "c"], "s")
    assert rounds(hosts(6), "n3")["hosts"]["n0"] == {"round": 1, "source": "n3", "after": []}


def test_refusals_are_one_sentence():
    with pytest.raises(K31Error, match="needs a seed host"):
        rounds(hosts(2), "")
    with pytest.raises(K31Error, match="x are said to hold a copy but are not staging hosts"):
        rounds(hosts(2), "n0", have=["x"])
    with pytest.raises(AnsibleFilterError, match="needs a seed host"):
        FILTERS["k31_model_rounds"](hosts(2), "")


def test_filter_and_its_doc():
    assert FILTERS["k31_model_rounds"](hosts(2), "n0") == rounds(hosts(2), "n0")
    for name in FILTERS:
        assert (ROOT / "roles/k31_model/filter_plugins" / f"{name}.yml").is_file(), name


MODEL = {"name": "model", "dest": "/models/k3", "src": "/srv/k3", "repo": "moonshotai/Kimi-K3.1-Pro", "manifest": ""}
DRAFT = {"name": "draft", "dest": "/models/draft", "src": "", "repo": "z-lab/draft", "manifest": "/srv/draft.sums"}


def test_what_a_host_stages_and_why_not():
    got = stage_items([MODEL, DRAFT], "path")
    assert got["items"] == [{**MODEL, "sums": "/models/k3/SHA256SUMS",
                             "stamp": "/var/lib/k31/verified/_models_k3.sha256"}]
    assert got["why_not"] == ["draft: no source directory (k31_model_source_dir, k31_model_draft_source_dir)"]
    # the hub needs no source directory; a manifest given is the one checked
    got = stage_items([MODEL, DRAFT], "hub")
    assert [(i["name"], i["sums"]) for i in got["items"]] == [("model", "/models/k3/SHA256SUMS"),
                                                               ("draft", "/srv/draft.sums")]
    assert got["why_not"] == []
    relative = {**MODEL, "dest": "moonshotai/Kimi-K3.1-Pro"}
    assert stage_items([relative], "rsync") == {
        "items": [], "why_not": ["model: its path in the plan is not a local directory"]}
    assert stage_items([MODEL], "") == {
        "items": [], "why_not": ["k31_model_source is unset: engines read model_path as it is (nothing staged)"]}
    assert FILTERS["k31_model_stage_items"]([MODEL], "path") == stage_items([MODEL], "path")


def test_an_rsync_dry_run_that_lists_only_directory_times_found_nothing_to_copy():
    results = [{"item": MODEL, "stdout_lines": [".d..t...... ./"]},
               {"item": DRAFT, "stdout_lines": [".d..t...... ./", ">f+++++++++ model.safetensors"]},
               {"item": {"name": "other"}, "skipped": True}]
    assert differing(results) == ["draft"] == FILTERS["k31_model_differing"](results)
    assert differing([{"item": MODEL, "stdout_lines": []}]) == []


def test_a_host_fed_by_the_seed_reads_its_source_and_one_fed_by_a_peer_reads_the_peers_copy():
    items = stage_items([MODEL, {**DRAFT, "src": "/srv/draft"}], "rsync")["items"]
    from_seed = peer_args({"round": 1, "source": "n0", "after": []}, items, ["model", "draft"], "n0")
    assert from_seed == ["/srv/k3/", "/models/k3/", "/models/k3/SHA256SUMS", "/var/lib/k31/verified/_models_k3.sha256",
                         "/srv/draft/", "/models/draft/", "/srv/draft.sums",
                         "/var/lib/k31/verified/_models_draft.sha256"]
    from_peer = FILTERS["k31_model_peer_args"]({"round": 2, "source": "n1", "after": ["n1"]}, items, ["draft"], "n0")
    assert from_peer == ["/models/draft/", "/models/draft/", "/srv/draft.sums",
                         "/var/lib/k31/verified/_models_draft.sha256"]


def test_fanout_knob_is_validated_with_its_choices():
    pd = {"platform": "mi355x", "agents": 92}

    def pd_hosts(**extra):
        return [from_mapping("p0", ["k31_prefill"], {"ansible_host": "192.0.2.1"}),
                from_mapping("d0", ["k31_decode"], {"ansible_host": "192.0.2.2", **extra}),
                from_mapping("r0", ["k31_router"], {"ansible_host": "192.0.2.9"})]

    with pytest.raises(K31Error, match=r"^k31_model_fanout=chain \(host d0\) is not valid; valid choices: tree, seed "
                                       r"\(roles/k31_model/meta/argument_specs.yml\)$"):
        resolve(pd, pd_hosts(k31_model_fanout="chain"))
    for ok in ("tree", "seed"):
        assert resolve(pd, pd_hosts(k31_model_fanout=ok))


SCRIPT = ROOT / "roles/k31_model/files/k31-stage-from-peer.sh"


def stage_job(tmp_path, verify="sha256", after="", source=""):
    import subprocess

    src, dest, state = tmp_path / "src", tmp_path / "dest", tmp_path / "state" / "staging-state"
    stamp = tmp_path / "verified" / "dest.sha256"
    argv = ["sh", "-c", SCRIPT.read_text(), "k31-stage", "ssh -o BatchMode=yes", source, after, verify, "5",
            str(state), f"{src}/", f"{dest}/", str(dest / "SHA256SUMS"), str(stamp)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30), state, stamp


def make_src(tmp_path):
    import hashlib

    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    files = {"model-00001.safetensors": b"w" * 1000, "sub/tokenizer.json": b"{}"}
    for name, data in files.items():
        (src / name).write_bytes(data)
    (src / "SHA256SUMS").write_text("".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, d in files.items()))
    return src


needs_rsync = pytest.mark.skipif(shutil.which("rsync") is None, reason="no rsync here (the nodes have it)")


@needs_rsync
def test_stage_job_copies_verifies_then_says_ok(tmp_path):
    make_src(tmp_path)
    done, state, stamp = stage_job(tmp_path)
    assert done.returncode == 0, done.stderr
    assert state.read_text() == "ok\n"
    assert (tmp_path / "dest/sub/tokenizer.json").read_bytes() == b"{}"
    assert stamp.is_file()


@needs_rsync
def test_stage_job_says_failed_on_a_bad_copy(tmp_path):
    src = make_src(tmp_path)
    (src / "sub/tokenizer.json").write_bytes(b"corrupt")    # the manifest no longer matches
    done, state, stamp = stage_job(tmp_path)
    assert done.returncode == 1
    assert state.read_text().startswith("failed: ") and "does not match" in state.read_text()
    assert not stamp.exists()


@needs_rsync
def test_stage_job_copies_one_file_and_checks_it_in_its_directory(tmp_path):
    """A file item (k31_image_fanout=tree: the image archive): SRC and DEST as plain paths, the manifest's name
    relative to DEST's directory."""
    import hashlib
    import subprocess

    data = b"an image archive" * 1000
    (tmp_path / "src").mkdir()
    (tmp_path / "src/k31-image.tar").write_bytes(data)
    sums = tmp_path / "image.SHA256SUMS"
    sums.write_text(f"{hashlib.sha256(data).hexdigest()}  k31-image.tar\n")
    state, dest = tmp_path / "state", tmp_path / "dest/k31-image.tar"

    def job():
        argv = ["sh", "-c", SCRIPT.read_text(), "k31-stage", "ssh -o BatchMode=yes", "", "", "sha256", "5",
                str(state), str(tmp_path / "src/k31-image.tar"), str(dest), str(sums), str(tmp_path / "stamp")]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30)

    done = job()
    assert done.returncode == 0, done.stderr
    assert state.read_text() == "ok\n" and dest.read_bytes() == data
    sums.write_text(f"{hashlib.sha256(b'another').hexdigest()}  k31-image.tar\n")    # the controller's differs
    done = job()
    assert done.returncode == 1 and state.read_text().startswith(f"failed: {dest} does not match {sums}")
    dest.unlink()
    (dest / "in-the-way").mkdir(parents=True)    # rsync would copy the file into it, and the check pass there
    done = job()
    assert done.returncode == 1 and state.read_text().startswith(f"failed: {dest} is a directory, where the file")


# -- the serving image's archive (k31_image_fanout=tree) ------------------------------------------------------

K31 = importlib.util.spec_from_file_location("k31_filters", ROOT / "filter_plugins/k31.py")
k31_filters = importlib.util.module_from_spec(K31)
K31.loader.exec_module(k31_filters)
K31_FILTERS = k31_filters.FilterModule().filters()


def test_the_archive_goes_from_the_controller_to_one_host_then_host_to_host():
    got = from_controller(hosts(8), hosts(8), [])
    assert got["seed"] == "n0" and got["controller"] is True
    # the seed holds the archive before the rounds: it is a source from round 1, like a host that held a copy
    assert got["hosts"] == rounds(hosts(8), "n0", ["n0"])["hosts"]
    assert "n0" not in got["hosts"] and got["rounds"] == 3    # 1 controller copy + 3 rounds for 8 hosts
    sources = {step["source"] for step in got["hosts"].values()}
    assert sources == {"n0", "n1", "n2", "n3"}    # every host that got it in an earlier round serves


def test_a_host_holding_a_verified_archive_seeds_the_tree_and_the_controller_copies_nothing():
    got = from_controller(hosts(4), need=["n0", "n1", "n3"], hold=["n2"])
    assert got["seed"] == "n2" and got["controller"] is False
    assert got["hosts"] == {"n0": {"round": 1, "source": "n2", "after": []},
                            "n1": {"round": 2, "source": "n2", "after": ["n0"]},
                            "n3": {"round": 2, "source": "n0", "after": ["n0"]}}
    # a host that needs the image and holds a verified archive loads it and copies nothing; one whose image is
    # right but holds no verified archive takes no part
    got = from_controller(hosts(4), need=["n1", "n2"], hold=["n1", "n3"])
    assert got["seed"] == "n1" and got["hosts"] == {"n2": {"round": 1, "source": "n1", "after": []}}
    assert from_controller(hosts(4), need=["n1"], hold=["n1"]) == {"seed": "", "controller": False, "rounds": 0,
                                                                   "hosts": {}}
    assert from_controller(hosts(4), need=[], hold=[])["hosts"] == {}


def test_the_archive_schedule_refuses_strangers_and_its_filter_says_so():
    with pytest.raises(K31Error, match="hosts x are said to need or hold the file but are not staging hosts"):
        from_controller(hosts(2), need=["x"], hold=[])
    with pytest.raises(AnsibleFilterError, match=r"^error: hosts y are said"):
        K31_FILTERS["k31_image_rounds"](hosts(2), [], ["y"])
    assert K31_FILTERS["k31_image_rounds"](hosts(3), hosts(3), []) == from_controller(hosts(3), hosts(3), [])
    # the peers a host waits on and copies from, at their SSH address (k31_model's and k31_image's tree.yml)
    hostvars = {"n0": {"ansible_host": "10.0.0.1"}, "n1": {}}
    assert K31_FILTERS["k31_ssh_addresses"](["n1", "n0"], hostvars) == ["n1", "10.0.0.1"]
    for name in ("k31_image_rounds", "k31_image_archive_sha256", "k31_over_ssh", "k31_ssh_addresses"):
        assert (ROOT / "filter_plugins" / f"{name}.yml").is_file(), name


def test_one_rule_says_which_hosts_the_controllers_archive_reaches_by_rsync():
    """The copy (roles/k31_image) and the controller's rsync check (k31_validate) read the same list."""
    over_ssh = K31_FILTERS["k31_over_ssh"]
    assert [over_ssh(c) for c in ("", None, "ssh", "smart")] == [True] * 4
    assert [over_ssh(c) for c in ("local", "podman", "community.docker.docker", "paramiko_ssh")] == [False] * 4
    copy = (ROOT / "roles/k31_image/tasks/from_controller.yml").read_text()
    assert "_k31_image_over_ssh: \"{{ _k31_image_conn.ansible_connection | default('') | k31_over_ssh }}\"" in copy
    check = (ROOT / "k31deploy/prereqs.py").read_text()
    assert "imagearchive.copies_over_ssh(host.text(\"ansible_connection\"))" in check
    assert "'smart'" not in copy and '"smart"' not in check


def test_the_archive_sha256_filter_remembers_the_digest_in_the_state_dir(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("K31_STATE_DIR", str(tmp_path / "state"))
    archive = tmp_path / "k31.tar"
    archive.write_bytes(b"image" * 1000)
    assert K31_FILTERS["k31_image_archive_sha256"](str(archive)) == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert (tmp_path / "state/image-archives.json").is_file()
    with pytest.raises(AnsibleFilterError, match=r"^error: k31_image_tarball=.*nope.tar cannot be read"):
        K31_FILTERS["k31_image_archive_sha256"](str(tmp_path / "nope.tar"))


def test_image_fanout_knob_is_validated_with_its_choices():
    pd = {"platform": "mi355x", "agents": 92}

    def pd_hosts(**extra):
        return [from_mapping("p0", ["k31_prefill"], {"ansible_host": "192.0.2.1"}),
                from_mapping("d0", ["k31_decode"], {"ansible_host": "192.0.2.2", **extra}),
                from_mapping("r0", ["k31_router"], {"ansible_host": "192.0.2.9"})]

    with pytest.raises(K31Error, match=r"^k31_image_fanout=seed \(host d0\) is not valid; valid choices: controller, "
                                       r"tree \(roles/k31_image/meta/argument_specs.yml\)$"):
        resolve(pd, pd_hosts(k31_image_fanout="seed"))
    for ok in ("controller", "tree"):
        assert resolve(pd, pd_hosts(k31_image_fanout=ok, k31_image_tree_poll=2,
                                    k31_image_rsync_ssh="ssh -o BatchMode=yes"))
