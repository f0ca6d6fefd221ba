"""Reading an Ansible inventory (INI or YAML, any source Ansible accepts) into the resolver's hosts."""

from __future__ import annotations

from pathlib import Path

from k31deploy.catalog import knob_specs
from k31deploy.errors import K31Error
from k31deploy.recipe.hosts import K31_GROUPS, LAYOUT_VARS, Host, check_groups, from_mapping
from k31deploy.validate import shown


def load_hosts(source: str) -> list[Host]:
    """Hosts of the k31 groups, in inventory order, with their merged variables."""
    if not Path(source).exists():
        raise K31Error(f"inventory {source} does not exist; pass -i with an INI or YAML inventory file")
    # Imported here: ansible is heavy and `k31 plan` without -i never needs it.
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    loader = DataLoader()
    try:
        inventory = InventoryManager(loader=loader, sources=[source])
    except AnsibleError as exc:
        raise K31Error(f"inventory {source} could not be parsed: {str(exc).splitlines()[0]}") from None
    if not inventory._inventory.processed_sources:    # Ansible warned why; it goes on with an empty inventory
        raise K31Error(f"inventory {source} could not be parsed as an Ansible inventory (INI or YAML; Ansible's "
                       f"warnings above say where); valid: an inventory as ansible-inventory -i {source} --list reads")
    check_groups({name: [h.name for h in group.get_hosts()] for name, group in inventory.groups.items()},
                 f"inventory {source}")
    if not inventory.list_hosts("all") or not any(g in inventory.groups for g in K31_GROUPS):
        raise K31Error(
            f"inventory {source} has no host in a k31 group; valid groups: {', '.join(K31_GROUPS)}"
        )
    from ansible.template import Templar

    variables = VariableManager(loader=loader, inventory=inventory)
    # What the resolver reads, templated as a playbook's hostvars would be ("{{ base }}/Kimi" is a path
    # there, and must be one here too); role variables keep their raw values (vaulted ones need a secret).
    templated = {"ansible_host", *LAYOUT_VARS, *(f"k31_{k}" for k in knob_specs())}
    hosts = []
    for host in inventory.list_hosts("all"):
        groups = [g.name for g in host.get_groups()]
        if not any(g in K31_GROUPS for g in groups):
            continue
        hostvars = dict(variables.get_vars(host=host, include_hostvars=False))
        templar = Templar(loader=loader, variables=hostvars)
        for var in templated & set(hostvars):
            try:
                hostvars[var] = templar.template(hostvars[var])
            except AnsibleError as exc:
                raise K31Error(f"{var} of host {shown(host.name)} could not be templated: "
                               f"{shown(str(exc).splitlines()[0])}") from None
        hosts.append(from_mapping(host.name, groups, hostvars))
    return hosts
