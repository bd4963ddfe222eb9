"""``diff``: what changed between two checkpoints, at every level ksfs sees.

Files inside the guest (added, removed, changed, with sizes, as ``diff -rq`` sees them; a
changed file also says in ``attrs`` whether its mode, owner or xattrs moved), the paths whose
mode, owner or extended attributes alone changed (``attr_changes``, which ``diff -r`` does not
report), the number of changed 64 KiB disk clusters (compared offset by offset in the fixed-
chunk manifests, no data read), the checkpoints' own stored files (added, removed, changed,
identical, from their manifests), the share of memory chunks of B not in A, and the host events
between them. A checkpoint is named within the session, or as ``OTHER/CHECKPOINT`` for one of
another session (a fork and its parent).

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

The guest files and disk clusters are those of each checkpoint's guest disk
(``keeper.guest_disk``: its only disk image, else the one holding the session's transcript,
else ``disk.raw``). With none, ``files_not_compared`` says why.
"""

from __future__ import annotations

from typing import Any

from ksfs.cas.chunking import FIXED_SIZE as CLUSTER  # a disk image's chunk: one qcow2 cluster
from ksfs.errors import KsfsError
from ksfs.model import CheckpointRecord, FileRecord, validate_name

_ABSENT = None  # past the end of the shorter file: reads as zeros, like a hole (QA: a disk
# grown online counted all its new, empty space as changed); the sizes are reported apart


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
        (da, why_a), (db, why_b) = self.guest_disk(ra), self.guest_disk(rb)
        out: dict[str, Any] = {
            "a": f"{ra.session}/{ra.name}",
            "b": f"{rb.session}/{rb.name}",
            "disk": self._disk_clusters(da, db),
            "memory": self._memory_share(ra, rb),
            "files": None,  # exactly what diff -rq --no-dereference of the two fs/ says
            "attr_changes": None,  # same type and content, mode, owner or xattrs moved
            "files_error": None,
            # the disk image each side's guest files come from, and why not when there is none
            "guest_disks": {"a": da and da.name, "b": db and db.name},
            "files_not_compared": why_a or why_b,
            "stored_files": self._stored_files(ra, rb),
        }
        out["events_path"], out["events"] = self._events_between(ra, rb)
        try:
            if da is not None and db is not None:
                from ksfs.guestfs import diff_trees

                fs = []
                for record, label in ((ra, out["a"]), (rb, out["b"])):
                    try:
                        fs.append(self.guest_fs(record))
                    except KsfsError as exc:  # which side (QA: "cannot be read" said not)
                        out["files_error"] = f"{label}: {exc}"
                        return out
                fa, fb = fs

                changes = [c.to_dict() for c in diff_trees(fa, fb, attrs=True)]
                out["files"] = [c for c in changes if c["kind"] != "attrs"]
                out["attr_changes"] = [c for c in changes if c["kind"] == "attrs"]
        except KsfsError as exc:
            out["files_error"] = str(exc)
        return out

    def _entries(self, record: CheckpointRecord, name: str):
        f = record.file(name)
        return None if f is None else self.store.load_manifest(f.manifest).entries

    def _disk_clusters(self, da: FileRecord | None, db: FileRecord | None
                       ) -> dict[str, Any] | None:
        if da is None or db is None:
            return None
        ea = self.store.load_manifest(da.manifest).entries
        eb = self.store.load_manifest(db.manifest).entries
        cmp = _compare_by_offset(ea, eb)
        return {
            "clusters": max(len(ea), len(eb)),  # manifest entries: stored clusters, hole runs
            "changed_clusters": cmp["changed_clusters"],
            "cluster_size": CLUSTER,
            # clusters that hold data (not a hole) in A or in B: what "changed" is out of
            "stored_clusters": cmp["stored_clusters"],
            "disk_clusters": -(-max(da.size, db.size) // CLUSTER),  # the whole disk
            "changed_bytes": cmp["changed_bytes"],
            "file_a": da.name, "file_b": db.name, "size_a": da.size, "size_b": db.size,
        }

    def _stored_files(self, ra: CheckpointRecord, rb: CheckpointRecord) -> list[dict[str, Any]]:
        """Each file stored in A or B (by name): added, removed, identical (same manifest, or
        same digest: the same bytes), or changed, with what the manifests say changed."""
        fa, fb = {f.name: f for f in ra.files}, {f.name: f for f in rb.files}
        out = []
        for name in sorted(fa.keys() | fb.keys()):
            a, b = fa.get(name), fb.get(name)
            d: dict[str, Any] = {"name": name, "size_a": a and a.size, "size_b": b and b.size}
            if a is None or b is None:
                d["kind"] = "added" if a is None else "removed"
            elif a.manifest == b.manifest or (a.digest and a.digest == b.digest) or (
                    a.chunking != b.chunking and a.size == b.size and self._same_bytes(a, b)):
                d["kind"] = "identical"
            else:
                d["kind"] = "changed"
                d.update(self._chunk_changes(a, b))
            out.append(d)
        return out

    def _same_bytes(self, a: FileRecord, b: FileRecord) -> bool:
        """Whether two files stored with different chunkings hold the same bytes (their
        digests, of the chunk lists, cannot tell: QA, a file imported once as a disk and once
        not was "changed"). Read and compared 8 MiB at a time, stopping at the first
        difference."""
        ra, rb = self.store.open_file(a.manifest, 0), self.store.open_file(b.manifest, 0)
        step = 8 << 20
        for off in range(0, a.size, step):
            n = min(step, a.size - off)
            if ra.read(off, n) != rb.read(off, n):
                return False
        return True

    def _chunk_changes(self, a: FileRecord, b: FileRecord) -> dict[str, Any]:
        """What the manifests of two versions of a file say about their difference. Fixed-size
        chunks (disk images) are compared offset by offset: ``changed_chunks`` of ``chunks``
        (those holding data on either side) and the bytes they cover. Content-defined chunks
        move with insertions, so for them ``changed_chunks`` counts B's chunks found nowhere in
        A (``chunks`` is B's count) and ``changed_bytes`` their bytes."""
        ma, mb = self.store.load_manifest(a.manifest), self.store.load_manifest(b.manifest)
        if ma.chunking == "fixed" and mb.chunking == "fixed":
            cmp = _compare_by_offset(ma.entries, mb.entries)
            return {"chunking": "fixed", "chunk_size": CLUSTER,
                    "chunks": cmp["stored_clusters"], "changed_chunks": cmp["changed_clusters"],
                    "changed_bytes": cmp["changed_bytes"]}
        ids_a = {cid for cid, _ in ma.entries if cid is not None}
        b_chunks = [(cid, n) for cid, n in mb.entries if cid is not None]
        new = [n for cid, n in b_chunks if cid not in ids_a]
        return {"chunking": mb.chunking, "chunks": len(b_chunks), "changed_chunks": len(new),
                "changed_bytes": sum(new)}

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


def _compare_by_offset(ea: list, eb: list) -> dict[str, int]:
    """Two fixed-chunk manifests compared range by range at the same offsets (a run of holes
    may be one entry on one side and several on the other): the 64 KiB clusters that hold data
    on either side, those whose chunk ids differ, and the bytes of the ranges that differ. Past
    the end of the shorter file counts as holes. No chunk is read."""

    def ranges(entries: list) -> list[tuple[int, Any]]:
        out, pos = [], 0
        for cid, n in entries:
            pos += n
            out.append((pos, cid))
        return out

    ra, rb = ranges(ea), ranges(eb)
    end = max(ra[-1][0] if ra else 0, rb[-1][0] if rb else 0)
    i = j = pos = 0
    stored = changed = changed_bytes = 0
    last_stored = last_changed = -1  # the last cluster counted, so none counts twice

    def count(lo: int, hi: int, last: int) -> tuple[int, int]:
        first, final = max(lo // CLUSTER, last + 1), (hi - 1) // CLUSTER
        return max(0, final - first + 1), max(last, final)

    while pos < end:
        a_end, ca = ra[i] if i < len(ra) else (end, _ABSENT)
        b_end, cb = rb[j] if j < len(rb) else (end, _ABSENT)
        nxt = min(a_end, b_end)
        if ca is not None or cb is not None:
            n, last_stored = count(pos, nxt, last_stored)
            stored += n
        if ca != cb:
            n, last_changed = count(pos, nxt, last_changed)
            changed += n
            changed_bytes += nxt - pos
        pos = nxt
        if i < len(ra) and a_end == nxt:
            i += 1
        if j < len(rb) and b_end == nxt:
            j += 1
    return {"stored_clusters": stored, "changed_clusters": changed,
            "changed_bytes": changed_bytes}
