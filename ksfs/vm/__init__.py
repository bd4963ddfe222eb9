"""The libvirt controller (layer 4): the only package of ksfs that imports libvirt.

Creates or adopts domains, takes atomic checkpoints (external snapshots with memory), restores
and forks them. Never imports the store, the ledger, trio, pyfuse3 or click: the keeper glues
this package to the store. See docs/vm.md.
"""

from ksfs.vm.chain import ChainSource
from ksfs.vm.controller import DomainController
from ksfs.vm.state import Frozen, FrozenDisk, Restored

__all__ = ["ChainSource", "DomainController", "Frozen", "FrozenDisk", "Restored"]
