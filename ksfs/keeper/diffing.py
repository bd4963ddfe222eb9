"""``diff``: what changed between two checkpoints, at every level ksfs sees.

Files inside the guest (added, removed, changed, with sizes), the number of changed 64 KiB disk
clusters (compared entry by entry in the fixed-chunk manifests, no data read), the share of
memory chunks of B not in A, and the host events between them. A checkpoint is named within
the session, or as ``OTHER/CHECKPOINT`` for one of another session (a fork and its parent).
"""

from __future__ import annotations

from typing import Any

from ksfs.errors import KsfsError
from ksfs.model import CheckpointRecord, validate_name


class Diffing:
    def _resolve(self, session: str, name: str) -> CheckpointRecord:
        if "/" in name:
            other, _, cp = name.partition("/")
            validate_name(other, "session name")
            validate_name(cp, "checkpoint name")
            return self.ledger.checkpoint(other, cp)
        validate_name(name, "checkpoint name")
        return self.ledger.checkpoint(session, name)

    def diff(self, session: str, a: str, b: str) -> dict[str, Any]:
        validate_name(session, "session name")
        ra, rb = self._resolve(session, a), self._resolve(session, b)
        out: dict[str, Any] = {
            "a": f"{ra.session}/{ra.name}",
            "b": f"{rb.session}/{rb.name}",
            "disk": self._disk_clusters(ra, rb),
            "memory": self._memory_share(ra, rb),
            "files": None,
            "files_error": None,
            "events": [e.to_dict() for e in self._events_between(ra, rb)],
        }
        try:
            fa, fb = self.guest_fs(ra), self.guest_fs(rb)
            if fa is not None and fb is not None:
                from ksfs.guestfs import diff_trees

                out["files"] = [c.to_dict() for c in diff_trees(fa, fb)]
        except KsfsError as exc:
            out["files_error"] = str(exc)
        return out

    def _entries(self, record: CheckpointRecord, name: str):
        f = record.file(name)
        return None if f is None else self.store.load_manifest(f.manifest).entries

    def _disk_clusters(self, ra: CheckpointRecord, rb: CheckpointRecord) -> dict[str, Any] | None:
        ea, eb = self._entries(ra, "disk.raw"), self._entries(rb, "disk.raw")
        if ea is None or eb is None:
            return None
        changed = sum(1 for x, y in zip(ea, eb, strict=False) if x != y)
        changed += abs(len(ea) - len(eb))
        return {"clusters": max(len(ea), len(eb)), "changed_clusters": changed,
                "cluster_size": 65536}

    def _memory_share(self, ra: CheckpointRecord, rb: CheckpointRecord) -> dict[str, Any] | None:
        ea, eb = self._entries(ra, "memory"), self._entries(rb, "memory")
        if ea is None or eb is None:
            return None
        ids_a = {cid for cid, _ in ea if cid is not None}
        b_chunks = [(cid, n) for cid, n in eb if cid is not None]
        differ = [(cid, n) for cid, n in b_chunks if cid not in ids_a]
        total = sum(n for _, n in b_chunks) or 1
        return {
            "chunks": len(b_chunks),
            "differing_chunks": len(differ),
            "share_differing": round(len(differ) / max(len(b_chunks), 1), 4),
            "bytes_differing": sum(n for _, n in differ),
            "share_bytes_differing": round(sum(n for _, n in differ) / total, 4),
        }

    def _events_between(self, ra: CheckpointRecord, rb: CheckpointRecord):
        if ra.session != rb.session:
            return []  # two lineages: their logs share no seqs to cut between
        lo, hi = sorted((ra.seq, rb.seq))
        return [e for e in self.ledger.events(ra.session, lo) if lo <= e.seq <= hi]
