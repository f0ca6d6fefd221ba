"""roles/k31_rdma's memlock: both drop-ins (limits.d for login sessions, systemd's DefaultLimitMEMLOCK for services)
in one k31_files run on a host that can raise limits, a sentence instead on one that cannot (a container); systemd
is re-executed only when its own drop-in changed, not for a change of limits.d alone."""

from __future__ import annotations

from pathlib import Path

import yaml
from ansible.plugins.filter.core import FilterModule as CoreFilters
from unit_render import native

ROOT = Path(__file__).resolve().parents[2]
RDMA = ROOT / "roles/k31_rdma"
SYSTEMD = yaml.safe_load((RDMA / "vars/main.yml").read_text())["_k31_rdma_memlock_systemd"]
FILTERS = {"bool": CoreFilters().filters()["bool"]}


def task(name: str) -> dict:
    (found,) = [t for t in yaml.safe_load((RDMA / "tasks/main.yml").read_text()) if t["name"] == name]
    return found


def runs(name: str, **scope) -> bool:
    return native("{{ " + task(name)["when"] + " }}", {"k31_rdma_memlock": True, **scope}, FILTERS)


def test_one_write_of_both_drop_ins_where_limits_can_be_raised_a_sentence_where_not():
    write = task("Memlock unlimited for login sessions and services")
    assert [f["dest"] for f in write["k31_files"]["files"]] == ["/etc/security/limits.d/k31-memlock.conf",
                                                                "{{ _k31_rdma_memlock_systemd }}"]
    assert SYSTEMD == "/etc/systemd/system.conf.d/k31-memlock.conf"
    for f in write["k31_files"]["files"]:
        template = f["content"].split("'")[3]
        assert (RDMA / "templates" / template).is_file()
    assert write["notify"] == "k31_rdma reexec systemd" and write["register"] == "_k31_rdma_memlock"
    can, cannot = {"can_raise_limits": True}, {"can_raise_limits": False}
    assert runs("Memlock unlimited for login sessions and services", _k31_rdma_choice=can)
    assert not runs("Memlock unlimited for login sessions and services", _k31_rdma_choice=cannot)
    assert runs("Say why memlock is left alone", _k31_rdma_choice=cannot)
    assert not runs("Say why memlock is left alone", _k31_rdma_choice=can)
    assert not runs("Say why memlock is left alone", _k31_rdma_choice=cannot, k31_rdma_memlock=False)


def test_systemd_is_re_executed_only_when_its_drop_in_changed():
    (handler,) = yaml.safe_load((RDMA / "handlers/main.yml").read_text())
    assert handler["listen"] == "k31_rdma reexec systemd"

    def reexec(changed: list[str]) -> bool:
        return native("{{ " + handler["when"] + " }}", {"_k31_rdma_memlock_systemd": SYSTEMD,
                                                       "_k31_rdma_memlock": {"changed_files": changed}}, {})

    assert reexec([SYSTEMD]) and reexec(["/etc/security/limits.d/k31-memlock.conf", SYSTEMD])
    assert not reexec(["/etc/security/limits.d/k31-memlock.conf"])
