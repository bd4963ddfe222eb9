"""Verbs on a session's virtual machine: new, adopt, save, restore, fork, pause, resume, rm.

Filled in once ksfs.vm lands; until then every machine verb says so plainly.
"""

from __future__ import annotations


class MachineVerbs:
    def machine_state(self, session: str) -> str:
        return "unknown"
