"""The store verbs through the real command line (a subprocess per call): round trips, figures,
bad input with its exit code and an unchanged store, and kill -9 of imports."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

KSFS = [sys.executable, "-m", "ksfs.cli"]


def ksfs(store: Path, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"ksfs {args} failed {res.returncode}: {res.stderr.decode()}")
    return res


def make_image(path: Path, size: int, seed: int, holes: bool = True) -> bytes:
    rnd = random.Random(seed)
    data = bytearray(size)
    for off in range(0, size, 65536):
        if holes and rnd.random() < 0.3:
            continue  # stays a hole
        n = min(65536, size - off)
        data[off:off + n] = rnd.randbytes(n // 2) + bytes(n - n // 2)
    path.write_bytes(bytes(data))
    return bytes(data)


def store_snapshot(store: Path) -> dict[str, int]:
    """Every file of the store with its size: 'nothing changed' means this is equal."""
    out = {}
    for p in sorted(store.rglob("*")):
        if p.is_file() and p.name not in ("lock", "daemon.lock"):
            out[str(p.relative_to(store))] = p.stat().st_size
    return out


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"


def test_import_cat_stats_round_trip(store: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk.raw"
    mem = tmp_path / "memory"
    d = make_image(disk, 5 * 65536 + 1234, seed=1)
    m = make_image(mem, 300_001, seed=2, holes=False)
    res = ksfs(store, "import", "s1", "c1", str(disk), str(mem))
    assert res.stdout.decode().strip().splitlines()[-1] == "c1"
    assert ksfs(store, "cat", "s1", "c1", "disk.raw").stdout == d
    assert ksfs(store, "cat", "s1", "c1", "memory").stdout == m
    figures = json.loads(ksfs(store, "stats", "--json").stdout)
    for key in ("logical_bytes", "stored_bytes", "chunks", "packs", "checkpoints"):
        assert key in figures
    assert figures["logical_bytes"] == len(d) + len(m)
    assert figures["checkpoints"] == 1
    assert 0 < figures["stored_bytes"] < figures["logical_bytes"]
    # A second, slightly changed image dedups against the first.
    d2 = bytearray(d)
    d2[70000:70010] = b"X" * 10
    disk.write_bytes(bytes(d2))
    ksfs(store, "import", "s1", "c2", str(disk))
    after = json.loads(ksfs(store, "stats", "--json").stdout)
    assert after["checkpoints"] == 2
    assert after["stored_bytes"] - figures["stored_bytes"] < 2 * 65536
    assert ksfs(store, "cat", "s1", "c2", "disk.raw").stdout == bytes(d2)
    assert ksfs(store, "check", "--read-data").returncode == 0
    clean = json.loads(ksfs(store, "check", "--json").stdout)
    assert clean["ok"] and clean["findings"] == [] and clean["problems"] == []
    assert clean["manifests_checked"] >= 2 and not clean["data_read"]
    # rm + gc frees what only c1 held, and c2 still reads back.
    ksfs(store, "rm", "s1", "c1")
    ksfs(store, "gc")
    assert ksfs(store, "cat", "s1", "c2", "disk.raw").stdout == bytes(d2)
    assert ksfs(store, "check", "--read-data").returncode == 0
    final = json.loads(ksfs(store, "stats", "--json").stdout)
    assert final["checkpoints"] == 1
    assert final["stored_bytes"] < after["stored_bytes"]


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["import", "s1", "c9", "/nonexistent/file"], 3, "not found"),
        (["cat", "nosuch", "c1", "disk.raw"], 3, "no session"),
        (["cat", "s1", "nosuch", "disk.raw"], 3, "no checkpoint"),
        (["cat", "s1", "c1", "nosuch"], 3, "not found"),
        (["rm", "s1", "nosuch"], 3, "no checkpoint"),
        (["rm", "ghost", "c1"], 3, "no session"),
        (["import", "a/b", "c9", "FILE"], 2, "'/'"),
        (["import", "s1", "..", "FILE"], 2, "'..'"),
        (["import", "s1", "", "FILE"], 2, "empty"),
        (["import", "s1", "x" * 256, "FILE"], 2, "255"),
        (["import", "s1", "c1", "FILE"], 4, "already exists"),
        (["import", "s1", "c9", "/dev/null"], 2, "not a regular file"),
        (["import", "s1", "c9", "DIR"], 2, "is a directory"),
        (["import", "s1", "c9", "/proc/self/status"], 2, "says it is empty but has content"),
        (["cat", "s1", "c1", ".."], 2, "'..'"),
        (["umount", "/nonexistent/mnt"], 3, "not found"),
        (["umount", "DIR"], 2, "is not mounted"),
        (["mount", "/nonexistent/mnt"], 3, "not found"),
        (["mount", "STORE"], 2, "would hide the store"),
        (["mount", "DIR"], 2, "would hide the store"),  # the store is tmp_path/store
        (["mount", "STORE/packs"], 2, "is inside the store"),
    ],
)
def test_bad_input_one_line_exit_code_nothing_changed(
    store: Path, tmp_path: Path, args: list[str], code: int, words: str
) -> None:
    f = tmp_path / "memory"
    f.write_bytes(b"hello" * 1000)
    ksfs(store, "import", "s1", "c1", str(f))
    before = store_snapshot(store)
    args = [str(f) if a == "FILE" else str(tmp_path) if a == "DIR" else a.replace(
        "STORE", str(store)) for a in args]
    res = ksfs(store, *args, check=False)
    err = res.stderr.decode()
    assert res.returncode == code, err
    assert len(err.strip().splitlines()) == 1, err
    assert words in err
    assert store_snapshot(store) == before


# ksfs is imported as root (the interpreter lives in root's home, which nobody cannot read),
# with what it loads lazily, then the process becomes nobody, real and effective ids alike
AS_NOBODY = """
import os, sys
import ctypes, ksfs.heap, ksfs.keeper, ksfs.keeper.offline
from ksfs.cli import main
os.setgroups([]); os.setgid(65534); os.setuid(65534)
sys.argv[0] = "ksfs"
main(sys.argv[1:])
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
@pytest.mark.parametrize("as_disk", [False, True])
def test_an_unreadable_file_is_not_permitted_and_changes_nothing(as_disk: bool) -> None:
    """Issue #2 review: a file the user cannot read was click's usage error (exit 2); the
    reference says 12, not permitted. One line naming it, exit 12, the store as it was (no
    checkpoint.begin event, no session). Run as nobody: root reads a mode 000 file."""
    import shutil
    import uuid

    base = Path("/var/tmp") / f"ksfs-unreadable-{uuid.uuid4().hex[:8]}"  # nobody reaches it
    base.mkdir(mode=0o755)
    try:
        store, ok, secret = base / "store", base / "memory", base / "secret.bin"
        ok.write_bytes(b"ok" * 5000)
        secret.write_bytes(b"secret" * 5000)
        os.chmod(secret, 0)
        ksfs(store, "import", "s", "c1", str(ok))
        for root, dirs, files in os.walk(store):  # the store is nobody's
            for name in [*dirs, *files]:
                os.chown(Path(root, name), 65534, 65534)
        os.chown(store, 65534, 65534)
        before = {p: p.read_bytes() for p in store.rglob("*") if p.is_file()
                  and p.name not in ("lock", "lock.mdb") and p.parent.name != "locks"}
        events = ksfs(store, "events", "s").stdout
        named = ["--disk", str(secret)] if as_disk else [str(secret)]
        for session in ("s", "new"):
            res = subprocess.run([sys.executable, "-c", AS_NOBODY, "--store", str(store),
                                  "import", session, "c2", *named], capture_output=True,
                                 text=True, timeout=120)
            assert res.returncode == 12, res.stderr
            assert res.stderr == f"ksfs: error: {secret} cannot be read: Permission denied\n"
        after = {p: p.read_bytes() for p in before}
        assert after == before
        assert ksfs(store, "events", "s").stdout == events
        assert ksfs(store, "checkpoints", "new", check=False).returncode == 3
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_not_a_store(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "somefile").write_text("mine")
    res = ksfs(plain, "stats", check=False)
    assert res.returncode == 5
    assert "not a ksfs store" in res.stderr.decode()
    assert sorted(p.name for p in plain.iterdir()) == ["somefile"]


@pytest.mark.parametrize("verb", ["stats", "import"])
def test_a_file_is_not_a_store(tmp_path: Path, verb: str) -> None:
    """A store path that is a file (or under one) is not a store: exit 5, the file untouched."""
    f = tmp_path / "afile"
    f.write_text("mine")
    src = tmp_path / "memory"
    src.write_bytes(b"x" * 100)
    args = ["stats"] if verb == "stats" else ["import", "s", "c", str(src)]
    for where in (f, f / "sub"):
        res = ksfs(where, *args, check=False)
        err = res.stderr.decode()
        assert res.returncode == 5, err
        assert len(err.strip().splitlines()) == 1 and "not a ksfs store" in err, err
    assert f.read_text() == "mine"


@pytest.mark.parametrize("name", ["domain.xml", "meta.json", "transcript", "forks", "fs"])
def test_import_refuses_the_names_a_checkpoint_directory_reserves(
        store: Path, tmp_path: Path, name: str) -> None:
    """These names are the checkpoint directory's own entries on the mount: a stored file of
    that name would clash with them, so import refuses it (exit 2) and changes nothing."""
    ok = tmp_path / "memory"
    ok.write_bytes(b"m" * 5000)
    ksfs(store, "import", "s1", "c1", str(ok))
    before = store_snapshot(store)
    bad = tmp_path / name
    bad.write_bytes(b"clash")
    res = ksfs(store, "import", "s1", "c2", str(ok), str(bad), check=False)
    err = res.stderr.decode()
    assert res.returncode == 2, err
    assert len(err.strip().splitlines()) == 1 and "reserved" in err, err
    assert store_snapshot(store) == before


def test_a_checkpoint_of_thousands_of_long_named_files(store: Path, tmp_path: Path) -> None:
    """The published and deleted events list names up to a size and count the rest: an event
    body has a limit, a checkpoint's file count has none."""
    src = tmp_path / "many"
    src.mkdir()
    names = [f"{i:04d}" + "L" * 240 for i in range(1200)]
    for i, n in enumerate(names):
        (src / n).write_text(str(i))
    out = ksfs(store, "import", "s1", "c1", *(str(src / n) for n in names)).stdout.decode()
    assert out.startswith("s1/c1: 1200 files, ")
    assert ksfs(store, "cat", "s1", "c1", names[-1]).stdout == b"1199"
    published = json.loads(ksfs(store, "events", "s1", "--json").stdout.splitlines()[-1])
    body = published["body"]
    assert published["type"] == "checkpoint.published"
    assert body["files"] == names[:len(body["files"])] and 0 < len(body["files"]) < 1200
    assert body["files_not_listed"] == 1200 - len(body["files"])
    said = json.loads(ksfs(store, "rm", "s1", "c1", "--json").stdout)
    deleted = json.loads(ksfs(store, "events", "s1", "--json").stdout.splitlines()[-1])["body"]
    assert len(deleted["files"]) + deleted["files_not_listed"] == 1200
    assert said == dict(deleted, session="s1", event_seq=said["event_seq"])
    assert ksfs(store, "check").returncode == 0


def test_two_files_of_one_base_name_are_named_in_the_refusal(store: Path,
                                                             tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        (tmp_path / d / "memory").write_bytes(b"x")
    res = ksfs(store, "import", "s1", "c1", str(tmp_path / "a" / "memory"),
               str(tmp_path / "b" / "memory"), check=False)
    err = res.stderr.decode().strip()
    assert res.returncode == 2 and err == (
        f"ksfs: error: {tmp_path / 'a' / 'memory'} and {tmp_path / 'b' / 'memory'} would both "
        "be stored as 'memory': a checkpoint keeps each file under its base name")
    assert not store.exists() or ksfs(store, "checkpoints", "s1", check=False).returncode == 3


def test_a_damaged_ledger_record_is_exit_6_not_a_traceback(store: Path, tmp_path: Path) -> None:
    """A ledger value whose bytes no longer decode (damage) is an integrity error: one line,
    exit 6, from every command that reads it."""
    import lmdb

    f = tmp_path / "memory"
    f.write_bytes(b"hello" * 1000)
    ksfs(store, "import", "s1", "c1", str(f))
    env = lmdb.open(str(store / "index"), max_dbs=32, subdir=True)
    try:
        sessions = env.open_db(b"sessions", create=False)
        with env.begin(write=True, db=sessions) as txn:
            keys = [bytes(k) for k in txn.cursor().iternext(values=False)]
            assert keys
            for k in keys:
                txn.put(k, b"\xff\xfe not json")
    finally:
        env.close()
    for args in (["checkpoints", "s1"], ["events", "s1"], ["check"]):
        res = ksfs(store, *args, check=False)
        err = res.stderr.decode()
        assert res.returncode == 6, (args, err)
        assert len(err.strip().splitlines()) == 1 and "damaged" in err, (args, err)


def test_kill_9_during_import_leaves_a_clean_store(store: Path, tmp_path: Path) -> None:
    """kill -9 at random moments of `ksfs import`: earlier checkpoints read back, check is clean,
    and no half-written checkpoint is visible."""
    rnd = random.Random(7)
    base = tmp_path / "disk.raw"
    data = make_image(base, 40 * 65536, seed=3)
    ksfs(store, "import", "s", "c0", str(base))
    published = {"c0": data}
    for trial in range(8):
        img = bytearray(data)
        for _ in range(20):
            off = rnd.randrange(0, len(img) - 100)
            img[off:off + 100] = rnd.randbytes(100)
        (tmp_path / f"t{trial}").mkdir()
        path = tmp_path / f"t{trial}" / "disk.raw"
        path.write_bytes(bytes(img))
        proc = subprocess.Popen(
            KSFS + ["--store", str(store), "import", "s", f"t{trial}", str(path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        time.sleep(rnd.uniform(0.05, 1.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        listed = json.loads(ksfs(store, "checkpoints", "s", "--json").stdout)
        names = {c["name"] for c in listed}
        if f"t{trial}" in names:
            published[f"t{trial}"] = bytes(img)
        assert set(published) == names
        assert ksfs(store, "check", "--read-data").returncode == 0
        for name, want in published.items():
            assert ksfs(store, "cat", "s", name, "disk.raw").stdout == want
    assert ksfs(store, "ledger", "verify").returncode == 0


def test_cat_reads_the_files_a_checkpoint_makes_from_its_record(store: Path,
                                                               tmp_path: Path) -> None:
    """meta.json (and transcript, domain.xml where the checkpoint has them) are files of the
    checkpoint on the mount; ``ksfs cat`` reads the same bytes."""
    from ksfs.keeper import Keeper

    f = tmp_path / "memory"
    f.write_bytes(b"hello" * 1000)
    ksfs(store, "import", "s1", "c1", str(f))
    meta = ksfs(store, "cat", "s1", "c1", "meta.json").stdout
    with Keeper(store) as k:
        assert meta == k.meta_bytes(k.ledger.checkpoint("s1", "c1"))
    assert json.loads(meta)["name"] == "c1"
    for absent in ("domain.xml", "transcript"):  # no VM, no disk: the checkpoint has neither
        res = ksfs(store, "cat", "s1", "c1", absent, check=False)
        assert res.returncode == 3, res.stderr


def test_an_automatic_name_a_user_took_moves_to_the_next_free_number(store: Path,
                                                                    tmp_path: Path) -> None:
    """An unnamed checkpoint is named after its begin event (c_NNNN); a checkpoint the user
    already named so must not make it fail: it takes the next free c_NNNN, never c_NNNN-2."""
    from ksfs.keeper import Keeper

    f = tmp_path / "memory"
    f.write_bytes(b"data" * 100)
    with Keeper(store, create=True) as k:
        k.import_files("s", "first", [f])
        last = list(k.ledger.events("s", 0))[-1].seq
        # the user takes the name the next unnamed checkpoint would get (its begin event comes
        # after the two events of this import: begin and published)
        taken = f"c_{last + 3:04d}"
        k.import_files("s", taken, [f])
        rec = k.import_files("s", None, [f])
        begin = next(e for e in k.ledger.events("s", last + 3) if e.type == "checkpoint.begin")
        assert begin.seq == last + 3 and begin.body["name"] is None
        assert rec.name == f"c_{last + 4:04d}", (rec.name, taken)
        assert list(k.ledger.checkpoint_names("s")).count(taken) == 1
        # and the published event of the unnamed one names its begin, so recover (run at every
        # daemon start) finds nothing unfinished and marks nothing failed
        assert k._unfinished("s") == []
        assert k.recover() == []
        assert not [e for e in k.ledger.events("s", 0) if e.type == "checkpoint.failed"]


def test_an_imports_begin_comes_before_its_checkpoint_and_a_failed_one_stops_it(
        store: Path, tmp_path: Path, monkeypatch) -> None:
    """An import's checkpoint.begin event is in the log before the checkpoint it begins, which
    is named after it; a begin that cannot be written makes the import fail with its error,
    with no checkpoint, no failed event and a store that checks clean."""
    from ksfs.errors import NoSpace
    from ksfs.keeper import Keeper
    from ksfs.ledger.ledger import Ledger

    f = tmp_path / "memory"
    f.write_bytes(os.urandom(300_000))
    with Keeper(store, create=True) as k:
        rec = k.import_files("s", None, [f])
        events = list(k.ledger.events("s", 0))
        begin = next(e for e in events if e.type == "checkpoint.begin")
        published = next(e for e in events if e.type == "checkpoint.published")
        assert begin.seq < published.seq and rec.seq == begin.seq
        assert rec.name == f"c_{begin.seq:04d}"
        record = Ledger.record

        def begin_fails(self, session, kind, body, *a, **kw):
            if kind == "checkpoint.begin":
                raise NoSpace("no space left for the begin event (as a full disk says)")
            return record(self, session, kind, body, *a, **kw)

        monkeypatch.setattr(Ledger, "record", begin_fails)
        before = [e.seq for e in k.ledger.events("s", 0)]
        with pytest.raises(NoSpace, match="the begin event"):
            k.import_files("s", "second", [f])
        assert [e.seq for e in k.ledger.events("s", 0)] == before
        assert list(k.ledger.checkpoint_names("s")) == [rec.name]
        assert k.store.check(read_data=True).ok


def test_sparse_images_are_imported_without_reading_holes_and_cat_keeps_them_sparse(
        store: Path, tmp_path: Path) -> None:
    rnd = random.Random(5)
    img = tmp_path / "disk.img"
    size = 2 * 1024**3 + 12345  # not a multiple of 64 KiB; the tail is written
    with open(img, "wb") as f:
        f.truncate(size)
        for off, n in ((0, 3000), (100_000, 300_000), (1024**3 + 7, 70_000),
                       (size - 5000, 5000)):
            f.seek(off)
            f.write(rnd.randbytes(n))
    tail_hole = tmp_path / "tail.img"  # ends in a hole that is not a whole 64 KiB
    with open(tail_hole, "wb") as f:
        f.write(rnd.randbytes(70_000))
        f.truncate(3 * 65536 + 100)
    ksfs(store, "import", "s1", "c1", str(img), str(tail_hole))
    for src in (img, tail_hole):
        out = tmp_path / f"out-{src.name}"
        with open(out, "wb") as f:
            subprocess.run(KSFS + ["--store", str(store), "cat", "s1", "c1", src.name],
                           stdout=f, check=True)
        assert out.stat().st_size == src.stat().st_size
        assert subprocess.run(["cmp", str(out), str(src)]).returncode == 0
        # holes were seeked over, not written: what the source has allocated, rounded out to
        # the 64 KiB chunks around each of its (at most four) written extents
        assert out.stat().st_blocks <= src.stat().st_blocks + 4 * 2 * 128
        # appended to, or into a pipe, the bytes are all written and the same
        with open(out, "ab") as f:
            subprocess.run(KSFS + ["--store", str(store), "cat", "s1", "c1", src.name],
                           stdout=f, check=True)
        assert out.stat().st_size == 2 * src.stat().st_size
        with open(out, "rb") as f:
            f.seek(src.stat().st_size)
            assert f.read(200_000) == src.read_bytes()[:200_000]
    piped = subprocess.run(KSFS + ["--store", str(store), "cat", "s1", "c1", "tail.img"],
                           capture_output=True, check=True).stdout
    assert piped == tail_hole.read_bytes()
    assert ksfs(store, "check", "--read-data").returncode == 0


def test_a_file_name_that_is_not_utf8_is_shown_as_its_bytes(store: Path, tmp_path: Path) -> None:
    bad = os.path.join(os.fsencode(tmp_path), b"\xff\xfe.bin")
    with open(bad, "wb") as f:
        f.write(b"x")
    res = subprocess.run([*map(os.fsencode, KSFS), b"--store", os.fsencode(store), b"import",
                          b"s1", b"c1", bad], capture_output=True)
    assert res.returncode == 2
    assert res.stderr.decode() == (
        "ksfs: error: invalid name b'\\xff\\xfe.bin': file name is not valid UTF-8\n")


def test_check_says_what_a_killed_import_left_and_gc_gives_it_back(tmp_path):
    """QA: the packs a killed import wrote were counted nowhere: `check` said "6 packs" with 9
    on disk, and only a `gc` nobody was told to run gave the space back."""
    store = tmp_path / "store"
    src = tmp_path / "data.bin"
    src.write_bytes(random.Random(5).randbytes(3 << 20))
    ksfs(store, "import", "s", "kept", str(src))
    other = tmp_path / "other.bin"
    other.write_bytes(random.Random(6).randbytes(3 << 20))
    killed = ksfs(store, "import", "s", "killed", str(other), check=False,
                  env=dict(os.environ, KSFS_CRASH_AT="pack.fsync"))
    assert killed.returncode == -signal.SIGKILL
    out = ksfs(store, "check").stdout.decode()
    assert out.startswith("store clean")
    assert "left by ingests that did not finish" in out and "ksfs gc" in out
    report = json.loads(ksfs(store, "check", "--json").stdout)
    assert report["ok"] and report["unfinished_bytes"] >= 3 << 20, report
    ksfs(store, "gc")
    report = json.loads(ksfs(store, "check", "--json").stdout)
    assert report["unfinished_bytes"] == 0 and report["unfinished_packs"] == 0, report
    assert "did not finish" not in ksfs(store, "check").stdout.decode()


def test_stats_counts_packs_and_their_bytes_alike_after_a_killed_import(tmp_path):
    """Issue #2 review: `stats` counted packs from the index but pack_bytes from every pack
    file, so after a killed import they disagreed until a gc. Both are the index's packs now;
    what the killed import left is uncommitted_pack_bytes, until gc gives it back."""
    store = tmp_path / "store"
    src = tmp_path / "data.bin"
    src.write_bytes(random.Random(5).randbytes(3 << 20))
    ksfs(store, "import", "s", "kept", str(src))
    before = json.loads(ksfs(store, "stats", "--json").stdout)
    assert before["uncommitted_pack_bytes"] == 0
    assert before["pack_bytes"] == sum(p.stat().st_size for p in (store / "packs").iterdir())
    other = tmp_path / "other.bin"
    other.write_bytes(random.Random(6).randbytes(3 << 20))
    killed = ksfs(store, "import", "s", "killed", str(other), check=False,
                  env=dict(os.environ, KSFS_CRASH_AT="pack.fsync"))
    assert killed.returncode == -signal.SIGKILL
    on_disk = sum(p.stat().st_size for p in (store / "packs").iterdir())
    assert on_disk >= before["pack_bytes"] + (3 << 20)
    after = json.loads(ksfs(store, "stats", "--json").stdout)
    for key in ("stored_bytes", "chunks", "packs", "pack_bytes", "checkpoints", "logical_bytes"):
        assert after[key] == before[key], (key, before, after)
    assert after["uncommitted_pack_bytes"] == on_disk - before["pack_bytes"]
    report = json.loads(ksfs(store, "check", "--json").stdout)
    assert report["unfinished_bytes"] == after["uncommitted_pack_bytes"]
    ksfs(store, "gc")
    collected = json.loads(ksfs(store, "stats", "--json").stdout)
    assert collected["uncommitted_pack_bytes"] == 0
    assert collected["pack_bytes"] == before["pack_bytes"] == \
        sum(p.stat().st_size for p in (store / "packs").iterdir())


@pytest.mark.parametrize("read_data", [False, True])
def test_plain_check_names_every_damaged_chunk_checkpoint_and_file(tmp_path: Path,
                                                                   read_data: bool) -> None:
    """Issue #2 review: plain `ksfs check` named at most 10 chunks a pack (the rest counted)
    and no checkpoint on a line of its own. Every chunk --json names is named in the text, every
    checkpoint and file that depends on them once, and it exits 6."""
    store = tmp_path / "store"
    src = tmp_path / "memory"
    src.write_bytes(random.Random(8).randbytes(3 << 20))
    ksfs(store, "import", "s", "c1", str(src))
    ksfs(store, "import", "s", "c2", str(src))
    ksfs(store, "import", "t", "c1", str(src))
    (pack,) = (store / "packs").iterdir()
    os.truncate(pack, pack.stat().st_size // 3)
    flags = ["--read-data"] if read_data else []
    report = json.loads(ksfs(store, "check", "--json", *flags, check=False).stdout)
    chunks = {f["chunk"] for f in report["findings"] if f["kind"].endswith("_chunk")}
    assert len(chunks) > 10, chunks  # (more than the old cap of 10 a pack)
    res = ksfs(store, "check", *flags, check=False)
    assert res.returncode == 6, res.stderr
    lines = res.stdout.decode().splitlines()
    assert {x.split(":")[0] for x in lines if x.startswith("chunk ")} == \
        {f"chunk {c}" for c in chunks}
    assert len([x for x in lines if x.startswith("chunk ")]) == len(chunks)
    assert lines[0].startswith(f"pack {int(pack.stem)}: ")
    for checkpoint in ("s/c1", "s/c2", "t/c1"):
        at = lines.index(f"checkpoint {checkpoint}: 1 of its files depends on damaged or "
                         "missing data")
        assert lines[at + 1].startswith(f"{checkpoint}/memory: unreadable ("), lines
        assert sum(x.startswith(f"{checkpoint}/memory:") for x in lines) == 1
    assert not any("more" in x.split() for x in lines), lines
    assert lines[-1].startswith("store DAMAGED: ")


FALLBACK_ONLY = """
import sys


class NoCompiledChunker:  # as when pyfastcdc's extension cannot load: the package itself does
    def find_spec(self, name, path=None, target=None):
        if name.startswith("pyfastcdc.cy"):
            raise ImportError(f"{name}: cannot open shared object file")


sys.meta_path.insert(0, NoCompiledChunker())
from ksfs.cli import main
main()
"""


def test_a_missing_compiled_chunker_is_one_line(store: Path, tmp_path: Path) -> None:
    """QA: with only pyfastcdc's pure-Python fallback loadable, the library's own warning (two
    lines) came before ksfs's one-line refusal (exit 7)."""
    src = tmp_path / "notes.txt"
    src.write_bytes(random.Random(1).randbytes(100_000))
    res = subprocess.run([sys.executable, "-c", FALLBACK_ONLY, "--store", str(store), "import",
                          "s", "c", str(src)], capture_output=True, timeout=60)
    assert res.returncode == 7, res.stderr
    lines = res.stderr.decode().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ksfs: error: pyfastcdc's compiled"), lines


def test_check_json_names_a_damaged_chunks_pack_and_offset(store: Path, tmp_path: Path) -> None:
    """QA: `check --json` named a damaged chunk's pack only inside its sentence; and (QA,
    thirty-fourth session) the pack had no line of its own, as a pack cut short has."""
    from ksfs.cas import ChunkStore

    src = tmp_path / "disk.raw"
    make_image(src, 4 * 65536, seed=9, holes=False)
    ksfs(store, "import", "s", "c", str(src))
    with ChunkStore.open(store) as s:
        with s.env.begin(db=s.db["chunks"]) as txn:
            cid = bytes(next(iter(txn.cursor()))[0])
        loc = s.lookup(cid)
    with open(store / "packs" / f"{loc.pack:08d}.pack", "r+b") as f:
        f.seek(loc.offset + 20)  # inside the record's header: check sees it without --read-data
        b = f.read(1)
        f.seek(loc.offset + 20)
        f.write(bytes([b[0] ^ 0x40]))
    for extra in ((), ("--read-data",)):
        res = ksfs(store, "check", "--json", *extra, check=False)
        assert res.returncode == 6, res.stderr
        found = [f for f in json.loads(res.stdout)["findings"] if f["kind"] == "damaged_chunk"]
        assert found == [{"kind": "damaged_chunk", "chunk": cid.hex(), "pack": loc.pack,
                          "offset": loc.offset, "why": found[0]["why"]}], found
        # and its pack has a finding of its own (QA, thirty-fourth session)
        report = json.loads(res.stdout)
        held = [f for f in report["findings"] if f["kind"] == "pack_holding_damage"]
        assert held == [{"kind": "pack_holding_damage", "pack": loc.pack, "chunks": 1,
                         "file": f"packs/{loc.pack:08d}.pack"}], held
        assert len(report["problems"]) == len(report["findings"])
    text = ksfs(store, "check", check=False).stdout.decode().splitlines()
    assert text[0] == (f"pack {loc.pack} (packs/{loc.pack:08d}.pack): holds 1 damaged or "
                       "missing chunk(s), each named on a line of its own"), text
    assert text[1].startswith(f"chunk {cid.hex()}: damaged"), text


def test_check_during_an_import_says_its_packs_are_in_use(store: Path, tmp_path: Path) -> None:
    """QA: a check run while an import wrote called its packs "left by ingests that did not
    finish"; they are a running ingest's, and once it commits they are counted as the store's."""
    from ksfs.cas import ChunkStore
    from tests.cas_helpers import BytesSource

    src = tmp_path / "data.bin"
    src.write_bytes(random.Random(3).randbytes(1 << 20))
    ksfs(store, "import", "s", "c", str(src))
    with ChunkStore.open(store) as s:
        with s.ingest() as ing:  # a running import: written, not yet committed
            ing.add_file(BytesSource(random.Random(4).randbytes(2 << 20)), chunking="fixed")
            ing.seal()
            out = ksfs(store, "check").stdout.decode()
            assert out.startswith("store clean") and "did not finish" not in out, out
            assert "an ingest is running" in out, out
            report = json.loads(ksfs(store, "check", "--json").stdout)
            assert report["unfinished_bytes"] == 0 and report["unfinished_packs"] == 0, report
            assert report["in_use_bytes"] >= 2 << 20 and report["in_use_packs"] >= 1, report
            with s.env.begin(write=True) as txn:
                ing.commit(txn)
    report = json.loads(ksfs(store, "check", "--json").stdout)
    assert report["in_use_bytes"] == 0 == report["unfinished_bytes"], report
    assert "running" not in ksfs(store, "check").stdout.decode()


def test_two_imports_of_one_new_file_at_once_store_and_count_it_once(store: Path,
                                                                     tmp_path: Path) -> None:
    """QA: two `ksfs import`s of the same new data at once both kept it in their packs and
    both reported it as stored. Whichever order they publish in, it is kept and counted once."""
    src = tmp_path / "data.bin"
    src.write_bytes(random.Random(8).randbytes(16 << 20))
    tiny = tmp_path / "tiny"
    tiny.write_bytes(b"t")
    ksfs(store, "import", "z", "c", str(tiny))  # the store exists before both start
    base = json.loads(ksfs(store, "stats", "--json").stdout)["stored_bytes"]
    procs = [subprocess.Popen(KSFS + ["--store", str(store), "import", "--json", s, "c",
                                      str(src)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for s in ("a", "b")]
    records = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        records.append(json.loads(out))
    stored = sorted(sum(f["stored"] for f in r["files"]) for r in records)
    figures = json.loads(ksfs(store, "stats", "--json").stdout)
    assert stored[0] == 0 and stored[1] > 16 << 20, stored
    assert figures["stored_bytes"] == base + stored[1], figures
    packs = store / "packs"
    assert sum(p.stat().st_size for p in packs.iterdir()) == base + stored[1]
    assert ksfs(store, "check", "--read-data").returncode == 0


def test_a_path_that_cannot_be_looked_at_is_one_line(store: Path, tmp_path: Path) -> None:
    """Review: a directory name over 255 bytes in a FILE argument ended `ksfs import` with a
    traceback (exit 1); a symbolic link loop was called "not found"."""
    loop = tmp_path / "loop.img"
    loop.symlink_to(loop)
    for path, words in ((f"{'a' * 300}/f", "too long"), (str(loop), "symbolic link")):
        res = ksfs(store, "import", "s", "c", path, check=False)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.decode().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ksfs: error: ") and words in lines[0], \
            lines
    assert not store.exists()


def test_recover_takes_back_a_session_only_a_killed_import_made(store: Path,
                                                                tmp_path: Path) -> None:
    """QA (thirty-fourth session): an import killed (-9) into a new session left the session
    ("no checkpoint") and its checkpoint.begin open, where one that fails in its own process
    takes the session back. `ksfs recover` now does that for it; a session with a checkpoint
    keeps it, its killed import's begin marked failed."""
    src = tmp_path / "memory"
    src.write_bytes(random.Random(5).randbytes(300_000))
    ksfs(store, "import", "kept", "c1", str(src))
    crash = dict(os.environ, KSFS_CRASH_AT="pack.write")
    new = tmp_path / "new" / "memory"
    new.parent.mkdir()
    new.write_bytes(random.Random(6).randbytes(300_000))  # (new bytes: a pack is written)
    for session in ("fresh", "kept"):
        res = ksfs(store, "import", session, "c2", str(new), check=False, env=crash)
        assert res.returncode == -signal.SIGKILL, res.stderr
    assert b"fresh" in ksfs(store, "session", "list").stdout  # (what the QA saw)
    report = json.loads(ksfs(store, "recover", "--json").stdout)
    by = {r["session"]: r["actions"] for r in report}
    assert by["fresh"] == ["checkpoint c2 begun at seq 1 marked failed",
                           "made by an import that never finished, and holding nothing: "
                           "removed"], report
    assert by["kept"] == ["checkpoint c2 begun at seq 3 marked failed"], report
    listed = ksfs(store, "session", "list", "--json").stdout
    assert [s["session"] for s in json.loads(listed)] == ["kept"], listed
    res = ksfs(store, "events", "fresh", check=False)
    assert res.returncode == 3, res.stderr
    assert ksfs(store, "cat", "kept", "c1", "memory").stdout == src.read_bytes()
    ksfs(store, "check", "--read-data")
    assert json.loads(ksfs(store, "recover", "--json").stdout) == []  # nothing more to do
    # the name is free again, for an import that finishes
    ksfs(store, "import", "fresh", "c1", str(src))
