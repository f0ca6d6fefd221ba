"""callback_plugins/k31_warm.py: the playbook's own process loads the filter plugins, so the forked task workers
do not load them again, task after task. A filter plugin that records the PID of every process importing it shows
where the loads happen, through a real ansible-playbook run with the project's ansible.cfg."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOK = """\
- name: Five tasks that each use a filter
  hosts: localhost
  gather_facts: false
  tasks:
""" + "".join(f"    - name: Task {i}\n      ansible.builtin.debug:\n        msg: \"{{{{ [{i}] | k31_loaded }}}}\"\n"
              for i in range(5))
FILTER = """\
import os
with open(os.environ["K31_LOADS"], "a") as f:
    f.write(f"{os.getpid()}\\n")


class FilterModule:
    def filters(self):
        return {"k31_loaded": lambda value: value}
"""


@pytest.fixture
def project(tmp_path):
    (tmp_path / "filter_plugins").mkdir()
    (tmp_path / "filter_plugins" / "k31_loaded.py").write_text(FILTER)
    (tmp_path / "play.yml").write_text(PLAYBOOK)
    return tmp_path


def loads(project: Path, callback_dir: str) -> list[str]:
    record = project / "loads"
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "ANSIBLE_CALLBACK_PLUGINS": callback_dir,
           "ANSIBLE_FILTER_PLUGINS": f"{ROOT / 'filter_plugins'}:{project / 'filter_plugins'}",
           "ANSIBLE_LOCAL_TEMP": str(project / "tmp"), "K31_LOADS": str(record), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "play.yml"],
                          cwd=project, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return record.read_text().split()


def test_the_playbooks_process_loads_the_filters_once_for_every_task(project):
    assert len(loads(project, str(ROOT / "callback_plugins"))) == 1


def test_without_it_each_task_loads_them_again(project):
    assert len(set(loads(project, str(project / "none")))) == 5


DATA_PLAYBOOK = """\
- name: Tasks that read the recipe's data
  hosts: localhost
  gather_facts: false
  tasks:
""" + "".join(f"    - name: Task {i}\n      ansible.builtin.debug:\n        msg: \"{{{{ [{i}] | k31_parsed }}}}\"\n"
              for i in range(3))
DATA_FILTER = """\
import os
from k31deploy import catalog, memory


def parsed(value):
    # what this worker found already parsed when its task began (inherited from the playbook's process)
    with open(os.environ["K31_LOADS"], "a") as f:
        f.write(f"{catalog.flag_registry.cache_info().currsize}{memory.constants.cache_info().currsize}\\n")
    return value


class FilterModule:
    def filters(self):
        return {"k31_parsed": parsed}
"""


@pytest.mark.parametrize(("callbacks", "found"), [("callback_plugins", "11"), ("none", "00")])
def test_the_workers_inherit_the_recipes_data_parsed(project, callbacks, found):
    """flags.yaml and memory.yaml, parsed once in the playbook's process: without it, every worker whose task reads
    them (k31_monitoring_args, once per host) parsed them again."""
    (project / "filter_plugins" / "k31_loaded.py").write_text(DATA_FILTER.replace("k31_parsed", "k31_loaded"))
    (project / "play.yml").write_text(DATA_PLAYBOOK.replace("k31_parsed", "k31_loaded"))
    where = str(ROOT / callbacks) if callbacks == "callback_plugins" else str(project / callbacks)
    assert loads(project, where) == [found] * 3
