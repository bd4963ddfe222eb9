"""The suite on both cores: `tools/test` runs pytest with ``-n 2 --dist loadgroup``.

The modules that boot guests or talk to libvirt run one after another on one worker, as the
whole suite ran before: their guests take a core of their own under TCG, one of them restarts
libvirtd, and several look at every domain libvirt has. Every other module goes whole (its
module-scoped fixtures made once) to whichever worker is free. Without ``-n`` nothing changes.
"""

from __future__ import annotations

import pytest

# Modules with no test marked ``vm`` that still ask libvirt something (a `session new` that is
# refused, a domain's state): kept with the VM modules so that a libvirtd restart there never
# meets them.
LIBVIRT_MODULES = frozenset({
    "test_cli_contract", "test_cli_output", "test_reliability_badinput", "test_store_planted",
    "test_vm_leftovers",
})
VM_GROUP = "vm"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not getattr(config.option, "numprocesses", None):
        return
    with_vm = {item.module.__name__ for item in items
               if item.get_closest_marker("vm") is not None}
    for item in items:
        module = item.module.__name__
        serial = module in with_vm or module.rpartition(".")[2] in LIBVIRT_MODULES
        item.add_marker(pytest.mark.xdist_group(VM_GROUP if serial else module))
