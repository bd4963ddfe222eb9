"""Deltas made again at the seal, once every chunk of the ingest is known.

A chunk is stored as it is digested, against the page homes known by then (``Ingest._homes_of``).
A page often lies twice among the new chunks of one save (a file's page cache and the buffer it
was copied from), and when the first copy is in a delta, the second finds no home: a delta is
never a base (one hop), so both hold the page's bytes. Three passes fix that before the packs
are fsynced, replacing records in this ingest's own packs (``Ingest._compact``):

- ``redelta``: a delta whose new pages a plain chunk stored after it (or on the other worker
  meanwhile) holds is made again with that chunk among its bases.
- ``plain_to_delta``: of two plain chunks holding the same page, stored at once on the two
  workers, one becomes a delta on the other (never one a delta names as its base).
- ``share_pages``: pages that two or more deltas hold and that no page home has go, once, into a
  plain chunk of their own (a shared-page chunk, which no manifest names), and those deltas are
  made again with it among their bases. GC keeps it while a live delta needs it, as any base.

Each is kept only where it saves bytes: a delta made again replaces the first when it is
smaller by REWORK_GAIN; a shared-page chunk is stored when its deltas save more than it costs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import zstandard

from ksfs.cas import delta, hints
from ksfs.cas import format as fmt
from ksfs.cas.packs import encode_alone
from ksfs.cas.pagecut import PAGE, chunk_pages

if TYPE_CHECKING:
    from ksfs.cas.ingest import Ingest

REWORK_GAIN = 256  # bytes a delta made again must save to replace the first
# Pages in one shared-page chunk: a page group's worth (128 KiB), since a delta's dictionary
# grows by it (16 before the groups grew to 32 pages: 0.3-0.5% more stored, no faster)
SHARED_PAGES_MAX = 32
INDEX_ENTRY_COST = 100  # what an index entry takes in LMDB, about, counted against a shared chunk

Redo = dict[bytes, tuple[tuple[int, bytes], list[bytes], int]]  # chunk -> payload, bases, plain len


@dataclass
class Plan:
    redo: Redo  # chunks to store again
    shared: dict[bytes, tuple[bytes, int]]  # shared-page chunks: id -> (plain bytes, file)


def plan(ing: Ingest) -> Plan:
    """What to store again; reads the ingest's state and other packs, writes nothing (so the
    seal fsyncs this ingest's packs meanwhile)."""
    redo: Redo = {}
    redelta(ing, redo)
    plain_to_delta(ing, redo)
    return Plan(redo, share_pages(ing, redo))


def apply(ing: Ingest, plan: Plan) -> None:
    """Replace the records ``plan`` makes again in this ingest's packs, and add its shared-page
    chunks."""
    if not plan.redo:
        return
    for w in ing.writers:
        if any(cid in plan.redo for cid, _ in w.written):
            ing._compact(w, plan.redo.keys())
    cctx = zstandard.ZstdCompressor(level=ing.level)
    for sid, (pages, number) in plan.shared.items():
        codec, stored = encode_alone(cctx, pages)
        ing._append(sid, stored, len(pages), codec)
        ing.brought[number].append(sid)
    for cid, ((codec, stored), _, plain_len) in plan.redo.items():
        ing._append(cid, stored, plain_len, codec)


def _current(ing: Ingest, redo: Redo, cid: bytes) -> tuple[int, list[bytes]] | None:
    """(record length, bases) of a delta of this ingest as it stands, or None."""
    loc, kept = ing.new.get(cid), ing._deltas_kept.get(cid)
    if loc is None or kept is None or loc.codec not in fmt.DELTA_CODECS:
        return None
    if cid in redo:
        payload, bases, _ = redo[cid]
        return fmt.HEADER_SIZE + len(payload[1]), bases
    return loc.record_len, kept[1]


def _delta(ing: Ingest, data: bytes, bases: list[bytes], extra: dict[bytes, bytes]
           ) -> tuple[int, bytes]:
    """The delta payload of ``data`` on ``bases`` (plain bytes from ``extra`` for chunks not
    stored yet)."""
    dictionary = b"".join(extra[b] if b in extra else ing._base(b) for b in bases)
    return fmt.delta_payload(bases, delta.compress(data, dictionary))


def _plain_home(ing: Ingest, home: bytes, converted: set[bytes]) -> bool:
    """Whether a page home can be a base: its bytes are kept, and it is an old plain chunk or a
    plain chunk of this ingest that stays plain (not one another import committed first: that
    may be a delta there)."""
    if home not in ing._bases or home in converted or home in ing.lost:
        return False
    here = ing.new.get(home)
    return here is None or here.codec not in fmt.DELTA_CODECS


def _votes(ing: Ingest, keys: list[int], cid: bytes, bases: list[bytes], converted: set[bytes]
           ) -> list[bytes]:
    """The page homes of these pages besides ``cid`` and ``bases``, most pages first."""
    votes: dict[bytes, int] = {}
    for key in keys:
        home = ing._homes.get(key)
        if home is not None and home != cid and home not in bases and \
                _plain_home(ing, home, converted):
            votes[home] = votes.get(home, 0) + 1
    return sorted(votes, key=lambda h: (-votes[h], h))


def redelta(ing: Ingest, redo: Redo) -> None:
    """Deltas whose pages a page home found after them holds (a plain chunk stored later, or on
    the other worker meanwhile), made again with those homes first among their bases where that
    is smaller."""
    jobs = []
    for cid, (data, _, fixed, keys) in ing._deltas_kept.items():
        now = _current(ing, redo, cid)
        if now is None or now[0] < 2 * REWORK_GAIN:  # too small to save that much
            continue
        length, bases = now
        extra = _votes(ing, keys, cid, bases, set())
        if not extra:
            continue
        if len(bases) + len(extra) > fmt.MAX_BASES:
            extra, bases = _fewest_left_out(ing, keys, extra, bases, fixed)
            if not extra:
                continue
        jobs.append((cid, data, extra + bases, length))  # the old version's bases last
    # on both workers: zstd lets go of the GIL
    made = ing.store.pool.map(lambda job: _delta(ing, job[1], job[2], {}), jobs)
    for (cid, data, chosen, length), payload in zip(jobs, made, strict=True):
        if fmt.HEADER_SIZE + len(payload[1]) < length - REWORK_GAIN:
            redo[cid] = (payload, chosen, len(data))


def _fewest_left_out(ing: Ingest, keys: list[int], extra: list[bytes], bases: list[bytes],
                     fixed: bool) -> tuple[list[bytes], list[bytes]]:
    """Of the homes found (``extra``, most pages first) and a delta's bases, the MAX_BASES
    holding the most of its pages (bases win ties: the rest of the chunk is there)."""
    mine = set(keys)
    keep = keep_most_pages({b: len(mine & ing._page_set(b, fixed)) for b in bases},
                           {h: sum(1 for k in keys if ing._homes.get(k) == h) for h in extra})
    return [h for h in extra if h in keep], [b for b in bases if b in keep]


def keep_most_pages(held: dict[bytes, int], votes: dict[bytes, int]) -> set[bytes]:
    """Of a chunk's bases (``held``: how many of its pages each holds) and the page homes found
    for it (``votes``: the same count), the MAX_BASES holding the most; bases win ties (the
    rest of the chunk, record headers and a changed page's unchanged bytes, is there)."""
    ranked = sorted([(n, 1, b) for b, n in held.items()] + [(n, 0, h) for h, n in votes.items()],
                    reverse=True)
    return {b for _, _, b in ranked[:fmt.MAX_BASES]}


def plain_to_delta(ing: Ingest, redo: Redo) -> None:
    """Plain chunks of this ingest whose pages another plain chunk holds (the two were stored at
    once, on the two workers), made deltas on it where that is smaller; never one that a delta
    names as its base, nor one another such delta is made on."""
    if not ing._local_bases:  # a first version: no page homes, nothing to look for
        return
    named = {b for loc in ing.new.values() if loc.base for b in loc.base_ids}
    named.update(b for _, bases, _ in redo.values() for b in bases)
    converted: set[bytes] = set()
    for cid in sorted(ing._local_bases):
        loc, packed = ing.new.get(cid), ing._page_keys.get(cid)
        if cid in named or loc is None or loc.codec in fmt.DELTA_CODECS or packed is None \
                or cid not in ing._bases:
            continue
        keys = [k for (k,) in hints.PAGE_KEY.iter_unpack(packed)]
        olders, fixed = ing._plain_olders.get(cid, ([], False))
        olders = [b for b in olders if b not in converted]
        extra = _votes(ing, keys, cid, olders, converted | {cid})
        if not extra:
            continue
        if len(olders) + len(extra) > fmt.MAX_BASES:
            extra, olders = _fewest_left_out(ing, keys, extra, olders, fixed)
        chosen = extra + olders  # its old version's bases last, as in _digest
        data = ing._bases[cid]
        payload = _delta(ing, data, chosen, {})
        if fmt.HEADER_SIZE + len(payload[1]) < loc.record_len - REWORK_GAIN:
            redo[cid] = (payload, chosen, len(data))
            converted.add(cid)
            named.update(chosen)


def share_pages(ing: Ingest, redo: Redo) -> dict[bytes, tuple[bytes, int]]:
    """Shared-page chunks for the pages several deltas hold that no page home has: id ->
    (plain bytes, number of the file whose delta holds them first); ``redo`` gets the deltas
    made again on them."""
    holders: dict[int, list[bytes]] = {}
    for cid, (_, _, _, keys) in ing._deltas_kept.items():
        if _current(ing, redo, cid) is None:
            continue
        for key in keys:
            if key in ing._homes or key in ing._hinted:
                continue
            got = holders.setdefault(key, [])
            if cid not in got:
                got.append(cid)
    by_first: dict[bytes, list[int]] = {}
    for key, got in holders.items():
        if len(got) >= 2:
            by_first.setdefault(got[0], []).append(key)
    if not by_first:
        return {}
    file_of = {cid: n for n, chunks in enumerate(ing.brought) for cid in chunks
               if cid in by_first}
    shared: dict[bytes, tuple[bytes, int]] = {}
    cctx = zstandard.ZstdCompressor(level=ing.level)
    with ing.store.env.begin(db=ing.store.db["chunks"]) as txn:
        for first, keys in by_first.items():
            keys = keys[:SHARED_PAGES_MAX]
            data, _, fixed, first_keys = ing._deltas_kept[first]
            page_of = dict(zip(first_keys, chunk_pages(data, fixed), strict=True))
            pages = b"".join(page_of[k] for k in keys)
            sid = fmt.chunk_id(pages)
            if sid in ing.new or sid in shared or txn.get(sid) is not None or \
                    first not in file_of or len(pages) != PAGE * len(keys):
                continue
            alone = len(encode_alone(cctx, pages)[1])
            cost = fmt.HEADER_SIZE + alone + INDEX_ENTRY_COST
            users = sorted({cid for k in keys for cid in holders[k]})
            if (len(users) - 1) * alone <= cost - alone + REWORK_GAIN + \
                    len(users) * fmt.BASE_ID_SIZE:
                continue  # pages that compress to next to nothing: the chunk cannot pay
            jobs = []
            for cid in users:
                length, bases = _current(ing, redo, cid) or (0, [])
                if not length:
                    continue
                data, _, fixed, own_keys = ing._deltas_kept[cid]
                if len(bases) >= fmt.MAX_BASES:  # in place of the base holding fewest pages
                    mine = set(own_keys)
                    weakest = min(bases, key=lambda b: (len(mine & ing._page_set(b, fixed)),
                                                        bases.index(b)))
                    if len(mine & ing._page_set(weakest, fixed)) >= len(mine & set(keys)):
                        continue
                    bases = [b for b in bases if b != weakest]
                jobs.append((cid, data, [sid, *bases], length))
            made = ing.store.pool.map(
                lambda job, new={sid: pages}: _delta(ing, job[1], job[2], new), jobs)
            remade, saved = {}, 0
            for (cid, data, chosen, length), payload in zip(jobs, made, strict=True):
                gain = length - fmt.HEADER_SIZE - len(payload[1]) - fmt.BASE_ID_SIZE
                if gain > 0:
                    remade[cid] = (payload, chosen, len(data))
                    saved += gain
            if len(remade) >= 2 and saved > cost + REWORK_GAIN:
                redo.update(remade)
                shared[sid] = (pages, file_of[first])
                ing._local_bases.add(sid)
                ing._bases[sid] = pages
    return shared
