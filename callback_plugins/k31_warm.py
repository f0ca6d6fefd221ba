"""k31_warm: load the Jinja filter and test plugins in ansible-playbook's own process, before its workers fork.

ansible-core 2.19 loads every filter (and test) plugin file the first time a template in a process uses one, and
keeps them on the process's plugin loaders. Each task runs in a worker forked from the playbook's process, so unless
that process has loaded them, every task that uses a filter loads them all again: about 0.3 s of CPU per task and
host on the sandbox, most of it k31's filters importing k31deploy (the recipe, the PKI's cryptography) -- the
largest single per-host cost of a deploy. Loaded here, at each play and task start, the workers inherit them. A
role that brings a filter_plugins folder (include_role) clears the loaders' cache; the next task start loads again.

It changes no output and no result (an aggregate callback with no output of its own); no need to enable it:
Ansible loads a callback that does not ask to be enabled from any callback folder it searches -- ansible.cfg's
callback_plugins, the folder `k31` adds (k31deploy/runner/driver.py), the molecule scenarios' env.
"""

from __future__ import annotations

from ansible.plugins.callback import CallbackBase
from ansible.plugins.loader import filter_loader, test_loader


def warm() -> None:
    """Load every filter and test plugin file (once: the loaders answer from their cache after that), and parse the
    recipe's data files the filters read into k31deploy's caches (once too): a worker that had to parse them itself
    spent about 20 ms of CPU on flags.yaml alone in each task that reads it (k31_monitoring_args, per host)."""
    for loader in (filter_loader, test_loader):
        for _ in loader.all():
            pass
    try:
        from k31deploy import catalog, memory
        from k31deploy.errors import K31Error
        from k31deploy.recipe import hosts
    except ImportError:    # a project without the package: the filters say so themselves
        return
    try:
        catalog.catalog()
        catalog.knob_specs()
        catalog.flag_registry()
        memory.constants()
        hosts.role_variables()
    except (K31Error, OSError):    # the filter that reads it says what is wrong, where it matters
        return


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "k31_warm"
    CALLBACK_NEEDS_ENABLED = False

    def v2_playbook_on_play_start(self, play):
        warm()

    def v2_playbook_on_task_start(self, task, is_conditional):
        warm()

    def v2_playbook_on_handler_task_start(self, task):
        warm()
