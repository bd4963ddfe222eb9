"""``diff``: what changed between two checkpoints, at every level ksfs sees.

Files inside the guest (added, removed, changed, with sizes, as ``diff -rq`` sees them; a
changed file also says in ``attrs`` whether its mode or owner moved), the paths whose mode or
owner alone changed (``attr_changes``, which ``diff -r`` does not report), the number of
changed 64 KiB disk clusters (compared entry by entry in the fixed-chunk manifests, no data
read), the share of memory chunks of B not in A, and the host events between them. A
checkpoint is named within the session, or as ``OTHER/CHECKPOINT`` for one of another session
(a fork and its parent).

Events between A and B: a checkpoint's place in its lineage's log is its ``checkpoint.published``
event (the event that ends it). The events between two places of one log are those after the
earlier place up to and including the later one: the later checkpoint's own ``begin`` and
``published`` belong to the range, the earlier one's do not, and a checkpoint against itself has
none. Across lineages the events are those along the fork tree's path from A to B: up from A
through each fork's log from its event 0 (``lineage.forked``) to A, across the deepest lineage
the two share between the two places there (a fork point counts as the place of the parent's
checkpoint it forked from), and down through each fork's log from event 0 to B. Each event says
which session's log it is from; ``events_path`` lists the stretches of each log. The set is the
same for (A, B) and (B, A). Sessions with no common root lineage have no path: no events.
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
            "files": None,  # exactly what diff -rq --no-dereference of the two fs/ says
            "attr_changes": None,  # same type and content, mode or owner moved
            "files_error": None,
        }
        out["events_path"], out["events"] = self._events_between(ra, rb)
        try:
            fa, fb = self.guest_fs(ra), self.guest_fs(rb)
            if fa is not None and fb is not None:
                from ksfs.guestfs import diff_trees

                changes = [c.to_dict() for c in diff_trees(fa, fb, attrs=True)]
                out["files"] = [c for c in changes if c["kind"] != "attrs"]
                out["attr_changes"] = [c for c in changes if c["kind"] == "attrs"]
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

    def _events_between(
        self, ra: CheckpointRecord, rb: CheckpointRecord
    ) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
        """The stretches of the logs on the path from A to B, and their events in that order."""
        pa, pb = self._place(ra), self._place(rb)
        common = 0
        while common < min(len(pa), len(pb)) and pa[common][0] == pb[common][0]:
            common += 1
        if common == 0:
            return None, []  # no shared root: no path between them
        stretches: list[tuple[str, str, int, int]] = []  # lineage, session, first, last seq
        for lineage, session, at in reversed(pa[common:]):  # up from A
            stretches.append((lineage, session, 0, at))
        lineage, session, at_a = pa[common - 1]
        at_b = pb[common - 1][2]
        stretches.append((lineage, session, min(at_a, at_b) + 1, max(at_a, at_b)))
        for lineage, session, at in pb[common:]:  # down to B
            stretches.append((lineage, session, 0, at))
        path, events = [], []
        for lineage, session, first, last in stretches:
            if first > last:
                continue  # the same place: nothing between
            path.append({"session": session, "lineage": lineage, "from_seq": first,
                         "to_seq": last})
            for e in self.ledger.lineage_events(lineage, first, last):
                events.append({**e.to_dict(), "session": session})
        return path, events

    def _place(self, record: CheckpointRecord) -> list[tuple[str, str, int]]:
        """(lineage, session, seq) from the root lineage down to the checkpoint's own: in each
        ancestor the end of the checkpoint its child forked from, in its own the end of it."""
        rec = self.ledger.session(record.session)
        out = [(rec.lineage, rec.name, self._end_seq(rec.lineage, record.name, record.seq))]
        for hop in self.ledger.lineage(record.session):  # nearest parent first
            out.append((hop.lineage, hop.session,
                        self._end_seq(hop.lineage, hop.checkpoint, hop.seq)))
        out.reverse()
        return out

    def _end_seq(self, lineage: str, name: str, seq: int) -> int:
        """The seq of the ``checkpoint.published`` that ended the checkpoint begun at ``seq``
        (its record's seq); ``seq`` itself when the log no longer holds it."""
        for e in self.ledger.lineage_events(lineage, seq):
            if e.type == "checkpoint.published" and (
                    e.body.get("name") == name or e.body.get("seq") == seq):
                return e.seq
            if e.seq > seq and e.type in ("checkpoint.begin", "checkpoint.failed"):
                break  # a session's checkpoints do not overlap: it was never published here
        return seq
