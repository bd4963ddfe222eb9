"""The keeper: the one place that orchestrates the store, the ledger, the VM controller and the
gateway. Every verb (import, save, fork, restore, pause, resume, delete, gc, ...) is a method
here, with its events and its locks; the FUSE layer, the control socket and the CLI all call these
same methods. The keeper never imports pyfuse3 or click, and reaches libvirt only through ksfs.vm.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ksfs.keeper.branching import RestoreVerbs
from ksfs.keeper.diffing import Diffing
from ksfs.keeper.guestlink import GuestLink
from ksfs.keeper.machine import MachineVerbs
from ksfs.keeper.offline import OfflineVerbs
from ksfs.keeper.recovery import Recovery
from ksfs.keeper.views import Views


class Keeper(OfflineVerbs, MachineVerbs, RestoreVerbs, Recovery, GuestLink, Diffing, Views):
    """Owns one open store and its ledger; the VM controller and gateway are attached lazily."""

    def __init__(self, store_path: str | Path, create: bool = False) -> None:
        from ksfs.cas import ChunkStore
        from ksfs.ledger import Ledger

        # Absolute: libvirt refuses relative snapshot paths, and a daemon's cwd is not ours.
        self.store_path = Path(os.path.abspath(store_path))
        self.store = ChunkStore.open(self.store_path, create=create)
        self.ledger = Ledger(self.store)
        self._init_views()
        self._vm = None
        self.gateway = None  # set by the daemon when it runs one
        # Set by a daemon that serves gateways: returns once the gateway of every machine
        # session in the ledger listens (GuestLink.gateway_listens).
        self.gateway_watcher: Callable[[], None] | None = None

    def close(self) -> None:
        self._holders.close()  # a count in progress must not read a closed store
        self.store.close()

    def __enter__(self) -> Keeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Keeper"]
