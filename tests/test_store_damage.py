"""A damaged store layout is one line and its exit code, never a traceback, a signal, or a gc
that deletes what it cannot see: a lost, emptied, foreign or truncated index, a pack cut short,
index values no pack can hold, a packs directory gone or a pack that is a directory; bad
import arguments that would make a store; a full or read-only file system under LMDB; a file
that changes while it is imported."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import lmdb
import pytest

from ksfs.cas import ChunkStore
from ksfs.cas import format as fmt
from ksfs.cas import ingest as ingest_mod
from ksfs.cas.packs import PackHandles
from ksfs.cas.store import STORE_ID
from ksfs.errors import BadInput, ChunkCorrupt, NoSpace, StoreDamaged, from_foreign
from tests.cas_helpers import put

KSFS = [sys.executable, "-m", "ksfs.cli"]


def ksfs(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True, text=True,
                          timeout=300)


def one_line(res: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The stderr of a command that must fail with ``code`` and one line holding ``words``."""
    err = res.stderr.strip()
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def packs_of(store: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in (store / "packs").iterdir()}


@pytest.fixture
def made(tmp_path: Path) -> tuple[Path, Path]:
    """(store, source file) with the file imported as s/a by the command line."""
    src = tmp_path / "memory"
    src.write_bytes(random.Random(1).randbytes(600_000))
    store = tmp_path / "store"
    res = ksfs(store, "import", "s", "a", str(src))
    assert res.returncode == 0, res.stderr
    return store, src


def empty_index_as_older_ksfs_made_it(index: Path) -> None:
    """An older ksfs opened a lost data.mdb with create: a new, empty environment with the
    store's databases in it and no store id."""
    (index / "data.mdb").unlink()
    env = lmdb.open(str(index), max_dbs=32, map_size=1 << 30)
    for name in ("chunks", "manifests", "packs", "cas_meta"):
        env.open_db(name.encode())
    env.close()


# --- 1: an index lost, emptied or of another store -------------------------------------------


@pytest.mark.parametrize("how", ["emptied", "removed", "made-again-empty", "of-another-store"])
def test_an_index_that_is_not_this_stores_is_damage_and_gc_deletes_no_pack(
        made: tuple[Path, Path], tmp_path: Path, how: str) -> None:
    store, src = made
    index = store / "index"
    if how == "emptied":
        (index / "data.mdb").write_bytes(b"")
    elif how == "removed":
        (index / "data.mdb").unlink()
    elif how == "made-again-empty":
        empty_index_as_older_ksfs_made_it(index)
    else:
        other = tmp_path / "other"
        assert ksfs(other, "import", "s", "a", str(src)).returncode == 0
        shutil.copy(other / "index" / "data.mdb", index / "data.mdb")
    before = packs_of(store)
    assert before
    for verb in (["check"], ["gc"], ["cat", "s", "a", "memory"], ["stats"],
                 ["import", "s", "b", str(src)]):
        one_line(ksfs(store, *verb), 6, "is damaged", str(index / "data.mdb"))
    assert packs_of(store) == before


def test_an_index_from_before_the_store_id_is_taken_and_marked(made: tuple[Path, Path]) -> None:
    store, src = made
    env = lmdb.open(str(store / "index"), max_dbs=32, map_size=1 << 30)
    with env.begin(write=True, db=env.open_db(b"cas_meta")) as txn:
        assert txn.pop(STORE_ID) is not None
    env.close()
    assert ksfs(store, "check").returncode == 0
    assert subprocess.run(KSFS + ["--store", str(store), "cat", "s", "a", "memory"],
                          capture_output=True).stdout == src.read_bytes()
    with ChunkStore.open(store) as s, s.env.begin(db=s.db["cas_meta"]) as txn:
        assert bytes(txn.get(STORE_ID)).decode() == s.marker["id"]


def test_a_new_store_and_an_empty_one_open(tmp_path: Path) -> None:
    with ChunkStore.open(tmp_path / "new", create=True) as s:
        assert s.stats()["chunks"] == 0
    with ChunkStore.open(tmp_path / "new") as s:
        assert s.check().ok


def test_an_index_directory_gone_is_damage_not_another_place(made: tuple[Path, Path]) -> None:
    store, _ = made
    shutil.rmtree(store / "index")
    one_line(ksfs(store, "check"), 6, "index directory is missing")
    one_line(ksfs(store, "import", "s", "b", str(made[1])), 6, "index directory is missing")
    assert not (store / "index").exists()


@pytest.mark.parametrize("shape", ["index a file", "packs a file", "marker a directory",
                                   "marker of another store"])
def test_a_store_broken_so_says_what_it_is_in_one_sentence(made: tuple[Path, Path],
                                                          shape: str) -> None:
    """Issue #2 review: an index that is a file was called "missing", a ksfs.json that is a
    directory gave "[Errno 21] Is a directory: 3", and an index of another store showed its
    id as a bytes repr (b'...')."""
    store, src = made
    marker = json.loads((store / "ksfs.json").read_text())
    if shape in ("index a file", "packs a file"):
        sub = shape.split()[0]
        shutil.rmtree(store / sub)
        (store / sub).write_text("not a directory\n")
        words = [f"the store at {store} is damaged: its {sub} {store / sub} is not a directory"]
    elif shape == "marker a directory":
        (store / "ksfs.json").unlink()
        (store / "ksfs.json").mkdir()
        words = [f"the store at {store} is damaged: {store / 'ksfs.json'} is a directory"]
    else:
        other = "0" * 32
        (store / "ksfs.json").write_text(json.dumps({**marker, "id": other}))
        words = [f"belongs to another store (its store id is {marker['id']}, this store's "
                 f"ksfs.json says {other})"]
    for args in (["stats"], ["check"], ["import", "s", "b", str(src)]):
        err = one_line(ksfs(store, *args), 6, *words)
        assert "missing" not in err and "Errno" not in err and "b'" not in err, err


# --- 2: an index cut short -------------------------------------------------------------------


def test_an_index_cut_short_is_refused_at_open_not_sigbus(made: tuple[Path, Path]) -> None:
    store, _ = made
    data = store / "index" / "data.mdb"
    size = data.stat().st_size
    assert size >= 4 * 4096, size
    os.truncate(data, size // 2 // 4096 * 4096)
    for verb in (["check"], ["cat", "s", "a", "memory"], ["gc"]):
        one_line(ksfs(store, *verb), 6, "cut short", str(data))


def test_a_flipped_byte_in_any_index_page_is_exit_6_or_nothing(made: tuple[Path, Path]) -> None:
    """QA (thirty-fourth session): one flipped byte in a B-tree page's flags was exit 1 with
    LMDB's MDB_BAD_TXN, and one in the meta page's format number exit 1 with "LMDB data format
    v91 is not supported". Each page's flags (and both meta pages' format numbers) damaged in
    turn, on a copy: `check` exits 0 (a free page) or 6, with one line, never 1; and `check
    --json` then prints a report whose finding is the index (it printed nothing)."""
    store, _ = made
    data = store / "index" / "data.mdb"
    clean = data.read_bytes()
    # page header: pgno (8), pad (2), flags (2); a meta page's format number after its magic
    spots = [p * 4096 + 10 for p in range(2, len(clean) // 4096)] + [20, 4096 + 20]
    said_damage = 0
    try:
        for at in spots:
            damaged = bytearray(clean)
            damaged[at] ^= 0x5A
            data.write_bytes(damaged)
            res = ksfs(store, "check")
            if res.returncode != 0:
                one_line(res, 6, "damaged")
                said_damage += 1
                # a script's `check --json` still gets its report, the index the finding
                res = ksfs(store, "check", "--json")
                err = one_line(res, 6, "damaged")
                report = json.loads(res.stdout)
                assert report["ok"] is False, report
                assert report["problems"] == [err.removeprefix("ksfs: error: ")], report
    finally:
        data.write_bytes(clean)
    assert said_damage >= 3, said_damage  # (the meta pages, and the pages in use)
    assert ksfs(store, "check", "--read-data").returncode == 0


# --- 3: a pack cut short ---------------------------------------------------------------------


@pytest.fixture
def multi_pack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(ingest_mod, "TARGET_PACK_BYTES", 256 * 1024)
    s = ChunkStore.open(tmp_path / "store", create=True)
    data = random.Random(3).randbytes(2 << 20)
    f = put(s, data, chunking="cdc")
    yield s, f, data
    s.close()


def test_check_without_data_finds_the_chunk_a_cut_pack_lost_its_end_of(multi_pack) -> None:
    s, f, _ = multi_pack
    with s.env.begin(db=s.db["chunks"]) as txn:
        in_two = sorted(((fmt.Location.decode(v), bytes(k)) for k, v in txn.cursor()
                         if fmt.Location.decode(v).pack == 2), key=lambda it: it[0].offset)
    assert len(in_two) >= 4, in_two
    straddler = in_two[len(in_two) // 2]
    cut = straddler[0].offset + fmt.HEADER_SIZE + 100  # inside its payload
    os.truncate(os.path.join(s.packs_dir, fmt.pack_name(2)), cut)
    lost = {cid.hex() for loc, cid in in_two if loc.offset + loc.record_len > cut}
    plain, read = s.check(read_data=False), s.check(read_data=True)
    assert set(plain.damaged_chunks) == lost == set(read.damaged_chunks)
    for rep in (plain, read):
        assert "cut short" in rep.damaged_chunks[straddler[1].hex()]
    with pytest.raises(ChunkCorrupt, match="cut short"):
        s.read_chunk(straddler[1])


# --- 4: index values no pack can hold ------------------------------------------------------


def damage_location(store: Path, cid: bytes | None = None, **changes: int) -> str:
    """Give a chunk's index entry (the first one's when cid is None) other figures; its hex id."""
    with ChunkStore.open(store) as s, s.env.begin(write=True, db=s.db["chunks"]) as txn:
        if cid is None:
            cid = bytes(next(iter(txn.cursor()))[0])
        loc = fmt.Location.decode(txn.get(cid))
        txn.put(cid, dataclasses.replace(loc, **changes).encode())
    return cid.hex()


@pytest.mark.parametrize("changes", [{"offset": 2**63 + 5}, {"offset": 2**64 - 1},
                                     {"stored_len": 2**32 - 1}])
def test_an_index_value_past_any_pack_is_damage_naming_the_chunk(
        made: tuple[Path, Path], changes: dict) -> None:
    store, _ = made
    cid = damage_location(store, **changes)
    one_line(ksfs(store, "cat", "s", "a", "memory"), 6, cid)
    res = ksfs(store, "check")
    assert res.returncode == 6 and f"chunk {cid}: damaged (its index entry is damaged" in \
        res.stdout, res.stdout + res.stderr


def resize_value(store: Path, db: str, key: bytes | None = None, keep: int = 9) -> bytes:
    """Make an index value (the first one's when key is None) ``keep`` bytes long, cut short
    or grown with zeros; its key."""
    with ChunkStore.open(store) as s, s.env.begin(write=True, db=s.db[db]) as txn:
        if key is None:
            key = bytes(next(iter(txn.cursor()))[0])
        txn.put(key, (bytes(txn.get(key)) + bytes(keep))[:keep])
    return key


@pytest.mark.parametrize("keep", [0, 9, 30])
def test_an_index_value_that_no_longer_decodes_is_exit_6_not_a_traceback(
        made: tuple[Path, Path], keep: int) -> None:
    """QA: check died in Location.decode with struct.error (exit 1). check names the chunk
    (and the file that needs it); cat and gc are one line, and gc deletes nothing."""
    store, _ = made
    cid = resize_value(store, "chunks", keep=keep).hex()
    res = ksfs(store, "check")
    assert res.returncode == 6 and "Traceback" not in res.stderr, res.stderr
    assert f"chunk {cid}: damaged (its index entry no longer decodes ({keep} bytes" in \
        res.stdout and "s/a/memory: unreadable" in res.stdout, res.stdout
    one_line(ksfs(store, "cat", "s", "a", "memory"), 6, cid, "no longer decodes")
    before = packs_of(store)
    one_line(ksfs(store, "gc"), 6, cid, "no longer decodes", "frees nothing")
    assert packs_of(store) == before


def test_a_pack_value_or_a_count_that_no_longer_decodes_is_exit_6(
        made: tuple[Path, Path]) -> None:
    store, src = made
    resize_value(store, "packs", fmt.pack_key(1), keep=5)
    res = ksfs(store, "check")
    assert res.returncode == 6 and "pack 1: its index entry no longer decodes" in res.stdout, \
        res.stdout + res.stderr
    for verb in (["stats"], ["gc"]):
        one_line(ksfs(store, *verb), 6, "pack 1", "no longer decodes")
    with ChunkStore.open(store) as s, s.env.begin(write=True, db=s.db["cas_meta"]) as txn:
        txn.put(fmt.pack_key(1), b"")  # (any key: only next_pack's value matters below)
        txn.put(b"next_pack", b"\x07x")
    one_line(ksfs(store, "gc"), 6, "next_pack", "no number")


def test_gc_leaves_a_pack_whose_index_value_is_damaged(tmp_path: Path) -> None:
    """The damaged chunk is live in a thin pack: gc would copy it, and names it instead."""
    store = tmp_path / "store"
    rnd = random.Random(4)
    keep, drop = tmp_path / "keep", tmp_path / "drop"
    keep.write_bytes(rnd.randbytes(100_000))
    drop.write_bytes(rnd.randbytes(900_000))
    assert ksfs(store, "import", "s", "a", str(keep), str(drop)).returncode == 0
    res = ksfs(store, "import", "s", "b", str(keep), "--json")
    assert res.returncode == 0, res.stderr
    (kept,) = json.loads(res.stdout)["files"]
    assert ksfs(store, "rm", "s", "a").returncode == 0
    with ChunkStore.open(store) as s:
        first = s.load_manifest(kept["manifest"]).entries[0][0]
    cid = damage_location(store, first, offset=2**63 + 5)
    res = ksfs(store, "gc")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert f"chunk {cid}" in res.stdout and "left as it was" in res.stdout, res.stdout


def test_a_damaged_dead_entry_does_not_make_gc_delete_a_live_pack(tmp_path: Path) -> None:
    """Review (ninth session): a dead chunk whose index entry claims a huge length took its
    pack's live figure to 0, and gc deleted the pack with the live chunks beside it."""
    store = tmp_path / "store"
    rnd = random.Random(5)
    keep, drop = tmp_path / "keep", tmp_path / "drop"
    keep.write_bytes(rnd.randbytes(300_000))
    drop.write_bytes(rnd.randbytes(300_000))
    assert ksfs(store, "import", "s", "a", str(keep)).returncode == 0
    res = ksfs(store, "import", "s", "b", str(drop), "--json")
    assert res.returncode == 0, res.stderr
    (dropped,) = json.loads(res.stdout)["files"]
    with ChunkStore.open(store) as s:
        first = s.load_manifest(dropped["manifest"]).entries[0][0]
    assert ksfs(store, "rm", "s", "b").returncode == 0
    damage_location(store, first, stored_len=2**32 - 1)
    res = ksfs(store, "gc")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert subprocess.run(KSFS + ["--store", str(store), "cat", "s", "a", "keep"],
                          capture_output=True, timeout=300).stdout == keep.read_bytes()


def test_pack_handles_refuse_an_offset_past_any_pack(tmp_path: Path) -> None:
    (tmp_path / fmt.pack_name(1)).write_bytes(b"x" * 100)
    h = PackHandles(str(tmp_path))
    try:
        for n, off in ((10, 2**63 + 5), (10, -1), (2**32, 0)):
            with pytest.raises(OSError):
                h.pread(1, n, off)
        assert h.pread(1, 10, 0) == b"x" * 10
    finally:
        h.close()


# --- 6: the packs directory gone, a pack that is a directory -------------------------------


def test_a_packs_directory_gone_is_damage_and_not_made_again(made: tuple[Path, Path]) -> None:
    store, src = made
    shutil.rmtree(store / "packs")
    for verb in (["stats"], ["check"], ["gc"], ["import", "s", "b", str(src)]):
        one_line(ksfs(store, *verb), 6, "packs directory is missing")
    assert not (store / "packs").exists()


def test_a_packs_directory_gone_after_open_is_damage(tmp_path: Path) -> None:
    with ChunkStore.open(tmp_path / "s", create=True) as s:
        put(s, random.Random(5).randbytes(100_000), chunking="cdc")
        shutil.rmtree(s.packs_dir)
        for call in (s.stats, s.check):
            with pytest.raises(StoreDamaged, match="packs directory is missing"):
                call()


def test_a_pack_that_is_a_directory_is_a_damaged_pack(made: tuple[Path, Path]) -> None:
    store, _ = made
    (pack,) = (store / "packs").iterdir()
    pack.unlink()
    pack.mkdir()
    res = ksfs(store, "check")
    assert res.returncode == 6 and "Traceback" not in res.stderr, res.stderr
    assert f"pack {int(pack.stem)}: its file is not a regular file" in res.stdout, res.stdout
    assert "missing (its pack" in res.stdout
    res = ksfs(store, "check", "--read-data")
    assert res.returncode == 6 and "Traceback" not in res.stderr, res.stderr
    res = ksfs(store, "gc")
    assert "Traceback" not in res.stderr, res.stderr
    assert pack.is_dir()


def test_check_names_a_symbolic_link_in_packs_as_gc_sees_it(made: tuple[Path, Path],
                                                             tmp_path: Path) -> None:
    """QA (issue 2): check counted a symbolic link by an unlisted pack's name as bytes an
    unfinished ingest left that gc gives back, while gc (lstat) leaves it be."""
    store, _ = made
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x" * 4096)
    link = store / "packs" / fmt.pack_name(99)
    link.symlink_to(target)
    res = ksfs(store, "check", "--json")
    report = json.loads(res.stdout)
    assert report["unfinished_bytes"] == 0 and report["unfinished_packs"] == 0, report
    res = ksfs(store, "check")
    assert "pack 99: its file is a symbolic link" in res.stdout, res.stdout
    assert "did not finish" not in res.stdout
    assert ksfs(store, "gc").returncode == 0
    assert link.is_symlink() and target.read_bytes() == b"x" * 4096


# --- 5: bad input to import makes no store --------------------------------------------------


@pytest.mark.parametrize("args, code", [
    (["s", "c", "MISSING"], 3),
    (["s/x", "c", "FILE"], 2),
    (["s", "c/x", "FILE"], 2),
    (["s", "c"], 2),
    (["s", "c", "DIR"], 2),
    (["s", "c", "FILE", "FILE"], 2),
])
def test_import_with_bad_input_makes_no_store(tmp_path: Path, args: list[str], code: int) -> None:
    f = tmp_path / "memory"
    f.write_bytes(b"x" * 100)
    store = tmp_path / "store"
    args = [{"FILE": str(f), "DIR": str(tmp_path), "MISSING": str(tmp_path / "nope")}.get(a, a)
            for a in args]
    one_line(ksfs(store, "import", *args), code)
    assert not store.exists()


def _short_kernel_file() -> Path:
    """A file the kernel makes as it is read, whose size says more than it holds."""
    for name in ("/sys/kernel/uevent_seqnum", "/sys/kernel/mm/transparent_hugepage/enabled",
                 "/sys/kernel/profiling", "/sys/power/state"):
        p = Path(name)
        with contextlib.suppress(OSError):
            if p.stat().st_size > len(p.read_bytes()) > 0:
                return p
    pytest.skip("no /sys file here says a size it does not hold")


@pytest.mark.parametrize("there", ["none", "an empty directory"])
def test_an_import_that_fails_after_opening_leaves_no_store(tmp_path: Path, there: str) -> None:
    """QA (twenty-second session): an import refused once the store was open (a file that
    ends before its size, or is cut while read) left the store it made: index, ksfs.json,
    lock, locks, packs, staging, vm. Now it goes again, as a refused session new's does; an
    empty directory given as the store is emptied again."""
    short = _short_kernel_file()
    store = tmp_path / "new" / "store"
    if there != "none":
        store.mkdir(parents=True)
    one_line(ksfs(store, "import", "s", "c1", str(short)), 2, "ended at byte")
    if there == "none":
        assert not (tmp_path / "new").exists()
    else:
        assert list(store.iterdir()) == []
    # a store that was there already keeps what it held
    src = tmp_path / "memory"
    src.write_bytes(b"y" * 5000)
    assert ksfs(store, "import", "s", "c0", str(src)).returncode == 0
    one_line(ksfs(store, "import", "s", "c1", str(short)), 2, "ended at byte")
    assert ksfs(store, "cat", "s", "c0", "memory").stdout == "y" * 5000


def test_import_with_stderr_closed_stores_the_checkpoint(tmp_path: Path) -> None:
    """QA: `ksfs import ... 2>&-` failed, exit 1 and no word (the progress bar asked a closed
    stderr whether it is a terminal)."""
    src = tmp_path / "memory"
    src.write_bytes(b"z" * 5000)
    store = tmp_path / "store"
    res = subprocess.run(KSFS + ["--store", str(store), "import", "s", "c1", str(src)],
                         stdout=subprocess.PIPE, text=True, timeout=120,
                         preexec_fn=lambda: os.close(2))
    assert res.returncode == 0 and res.stdout.splitlines()[-1] == "c1", res
    assert ksfs(store, "cat", "s", "c1", "memory").stdout == "z" * 5000


# --- 7: a full or read-only file system under LMDB -----------------------------------------


@contextlib.contextmanager
def small_fs(where: Path, size: str = "64m") -> Iterator[Path]:
    where.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(fs: Path) -> None:
    with open(fs / "filler", "wb", buffering=0) as f:
        for size in (1 << 20, 4096, 1):  # down to the last byte
            with contextlib.suppress(OSError):
                while f.write(b"\1" * size):
                    pass


def test_a_commit_a_full_disk_cut_short_is_no_space_not_eio(tmp_path: Path) -> None:
    """Only the index grows (the file is stored already): LMDB says ENOSPC or, for a short
    write, EIO; both are exit 9."""
    src = tmp_path / "small"
    src.write_bytes(random.Random(7).randbytes(3_000_000))
    with small_fs(tmp_path / "fs") as fs:
        store = fs / "store"
        assert ksfs(store, "import", "s", "a", str(src)).returncode == 0
        fill(fs)
        for i in range(4):
            one_line(ksfs(store, "import", "s", f"b{i}", str(src)), 9, "no space left")
        exc = lmdb.Error("mdb_txn_commit: Input/output error")
        assert isinstance(from_foreign(exc, store), NoSpace)
    # with room to spare an EIO is what it says
    assert not isinstance(from_foreign(exc, tmp_path), NoSpace)


@pytest.mark.parametrize("there", [False, True])
def test_a_store_creation_the_disk_cuts_short_leaves_nothing_it_made(
        tmp_path: Path, there: bool) -> None:
    """QA: with 8 KiB free a new store's import failed (exit 9) and left index/data.mdb of 4096
    invalid bytes and the layout without a marker: once there was room, the same import said
    the index was damaged (exit 6). Only what the creation made goes: a directory that was
    there before stays."""
    src = tmp_path / "small"
    src.write_bytes(random.Random(8).randbytes(50_000))
    with small_fs(tmp_path / "fs") as fs:
        store = fs / "tm" / "newstore"
        if there:
            store.mkdir(parents=True)
        fill(fs)
        filler = fs / "filler"
        os.truncate(filler, filler.stat().st_size - (8 << 10))
        one_line(ksfs(store, "import", "s", "c1", str(src)), 9, "no space left")
        assert (list(store.iterdir()) == []) if there else not (fs / "tm").exists()
        filler.unlink()
        res = ksfs(store, "import", "s", "c1", str(src))
        assert res.returncode == 0, res.stderr
        assert ksfs(store, "check").returncode == 0


def test_a_store_on_a_read_only_file_system_reads_and_refuses_changes(tmp_path: Path) -> None:
    """A store on read-only media or a snapshot reads as it is (LMDB opened without its lock
    file, which cannot be made there); every change is one line, exit 12, and changes nothing."""
    src = tmp_path / "small"
    src.write_bytes(random.Random(3).randbytes(300_000) + b"x" * 200_000)
    with small_fs(tmp_path / "fs", "8m") as fs:
        store = fs / "store"
        assert ksfs(store, "import", "s", "a", str(src)).returncode == 0
        before = json.loads(ksfs(store, "stats", "--json").stdout)
        if subprocess.run(["mount", "-o", "remount,ro", str(fs)]).returncode != 0:
            pytest.skip("cannot remount the tmpfs read-only")
        got = subprocess.run(KSFS + ["--store", str(store), "cat", "s", "a", "small"],
                             capture_output=True, timeout=300)
        assert got.returncode == 0 and got.stdout == src.read_bytes(), got.stderr
        assert json.loads(ksfs(store, "stats", "--json").stdout) == before
        for verb in (["check"], ["check", "--read-data"], ["ledger", "verify"],
                     ["checkpoints", "s"], ["events", "s"]):
            res = ksfs(store, *verb)
            assert res.returncode == 0, (verb, res.stderr)
        for verb in (["import", "s", "b", str(src)], ["rm", "s", "a"], ["gc"],
                     ["budget", "s", "--tokens", "5"]):  # (QA: the gateway's was exit 1)
            one_line(ksfs(store, *verb), 12, "read-only", str(store))
        assert json.loads(ksfs(store, "stats", "--json").stdout) == before


# --- 8: a file that changes while it is imported ---------------------------------------------


@pytest.mark.parametrize("chunking", ["cdc", "fixed"])
@pytest.mark.parametrize("change, words", [
    ("grow", "20971520 bytes when its import began, 25971520 now"),
    ("shrink", "20971520 bytes when its import began, 1048576 now"),
    ("rewrite", "it was written to"),
])
def test_a_file_that_changes_while_it_is_imported_is_refused(
        tmp_path: Path, chunking: str, change: str, words: str) -> None:
    """Growing, shrinking or rewritten after the first batch was read: refused alike (exit 2),
    never stored at the size it had when it was opened."""
    src = tmp_path / "file"
    src.write_bytes(random.Random(8).randbytes(20 << 20))  # more than one 8 MiB read batch

    def after_first_batch(done: int, total: int) -> None:
        if after_first_batch.done:
            return
        after_first_batch.done = True
        if change == "grow":
            with open(src, "ab") as f:
                f.write(b"y" * 5_000_000)
        elif change == "shrink":
            os.truncate(src, 1 << 20)
        else:
            with open(src, "r+b") as f:
                f.seek(100)
                f.write(b"z" * 10)
            os.utime(src, ns=(0, 1))  # a rewrite within the clock's tick still shows

    after_first_batch.done = False
    with ChunkStore.open(tmp_path / "store", create=True) as s, s.ingest() as ing:
        with pytest.raises(BadInput, match=f"{src} changed while it was imported") as caught:
            ing.add_file(str(src), chunking=chunking, progress=after_first_batch)
        assert words in str(caught.value)
        assert caught.value.exit_code == 2
        assert not ing.manifests
        src.write_bytes(b"still" * 1000)  # a file left alone is stored as it is
        assert ing.add_file(str(src), chunking=chunking).size == 5000


def test_two_processes_making_one_store_at_once_agree_on_its_id(tmp_path, monkeypatch) -> None:
    """Review (ninth session): two creators of one new store each wrote an id of their own into
    the index and the marker; when they interleaved, the marker named one and the index the
    other, and the store was refused as damaged for ever."""
    from ksfs.cas import store as store_mod

    path = tmp_path / "store"
    write_marker = store_mod._write_marker

    def other_creator_first(where, marker):  # A is about to write its marker: B runs whole
        monkeypatch.setattr(store_mod, "_write_marker", write_marker)
        store_mod._create_layout(where)
        write_marker(where, marker)

    monkeypatch.setattr(store_mod, "_write_marker", other_creator_first)
    store_mod._create_layout(str(path))
    with store_mod.ChunkStore.open(path) as store:
        assert store.marker["id"]


def test_processes_making_one_store_at_once_all_open_it(tmp_path: Path) -> None:
    """Review (ninth session): a creator that listed the directory after another had put its
    marker in place refused it as "a non-empty directory without a ksfs marker" (exit 5)."""
    code = ("import sys\nfrom ksfs.cas import ChunkStore\n"
            "ChunkStore.open(sys.argv[1], create=True).close()\n")
    for round_ in range(8):
        path = tmp_path / f"store{round_}"
        procs = [subprocess.Popen([sys.executable, "-c", code, str(path)],
                                  stderr=subprocess.PIPE, text=True) for _ in range(3)]
        errors = [p.communicate(timeout=120)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], errors
        with ChunkStore.open(path) as s:
            assert s.marker["id"]


# --- 9: an import that fails leaves no session it made -------------------------------------


def test_a_failed_import_into_a_new_session_leaves_no_session(tmp_path: Path) -> None:
    """QA (tenth session): an import that failed after it made its session (a file the
    kernel makes shorter than its size, a step failing, Ctrl-C) left an empty session behind,
    so bad input changed the store; an existing session keeps its failure in its log."""
    src = tmp_path / "ok"
    src.write_bytes(b"seed" * 1000)
    store = tmp_path / "store"
    assert ksfs(store, "import", "seed", "c0", str(src)).returncode == 0
    before = json.loads(ksfs(store, "stats", "--json").stdout)
    env = dict(os.environ, KSFS_FAIL_AT="ingest.file")
    res = subprocess.run(KSFS + ["--store", str(store), "import", "odd", "x1", str(src)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode != 0 and "injected fault" in res.stderr, res.stderr
    assert json.loads(ksfs(store, "stats", "--json").stdout) == before
    listed = json.loads(ksfs(store, "session", "list", "--json").stdout)
    assert [r["session"] for r in listed] == ["seed"]
    from ksfs.keeper.locks import _lock_path

    assert not _lock_path(store, "odd").exists()  # nor its lock file (eleventh session)
    assert ksfs(store, "import", "odd", "x1", str(src)).returncode == 0  # the name is free
    res = subprocess.run(KSFS + ["--store", str(store), "import", "seed", "c1", str(src)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode != 0
    kinds = [json.loads(x)["type"] for x in ksfs(store, "events", "seed", "--json").stdout
             .splitlines()]
    assert kinds[-2:] == ["checkpoint.begin", "checkpoint.failed"]
    assert ksfs(store, "check").returncode == 0
    assert ksfs(store, "ledger", "verify").returncode == 0


def test_a_file_shorter_than_its_size_is_named(tmp_path: Path) -> None:
    kernel_made = next((p for p in ("/sys/kernel/mm/transparent_hugepage/enabled",
                                    "/sys/devices/system/cpu/online", "/sys/kernel/uevent_seqnum")
                        if os.path.isfile(p) and os.stat(p).st_size > 100), None)
    if kernel_made is None:
        pytest.skip("no sysfs file that claims more bytes than it has")
    res = ksfs(tmp_path / "store", "import", "s", "c", kernel_made)
    one_line(res, 2, kernel_made, "import a copy")


# --- 10: a live chunk the index no longer lists ---------------------------------------------


def rekey(store: Path, cid: bytes) -> bytes:
    """Move a chunk's index entry to another key, as one flipped bit in a B-tree key does:
    the real id is gone from the index and an id no manifest names holds its location."""
    other = bytes([cid[0] ^ 0x01]) + cid[1:]
    with ChunkStore.open(store) as s, s.env.begin(write=True, db=s.db["chunks"]) as txn:
        value = bytes(txn.get(cid))
        txn.delete(cid)
        txn.put(other, value)
    return other


def test_gc_refuses_when_a_live_chunk_is_not_in_the_index(made: tuple[Path, Path]) -> None:
    """QA (issue 2): with a live chunk's key damaged, gc freed the entry under the damaged key,
    the only pointer to that chunk's bytes (a later repack would delete them)."""
    store, _ = made
    with ChunkStore.open(store) as s:
        mid = _manifests(s)[0]  # every manifest is live: nothing was removed
        cid = s.load_manifest(mid).entries[0][0]
    other = rekey(store, cid)
    res = ksfs(store, "check")
    assert res.returncode == 6 and f"chunk {cid.hex()}: missing" in res.stdout, res.stdout
    before = packs_of(store)
    one_line(ksfs(store, "gc"), 6, cid.hex(), "not in the index", "ksfs check")
    with ChunkStore.open(store) as s:
        assert s.lookup(other) is not None  # nothing freed: the entry can still be put back
        with pytest.raises(StoreDamaged, match="not in the index"):
            s.gc([mid])
        assert s.lookup(other) is not None
    assert packs_of(store) == before


def _manifests(s: ChunkStore) -> list[str]:
    with s.env.begin(db=s.db["manifests"]) as txn:
        return [bytes(k).hex() for k in txn.cursor().iternext(values=False)]


# --- 11: a B-tree page that sends lookups the wrong way ----------------------------------------


def misrouting_flip(index: Path, tmp_path: Path) -> int:
    """An offset in data.mdb where one flipped byte (a separator key of a branch page of the
    chunks B-tree) makes a lookup by id miss a chunk that a cursor walk still lists, found by
    trying each flip on a copy."""
    data = (index / "data.mdb").read_bytes()
    copy = tmp_path / "probe"
    copy.mkdir()

    def misroutes(buf: bytes) -> bool:
        (copy / "data.mdb").write_bytes(buf)
        env = lmdb.open(str(copy), max_dbs=32, readonly=True, lock=False)
        try:
            with env.begin(db=env.open_db(b"chunks", create=False)) as txn:
                keys = [bytes(k) for k in txn.cursor().iternext(values=False)]
                return len(keys) == want and any(txn.get(k) is None for k in keys)
        except lmdb.Error:
            return False
        finally:
            env.close()

    env = lmdb.open(str(index), max_dbs=32, readonly=True, lock=False)
    with env.begin(db=env.open_db(b"chunks", create=False)) as txn:
        want = txn.stat()["entries"]
    env.close()
    for start in range(0, len(data), 4096):
        pgno, flags, lower, upper = (int.from_bytes(data[start:start + 8], "little"),
                                     *(int.from_bytes(data[start + i:start + i + 2], "little")
                                       for i in (10, 12, 14)))
        if pgno != start // 4096 or flags != 1 or not 16 < lower <= upper <= 4096:
            continue  # not a branch page
        for at in range(start + upper, start + 4096):
            buf = bytearray(data)
            buf[at] ^= 0x55
            if misroutes(bytes(buf)):
                return at
    raise AssertionError("no flip in a branch page sends a lookup astray")


def test_check_looks_chunks_up_by_id_as_reads_do(tmp_path: Path) -> None:
    """QA: a flipped byte in a branch page of the chunks B-tree made lookups by id miss chunks a
    cursor walk still listed; check (which only walked) said clean while cat and gc failed."""
    store = tmp_path / "store"
    for i in (1, 2, 3):
        src = tmp_path / str(i) / "memory"
        src.parent.mkdir()
        src.write_bytes(random.Random(i).randbytes(4 << 20))  # ~200 chunks each: 3+ leaves
        assert ksfs(store, "import", "s", f"c{i}", str(src)).returncode == 0
    at = misrouting_flip(store / "index", tmp_path)
    with open(store / "index" / "data.mdb", "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x55]))
    unreadable = [c for c in ("c1", "c2", "c3") if subprocess.run(
        KSFS + ["--store", str(store), "cat", "s", c, "memory"], capture_output=True,
        timeout=300).returncode == 6]
    assert unreadable
    for args in (["check"], ["check", "--read-data"]):
        res = ksfs(store, *args)
        assert res.returncode == 6, (res.stdout, res.stderr)
        assert "lookup by its id does not find it" in res.stdout, res.stdout
        for c in unreadable:
            assert f"s/{c}/memory: unreadable" in res.stdout, res.stdout


# --- a lock file in another shape -------------------------------------------------------------


def _lock_shapes(path: Path, shape: str, elsewhere: Path) -> None:
    path.unlink(missing_ok=True)
    if shape == "directory":
        path.mkdir()
    elif shape == "dangling symlink":  # O_CREAT would follow it and make the file it names
        elsewhere.mkdir(exist_ok=True)
        path.symlink_to(elsewhere / "made-here")
    elif shape == "hard link":  # (security QA F18: O_NOFOLLOW does not see one)
        elsewhere.mkdir(exist_ok=True)
        (elsewhere / "another").write_text("another file\n")
        os.link(elsewhere / "another", path)
    else:
        os.mkfifo(path)


@pytest.mark.parametrize("shape", ["directory", "dangling symlink", "fifo", "hard link"])
def test_a_store_lock_that_is_no_file_is_damage_naming_it(made: tuple[Path, Path],
                                                           tmp_path: Path, shape: str) -> None:
    """QA (twenty-second session): STORE/lock as a directory was 'open the store lock failed:
    Is a directory', exit 1; as a dangling symlink, 'open the store lock not found', exit 3,
    and followed: the file it named was made. Now: one line naming it, exit 6, nothing made
    or changed, whatever the verb."""
    store, src = made
    elsewhere = tmp_path / "elsewhere"
    _lock_shapes(store / "lock", shape, elsewhere)
    before = packs_of(store)
    kind = {"directory": "a directory", "dangling symlink": "a symbolic link",
            "fifo": "a FIFO", "hard link": "a hard link (2 names)"}[shape]
    for args in (["check"], ["import", "s", "b", str(src)], ["gc"]):  # (rm takes no store lock)
        one_line(ksfs(store, *args), 6, f"its lock file {store / 'lock'} is {kind}")
    assert packs_of(store) == before
    assert not (elsewhere / "made-here").exists()


@pytest.mark.parametrize("shape", ["directory", "dangling symlink", "fifo", "locks a file",
                                   "locks a link"])
def test_a_session_lock_that_is_no_file_is_damage_naming_it(made: tuple[Path, Path],
                                                             tmp_path: Path, shape: str) -> None:
    """QA: a session's lock file as a directory, or locks/ as a plain file, made import and rm
    exit 1. Now exit 6, one line, the checkpoint still there. Security QA F17: locks/ as a
    link to a directory had lock files made and deleted there."""
    store, src = made
    locks = store / "locks"
    if shape == "locks a file":
        shutil.rmtree(locks)
        locks.write_text("")
        words = f"{locks} is not a directory"
    elif shape == "locks a link":
        shutil.rmtree(locks)
        (tmp_path / "elsewhere").mkdir()
        locks.symlink_to(tmp_path / "elsewhere")
        words = f"{locks} is a symbolic link: remove it (ksfs makes it again)"
    else:
        (lock,) = locks.glob("*.lock")
        _lock_shapes(lock, shape, tmp_path / "elsewhere")
        words = f"its lock file {lock} is"
    for args in (["import", "s", "b", str(src)], ["rm", "s", "a"]):
        one_line(ksfs(store, *args), 6, words)
    listed = ksfs(store, "checkpoints", "s", "--json")
    assert [c["name"] for c in json.loads(listed.stdout)] == ["a"], listed
    assert not (tmp_path / "elsewhere" / "made-here").exists()
    if shape == "locks a link":
        assert list((tmp_path / "elsewhere").iterdir()) == []


@pytest.mark.parametrize("shape", ["directory", "dangling symlink", "fifo"])
def test_a_seal_lock_that_is_no_file_is_damage_naming_it(made: tuple[Path, Path],
                                                          tmp_path: Path, shape: str) -> None:
    """QA: STORE/seal.lock as a directory made every ingest seal without it, unsaid (imports
    no longer published one at a time), and a symlink there was followed. Now the import is
    exit 6, one line naming it, and publishes nothing."""
    store, src = made
    elsewhere = tmp_path / "elsewhere"
    _lock_shapes(store / "seal.lock", shape, elsewhere)
    kind = {"directory": "a directory", "dangling symlink": "a symbolic link",
            "fifo": "a FIFO"}[shape]
    one_line(ksfs(store, "import", "s", "b", str(tmp_path / "memory")), 6,
             f"its lock file {store / 'seal.lock'} is {kind}")
    listed = ksfs(store, "checkpoints", "s", "--json")
    assert [c["name"] for c in json.loads(listed.stdout)] == ["a"], listed
    assert not (elsewhere / "made-here").exists()
