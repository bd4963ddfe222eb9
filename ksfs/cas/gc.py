"""Garbage collection: mark from the live manifests, sweep the rest, repack thin packs.

Marking keeps the base of every live delta, except where storing that base's deltas whole takes
fewer bytes on disk than keeping it (a base no live manifest names, after its checkpoint was
deleted, in a pack this GC repacks): those deltas are rewritten as plain chunks first
(``flatten``) and the base is swept.

GC holds the store lock exclusively, so it never runs beside an ingest (which could be about to
commit chunks GC sees as unreferenced). Repacking copies live chunks to a new pack, fsyncs and
verifies it, and only then points the index at the copies and unlinks the old pack. A reader
that had looked a chunk up in an old pack finds it again through the index, or keeps reading the
unlinked file through its open fd. GC never deletes a manifest it was told is live; live delta
manifests whose base it deletes are stored again on a live base (``_rebase_manifests``). It stops
before deleting anything if a live manifest is missing or damaged, or names a chunk the index
does not list.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat as stat_
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zstandard

from ksfs import progress
from ksfs.cas import delta, hints
from ksfs.cas import format as fmt
from ksfs.cas.flatten import Flattened, append_to, commit_writers, flatten, release
from ksfs.cas.packs import PackWriter, decode_payload, fsync_dir
from ksfs.cas.store import index_errors, list_packs_dir
from ksfs.crashpoints import crash_point
from ksfs.errors import IntegrityError, KsfsError, NoSpace, StoreDamaged, translate

if TYPE_CHECKING:
    from ksfs.cas.store import ChunkStore

log = logging.getLogger(__name__)


@dataclass
class GCResult:
    chunks_freed: int = 0
    bytes_freed: int = 0  # stored record bytes no longer referenced
    # record bytes written to store whole the deltas whose base went (deltas_flattened): what
    # the store shrank by is bytes_freed - bytes_rewritten
    bytes_rewritten: int = 0
    manifests_removed: int = 0
    manifests_rebased: int = 0  # delta manifests whose base went, stored on a live one instead
    packs_removed: list[int] = field(default_factory=list)
    packs_repacked: list[int] = field(default_factory=list)
    packs_written: list[int] = field(default_factory=list)
    # pack file bytes given back to the filesystem, net: the packs removed, cut or repacked,
    # less the packs this gc wrote (QA, thirty-fourth session: a repack said it gave back the
    # old pack's whole size, though a new pack held its live part)
    disk_bytes_reclaimed: int = 0
    disk_bytes_written: int = 0  # the packs this gc wrote (repacks, flattened deltas)
    skipped_packs: dict[int, str] = field(default_factory=dict)  # not repacked: damage found
    # packs whose size figure disagreed with their file and the records the index places in
    # them, and was set to agree: pack number -> (figure before, figure now). A pack cut short
    # that lost no record still placed gets its file's length (importing a good copy again
    # stored what it lost anew); one whose figure damage made too small, its last record's end
    settled_packs: dict[int, tuple[int, int]] = field(default_factory=dict)
    deltas_flattened: int = 0  # deltas stored whole again so their base could go
    flatten_skipped: str = ""  # why flattening failed and was left for the next GC


def collect(store: ChunkStore, live_manifests: Iterable[str] | Callable[[], Iterable[str]],
            threshold: float, timeout: float | None) -> GCResult:
    lock = store.lock(exclusive=True, timeout=timeout)
    try:
        live = live_manifests() if callable(live_manifests) else live_manifests
        # an LMDB error is reported as a ksfs error (a full disk: NoSpace). Each transaction
        # is whole or nothing: one failing at the sweep's commit deletes nothing; one failing
        # later (a repack's) leaves the sweep done and the repack to the next gc
        with index_errors("gc", store.path):
            return _collect(store, {_manifest_key(store, m) for m in live}, threshold)
    finally:
        os.close(lock)


def _manifest_key(store: ChunkStore, name: object) -> bytes:
    """The key of a live manifest; StoreDamaged (exit 6) for a name that is no manifest id (a
    damaged checkpoint record can name anything: it was a ValueError or TypeError traceback),
    before anything is deleted."""
    try:
        return bytes.fromhex(name)  # type: ignore[arg-type]
    except (ValueError, TypeError):
        raise StoreDamaged(path=store.path, why=(
            f"a checkpoint record names {str(name)[:80]!r} as a manifest, which is no manifest "
            "id, so gc frees nothing (run `ksfs check` to see what is damaged)")) from None


def _collect(store: ChunkStore, live: set[bytes], threshold: float) -> GCResult:
    res = GCResult()
    db = store.db
    # mark: a live manifest that cannot be read stops GC before it deletes anything
    marked: set[bytes] = set()
    progress.report("marking the chunks live checkpoints use")
    with store.env.begin() as txn:
        for mid in live:
            info = store.load_manifest(mid.hex(), txn)
            marked.update(cid for cid, _ in info.entries if cid is not None)
        _require_indexed(store, txn, marked)
        # a live delta keeps its base (bases are never deltas: one pass marks them all)
        bases = {b for k, v in txn.cursor(db=db["chunks"])
                 if len(v) > fmt.INDEX_VALUE.size and bytes(k) in marked
                 for b in fmt.Location.decode(v, bytes(k)).base_ids}
        _require_decodable(store, txn, bases)
        first_no = _first_pack_no(txn, store)
        repacked = _packs_repacked(txn, store, marked | bases, threshold)
    # ... unless its deltas cost less stored whole than with it, counting as given back only
    # the records of packs this GC repacks or removes (the others stay on disk as they are).
    # Flattening only saves bytes: when it fails (a full disk, most likely) GC goes on
    # without it and frees what it can.
    try:
        flat = flatten(store, marked, first_no, repacked)
    except (OSError, KsfsError) as exc:
        log.warning("gc: not flattening deltas this time: %s", exc)
        res.flatten_skipped = str(exc)
        flat = Flattened()
    res.deltas_flattened = flat.deltas
    res.packs_written.extend(flat.packs)
    marked |= bases - flat.bases
    # sweep, in one transaction
    progress.report("sweeping what nothing uses")
    with store.env.begin(write=True) as txn:
        res.manifests_rebased = _rebase_manifests(txn, db["manifests"], live)
        dead_manifests = [bytes(k) for k in txn.cursor(db=db["manifests"]).iternext(values=False)
                          if bytes(k) not in live]
        for k in dead_manifests:
            txn.delete(k, db=db["manifests"])
        meta = txn.cursor(db=db["cas_meta"])
        if meta.set_range(hints.PREFIX):  # the page hints of manifests no longer live
            for k in list(meta.iternext(values=False)):
                if not bytes(k).startswith(hints.PREFIX):
                    break
                if bytes(k)[len(hints.PREFIX):] not in live:
                    txn.delete(k, db=db["cas_meta"])
        res.manifests_removed = len(dead_manifests)
        freed: dict[int, int] = {}
        dead_chunks = []
        for k, v in txn.cursor(db=db["chunks"]):
            if bytes(k) not in marked:
                dead_chunks.append(bytes(k))
                try:
                    loc = fmt.Location.decode(v, bytes(k))
                except IntegrityError:  # which pack it was in is lost: it frees no figure
                    continue
                if loc.problem() is None:  # a damaged length must not empty a live pack
                    freed[loc.pack] = freed.get(loc.pack, 0) + loc.record_len
        for k in dead_chunks:
            txn.delete(k, db=db["chunks"])
        release(txn, store, freed)
        res.chunks_freed = len(dead_chunks)
        res.bytes_freed = sum(freed.values()) + flat.delta_bytes
        res.bytes_rewritten = flat.whole_bytes
        fmt.bump_gc_generation(txn, db["cas_meta"])  # see fmt.GC_GENERATION
        crash_point("gc.sweep")
    _drop_orphans(store, res)
    _repack(store, threshold, res)
    res.disk_bytes_written = sum(_pack_file_size(store, no) for no in res.packs_written)
    res.disk_bytes_reclaimed = max(0, res.disk_bytes_reclaimed - res.disk_bytes_written)
    return res


def _pack_file_size(store: ChunkStore, no: int) -> int:
    try:
        return os.lstat(os.path.join(store.packs_dir, fmt.pack_name(no))).st_size
    except FileNotFoundError:  # (a pack written and removed again by this gc)
        return 0


def _rebase_manifests(txn, mdb, live: set[bytes]) -> int:
    """Store again the live delta manifests whose base is not live, before the sweep deletes it
    (and the chunks it names, which a check would then call missing): for each such base, one
    of its deltas (the lowest id: any will do) becomes plain and the others deltas on it."""
    orphans: dict[bytes, list[bytes]] = {}
    for mid in live:
        base = fmt.manifest_base(txn.get(mid, b"", db=mdb))
        if base is not None and base not in live:
            orphans.setdefault(base, []).append(mid)
    for mids in orphans.values():
        mids.sort()
        plain = {mid: delta.expand_manifest(mid, txn.get(mid, db=mdb),
                                            lambda b: txn.get(b, db=mdb)) for mid in mids}
        new_base = mids[0]
        txn.put(new_base, plain[new_base], db=mdb)
        for mid in mids[1:]:
            txn.put(mid, delta.manifest_delta(plain[mid], new_base, plain[new_base])
                    or plain[mid], db=mdb)
    return sum(map(len, orphans.values()))


def _require_indexed(store: ChunkStore, txn, marked: set[bytes]) -> None:
    """Every chunk a live manifest holds is in the index, or GC stops before deleting anything.

    An index whose key was damaged lists the chunk under another id: the sweep would take that
    entry for garbage and free the only pointer to live bytes (a later repack deletes them).
    """
    chunks = store.db["chunks"]
    lost = [cid for cid in marked if txn.get(cid, db=chunks) is None]
    if lost:
        more = f" and {len(lost) - 1} more" if len(lost) > 1 else ""
        raise StoreDamaged(path=store.path, why=(
            f"chunk {min(lost).hex()}{more}, held by a live checkpoint, is not in the index, "
            "so gc frees nothing (run `ksfs check` to see what is damaged)"))
    _require_decodable(store, txn, marked)


def _require_decodable(store: ChunkStore, txn, kept: set[bytes]) -> None:
    """Every index entry GC keeps decodes, or GC stops before deleting anything: it could not
    tell which pack such a chunk holds, so a repack could remove its bytes."""
    for cid in kept:
        raw = txn.get(cid, db=store.db["chunks"])
        if raw is not None:
            try:
                loc = fmt.Location.decode(raw, cid)
            except IntegrityError as exc:
                raise StoreDamaged(path=store.path, why=f"{exc}; a live checkpoint holds it, "
                                   "so gc frees nothing (run `ksfs check` to see what is "
                                   "damaged)") from None
            if loc.bases_disagree():  # it may have lost a base GC would then free
                raise StoreDamaged(path=store.path, why=(
                    f"the index entry of chunk {cid.hex()} names {len(loc.base_ids)} bases "
                    f"for codec {loc.codec}; a live checkpoint holds it, so gc frees nothing "
                    "(run `ksfs check` to see what is damaged)"))


def _packs_repacked(txn, store: ChunkStore, kept: set[bytes], threshold: float) -> set[int]:
    """The packs the repack after the sweep copies out or removes, judged as ``_repack`` will
    judge them: their kept records under ``threshold`` of their size, or none. Flattening only
    takes records out of packs, so it never takes a pack off this list."""
    chunks = store.db["chunks"]
    live: dict[int, int] = {}
    for cid in kept:
        raw = txn.get(cid, db=chunks)
        if raw is None:
            continue
        loc = fmt.Location.decode(raw, cid)  # (each one kept decodes: _require_decodable)
        if loc.problem() is None:
            live[loc.pack] = live.get(loc.pack, 0) + loc.record_len
    going = set()
    for k, v in txn.cursor(db=store.db["packs"]):
        no, (size, _) = int.from_bytes(k, "big"), fmt.decode_pack_value(k, v)
        if live.get(no, 0) == 0 or (size and live[no] < threshold * size):
            going.add(no)
    return going


def _first_pack_no(txn, store: ChunkStore) -> int:
    """The lowest number a pack GC writes may take: past every pack listed and next_pack."""
    listed = [int.from_bytes(k, "big") + 1
              for k in txn.cursor(db=store.db["packs"]).iternext(values=False)]
    return max([fmt.next_pack(txn, store.db["cas_meta"]), *listed])


def _drop_orphans(store: ChunkStore, res: GCResult) -> None:
    """Remove packs no index lists, cut tails abandoned ingests left after committed bytes, and
    settle size figures that disagree with the file and the records the index places there.

    Bytes the index places records in are never removed, whatever the figures say: a pack
    whose entry in the packs database is lost, or whose figure damage made too small, still
    holds live records (this deleted such a pack as an unfinished ingest's, and cut such a
    figure's records off)."""
    with store.env.begin() as txn:
        packs = {int.from_bytes(k, "big"): fmt.decode_pack_value(k, v)
                 for k, v in txn.cursor(db=store.db["packs"])}
        ends = _record_ends(txn, store)
    settle: dict[int, int] = {}
    for name in list_packs_dir(store.path, store.packs_dir):
        if (no := fmt.pack_number(name)) is None:
            continue
        path = os.path.join(store.packs_dir, name)
        with translate("reclaim pack", path):
            st = os.lstat(path)
            if not stat_.S_ISREG(st.st_mode):
                continue  # not a pack any ingest wrote: check names it, gc leaves it be
            st_size, placed = st.st_size, ends.get(no, 0)
            if no not in packs:
                if placed:
                    res.skipped_packs[no] = ("the store does not list it, but index entries "
                                             "place records in it")
                    continue
                os.unlink(path)
                store.handles.forget(no)
                res.packs_removed.append(no)
                res.disk_bytes_reclaimed += st_size
                continue
            size = packs[no][0]
            if st_size > max(size, placed):
                os.truncate(path, max(size, placed))
                res.disk_bytes_reclaimed += st_size - max(size, placed)
                st_size = max(size, placed)
            if placed <= st_size and st_size < size:
                settle[no] = st_size  # cut short, losing only records no longer placed
            elif size < placed <= st_size:
                settle[no] = placed
    if settle:
        _settle(store, settle, res)


def _record_ends(txn, store: ChunkStore) -> dict[int, int]:
    """Pack number -> where the last record the index places in it ends. (An entry that does
    not decode, or whose figures no pack can hold, places nothing: check names it.)"""
    ends: dict[int, int] = {}
    for k, v in txn.cursor(db=store.db["chunks"]):
        try:
            loc = fmt.Location.decode(v, bytes(k))
        except IntegrityError:
            continue
        if loc.problem() is None:
            ends[loc.pack] = max(ends.get(loc.pack, 0), loc.offset + loc.record_len)
    return ends


def _settle(store: ChunkStore, sizes: dict[int, int], res: GCResult) -> None:
    """Set the size figure of each pack in ``sizes`` (see ``GCResult.settled_packs``): check
    then no longer calls them damaged, and an ingest may append to them again (one never
    appends to a pack shorter than its figure)."""
    with store.env.begin(write=True, db=store.db["packs"]) as txn:
        for no, size in sizes.items():
            key = fmt.pack_key(no)
            raw = txn.get(key)
            if raw is not None:
                before, live = fmt.decode_pack_value(key, raw)
                txn.put(key, fmt.PACK_VALUE.pack(size, live))
                res.settled_packs[no] = (before, size)


def _repack(store: ChunkStore, threshold: float, res: GCResult) -> None:
    db = store.db
    with store.env.begin() as txn:
        packs = {int.from_bytes(k, "big"): fmt.decode_pack_value(k, v)
                 for k, v in txn.cursor(db=db["packs"])}
        thin = {no for no, (size, live) in packs.items() if size and live < threshold * size}
        empty = {no for no, (size, live) in packs.items() if live == 0}
        moving: dict[int, list[tuple[bytes, fmt.Location]]] = {}
        referenced: set[int] = set()
        if thin or empty:
            for k, v in txn.cursor(db=db["chunks"]):
                loc = fmt.Location.decode(v, bytes(k))
                referenced.add(loc.pack)
                if loc.pack in thin or loc.pack in empty:
                    moving.setdefault(loc.pack, []).append((bytes(k), loc))
        # A pack is removed only when no chunk points into it, whatever its live figure says
        # (a figure made wrong by a damaged entry would otherwise delete live records):
        # one still referenced is copied out like a thin one.
        thin |= empty & referenced
        empty -= referenced
        first_no = _first_pack_no(txn, store)
    if not thin and not empty:
        return
    writers: list[PackWriter] = []
    moved: list[tuple[bytes, fmt.Location]] = []
    done: list[int] = []
    dctx = zstandard.ZstdDecompressor()
    pack_bytes = {no: sum(loc.record_len for _, loc in moving.get(no, ())) for no in thin - empty}
    steps = progress.Steps("repacking sparse packs", sum(pack_bytes.values()))
    committed = False
    try:
        for no in sorted(thin - empty):
            items = sorted(moving.get(no, []), key=lambda it: it[1].offset)
            copies = _copy_pack(store, no, items, writers, first_no, dctx, res)
            steps.add(pack_bytes[no])
            if copies is None:
                continue
            if writers:
                first_no = max(first_no, writers[-1].no + 1)
            moved.extend(copies)
            done.append(no)
        for w in writers:
            w.sync()
            w.verify(dctx, store.run_split, store.read_base)
        gone = sorted(set(done) | empty)
        with index_errors("gc", store.path), store.env.begin(write=True) as txn:
            for cid, loc in moved:
                txn.put(cid, loc.encode(), db=db["chunks"])
            for no in gone:
                txn.delete(fmt.pack_key(no), db=db["packs"])
            commit_writers(txn, store, writers)
            crash_point("gc.repack")
        committed = True
    except NoSpace as exc:
        raise _no_room_to_repack(store, exc, sum(pack_bytes.values()), len(pack_bytes)) from exc
    finally:
        for w in writers:
            w.close()
            if not committed:  # nothing names its records: a partial pack is no ingest's
                with contextlib.suppress(OSError):  # leftover, and its space goes back now
                    os.unlink(w.path)
    for no in gone:
        path = os.path.join(store.packs_dir, fmt.pack_name(no))
        with translate("remove repacked pack", path):
            try:
                st = os.lstat(path)
                if stat_.S_ISREG(st.st_mode):
                    os.unlink(path)
                    res.disk_bytes_reclaimed += st.st_size
                else:  # a directory by a pack's name (it was EISDIR, exit 1): check names it
                    empty.discard(no)
                    res.skipped_packs[no] = "its file is not a regular file"
            except FileNotFoundError:
                pass
        store.handles.forget(no)
    fsync_dir(store.packs_dir)
    res.packs_repacked = done
    res.packs_removed.extend(sorted(empty))
    res.packs_written.extend(w.no for w in writers if w.written)


def _no_room_to_repack(store: ChunkStore, exc: NoSpace, need: int, packs: int) -> NoSpace:
    """Say what a repack the disk cut short needs: about the live bytes it copies (QA: the
    bare ENOSPC left the user to guess)."""
    return NoSpace(path=store.path, why=(
        f"{exc.fields.get('why', exc)}; gc copies {need / (1 << 20):.1f} MiB of live chunks "
        f"out of {packs} sparse pack(s) and needs about that much free space: removing or "
        "moving other files on its file system, or deleting more checkpoints (`ksfs rm`), "
        "lets the next gc go on (what this one swept stays swept; its partial pack is gone)"))


def _copy_pack(store: ChunkStore, no: int, items: list[tuple[bytes, fmt.Location]],
               writers: list[PackWriter], first_no: int, dctx: zstandard.ZstdDecompressor,
               res: GCResult) -> list[tuple[bytes, fmt.Location]] | None:
    """Copy the live records of pack no to the newest writer; None if one of them is damaged."""
    path = os.path.join(store.packs_dir, fmt.pack_name(no))
    records = []
    for cid, loc in items:
        why = loc.problem()
        if why is not None:
            res.skipped_packs[no] = f"chunk {cid.hex()}: {why}"
            return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:  # reading only: no full disk here, the pack itself is the trouble
        res.skipped_packs[no] = f"it cannot be opened: {exc.strerror}"
        return None
    try:
        for cid, loc in items:
            try:
                rec = os.pread(fd, loc.record_len, loc.offset)
            except OSError as exc:  # EIO, or a directory by the pack's name (EISDIR)
                res.skipped_packs[no] = f"it cannot be read: {exc.strerror}"
                return None
            try:
                decode_payload(cid, rec[fmt.HEADER_SIZE :], loc.codec, loc.plain_len, dctx,
                               store.read_base)
            except IntegrityError as exc:
                res.skipped_packs[no] = str(exc)
                return None
            records.append((cid, loc, rec[fmt.HEADER_SIZE :]))
    finally:
        os.close(fd)
    copies = []
    for cid, loc, payload in records:
        copies.append((cid, append_to(writers, store, first_no, cid, payload, loc.plain_len,
                                      loc.codec)))
    return copies
