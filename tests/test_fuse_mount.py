"""The mount for real: a server subprocess over an offline store, read with plain system calls and
tools (cat, cmp, ls). Every byte is compared with the original file and with the keeper's reader."""

from __future__ import annotations

import errno
import json
import math
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ksfs.keeper import Keeper
from tests.mount_helpers import MIB, REPO, build_store, mounted, write_disk, write_memory


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return build_store(tmp_path_factory.mktemp("fuse"))


@pytest.fixture(scope="module")
def mnt(sources):
    # No default guest template: mkdir sessions/NAME must refuse plainly (EPERM).
    with mounted(sources["store"], env={"KSFS_GUEST": ""}) as m:
        yield m


@pytest.fixture(scope="module")
def keeper(sources, mnt):
    with Keeper(sources["store"]) as k:
        yield k


def cp(mnt: Path, session: str, checkpoint: str) -> Path:
    return mnt / "sessions" / session / "checkpoints" / checkpoint


def events(mnt: Path, session: str) -> list[dict]:
    return [json.loads(line) for line in (mnt / "sessions" / session / "events").read_text()
            .splitlines()]


def rejected(mnt: Path, session: str, since: int) -> list[dict]:
    return [e for e in events(mnt, session) if e["type"] == "input.rejected" and e["seq"] >= since]


def tree_of(mnt: Path) -> dict:
    """What the tree holds: sessions, their checkpoints and each checkpoint's file names/sizes."""
    out = {}
    for s in sorted(os.listdir(mnt / "sessions")):
        if s == "many":
            out[s] = len(os.listdir(mnt / "sessions" / s / "checkpoints"))
            continue
        cps = {}
        for c in sorted(os.listdir(mnt / "sessions" / s / "checkpoints")):
            d = cp(mnt, s, c)
            cps[c] = sorted((n, (d / n).stat().st_size) for n in os.listdir(d) if n != "forks")
        out[s] = cps
    return out


def test_layout_and_sizes(mnt, sources, keeper):
    assert sorted(os.listdir(mnt)) == ["sessions", "store"]
    assert sorted(os.listdir(mnt / "sessions")) == ["many", "s1"]
    assert sorted(os.listdir(mnt / "sessions" / "s1")) == [
        "checkpoints", "events", "resume", "status", "usage"]
    assert sorted(os.listdir(cp(mnt, "s1", "c1"))) == [
        "disk.raw", "forks", "fs", "memory", "meta.json", "transcript"]
    rec = keeper.ledger.checkpoint("s1", "c1")
    for name, src in (("disk.raw", sources["disk1"]), ("memory", sources["memory"])):
        st = (cp(mnt, "s1", "c1") / name).stat()
        assert st.st_size == src.stat().st_size
        # st_blocks: the bytes no other checkpoint holds; c2 has the same memory and a disk
        # that differs in two places (stored as deltas against c1's chunks). The mount counts
        # every checkpoint's chunks in the background after the first stat, so the figure
        # settles within a second or so of that.
        want = max(math.ceil(keeper.exclusive_bytes(rec, name) / 512), 1)
        deadline = time.monotonic() + 15
        while st.st_blocks != want and time.monotonic() < deadline:
            time.sleep(0.1)
            st = (cp(mnt, "s1", "c1") / name).stat()
        assert st.st_blocks == want
        assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o444
    # c2 holds every chunk of it: 1 block, not 0 (tar --sparse skips a file of 0 blocks)
    assert (cp(mnt, "s1", "c1") / "memory").stat().st_blocks == 1
    assert 0 < (cp(mnt, "s1", "c2") / "disk.raw").stat().st_blocks < 2 * 128
    # ls -l tells the true sizes too.
    listing = subprocess.run(["ls", "-l", str(cp(mnt, "s1", "c1"))], capture_output=True,
                             text=True, check=True).stdout
    sizes = {line.split()[-1]: int(line.split()[4]) for line in listing.splitlines()[1:]}
    assert sizes["disk.raw"] == sources["disk1"].stat().st_size
    assert sizes["memory"] == sources["memory"].stat().st_size
    meta = json.loads((cp(mnt, "s1", "c1") / "meta.json").read_text())
    assert meta["files"]["memory"]["size"] == sources["memory"].stat().st_size
    assert sizes["meta.json"] == len((cp(mnt, "s1", "c1") / "meta.json").read_bytes())
    store = json.loads((mnt / "store").read_text())
    assert store["checkpoints"] == 1003
    status = json.loads((mnt / "sessions" / "s1" / "status").read_text())
    assert status["session"] == "s1" and status["last_checkpoint"] == "scratch"
    assert (mnt / "sessions" / "s1" / "status").stat().st_size == len(
        (mnt / "sessions" / "s1" / "status").read_bytes())
    assert (mnt / "sessions" / "s1" / "resume").read_text() == "none\n"
    assert (mnt / "sessions" / "s1" / "resume").stat().st_mode & 0o777 == 0o644


def test_listings_have_dot_and_dotdot_as_on_any_filesystem(mnt):
    c1 = cp(mnt, "s1", "c1")
    for d, parent in ((mnt, mnt.parent), (mnt / "sessions", mnt), (c1, c1.parent)):
        names = subprocess.run(["ls", "-a1", str(d)], capture_output=True, text=True,
                               check=True).stdout.split()
        assert names[:2] == [".", ".."] and "." not in os.listdir(d)
        assert os.stat(d / ".").st_ino == os.stat(d).st_ino
        assert os.stat(d / "..").st_ino == os.stat(parent).st_ino
    found = subprocess.run(["find", str(c1), "-maxdepth", "1", "-type", "f"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert sorted(Path(f).name for f in found) == [
        "disk.raw", "memory", "meta.json", "transcript"]


def test_every_byte_equals_the_original_and_ksfs_cat(mnt, sources, keeper):
    for c, disk in (("c1", sources["disk1"]), ("c2", sources["disk2"])):
        for name, src in (("disk.raw", disk), ("memory", sources["memory"])):
            through = (cp(mnt, "s1", c) / name).read_bytes()
            assert through == src.read_bytes(), (c, name)
            cat = subprocess.run([sys.executable, "-m", "ksfs.cli", "--store",
                                  str(sources["store"]), "cat", "s1", c, name],
                                 capture_output=True, check=True, cwd=REPO).stdout
            assert through == cat, (c, name)


def test_new_session_without_a_guest_template_is_refused(mnt):
    before = os.listdir(mnt / "sessions")
    with pytest.raises(OSError) as info:
        os.mkdir(mnt / "sessions" / "fresh")
    assert info.value.errno == errno.EPERM
    assert os.listdir(mnt / "sessions") == before


def test_random_offsets_match_original_and_keeper(mnt, sources, keeper):
    rnd = random.Random(5)
    for name, src in (("disk.raw", sources["disk1"]), ("memory", sources["memory"])):
        original = src.read_bytes()
        reader = keeper.open_file("s1", "c1", name)
        fd = os.open(cp(mnt, "s1", "c1") / name, os.O_RDONLY)
        try:
            for _ in range(300):
                off = rnd.randrange(0, len(original) + 100)
                n = rnd.choice([1, 7, 4096, 65536, 65537, 300_000, rnd.randrange(1, 2 * MIB)])
                got = os.pread(fd, n, off)
                assert got == original[off : off + n], (name, off, n)
                assert got == reader.read(off, n), (name, off, n)
        finally:
            os.close(fd)


def test_cmp_behaves_as_on_plain_files(mnt, sources):
    def run(a: Path, b: Path) -> tuple[int, str]:
        r = subprocess.run(["cmp", str(a), str(b)], capture_output=True, text=True)
        return r.returncode, r.stdout.replace(str(a), "A").replace(str(b), "B")

    same = run(cp(mnt, "s1", "c1") / "memory", cp(mnt, "s1", "c2") / "memory")
    assert same == (0, "")
    through = run(cp(mnt, "s1", "c1") / "disk.raw", cp(mnt, "s1", "c2") / "disk.raw")
    plain = run(sources["disk1"], sources["disk2"])
    assert through == plain and through[0] == 1
    assert f"byte {1 * MIB + 501}" in through[1]


def test_tar_sparse_archives_checkpoints_as_they_are(mnt, sources, tmp_path):
    """QA (tenth session): GNU tar --sparse stored a file of st_blocks 0 as one hole without
    reading it, so a checkpoint whose chunks another checkpoint also held, and every record
    file, came out of the archive as zeros."""
    out = tmp_path / "out"
    out.mkdir()
    # c2 holds every chunk of c1's memory: once the mount has counted the holders, c1's
    # memory says 1 block (it said 0 before the fix: the case tar skipped)
    memory = cp(mnt, "s1", "c1") / "memory"
    deadline = time.monotonic() + 15
    while memory.stat().st_blocks != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert memory.stat().st_blocks == 1
    pack = subprocess.run(["tar", "-cSf", "-", "-C", str(cp(mnt, "s1", "c1")), "memory",
                           "disk.raw", "meta.json"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-xf", "-", "-C", str(out)], input=pack, check=True)
    assert (out / "memory").read_bytes() == sources["memory"].read_bytes()
    assert (out / "disk.raw").read_bytes() == sources["disk1"].read_bytes()
    assert (out / "meta.json").read_bytes() == (cp(mnt, "s1", "c1") / "meta.json").read_bytes()
    assert json.loads((out / "meta.json").read_text())["name"] == "c1"
    # a record file says 1 block, as mount.md says (QA, eleventh session: meta.json said 4,
    # and a transcript, a view of disk.raw, counted its bytes a second time in du)
    meta = cp(mnt, "s1", "c1") / "meta.json"
    assert meta.stat().st_size > 512 and meta.stat().st_blocks == 1


def test_bad_input_gets_its_errno_and_event(mnt, keeper):
    before = tree_of(mnt)
    since = keeper.ledger.last_seq("s1") + 1
    s1 = mnt / "sessions" / "s1"
    cps = s1 / "checkpoints"

    def refused(fn, *args) -> int:
        with pytest.raises(OSError) as info:
            fn(*args)
        return info.value.errno

    # Names: control characters, non-UTF-8 and over 255 bytes reach us; '/', NUL, '.' and '..'
    # are refused by the kernel or libc before any request (see docs/mount.md).
    assert refused(os.mkdir, cps / "bad\x01name") == errno.EINVAL
    assert refused(os.mkdir, os.fsencode(cps) + b"/bad\xffname") == errno.EINVAL
    assert refused(os.mkdir, cps / ("x" * 256)) == errno.EINVAL
    assert refused(os.mkdir, cps / "..") == errno.EEXIST
    # Existing names.
    assert refused(os.mkdir, cps / "c1") == errno.EEXIST
    assert refused(os.mkdir, cps / "c1" / "forks" / "s1") == errno.EEXIST
    assert refused(os.mkdir, mnt / "sessions" / "s1") == errno.EEXIST
    # Where nothing can be created.
    assert refused(os.mkdir, s1 / "nothing") == errno.EPERM
    assert refused(os.mkdir, mnt / "nothing") == errno.EPERM
    assert refused(os.mkdir, cps / "c1" / "nothing") == errno.EPERM
    assert refused(os.open, s1 / "newfile", os.O_CREAT | os.O_WRONLY, 0o644) == errno.EPERM
    assert refused(os.unlink, cps / "c1" / "memory") == errno.EPERM
    assert refused(os.rename, cps / "c1", cps / "c9") == errno.EPERM
    assert refused(os.rmdir, s1) == errno.EPERM
    assert refused(os.rmdir, cps / "nope") == errno.ENOENT
    # Writing read-only files.
    for path in (s1 / "status", s1 / "events", cps / "c1" / "memory", mnt / "store"):
        assert refused(os.open, path, os.O_WRONLY) in (errno.EROFS, errno.EACCES)
    assert refused(os.truncate, cps / "c1" / "disk.raw", 0) in (errno.EROFS, errno.EACCES)
    # resume: unknown checkpoint, garbage, nothing.
    for data, want in ((b"nope\n", errno.ENOENT), (b"\xff\xfe\n", errno.EINVAL),
                       (b"\n", errno.EINVAL), (b"a/b\n", errno.EINVAL), (b"x\x01\n", errno.EINVAL),
                       (b"x\n\n", errno.EINVAL)):
        fd = os.open(s1 / "resume", os.O_WRONLY | os.O_TRUNC)
        try:
            assert refused(os.write, fd, data) == want, data
        finally:
            os.close(fd)
    said = (s1 / "resume").read_text()
    assert said.startswith("rejected: ")
    # QA: a chmod or touch of resume, refused, replaced what reading it says
    assert refused(os.chmod, s1 / "resume", 0o600) in (errno.EROFS, errno.EPERM)
    assert refused(os.utime, s1 / "resume") in (errno.EROFS, errno.EPERM)
    assert (s1 / "resume").read_text() == said
    # and the event does not call the writable resume "read-only" (QA, thirty-fourth session)
    why = [e["body"]["why"] for e in rejected(mnt, "s1", since) if e["body"]["file"] == "resume"
           and e["body"].get("change") == "attributes"]
    assert why and all("only a checkpoint's name may be written into it" in w for w in why), why

    assert tree_of(mnt) == before
    got = rejected(mnt, "s1", since)
    files = [e["body"]["file"] for e in got]
    # One event per refusal that names session s1 (everything above but the root's mkdir and
    # the kernel's own refusals).
    # One event per refusal that reaches the mount and names session s1. The kernel answers
    # mkdir of an existing entry (EEXIST), rmdir of a missing one (ENOENT) and the root's mkdir
    # from its own lookup, so those never reach us and carry no event (docs/mount.md).
    assert sorted(files) == sorted([
        "checkpoints/bad\x01name", "checkpoints/bad\udcffname", "checkpoints/" + "x" * 256,
        "checkpoints/c1/forks/s1", "nothing", "checkpoints/c1/nothing", "newfile",
        "checkpoints/c1/memory", "checkpoints/c1", "s1", "status", "events",
        "checkpoints/c1/memory", "checkpoints/c1/disk.raw"] + ["resume"] * 8)
    assert [e["body"].get("change") for e in got if e["body"]["file"] == "resume"][-2:] == [
        "attributes", "attributes"]
    values = [e["body"]["value"] for e in got
              if e["body"]["file"] == "resume" and "change" not in e["body"]]
    # the value as restore read it: one trailing newline off, no more
    assert values == ["nope", "\ufffd\ufffd", "", "a/b", "x\x01", "x\n"]
    assert all(e["body"]["why"] for e in got)


def test_live_files_keep_their_times_until_their_bytes_change(mnt, keeper):
    """QA: status, events, usage and resume said "now" as their mtime at every stat, so
    `tar -c` of a session exited 1 ("file changed as we read it") and rsync copied them on
    every run."""
    s1 = mnt / "sessions" / "s1"
    live = ("status", "events", "usage", "resume")
    first = {n: (s1 / n).stat() for n in live}
    time.sleep(1.1)
    again = {n: (s1 / n).stat() for n in live}
    for n in live:
        assert (first[n].st_mtime_ns, first[n].st_ctime_ns) == (
            again[n].st_mtime_ns, again[n].st_ctime_ns), n
    for n in ("status", "events", "resume", "usage"):  # a read does not move them either
        (s1 / n).read_bytes()
    archive = subprocess.run(["tar", "-cf", "-", "-C", str(s1), *live], capture_output=True)
    assert archive.returncode == 0, archive.stderr
    keeper.reject("s1", "somewhere", "", "a new event")  # events (and status's seq) change
    later = {n: (s1 / n).stat() for n in ("events", "status")}
    assert later["events"].st_mtime_ns > again["events"].st_mtime_ns
    assert later["events"].st_size > again["events"].st_size
    assert later["status"].st_mtime_ns > again["status"].st_mtime_ns


def test_an_open_event_log_reads_to_its_end_after_its_session_goes(mnt, keeper, tmp_path):
    """QA: reading on in an open `events` (tail -f) of a session removed meanwhile was ENOENT."""
    src = tmp_path / "f.bin"
    src.write_bytes(b"x")
    keeper.import_files("goes", "c1", [src])
    with open(mnt / "sessions" / "goes" / "events", "rb") as f:
        seen = f.read()
        assert b"checkpoint" in seen
        keeper.remove_session("goes")
        assert f.read() == b""  # the end of the log it had, not an error
    assert "goes" not in os.listdir(mnt / "sessions")


def test_rmdir_deletes_a_checkpoint(mnt, keeper, tmp_path):
    scratch = cp(mnt, "s1", "scratch")
    assert (scratch / "note").read_bytes() == b"tiny\n"
    os.rmdir(scratch)
    assert "scratch" not in os.listdir(mnt / "sessions" / "s1" / "checkpoints")
    assert not scratch.exists()
    assert "scratch" not in keeper.ledger.checkpoint_names("s1")
    # A new checkpoint under the same name is a new object: no stale page of the old one.
    (tmp_path / "note").write_bytes(b"second version\n")
    keeper.import_files("s1", "scratch", [tmp_path / "note"])
    assert sorted(os.listdir(scratch)) == ["forks", "meta.json", "note"]
    assert (scratch / "note").read_bytes() == b"second version\n"
    os.rmdir(scratch)


def test_a_deleted_checkpoint_directory_lists_nothing(mnt, keeper, tmp_path):
    (tmp_path / "gone").write_bytes(b"soon gone\n")
    keeper.import_files("s1", "doomed", [tmp_path / "gone"])
    d = cp(mnt, "s1", "doomed")
    assert "gone" in os.listdir(d)
    cwd = os.getcwd()
    os.chdir(d)  # a shell sitting in it while the checkpoint is deleted elsewhere
    try:
        keeper.delete_checkpoint("s1", "doomed")
        with pytest.raises(FileNotFoundError):
            os.listdir(".")
        with pytest.raises(FileNotFoundError):
            open("gone", "rb")
    finally:
        os.chdir(cwd)


def test_xattrs_are_none_and_df_shows_the_store_file_system(mnt, sources):
    f = cp(mnt, "s1", "c1") / "memory"
    for p in (mnt, cp(mnt, "s1", "c1"), f, mnt / "sessions" / "s1" / "status"):
        assert os.listxattr(p) == []
        with pytest.raises(OSError) as exc:
            os.getxattr(p, "user.x")
        assert exc.value.errno == errno.EOPNOTSUPP
    with pytest.raises(OSError) as exc:
        os.setxattr(f, "user.x", b"1")
    assert exc.value.errno in (errno.EROFS, errno.EACCES)  # EACCES: the file is 0444
    tar = subprocess.run(["tar", "--xattrs", "-cf", "/dev/null", str(cp(mnt, "s1", "c1"))],
                         capture_output=True, text=True)
    assert tar.returncode == 0 and "xattr" not in tar.stderr, tar.stderr
    ours, host = os.statvfs(mnt), os.statvfs(sources["store"])
    assert ours.f_blocks * ours.f_frsize == host.f_blocks * host.f_frsize
    assert 0 < ours.f_bavail <= ours.f_bfree <= ours.f_blocks  # (others write meanwhile)


def test_st_blocks_follow_what_other_checkpoints_hold(mnt, keeper, tmp_path):
    data = random.Random(4).randbytes(3 * MIB)
    (tmp_path / "own.img").write_bytes(data)
    keeper.import_files("held", "x1", [], disks=[tmp_path / "own.img"])
    keeper.import_files("held", "x2", [], disks=[tmp_path / "own.img"])
    f = cp(mnt, "held", "x1") / "own.img"
    assert f.stat().st_blocks == 1  # x2 holds the same chunks (never 0: see blocks_for)
    keeper.delete_checkpoint("held", "x2")
    # Attributes of checkpoint files are cached for ever; the mount tells the kernel to drop
    # them once what other checkpoints hold has changed (within about a second).
    deadline = time.monotonic() + 15
    while f.stat().st_blocks == 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert f.stat().st_blocks * 512 >= len(data)  # random bytes: stored raw, now x1's alone
    assert f.stat().st_size == len(data) and f.read_bytes() == data
    # du of the checkpoint directory tells what deleting it frees
    du = subprocess.run(["du", "-s", "-B1", str(cp(mnt, "held", "x1"))], capture_output=True,
                        text=True, check=True).stdout.split()[0]
    assert int(du) >= len(data)
    keeper.delete_checkpoint("held", "x1")


def test_reading_a_checkpoint_deleted_and_collected_meanwhile_is_estale(mnt, keeper, tmp_path):
    data = random.Random(8).randbytes(24 * MIB)
    (tmp_path / "big.img").write_bytes(data)
    keeper.import_files("gone", "g1", [], disks=[tmp_path / "big.img"])
    with open(cp(mnt, "gone", "g1") / "big.img", "rb", buffering=0) as f:
        assert f.read(MIB) == data[:MIB]
        keeper.delete_checkpoint("gone", "g1")
        keeper.gc()
        with pytest.raises(OSError) as exc:
            while f.read(MIB):
                pass
    # not EIO: nothing is damaged, the checkpoint is gone (as NFS says of a deleted file)
    assert exc.value.errno == errno.ESTALE
    assert keeper.check(read_data=True).ok


def test_listing_a_thousand_checkpoints(mnt):
    d = mnt / "sessions" / "many" / "checkpoints"
    names = os.listdir(d)
    assert sorted(names) == [f"k_{i:05d}" for i in range(1000)]
    out = subprocess.run(["ls", "-l", str(d)], capture_output=True, text=True, check=True).stdout
    assert len(out.splitlines()) == 1001
    assert (d / "k_00999" / "note").read_bytes() == b"tiny\n"


def test_eight_readers_during_import_and_gc(mnt, sources, keeper, tmp_path):
    originals = {("c1", "disk.raw"): sources["disk1"].read_bytes(),
                 ("c2", "disk.raw"): sources["disk2"].read_bytes(),
                 ("c1", "memory"): sources["memory"].read_bytes()}
    keys = list(originals)
    # Garbage for the GC to sweep: a checkpoint of its own data, deleted.
    junk = write_disk(tmp_path / "junk.raw", 2 * MIB, 99, [(0, 2 * MIB)])
    keeper.import_files("s1", "junk", [], disks=[junk])
    keeper.delete_checkpoint("s1", "junk")
    errors: list[str] = []
    stop = threading.Event()
    rounds = [0] * 8

    def reader(i: int) -> None:
        try:
            while not stop.is_set() or rounds[i] < 2:
                c, name = keys[(i + rounds[i]) % len(keys)]
                r = subprocess.run(["cat", str(cp(mnt, "s1", c) / name)], capture_output=True)
                if r.returncode != 0 or r.stdout != originals[(c, name)]:
                    errors.append(f"reader {i}: {c}/{name} rc={r.returncode}")
                rounds[i] += 1
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    try:
        newdisk = write_disk(tmp_path / "new.raw", 3 * MIB, 42, [(0, 3 * MIB)])
        keeper.import_files("s1", "during", [], disks=[newdisk])
        result = keeper.gc()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert all(r >= 2 for r in rounds)
    assert result["chunks_freed"] > 0  # the GC really swept while the readers read
    assert (cp(mnt, "s1", "during") / "new.raw").read_bytes() == newdisk.read_bytes()
    os.rmdir(cp(mnt, "s1", "during"))
    report = keeper.check(read_data=True)
    assert report.ok, report.lines()


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    root = tmp_path_factory.mktemp("bigfiles")
    size = 24 * MIB + 777
    disk = write_disk(root / "disk.raw", size, 4,
                      [(0, 5 * MIB), (7 * MIB + 3, 6 * MIB), (20 * MIB, size - 20 * MIB)])
    memory = write_memory(root / "memory", 17 * MIB + 5, 8)
    with Keeper(root / "store", create=True) as k:
        k.import_files("s", "c", [memory], disks=[disk])
    return {"store": root / "store", "disk.raw": disk, "memory": memory}


def test_large_files_read_sequentially_randomly_and_abandoned(big):
    """Files of tens of MiB through the mount equal the originals and the store's reader: 1 MiB
    requests, odd sizes, jumps, a reader that stops early."""
    with mounted(big["store"]) as mnt, Keeper(big["store"]) as k:
        d = mnt / "sessions" / "s" / "checkpoints" / "c"
        rnd = random.Random(9)
        for name in ("disk.raw", "memory"):
            original = big[name].read_bytes()
            reader = k.open_file("s", "c", name)
            # Abandoned: a few sequential reads, then close (the stream must stop, not leak).
            with open(d / name, "rb", buffering=0) as f:
                head = f.read(3 * MIB)
            assert head == original[: 3 * MIB]
            # Sequential in odd sizes, with random jumps in between.
            fd = os.open(d / name, os.O_RDONLY)
            try:
                off = 0
                while off < len(original):
                    n = rnd.choice([4096, 100_000, MIB, 3 * MIB + 1])
                    got = os.pread(fd, n, off)
                    assert got == original[off : off + n] == reader.read(off, n), (name, off)
                    off += len(got)
                    if rnd.random() < 0.1:
                        j = rnd.randrange(len(original))
                        assert os.pread(fd, 5000, j) == original[j : j + 5000]
            finally:
                os.close(fd)
            assert (d / name).read_bytes() == original
    assert "Traceback" not in mounted.last_log
