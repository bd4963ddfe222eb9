"""Checking a store: ``check_store`` finds every damaged or missing chunk, pack and manifest.

It reads under the shared store lock (so GC does not move things mid-check) and reports; it never
repairs, deletes or rewrites anything. Without ``read_data`` it checks that index, pack figures,
pack files, record headers and manifests agree, and looks up by id (as reads do) every chunk a
manifest names; with it, every chunk is decompressed and hashed.
The report names every reference (checkpoint file) that depends on something damaged.
"""

from __future__ import annotations

import fcntl
import os
import stat as stat_
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zstandard

from ksfs import progress
from ksfs.cas import delta
from ksfs.cas import format as fmt
from ksfs.cas.packs import decode_payload
from ksfs.cas.store import index_errors, list_packs_dir
from ksfs.errors import ChunkCorrupt, IntegrityError

if TYPE_CHECKING:
    from ksfs.cas.store import ChunkStore

READ_SPAN = 8 * 1024 * 1024
LOST_BY_ID = "the index lists it, but a lookup by its id does not find it: a B-tree page is damaged"


@dataclass
class CheckReport:
    """What a check found. A clean report is falsy and has ``ok`` true."""

    damaged_chunks: dict[str, str] = field(default_factory=dict)  # chunk hex -> why
    missing_chunks: dict[str, str] = field(default_factory=dict)
    damaged_packs: dict[int, str] = field(default_factory=dict)  # pack number -> why
    damaged_manifests: dict[str, str] = field(default_factory=dict)  # manifest hex -> why
    # the index's counters in cas_meta that disagree with what it lists: name -> why
    damaged_counters: dict[str, str] = field(default_factory=dict)
    affected_manifests: dict[str, list[str]] = field(default_factory=dict)  # -> chunk hexes
    affected_references: dict[str, list[str]] = field(default_factory=dict)  # ref -> why
    chunks_checked: int = 0
    manifests_checked: int = 0
    packs_checked: int = 0
    data_read: bool = False
    # where the index puts each damaged or missing chunk: (pack, offset), for scripts
    locations: dict[str, tuple[int, int]] = field(default_factory=dict)
    orphan_packs: list[int] = field(default_factory=list)  # unindexed packs GC will remove
    orphan_bytes: int = 0  # bytes of abandoned ingests, reclaimable, not damage
    # packs a running ingest (or repack) is appending to, and its bytes not yet committed
    in_use_packs: list[int] = field(default_factory=list)
    in_use_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not (self.damaged_chunks or self.missing_chunks or self.damaged_packs
                    or self.damaged_manifests or self.affected_manifests
                    or self.affected_references or self.damaged_counters)

    def __bool__(self) -> bool:
        return not self.ok

    def lines(self) -> list[str]:
        """One human sentence per finding, every one (``--json``'s problems): in the order and
        number of ``findings``."""
        out = [f"index counter {name}: {why}"
               for name, why in sorted(self.damaged_counters.items())]
        out += [f"pack {no}: {why}" for no, why in sorted(self.damaged_packs.items())]
        out += [_holding_line(no, n) for no, n in sorted(self.packs_holding_damage().items())]
        out += [_chunk_line(c, "damaged", why) for c, why in sorted(self.damaged_chunks.items())]
        out += [_chunk_line(c, "missing", why) for c, why in sorted(self.missing_chunks.items())]
        out += self._manifest_lines()
        out += [self._file_line(ref) for ref in sorted(self.affected_references)]
        return out

    def text_lines(self) -> list[str]:
        """What plain ``ksfs check`` prints: every finding of ``lines``, grouped. Each damaged
        pack comes with the damaged or missing chunks the index places in it, one line each,
        in pack order (so a pack cut short names every chunk it lost: QA, nineteenth session,
        1,136 of them, which the issue's "every damaged chunk" asks for); then the chunks the
        index places nowhere; then the manifests; then each checkpoint that depends on
        something damaged, on a line of its own, followed by each of its files that does."""
        out = [f"index counter {name}: {why}"
               for name, why in sorted(self.damaged_counters.items())]
        by_pack: dict[int, list[str]] = {}
        nowhere = []
        for c in {**self.damaged_chunks, **self.missing_chunks}:
            at = self.locations.get(c)
            if at is None:
                nowhere.append(c)
            else:
                by_pack.setdefault(at[0], []).append(c)
        for no in sorted(set(self.damaged_packs) | set(by_pack)):
            if no in self.damaged_packs:
                out.append(f"pack {no}: {self.damaged_packs[no]}")
            else:
                out.append(_holding_line(no, len(by_pack[no])))
            chunks = sorted(by_pack.get(no, []), key=lambda c: (self.locations[c][1], c))
            out += [line for c in chunks for line in self._chunk_lines(c)]
        out += [line for c in sorted(nowhere) for line in self._chunk_lines(c)]
        out += self._manifest_lines()
        by_checkpoint: dict[str, list[str]] = {}
        for ref in self.affected_references:
            checkpoint, slash, _ = ref.rpartition("/")
            by_checkpoint.setdefault(checkpoint if slash else "", []).append(ref)
        for checkpoint, refs in sorted(by_checkpoint.items()):
            if checkpoint:  # (a reference that names no checkpoint stands alone)
                verb = "depends" if len(refs) == 1 else "depend"
                out.append(f"checkpoint {checkpoint}: {len(refs)} of its files {verb} on "
                           "damaged or missing data")
            out += [self._file_line(ref) for ref in sorted(refs)]
        return out

    def _chunk_lines(self, chunk: str) -> list[str]:
        """The line of a damaged or missing chunk (two when it is both)."""
        return [_chunk_line(chunk, what, found[chunk])
                for what, found in (("damaged", self.damaged_chunks),
                                    ("missing", self.missing_chunks)) if chunk in found]

    def _manifest_lines(self) -> list[str]:
        out = [f"manifest {m}: {why}" for m, why in sorted(self.damaged_manifests.items())]
        # The chunks are counted, not listed again: each has a line of its own already, and
        # --json's finding lists them (a pack cut short made one line of 6,000 characters)
        out += [f"manifest {m}: depends on {len(c)} damaged or missing chunk(s), each named on "
                "a line of its own" for m, c in sorted(self.affected_manifests.items())]
        return out

    def _file_line(self, ref: str) -> str:
        return f"{ref}: unreadable ({'; '.join(self.affected_references[ref])})"

    def findings(self) -> list[dict[str, Any]]:
        """The findings of ``lines`` as records for scripts (``ksfs check --json``), in the same
        order: each has a ``kind`` and names what it is about."""
        out: list[dict[str, Any]] = [{"kind": "damaged_counter", "counter": name, "why": why}
                                     for name, why in sorted(self.damaged_counters.items())]
        out += [{"kind": "damaged_pack", "pack": no, "why": why}
                for no, why in sorted(self.damaged_packs.items())]
        out += [{"kind": "pack_holding_damage", "pack": no, "file": f"packs/{fmt.pack_name(no)}",
                 "chunks": n} for no, n in sorted(self.packs_holding_damage().items())]
        out += [{"kind": "damaged_chunk", "chunk": c, **self._where(c), "why": why}
                for c, why in sorted(self.damaged_chunks.items())]
        out += [{"kind": "missing_chunk", "chunk": c, **self._where(c), "why": why}
                for c, why in sorted(self.missing_chunks.items())]
        out += [{"kind": "damaged_manifest", "manifest": m, "why": why}
                for m, why in sorted(self.damaged_manifests.items())]
        out += [{"kind": "affected_manifest", "manifest": m, "chunks": sorted(c)}
                for m, c in sorted(self.affected_manifests.items())]
        out += [{"kind": "unreadable_file", "file": ref, "why": list(why)}
                for ref, why in sorted(self.affected_references.items())]
        return out

    def packs_holding_damage(self) -> dict[int, int]:
        """Pack number -> how many damaged or missing chunks the index places in it, for the
        packs that are sound themselves (a damaged pack has its own line): the pack is named
        too, as the issue's "every damaged chunk and pack" asks (QA, thirty-fourth session: a
        flipped byte named its chunk, and its pack only inside the chunk's line)."""
        held: dict[int, int] = {}
        for c in {**self.damaged_chunks, **self.missing_chunks}:
            at = self.locations.get(c)
            if at is not None and at[0] not in self.damaged_packs:
                held[at[0]] = held.get(at[0], 0) + 1
        return held

    def _where(self, chunk: str) -> dict[str, int]:
        """The pack and offset the index gives a chunk (none for one it does not list)."""
        at = self.locations.get(chunk)
        return {} if at is None else {"pack": at[0], "offset": at[1]}

    def summary(self) -> str:
        state = "clean" if self.ok else "DAMAGED"
        text = (f"store {state}: {_n(self.chunks_checked, 'chunk')}, "
                f"{_n(self.manifests_checked, 'manifest')}, {_n(self.packs_checked, 'pack')} "
                f"checked{' with data' if self.data_read else ''}")
        if self.orphan_bytes:
            # Not damage, but disk space: said, or a killed import's packs go unseen (QA).
            files = f"{len(self.orphan_packs)} pack file(s) and " if self.orphan_packs else ""
            text += (f"; {files}{self.orphan_bytes / (1 << 20):.1f} MiB left by ingests that "
                     f"did not finish, which no checkpoint uses (`ksfs gc` gives them back)")
        if self.in_use_bytes:
            text += (f"; an ingest is running: {len(self.in_use_packs)} pack file(s) in use by "
                     f"it, {self.in_use_bytes / (1 << 20):.1f} MiB not yet committed")
        return text


def _holding_line(no: int, chunks: int) -> str:
    return (f"pack {no} (packs/{fmt.pack_name(no)}): holds {chunks} damaged or missing "
            "chunk(s), each named on a line of its own")


def _chunk_line(chunk: str, what: str, why: str) -> str:
    return f"chunk {chunk}: {what} ({why})"


def _n(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def check_store(store: ChunkStore, read_data: bool, references: dict[str, list[str]]
                ) -> CheckReport:
    lock = store.lock(exclusive=False)
    try:
        return _check(store, read_data, references)
    finally:
        os.close(lock)


def _check(store: ChunkStore, read_data: bool, references: dict[str, list[str]]) -> CheckReport:
    rep = CheckReport(data_read=read_data)
    db = store.db
    # a damaged index cannot be listed: that is one IntegrityError naming it, not a traceback
    # (and a value that no longer decodes is its chunk's or pack's damage, not a struct.error)
    with index_errors("read the index", store.path), store.env.begin() as txn:
        packs, undecodable = {}, []
        for k, v in txn.cursor(db=db["packs"]):
            if len(v) == fmt.PACK_VALUE.size:
                packs[int.from_bytes(k, "big")] = fmt.PACK_VALUE.unpack(v)
            else:
                undecodable.append(int.from_bytes(k, "big"))
                rep.damaged_packs[undecodable[-1]] = \
                    f"its index entry no longer decodes ({len(v)} bytes, not {fmt.PACK_VALUE.size})"
        chunks, listed = [], set()
        for k, v in txn.cursor(db=db["chunks"]):
            listed.add(cid := bytes(k))
            try:
                chunks.append((cid, fmt.Location.decode(v, cid)))
            except ChunkCorrupt as exc:
                rep.damaged_chunks[cid.hex()] = str(exc.fields["why"])
        manifests = {bytes(k): bytes(v) for k, v in txn.cursor(db=db["manifests"])}
        infos = _decode_manifests(manifests, rep)
        lost = _lost_by_id(txn, db["chunks"], infos, chunks, listed)
        counters = {name: txn.get(name, db=db["cas_meta"]) for name in COUNTERS}
    rep.packs_checked = len(packs) + len(undecodable)
    for cid in lost:
        rep.missing_chunks[cid.hex()] = LOST_BY_ID

    # packs: present, as long as the index says, and their live figures add up
    live: dict[int, int] = {}
    ends: dict[int, int] = {}  # where the last record the index places in each pack ends
    for _, loc in chunks:
        live[loc.pack] = live.get(loc.pack, 0) + loc.record_len
        if loc.problem() is None:
            ends[loc.pack] = max(ends.get(loc.pack, 0), loc.offset + loc.record_len)
    disk, odd = _pack_files(store)
    for no in undecodable:  # judged by what is there, said once as damaged above
        packs[no] = (disk.get(no, 0), live.get(no, 0))
    for no, what in odd.items():
        rep.damaged_packs[no] = f"its file is {what} (no ingest makes one; gc leaves it)"
    for no, (size, live_bytes) in packs.items():
        if no in odd:
            pass
        elif no not in disk:
            rep.damaged_packs[no] = "its file is missing"
        elif disk[no] < size:
            rep.damaged_packs[no] = f"its file has {disk[no]} bytes, the index expects {size}"
            if ends.get(no, 0) <= disk[no]:  # e.g. a good copy imported again since the cut
                rep.damaged_packs[no] += (": cut short, but no record the index places in it "
                                          "was lost (`ksfs gc` takes its file's length as its "
                                          "size)")
        elif disk[no] > max(size, ends.get(no, 0)):
            # (records the index places past the figure are its damage, named below)
            _uncommitted(store, rep, no, disk[no] - max(size, ends.get(no, 0)))
        if no in disk and size < ends.get(no, 0) <= disk[no]:
            # the figure is the damage: the records are read from the file, and checked there
            rep.damaged_packs.setdefault(
                no, f"its index entry gives it {size} bytes, but the index places records in it "
                    f"up to byte {ends[no]} (`ksfs gc` sets its size to that)")
        if live.get(no, 0) != live_bytes:
            rep.damaged_packs.setdefault(
                no, f"live bytes {live_bytes} disagree with its index entries ({live.get(no, 0)})")
    for no, size in disk.items():
        if no not in packs and no not in live:  # (one entries name is damage, named below)
            _uncommitted(store, rep, no, size, listed=False)
    for no in live:
        if no not in packs:
            rep.damaged_packs[no] = "index entries point at a pack the store does not list"
    _check_counters(counters, set(packs), set(live), set(disk) | set(odd), rep)

    # chunks: in pack order, header (and with read_data, payload) against the index
    chunks.sort(key=lambda item: (item[1].pack, item[1].offset))
    rep.chunks_checked = len(listed)
    by_pack: dict[int, list[tuple[bytes, fmt.Location]]] = {}
    for cid, loc in chunks:
        end = loc.offset + loc.record_len
        if (why := loc.problem()) is not None:
            rep.damaged_chunks[cid.hex()] = why
        elif loc.pack in odd:
            rep.missing_chunks[cid.hex()] = f"its pack {loc.pack} is {odd[loc.pack]}"
        elif loc.pack not in disk:  # (named above: missing, or listed nowhere)
            rep.missing_chunks[cid.hex()] = f"its pack {loc.pack} is missing"
        elif end > disk[loc.pack]:
            # the file is what a read gets, whatever the pack's figure says
            rep.damaged_chunks[cid.hex()] = _cut_short(loc, disk[loc.pack])
        else:
            by_pack.setdefault(loc.pack, []).append((cid, loc))
    pack_bytes = {no: sum(loc.record_len for _, loc in items) for no, items in by_pack.items()}
    steps = progress.Steps("reading and hashing every chunk" if read_data else
                           "checking every chunk's header", sum(pack_bytes.values()))
    for no, items in by_pack.items():
        _check_pack(store, no, items, read_data, rep)
        steps.add(pack_bytes[no])
    _check_bases(chunks, rep)

    # manifests: intact, and every chunk they name is indexed and sound
    bad = set(rep.damaged_chunks) | set(rep.missing_chunks)
    rep.manifests_checked = len(manifests)
    for mid, info in infos.items():
        hurt = set()
        for cid, _ in info.entries:
            if cid is None:
                continue
            h = cid.hex()
            if cid not in listed:
                rep.missing_chunks.setdefault(h, "it is not in the index")
                hurt.add(h)
            elif h in bad:
                hurt.add(h)
        if hurt:
            rep.affected_manifests[mid.hex()] = sorted(hurt)

    for cid, loc in chunks:
        if cid.hex() in rep.damaged_chunks or cid.hex() in rep.missing_chunks:
            rep.locations[cid.hex()] = (loc.pack, loc.offset)

    for mid, refs in references.items():
        why = None
        mhex = str(mid)  # a damaged record may name anything (an int was a TypeError)
        try:
            key = bytes.fromhex(mhex)
        except ValueError:
            key = b""
        if key not in manifests:
            rep.damaged_manifests.setdefault(mhex, "it is missing from the store")
            why = f"manifest {mhex} is missing"
        elif mhex in rep.damaged_manifests:
            why = f"manifest {mhex} is damaged"
        elif mhex in rep.affected_manifests:
            n = len(rep.affected_manifests[mhex])
            why = f"manifest {mhex} depends on {n} damaged or missing chunk(s)"
        if why:
            for ref in refs:
                rep.affected_references.setdefault(ref, []).append(why)
    return rep


# The counters cas_meta keeps, and what a value that is no number breaks.
COUNTERS = {
    fmt.NEXT_PACK: "every ingest and gc fails",
    fmt.INGEST_COMMITS: "every ingest fails at its commit",
    fmt.GC_GENERATION: "every gc fails, and the mount's space figures (st_blocks) stop "
                       "following the store",
}
RESTORE = "restore the index from a backup"


def _check_counters(counters: dict[bytes, bytes | None], listed: set[int], named: set[int],
                    on_disk: set[int], rep: CheckReport) -> None:
    """The counters in cas_meta against what the index lists. Each must be a number. Every
    commit that lists a pack moves ``next_pack`` past it in the same transaction, so one not
    above every pack the index lists or its entries name is damage. It is dangerous where such
    a pack is neither listed nor on disk and lies past every listed one: new packs are numbered
    past ``next_pack`` and every listed pack (and never over a file), so the next new pack can
    take its number, and the entries would point into that pack's records. A pack file the
    index does not list may lie past ``next_pack``: an ingest that died before its commit
    leaves one. ``ingest_commits`` and ``gc_generation`` are only ever compared for change, so
    no value of theirs that is a number breaks anything, and whether one went backwards cannot
    be told from one look at the store."""
    for name, raw in counters.items():
        try:
            fmt.meta_int(raw, name.decode())
        except IntegrityError:
            rep.damaged_counters[name.decode()] = \
                f"{bytes(raw or b'')[:40]!r} is no number: {COUNTERS[name]} ({RESTORE})"
    if fmt.NEXT_PACK.decode() in rep.damaged_counters:
        return
    raw = counters[fmt.NEXT_PACK]
    value = fmt.meta_int(raw, "next_pack", 1)
    shown = "missing (read as 1)" if raw is None else str(value)[:40]
    if value > fmt.MAX_PACK_NO:
        rep.damaged_counters["next_pack"] = (
            f"{shown} is past the last pack number ({fmt.MAX_PACK_NO}): every ingest and gc "
            f"fails ({RESTORE})")
        return
    top = max(listed | named, default=0)
    if value > top:
        return
    floor = max(value, max(listed, default=0) + 1)
    unplaced = sorted(no for no in named - listed - on_disk if no >= floor)
    if unplaced:
        rep.damaged_counters["next_pack"] = (
            f"{shown} is not above pack {unplaced[-1]}, which index entries name while neither "
            "the index lists it nor packs/ holds it: the next new pack can take its number, and "
            "those entries would point into that pack's records")
    else:
        whose = "the index lists" if top in listed else "index entries name"
        rep.damaged_counters["next_pack"] = (
            f"{shown} is not above pack {top}, which {whose}: no commit leaves it so, the index "
            "is damaged (new packs are numbered past every listed pack and pack file all the "
            "same, and the next ingest that stores a chunk moves it past every listed pack)")


def _decode_manifests(manifests: dict[bytes, bytes], rep: CheckReport
                      ) -> dict[bytes, fmt.ManifestInfo]:
    """The manifests that are intact, decoded; the others go into ``rep`` as damaged."""
    infos = {}
    for mid, value in manifests.items():
        try:
            raw = delta.expand_manifest(mid, value, manifests.get)
            infos[mid] = fmt.decode_manifest(raw, mid.hex())
        except IntegrityError as exc:
            rep.damaged_manifests[mid.hex()] = str(exc)
    return infos


def _lost_by_id(txn, db, infos: dict[bytes, fmt.ManifestInfo],
                chunks: list[tuple[bytes, fmt.Location]], listed: set[bytes]) -> set[bytes]:
    """The listed chunks a manifest (or a delta, as its base) names that a lookup by id does
    not find. Reads look chunks up by id; a damaged branch page of the B-tree sends such a
    lookup the wrong way while a cursor walk still lists every key (QA: check called a store
    clean whose files ``cat`` could not read). Chunks the walk does not list are named as
    not in the index by the manifest pass."""
    wanted = {b for _, loc in chunks for b in loc.base_ids}
    for info in infos.values():
        wanted.update(cid for cid, _ in info.entries if cid is not None)
    return {cid for cid in wanted & listed if txn.get(cid, db=db) is None}


def _pack_files(store: ChunkStore) -> tuple[dict[int, int], dict[int, str]]:
    """({pack number: size} of the pack files in packs/, {number: what its entry is} for those
    that are no regular file: a directory, a device or a symbolic link by a pack's name is
    damage to name, not one to read). lstat, as gc judges them: a symbolic link is no pack gc
    would give back, whatever it points at."""
    disk: dict[int, int] = {}
    odd: dict[int, str] = {}
    for name in list_packs_dir(store.path, store.packs_dir):
        if (no := fmt.pack_number(name)) is None:
            continue
        try:
            st = os.lstat(os.path.join(store.packs_dir, name))
        except FileNotFoundError:  # gone since the listing: as if never listed
            continue
        if stat_.S_ISREG(st.st_mode):
            disk[no] = st.st_size
        else:
            odd[no] = _kind(st.st_mode)
    return disk, odd


def _uncommitted(store: ChunkStore, rep: CheckReport, no: int, nbytes: int,
                 listed: bool = True) -> None:
    """Count pack bytes the index does not list: a running writer's (it holds the pack's
    flock until it has committed) or ones an ingest that died left (gc gives them back)."""
    if _in_use(os.path.join(store.packs_dir, fmt.pack_name(no))):
        rep.in_use_packs.append(no)
        rep.in_use_bytes += nbytes
    elif _committed_since(store, no):
        pass  # an ingest committed them after our snapshot of the index, then let go
    else:
        if not listed:
            rep.orphan_packs.append(no)
        rep.orphan_bytes += nbytes


def _committed_since(store: ChunkStore, no: int) -> bool:
    """Whether the index now counts the whole pack file: read after its writer let go of the
    pack, so a commit made before that is seen."""
    with index_errors("read the index", store.path), store.env.begin() as txn:
        raw = txn.get(fmt.pack_key(no), db=store.db["packs"])
    if raw is None:
        return False
    path = os.path.join(store.packs_dir, fmt.pack_name(no))
    try:
        size = os.lstat(path).st_size
    except OSError:
        return False
    return len(raw) == fmt.PACK_VALUE.size and fmt.PACK_VALUE.unpack(raw)[0] >= size


def _in_use(path: str) -> bool:
    """Whether a writer holds the pack's flock (a try with a shared lock, let go at once)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also lets go of a lock we got
    return False


def _kind(mode: int) -> str:
    return "a symbolic link" if stat_.S_ISLNK(mode) else "not a regular file"


def _cut_short(loc: fmt.Location, file_size: int) -> str:
    return (f"pack {loc.pack} is cut short: its file ends at byte {file_size}, this record at "
            f"{loc.offset + loc.record_len}")


def _check_pack(store: ChunkStore, no: int, items: list[tuple[bytes, fmt.Location]],
                read_data: bool, rep: CheckReport) -> None:
    path = os.path.join(store.packs_dir, fmt.pack_name(no))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        for cid, _ in items:
            rep.missing_chunks[cid.hex()] = f"pack {no} cannot be opened: {exc.strerror}"
        return
    try:
        if not read_data:
            for cid, loc in items:
                try:
                    head = os.pread(fd, fmt.HEADER_SIZE, loc.offset)
                except OSError as exc:  # EIO: a bad sector is this record's damage
                    rep.damaged_chunks[cid.hex()] = f"pack {no} cannot be read: {exc.strerror}"
                    continue
                why = _header_problem(head, cid, loc)
                if why:
                    rep.damaged_chunks[cid.hex()] = f"pack {no} offset {loc.offset}: {why}"
            return
        # read spans of records at once, then decompress and hash on both workers
        i = 0
        while i < len(items):
            j = i
            start = items[i][1].offset
            while j < len(items) and items[j][1].offset + items[j][1].record_len - start <= \
                    max(READ_SPAN, items[i][1].record_len):
                j += 1
            end = items[j - 1][1].offset + items[j - 1][1].record_len
            try:
                raw = os.pread(fd, end - start, start)
            except OSError:  # EIO somewhere in the span: read its records one by one
                raw = _read_one_by_one(fd, no, items[i:j], start, end, rep)
            jobs = [(cid, loc, raw[loc.offset - start : loc.offset - start + loc.record_len])
                    for cid, loc in items[i:j] if cid.hex() not in rep.damaged_chunks]
            for found in store.run_split(lambda part: _verify_records(store, part), jobs):
                for h, why in found:
                    rep.damaged_chunks[h] = f"pack {no}: {why}"
            i = j
    finally:
        os.close(fd)


def _read_one_by_one(fd: int, no: int, items: list[tuple[bytes, fmt.Location]], start: int,
                     end: int, rep: CheckReport) -> bytes:
    """The span [start, end) of pack ``no`` read record by record after reading it whole
    failed: a record that cannot be read is damaged (named in ``rep``), its bytes left zero."""
    raw = bytearray(end - start)
    for cid, loc in items:
        try:
            rec = os.pread(fd, loc.record_len, loc.offset)
        except OSError as one:
            rep.damaged_chunks[cid.hex()] = f"pack {no} cannot be read: {one.strerror}"
            continue
        raw[loc.offset - start : loc.offset - start + len(rec)] = rec
    return bytes(raw)


def _header_problem(head_raw: bytes, cid: bytes, loc: fmt.Location) -> str | None:
    head = fmt.decode_record_header(head_raw)
    if isinstance(head, str):
        return head
    if head != (cid, loc.plain_len, loc.stored_len, loc.codec):
        return "record header disagrees with the index"
    return None


def _check_bases(chunks: list[tuple[bytes, fmt.Location]], rep: CheckReport) -> None:
    """Every delta's base is indexed, not a delta itself, and sound: else the delta is lost too."""
    locs = dict(chunks)
    for cid, loc in chunks:
        if loc.bases_disagree():
            rep.damaged_chunks.setdefault(cid.hex(), "its index entry's codec and base disagree")
            continue
        for base_id in loc.base_ids:
            base = locs.get(base_id)
            why = None
            if base_id.hex() in rep.damaged_chunks or base_id.hex() in rep.missing_chunks:
                why = "it is damaged or missing"
            elif base is None:
                why = "it is not in the index"
            elif base.codec in fmt.DELTA_CODECS:
                why = "it is a delta itself"
            if why:
                rep.damaged_chunks.setdefault(cid.hex(), f"its base chunk {base_id.hex()}: {why}")
                break


def _verify_records(store: ChunkStore, jobs: list[tuple[bytes, fmt.Location, bytes]]
                    ) -> list[tuple[str, str]]:
    d = zstandard.ZstdDecompressor()
    found = []
    for cid, loc, rec in jobs:
        if len(rec) < loc.record_len:  # the file shrank since check listed it
            found.append((cid.hex(), "its pack is cut short"))
            continue
        why = _header_problem(rec[: fmt.HEADER_SIZE], cid, loc)
        if why is None:
            try:
                decode_payload(cid, rec[fmt.HEADER_SIZE :], loc.codec, loc.plain_len, d,
                               store.read_base, loc.base)
            except IntegrityError as exc:
                why = exc.fields.get("why", str(exc))
        if why:
            found.append((cid.hex(), str(why)))
    return found
