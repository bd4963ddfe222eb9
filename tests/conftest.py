"""The suite on both cores: `tools/test` runs pytest with ``-n 2`` (pytest-xdist).

The modules that boot guests or talk to libvirt run one after another on one worker, as the
whole suite ran before: their guests take a core of their own under TCG, one of them restarts
libvirtd, and several look at every domain libvirt has. Every other module goes whole (its
module-scoped fixtures made once) to whichever worker is free. Without ``-n`` nothing changes.

The work units are made here (``pytest_xdist_make_scheduler``) rather than with xdist's
``xdist_group`` marks: those rename each test's node id, which pytest 9 no longer lets a plugin
do, so the marks were silently ignored and VM modules ran on both workers at once.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Modules with no test marked ``vm`` that still ask libvirt something (a `session new` that is
# refused, a domain's state): kept with the VM modules so that a libvirtd restart there never
# meets them.
LIBVIRT_MODULES = frozenset({
    "test_cli_contract", "test_cli_output", "test_reliability_badinput", "test_store_planted",
    "test_vm_leftovers",
})
VM_UNIT = "vm"
# How a VM module says so: `pytestmark = pytest.mark.vm`, or `@pytest.mark.vm` on some of its
# tests (then all of it is serial: its other tests may share their fixtures).
_VM_MARK = re.compile(r"\bpytest\.mark\.vm\b")


@functools.cache
def serial_module(path: str) -> bool:
    """Whether the test module at ``path`` (as a node id begins: tests/test_x.py) runs in the
    one serial work unit."""
    if Path(path).stem in LIBVIRT_MODULES:
        return True
    try:
        return _VM_MARK.search((ROOT / path).read_text("utf-8")) is not None
    except OSError:
        return False


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    if config.getoption("dist") == "each":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class VMSerialScheduling(LoadScopeScheduling):
        """Work units: the serial one of every VM and libvirt module, else one per module.
        The largest unit goes out first (xdist orders them by their number of tests)."""

        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return VM_UNIT if serial_module(module) else module

    return VMSerialScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked ``vm`` in a way the rule above does not see (a mark made elsewhere and
    given as a parameter's) would run beside the VM unit: refused, so the rule stays whole."""
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if item.get_closest_marker("vm") is not None and not serial_module(module):
            raise pytest.UsageError(
                f"{item.nodeid} is marked vm but its module never says `pytest.mark.vm`: say it "
                "there (tests/conftest.py keeps VM modules on one worker)")
