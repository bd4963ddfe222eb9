"""The chunk store: a directory of pack files and one LMDB environment, opened as ``ChunkStore``.

This module owns the store's layout, its marker, the shared LMDB environment (the ledger and the
gateway open their own named databases in it), the store-wide flock and chunk lookup/read with
verification. Ingest, check and GC live in their own modules and are reached through methods
here. It never imports trio, pyfuse3, libvirt or click, and never returns bytes it has not
checked against their id.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import stat as stat_
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

import lmdb
import zstandard

from ksfs.cas import delta
from ksfs.cas import format as fmt
from ksfs.cas.packs import PackHandles, decode_payload, fsync_dir
from ksfs.errors import (
    Busy,
    ChunkCorrupt,
    ChunkMissing,
    KsfsError,
    ManifestCorrupt,
    NoSpace,
    NotAStore,
    NotPermitted,
    StoreDamaged,
    from_foreign,
    from_os_error,
    translate,
)
from ksfs.regularfile import open_lock_file, read_store_file

log = logging.getLogger(__name__)

MARKER = "ksfs.json"
FORMAT = "ksfs-store"
# 1: no delta chunks. 2: delta chunks (codec 2). 3: deltas on several bases (codec 3). 4: delta
# manifests (format.MANIFEST_DELTA_MAGIC). An ingest
# raises an older store's marker to this version before it writes anything, so a ksfs that knows
# only an older one refuses the store with a clear reason instead of reporting deltas as damage.
VERSION = 4
READABLE_VERSIONS = (1, 2, 3, 4)
LAYOUT = ("index", "packs", "staging", "vm")
# What holds checkpoint bytes (memory images: the guest's secrets too) is its owner's alone;
# the files inside stay readable by all, so a pack root wrote into a user's store still reads
# for that user. vm/ is left to the umask: QEMU may run as another user and open files there.
PRIVATE = ("index", "packs", "staging", "locks")
MAP_SIZE = 1 << 40 if sys.maxsize > 2**32 else 1 << 30  # sparse: LMDB only maps, never fills
MAX_DBS = 32
CAS_DBS = ("chunks", "manifests", "packs", "cas_meta")
# In cas_meta: the id (from the marker) of the store the index was made for. LMDB makes a new,
# empty environment wherever its file is missing or empty, and an empty index reads as an empty
# store: check would call it clean and gc would delete every pack as unlisted. So an index
# without this key (or naming another store) is refused as damage.
STORE_ID = b"store_id"
RESTORE_INDEX = "its packs are untouched: restore the index from a backup"

_envs: dict[str, list[Any]] = {}  # realpath -> [env, users]: LMDB forbids opening one env twice
_envs_lock = threading.Lock()


def _open_env(path: str, create: bool = False) -> lmdb.Environment:
    """The shared environment of the index directory ``path``; only ``create`` (a new store)
    may make its file, and a file cut short is refused before anything reads through the map."""
    with _envs_lock:
        slot = _envs.get(path)
        if slot is None:
            data = os.path.join(path, "data.mdb")
            _require_index_files(path)
            if not create:
                _require_index_file(data)
            try:
                env = lmdb.open(path, map_size=MAP_SIZE, max_dbs=MAX_DBS, subdir=True,
                                max_readers=512, create=create)
            except lmdb.Error as exc:
                if create or not _on_read_only_fs(path):
                    raise _lmdb_error("open the index", os.path.dirname(path), exc) from exc
                env = _open_read_only_env(path)
            try:
                _require_whole_file(env, data)
            except BaseException:
                env.close()
                raise
            slot = _envs[path] = [env, 0]
        slot[1] += 1
        return slot[0]


def _require_index_dir(store: str) -> None:
    """LMDB opens index/ and the files in it following links, and writes its lock file even
    for a reading command: a link planted there would have root write where it points."""
    index = os.path.join(store, "index")
    try:
        st = os.lstat(index)
    except FileNotFoundError:
        return  # told as a missing directory where it is needed
    if not stat_.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat_.S_ISLNK(st.st_mode) else "not a directory"
        raise StoreDamaged(path=store, why=f"its index {index} is {kind}")


def _require_index_files(index: str) -> None:
    """data.mdb and lock.mdb, where present, are regular files of one name (see above)."""
    store = os.path.dirname(index)
    for name in ("data.mdb", "lock.mdb"):
        where = os.path.join(index, name)
        try:
            st = os.lstat(where)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise from_os_error(exc, "open the index", where) from exc
        if stat_.S_ISLNK(st.st_mode):
            raise StoreDamaged(path=store, why=f"its index file {where} is a symbolic link")
        if not stat_.S_ISREG(st.st_mode):
            raise StoreDamaged(path=store, why=f"its index file {where} is not a regular file")
        if st.st_nlink != 1:
            raise StoreDamaged(path=store, why=f"its index file {where} has {st.st_nlink} "
                               "hard links: ksfs writes it in place")


def _on_read_only_fs(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _open_read_only_env(path: str) -> lmdb.Environment:
    """A store on a read-only file system (a snapshot, read-only media, a ro bind mount) is
    read without LMDB's lock file, which cannot be made there. No writer can reach the index
    through this mount; one writing through another, writable view of the same files is not
    seen (LMDB's reader table lives in that lock file), and every chunk read is still checked
    against its id."""
    try:
        return lmdb.open(path, map_size=MAP_SIZE, max_dbs=MAX_DBS, subdir=True,
                         readonly=True, lock=False, create=False)
    except lmdb.Error as exc:
        raise _lmdb_error("open the index", os.path.dirname(path), exc) from exc


def _index_damaged(data: str, why: str) -> StoreDamaged:
    store = os.path.dirname(os.path.dirname(data))
    return StoreDamaged(path=store, why=f"its index {data} {why}; {RESTORE_INDEX}")


def _require_index_file(data: str) -> None:
    """Without MDB_CREATE LMDB still turns an empty file into a new environment: refuse first."""
    try:
        st = os.stat(data)
    except FileNotFoundError:
        raise _index_damaged(data, "is missing") from None
    except OSError as exc:
        raise from_os_error(exc, "open the index", data) from exc
    if not stat_.S_ISREG(st.st_mode):
        raise _index_damaged(data, "is not a regular file")
    if st.st_size == 0:
        raise _index_damaged(data, "is empty")


def _require_whole_file(env: lmdb.Environment, data: str) -> None:
    """LMDB reads pages through a mapping: a page past the end of a truncated file is SIGBUS,
    not an error, so the file must hold every page the newest meta page counts. (The file only
    grows: LMDB writes pages before the meta page that counts them, and never shrinks it.)"""
    try:
        need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        have = os.stat(data).st_size
    except lmdb.Error as exc:
        raise _lmdb_error("open the index", os.path.dirname(os.path.dirname(data)), exc) from exc
    except OSError as exc:
        raise from_os_error(exc, "open the index", data) from exc
    if have < need:
        raise _index_damaged(data, f"is cut short ({have} bytes of the {need} it uses)")
    _require_roots(env, data)


# A named database's record in LMDB's main database (MDB_db on 64-bit hosts): its root page
# number is the last field; an empty database has none (P_INVALID).
_DB_RECORD = 48
_NO_ROOT = (1 << 64) - 1


def _require_roots(env: lmdb.Environment, data: str) -> None:
    """Every named database's root page lies in the file. LMDB finds a root past it only when
    a cursor opens, ignores that there, and reports the cursor's first use as MDB_BAD_TXN,
    which a bug also gives: so such damage is told here, as the index's (QA)."""
    try:
        last = env.info()["last_pgno"]
        with env.begin() as txn:
            for name, rec in txn.cursor():
                root = int.from_bytes(rec[_DB_RECORD - 8 :], "little")
                if len(rec) == _DB_RECORD and root != _NO_ROOT and root > last:
                    raise _index_damaged(data, f"gives its {bytes(name).decode(errors='replace')!r}"
                                         f" database a root page ({root}) past its last ({last})")
    except lmdb.Error as exc:
        raise _lmdb_error("open the index", os.path.dirname(os.path.dirname(data)), exc) from exc


def _close_env(path: str) -> None:
    with _envs_lock:
        slot = _envs.get(path)
        if slot is None:
            return
        slot[1] -= 1
        if slot[1] == 0:
            slot[0].close()
            del _envs[path]


def _lmdb_error(what: str, path: str, exc: lmdb.Error) -> KsfsError:
    """A full disk is NoSpace, damage IntegrityError, a refusal NotPermitted, the rest a
    KsfsError naming ``what`` (errors.from_foreign knows every LMDB error)."""
    return from_foreign(exc, path, what)


@contextlib.contextmanager
def index_errors(what: str, path: str) -> Iterator[None]:
    """Re-raise an LMDB error from the block as a ksfs error naming ``what`` (a full disk is
    NoSpace, damage is IntegrityError)."""
    try:
        yield
    except lmdb.Error as exc:
        raise _lmdb_error(what, path, exc) from exc


class ChunkStore:
    """An open store. Invariant: every index entry points at a fsynced, verified record."""

    def __init__(self, path: str, marker: dict[str, Any], level: int) -> None:
        self.path = path
        self.marker = marker
        self.level = level
        _require_index_dir(path)
        self.index_path = os.path.realpath(os.path.join(path, "index"))
        self.packs_dir = os.path.join(path, "packs")
        self.env = _open_env(self.index_path)
        try:
            self.db = self._open_dbs()
            self._require_own_index()
        except lmdb.Error as exc:
            _close_env(self.index_path)
            raise _lmdb_error("open the store's databases", path, exc) from exc
        except BaseException:
            _close_env(self.index_path)
            raise
        self.handles = PackHandles(self.packs_dir)
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.closed = False
        self.relocated_reads = 0

    # --- opening -------------------------------------------------------------------------

    def _open_dbs(self) -> dict[str, Any]:
        """The cas databases, which every store's index has had since it was made."""
        dbs = {}
        for name in CAS_DBS:
            try:
                dbs[name] = self.env.open_db(name.encode(), create=False)
            except lmdb.NotFoundError:
                raise _index_damaged(os.path.join(self.index_path, "data.mdb"),
                                     f"has no {name!r} database") from None
        return dbs

    def _require_own_index(self) -> None:
        """The index names this store (``STORE_ID``). An index from before that key existed
        is taken, and marked, unless it lists no chunk while packs/ holds pack files: that is
        an index lost and made again empty (by an older ksfs), not a store."""
        data = os.path.join(self.index_path, "data.mdb")
        own = self.marker.get("id")
        with self.env.begin(db=self.db["cas_meta"]) as txn:
            named = txn.get(STORE_ID)
            chunks = txn.stat(self.db["chunks"])["entries"] if named is None else 0
        if named is not None:
            if own is not None and bytes(named) != str(own).encode():
                theirs = bytes(named).decode("ascii", "backslashreplace")
                raise _index_damaged(data, f"belongs to another store (its store id is "
                                     f"{theirs}, this store's {MARKER} says {own})")
            return
        if chunks == 0:
            packs = [n for n in list_packs_dir(self.path, self.packs_dir)
                     if n.endswith(".pack")]
            if packs:
                raise _index_damaged(data, f"lists no chunks, but packs/ holds {len(packs)} "
                                     "pack file(s): the index was lost or emptied (if this "
                                     "store never held a checkpoint, those packs are the "
                                     "leftovers of a killed first import: removing "
                                     "packs/*.pack lets it open)")
        if own is not None:
            with contextlib.suppress(lmdb.Error):  # a read-only store is read all the same
                with self.env.begin(write=True, db=self.db["cas_meta"]) as txn:
                    txn.put(STORE_ID, str(own).encode())

    @classmethod
    def open(cls, path: str | os.PathLike[str], create: bool = False, level: int = 3) -> ChunkStore:
        """Open the store at path (making it first if create); NotAStore when it is not one."""
        path = os.path.abspath(os.fspath(path))
        marker_path = os.path.join(path, MARKER)
        if create and not os.path.exists(marker_path):
            _create_layout(path)
        if not os.path.isdir(path):
            why = "it is not a directory" if os.path.lexists(path) else "no such directory"
            raise NotAStore(path=path, why=why)
        try:
            marker = json.loads(read_store_file(marker_path, path))
        except FileNotFoundError:
            raise NotAStore(path=path, why=f"it has no {MARKER} marker") from None
        except (OSError, ValueError) as exc:
            raise NotAStore(path=path, why=f"its {MARKER} marker is unreadable: {exc}") from None
        if not isinstance(marker, dict) or marker.get("format") != FORMAT:
            raise NotAStore(path=path, why=f"its {MARKER} marker is not a ksfs-store marker")
        if marker.get("version") not in READABLE_VERSIONS:
            known = " or ".join(map(str, READABLE_VERSIONS))
            raise NotAStore(path=path, why=f"store format version {marker.get('version')!r} "
                            f"is not one this ksfs reads ({known})")
        # the marker says this is a store: what is missing from it is damage, not another place
        for sub in ("index", "packs"):
            where = os.path.join(path, sub)
            if not os.path.isdir(where):  # (missing, or something else by its name)
                kind = "a symbolic link" if os.path.islink(where) else "not a directory"
                why = f"{where} is {kind}" if os.path.lexists(where) else "directory is missing"
                raise StoreDamaged(path=path, why=f"its {sub} {why}")
        _make_private(path)
        return cls(path, marker, level)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.handles.close()
        _close_env(self.index_path)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- shared machinery ----------------------------------------------------------------

    @property
    def pool(self) -> ThreadPoolExecutor:
        """Two workers: hashing and zstd release the GIL, so both cores work."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(2, thread_name_prefix="ksfs-cas")
            return self._pool

    def run_split(self, fn: Callable[[list], Any], items: list) -> list:
        """Run fn over two halves of items on the pool, return both results in order."""
        if len(items) < 2:
            return [fn(items)]
        mid = len(items) // 2
        futs = [self.pool.submit(fn, items[:mid]), self.pool.submit(fn, items[mid:])]
        return [f.result() for f in futs]

    @property
    def dctx(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._local, "dctx", None)
        if d is None:
            d = self._local.dctx = zstandard.ZstdDecompressor()
        return d

    def lock(self, exclusive: bool, timeout: float | None = None) -> int:
        """Take the store-wide flock; return its fd (closing the fd releases it)."""
        lock_path = os.path.join(self.path, "lock")
        try:
            # 0600: flock needs only an open file, so a lock file others may open is one any
            # local user can hold, stalling every ingest and gc (QA, fifteenth session).
            fd = open_lock_file(lock_path, self.path, os.O_RDWR, 0o600)
            _close_to_others(fd)
        except OSError as exc:
            if exclusive or exc.errno != errno.EROFS:
                raise from_os_error(exc, "open the store lock", lock_path) from exc
            # a reader of a store on a read-only file system: nothing can change it from here;
            # a lock file an earlier writer made still takes our shared lock
            target = lock_path if os.path.exists(lock_path) else self.path
            with translate("open the store lock", target):
                fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC)
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            if timeout is None:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                except BlockingIOError:
                    # Said, so that a command waiting here is not taken for hung.
                    log.warning("the store at %s is locked by %s; waiting for it", self.path,
                                "an ingest or a check" if exclusive else "a gc")
                    fcntl.flock(fd, mode)
                return fd
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    return fd
                except OSError as exc:
                    if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                if time.monotonic() >= deadline:
                    raise Busy(f"the store at {self.path} is busy (an ingest or a GC holds its "
                               f"lock) and stayed so for {timeout:g} s")
                time.sleep(0.05)
        except BaseException:
            os.close(fd)
            raise

    # --- chunks --------------------------------------------------------------------------

    def lookup(self, cid: bytes) -> fmt.Location | None:
        with self.env.begin(db=self.db["chunks"]) as txn:
            raw = txn.get(cid)
        return None if raw is None else fmt.Location.decode(raw, cid)

    def held_chunks(self, manifests: Iterable[str]) -> dict[bytes, int]:
        """The chunks these manifests hold, each with its record's bytes in its pack; the bases
        of each of their deltas included, since GC keeps a base for its deltas. A chunk the
        index no longer has holds nothing. ManifestCorrupt for a manifest that is gone."""
        held: dict[bytes, int] = {}
        with self.env.begin(db=self.db["chunks"]) as txn:
            ids: set[bytes] = set()
            for m in manifests:
                ids.update(cid for cid, _ in self.load_manifest(m, txn).entries
                           if cid is not None)
            for cid in ids:
                raw = txn.get(cid)
                if raw is None or len(raw) < fmt.INDEX_VALUE.size:  # lost or damaged: check says
                    continue
                held[cid] = fmt.HEADER_SIZE + fmt.INDEX_VALUE.unpack_from(raw)[2]
                for base in fmt.split_base_ids(bytes(raw[fmt.INDEX_VALUE.size :])):
                    if base in held:
                        continue
                    braw = txn.get(base)
                    if braw is not None and len(braw) >= fmt.INDEX_VALUE.size:
                        held[base] = fmt.HEADER_SIZE + fmt.INDEX_VALUE.unpack_from(braw)[2]
        return held

    def read_chunk(self, cid: bytes, loc: fmt.Location | None = None) -> bytes:
        """The plain bytes of a chunk, checked against its id.

        A chunk GC moved between our index lookup and our read is found again through the
        index; only a failure at a location the index still names is reported.
        """
        if loc is None:
            loc = self.lookup(cid)
        for attempt in range(3):
            if loc is None:
                raise ChunkMissing(chunk=cid.hex())
            try:
                return self._read_at(cid, loc)
            except (ChunkCorrupt, ChunkMissing):
                again = self.lookup(cid)
                if again == loc or attempt == 2:
                    raise
                loc = again
                self.relocated_reads += 1  # GC moved it under us: found again via the index
        raise AssertionError("unreachable")

    def _read_at(self, cid: bytes, loc: fmt.Location) -> bytes:
        why = loc.problem()
        if why is not None:
            raise ChunkCorrupt(chunk=cid.hex(), why=why)
        try:
            raw = self.handles.pread(loc.pack, loc.record_len, loc.offset)
        except FileNotFoundError:
            raise ChunkMissing(f"chunk {cid.hex()} is missing: its pack {loc.pack} is gone",
                               chunk=cid.hex()) from None
        except OSError as exc:
            raise ChunkCorrupt(chunk=cid.hex(), why=f"reading pack {loc.pack}: {exc}") from None
        if len(raw) != loc.record_len:
            raise ChunkCorrupt(chunk=cid.hex(), why=f"pack {loc.pack} is cut short")
        head = fmt.decode_record_header(raw)
        if isinstance(head, str):
            raise ChunkCorrupt(chunk=cid.hex(), why=f"pack {loc.pack}: {head}")
        if head != (cid, loc.plain_len, loc.stored_len, loc.codec):
            raise ChunkCorrupt(chunk=cid.hex(), why=f"pack {loc.pack}: header disagrees with "
                               "the index")
        payload = memoryview(raw)[fmt.HEADER_SIZE :]  # no copy of the payload before zstd
        return decode_payload(cid, payload, loc.codec, loc.plain_len, self.dctx, self.read_base,
                              loc.base)

    def read_base(self, cid: bytes) -> bytes:
        """The plain bytes of a delta's base chunk, which must not be a delta itself: one hop
        at most, so a damaged index can never send a read round a cycle."""
        loc = self.lookup(cid)
        if loc is not None and loc.codec in fmt.DELTA_CODECS:
            raise ChunkCorrupt(chunk=cid.hex(), why="a delta's base is itself a delta")
        return self.read_chunk(cid, loc)

    # --- manifests -----------------------------------------------------------------------

    def load_manifest(self, manifest_hex: str, txn: lmdb.Transaction | None = None
                      ) -> fmt.ManifestInfo:
        try:
            key = bytes.fromhex(manifest_hex)
        except (ValueError, TypeError):
            raise ManifestCorrupt(manifest=manifest_hex, why="not a hex manifest id") from None
        if txn is None:
            with self.env.begin(db=self.db["manifests"]) as t:
                return self.load_manifest(manifest_hex, t)
        value = txn.get(key, db=self.db["manifests"])
        if value is None:
            raise ManifestCorrupt(manifest=manifest_hex, why="not in the store")
        raw = delta.expand_manifest(key, value,
                                    lambda base: txn.get(base, db=self.db["manifests"]))
        return fmt.decode_manifest(raw, manifest_hex)

    def manifest_size(self, manifest_hex: str) -> int:
        return self.load_manifest(manifest_hex).size

    def has_manifest(self, manifest_hex: str) -> bool:
        with self.env.begin(db=self.db["manifests"]) as t:
            return t.get(bytes.fromhex(manifest_hex)) is not None

    def open_file(self, manifest_hex: str, cache_bytes: int = 32 * 1024 * 1024) -> Any:
        from ksfs.cas.reader import FileReader

        return FileReader(self, manifest_hex, cache_bytes)

    # --- verbs in their own modules ------------------------------------------------------

    def ingest(self) -> Any:
        from ksfs.cas.ingest import Ingest

        self._raise_version()
        return Ingest(self)

    def _raise_version(self) -> None:
        """Mark an older store as this version before the first write that may need it."""
        if self.marker.get("version") == VERSION:
            return
        with translate("upgrade the store marker", self.path):
            _write_marker(self.path, {**self.marker, "version": VERSION})
        self.marker = {**self.marker, "version": VERSION}

    def check(self, read_data: bool = False,
              references: dict[str, list[str]] | None = None) -> Any:
        from ksfs.cas.check import check_store

        return check_store(self, read_data, references or {})

    def gc(self, live_manifests: Iterable[str] | Callable[[], Iterable[str]],
           threshold: float = 0.5, timeout: float | None = None) -> Any:
        """Mark from live_manifests (a callable is called once the lock is held), sweep, repack."""
        from ksfs.cas.gc import collect

        return collect(self, live_manifests, threshold, timeout)

    def stats(self) -> dict[str, int]:
        """The figures of what the index lists: ``chunks``, ``manifests``, ``packs``; the bytes
        of its chunks' records (``stored_bytes``: what a chunk no checkpoint uses any more
        keeps until gc) and the committed bytes of its packs (``pack_bytes``: those records and
        the dead ones gc has yet to repack). Bytes in packs/ that no commit counts are apart,
        ``uncommitted_pack_bytes``: a running ingest's, or a killed one's, which gc gives back.
        (``pack_bytes`` once summed every pack file while ``packs`` counted the index's, so
        the two disagreed after a killed import: issue #2 review.)"""
        live = 0
        committed: dict[int, int] = {}
        with self.env.begin() as txn:
            chunks = txn.stat(self.db["chunks"])["entries"]
            manifests = txn.stat(self.db["manifests"])["entries"]
            for key, value in txn.cursor(db=self.db["packs"]):
                size, live_bytes = fmt.decode_pack_value(key, value)
                committed[int.from_bytes(key, "big")] = size
                live += live_bytes
        uncommitted = 0
        for name in list_packs_dir(self.path, self.packs_dir):
            if (no := fmt.pack_number(name)) is None:
                continue
            try:
                st = os.lstat(os.path.join(self.packs_dir, name))
            except FileNotFoundError:  # gone since the listing (gc)
                continue
            if stat_.S_ISREG(st.st_mode):  # (anything else is damage, which check names)
                uncommitted += max(0, st.st_size - committed.get(no, 0))
        return {"stored_bytes": live, "chunks": chunks, "packs": len(committed),
                "pack_bytes": sum(committed.values()), "uncommitted_pack_bytes": uncommitted,
                "manifests": manifests}


def list_packs_dir(store: str, packs_dir: str) -> list[str]:
    """The names in packs/; StoreDamaged when it is gone (it was there when the store opened)."""
    try:
        return os.listdir(packs_dir)
    except (FileNotFoundError, NotADirectoryError):
        raise StoreDamaged(path=store, why="its packs directory is missing") from None
    except OSError as exc:
        raise from_os_error(exc, "list the packs directory", packs_dir) from exc


def _create_layout(path: str) -> None:
    """Make a new store's directories; the marker comes last, so a half-made store is none.
    A creation that fails (a full disk) removes again what it made, and only that: a retry
    then simply makes the store, where a half-made index would read as damage (QA)."""
    made: list[str] = []
    try:
        _make_layout(path, made)
    except BaseException:
        if not os.path.exists(os.path.join(path, MARKER)):  # (else made whole, by us or another)
            for what in reversed(made):
                with contextlib.suppress(OSError):  # a directory another process filled stays
                    (os.rmdir if os.path.isdir(what) else os.unlink)(what)
        raise


def _make_layout(path: str, made: list[str]) -> None:
    """``_create_layout``'s work; ``made`` gets each path it makes, in order."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise NotAStore(path=path, why="it is not a directory")
    if os.path.isdir(path):
        with translate("list the store directory", path):
            names = os.listdir(path)
        if MARKER in names:
            return  # another process made it meanwhile (its marker comes last)
        extra = {n for n in names if not n.startswith(MARKER + ".")} - (set(LAYOUT) | {"lock"})
        if extra:
            raise NotAStore(path=path, why="it is a non-empty directory without a ksfs marker")
        # A link in a directory someone prepared would have root make the lock file or the
        # index where it points (security QA F15); packs/ and vm/ may be links, a place the
        # user chose (another disk), as they may in a store made already
        links = sorted(n for n in ("index", "lock") if os.path.islink(os.path.join(path, n)))
        if links:
            raise NotAStore(path=path, why=f"its {links[0]} is a symbolic link, and a store's "
                            "lock and index are made only as files of its own")
    missing = []
    up = path
    while not os.path.lexists(up) and up != os.path.dirname(up):
        missing.append(up)
        up = os.path.dirname(up)
    try:
        os.makedirs(path, exist_ok=True)
        made.extend(reversed(missing))
    except OSError as exc:
        err = from_os_error(exc, "create the store", path)
        if isinstance(err, (NoSpace, NotPermitted)):
            raise err from exc
        # ENOTDIR, EEXIST, ENOENT under /proc...: a place no store can be made
        raise NotAStore(path=path, why=f"it cannot be created: {exc.strerror}") from exc
    with translate("create the store", path):
        for name in (*LAYOUT, "lock"):
            where = os.path.join(path, name)
            if not os.path.lexists(where):
                made.append(where)
            if name == "lock":  # (no link followed, no FIFO waited on: as the store opens it)
                os.close(open_lock_file(where, path, os.O_WRONLY, 0o600))
            else:
                os.makedirs(where, exist_ok=True)
        _make_private(path)
        store_id = uuid.uuid4().hex
        _require_index_dir(path)
        index = os.path.realpath(os.path.join(path, "index"))
        made.extend(f for f in (os.path.join(index, n) for n in ("data.mdb", "lock.mdb"))
                    if not os.path.lexists(f))
        env = _open_env(index, create=True)
        try:
            with index_errors("create the index", path):
                dbs = [env.open_db(name.encode()) for name in CAS_DBS]
                with env.begin(write=True, db=dbs[CAS_DBS.index("cas_meta")]) as txn:
                    # Two processes making one store at once (two imports into a new --store)
                    # both get here; write transactions run one at a time, so the second takes
                    # the first's id and both markers agree with the index.
                    named = txn.get(STORE_ID)
                    if named is None:
                        txn.put(STORE_ID, store_id.encode())
                    else:
                        store_id = bytes(named).decode()
        finally:
            _close_env(index)
        _write_marker(path, {"format": FORMAT, "version": VERSION, "id": store_id})


def _close_to_others(fd: int) -> None:
    """Take group and other access off a lock file of ours made before the 0600 rule."""
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and stat_.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, stat_.S_IMODE(st.st_mode) & 0o600)
    except OSError:  # another owner's store, read here: it stays as it was
        pass


def _make_private(path: str) -> None:
    """Close the store's data directories to other users (stores made before this rule are
    closed at their next open by their owner)."""
    for sub in PRIVATE:
        where = os.path.join(path, sub)
        try:
            st = os.lstat(where)
            if stat_.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and \
                    stat_.S_IMODE(st.st_mode) & 0o077:
                os.chmod(where, stat_.S_IMODE(st.st_mode) & 0o700)
        except OSError:  # a read-only file system, another owner: reading goes on as it was
            pass


def _write_marker(path: str, marker: dict[str, Any]) -> None:
    """Replace the marker atomically: a temp file of its own (writers may race), then rename."""
    import tempfile  # here: it loads shutil, bz2, lzma and random, and only new stores need it

    fd, tmp = tempfile.mkstemp(prefix=MARKER + ".", suffix=".tmp", dir=path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(marker, f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.rename(tmp, os.path.join(path, MARKER))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path)
