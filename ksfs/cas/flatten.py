"""Turning deltas back into plain chunks once their base is kept for them alone.

A delta keeps its base alive. While the checkpoint that first stored the base lives, that is
free; once it is deleted, the base stays only for the deltas, and delta plus base can cost more
than the deltas' chunks stored whole. GC then rewrites those deltas as plain chunks (zstd alone)
and lets the base go, for each base where that stores fewer bytes on disk in this GC: the
records of base and deltas come back only where their pack is repacked or removed, so a base
in a pack that stays full is kept (flattening it would only add the chunks written whole).
Like repack, the new records are written to a new pack, fsynced and verified before the index
points at them, so a crash leaves either the deltas or the plain copies indexed, never neither.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zstandard

from ksfs.cas import format as fmt
from ksfs.cas.packs import TARGET_PACK_BYTES, PackWriter, encode_alone
from ksfs.crashpoints import crash_point
from ksfs.errors import IntegrityError

if TYPE_CHECKING:
    from ksfs.cas.store import ChunkStore

Plain = tuple[bytes, fmt.Location, int, bytes, int]  # id, old location, codec, stored, plain len
PLAN_BYTES = 256 * 1024 * 1024  # rewritten bytes held per GC run; the rest waits for the next


@dataclass
class Flattened:
    bases: set[bytes] = field(default_factory=set)  # no longer needed: the sweep frees them
    deltas: int = 0
    delta_bytes: int = 0  # record bytes of the deltas rewritten, now dead in their packs
    whole_bytes: int = 0  # record bytes of the same chunks stored whole in their place
    packs: list[int] = field(default_factory=list)


def flatten(store: ChunkStore, direct: set[bytes], first_no: int,
            repacked: set[int]) -> Flattened:
    """Rewrite the deltas whose base no live manifest names, where that saves disk bytes.

    ``direct``: the chunks live manifests name. ``repacked``: the packs this GC's repack copies
    out or removes; only the records in those give their bytes back in this GC (a record left
    dead in a pack that stays is still on disk), so only they count against the bytes written.
    On failure nothing is committed and the packs this wrote are removed before the error is
    raised.
    """
    db = store.db
    groups: dict[bytes, list[tuple[bytes, fmt.Location]]] = {}
    with store.env.begin(db=db["chunks"]) as txn:
        for k, v in txn.cursor():
            if len(v) > fmt.INDEX_VALUE.size and bytes(k) in direct:
                loc = fmt.Location.decode(v, bytes(k))
                for base in loc.base_ids:  # a delta on several bases is in each one's group
                    if base not in direct:
                        groups.setdefault(base, []).append((bytes(k), loc))
        base_locs = {b: fmt.Location.decode(raw, b) for b in groups
                     if (raw := txn.get(b)) is not None}
    cctx = zstandard.ZstdCompressor(level=store.level)
    plans: dict[bytes, list[Plain]] = {}
    planned = 0
    for base, deltas in groups.items():
        if planned > PLAN_BYTES:
            break
        bloc = base_locs.get(base)
        if bloc is None:
            continue  # check reports the missing base
        freed = sum(loc.record_len for loc in (bloc, *(loc for _, loc in deltas))
                    if loc.pack in repacked)
        if freed <= fmt.HEADER_SIZE * len(deltas):
            continue  # no rewrite can be smaller: not worth reading the deltas
        try:
            plain = [_alone(cctx, cid, loc, store.read_chunk(cid, loc)) for cid, loc in deltas]
        except IntegrityError:
            continue  # damaged: left as it is, for check to name
        whole = sum(fmt.HEADER_SIZE + len(p[3]) for p in plain)
        if whole < freed:
            plans[base] = plain
            planned += whole
    done = Flattened()
    if not plans:
        return done
    writers: list[PackWriter] = []
    committed = False
    try:
        moved = []
        written: set[bytes] = set()
        for plain in plans.values():
            for cid, old, codec, stored, plain_len in plain:
                if cid in written:  # a delta on two bases both flattened
                    continue
                written.add(cid)
                new = append_to(writers, store, first_no, cid, stored, plain_len, codec)
                moved.append((cid, old, new))
        for w in writers:
            w.sync()
            w.verify(store.dctx, store.run_split, store.read_base)
        with store.env.begin(write=True) as txn:
            dead: dict[int, int] = {}
            for cid, old, new in moved:
                txn.put(cid, new.encode(), db=db["chunks"])
                dead[old.pack] = dead.get(old.pack, 0) + old.record_len
            release(txn, store, dead)
            commit_writers(txn, store, writers)
            fmt.bump_gc_generation(txn, db["cas_meta"])  # bases are held no more
            crash_point("gc.flatten")
        committed = True
    finally:
        for w in writers:
            w.close()
            if not committed:  # nothing names these records: give the space back now
                with contextlib.suppress(OSError):
                    os.unlink(w.path)
    done.bases = set(plans)
    done.deltas = len(moved)
    done.delta_bytes = sum(old.record_len for _, old, _ in moved)
    done.whole_bytes = sum(new.record_len for _, _, new in moved)
    done.packs = [w.no for w in writers if w.written]
    return done


def _alone(cctx: zstandard.ZstdCompressor, cid: bytes, loc: fmt.Location, plain: bytes) -> Plain:
    return cid, loc, *encode_alone(cctx, plain), len(plain)


def append_to(writers: list[PackWriter], store: ChunkStore, first_no: int, cid: bytes,
              stored: bytes, plain_len: int, codec: int) -> fmt.Location:
    """Append a record GC writes to its newest pack, starting one (numbered from first_no)
    when there is none or it is full."""
    if not writers or writers[-1].size >= TARGET_PACK_BYTES:
        start = max(first_no, *(w.no + 1 for w in writers)) if writers else first_no
        writers.append(PackWriter.create(store.packs_dir, start))
    return writers[-1].append(cid, stored, plain_len, codec)


def release(txn, store: ChunkStore, dead: dict[int, int]) -> None:
    """Take ``dead`` record bytes (pack number -> bytes) off their packs' live figures."""
    for no, n in dead.items():
        key = fmt.pack_key(no)
        raw = txn.get(key, db=store.db["packs"])
        if raw is not None:
            size, live = fmt.decode_pack_value(key, raw)
            txn.put(key, fmt.PACK_VALUE.pack(size, max(0, live - n)), db=store.db["packs"])


def commit_writers(txn, store: ChunkStore, writers: list[PackWriter]) -> None:
    """Record the packs GC wrote (size, live bytes) and move ``next_pack`` past them."""
    db = store.db
    top = 0
    for w in writers:
        top = max(top, w.no)
        if w.written:
            live = sum(loc.record_len for _, loc in w.written)
            txn.put(fmt.pack_key(w.no), fmt.PACK_VALUE.pack(w.end, live), db=db["packs"])
    if top + 1 > fmt.next_pack(txn, db["cas_meta"]):
        txn.put(fmt.NEXT_PACK, str(top + 1).encode(), db=db["cas_meta"])
