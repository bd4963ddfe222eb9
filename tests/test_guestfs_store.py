"""GuestFS over real chunk-store files: a disk image ingested into a ChunkStore reads exactly as
its source tree; diff_trees between two checkpoints of one disk agrees with diff -rq of their
loop mounts while proving unchanged files equal from chunk ids instead of reading them; and a
damaged chunk gives the store's integrity error for the file it holds, not other bytes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from test_guestfs_helpers import (
    compare_with_dir,
    diff_rq,
    loop_mount,
    make_tree,
    same_mtime_write,
)

from ksfs.cas import ChunkStore
from ksfs.errors import IntegrityError
from ksfs.guestfs import GuestFS, diff_trees, read_transcript
from ksfs.guestfs.mkimage import build_ext4


class CountingReader:
    """A store file reader that counts the bytes asked of it (chunk ids pass through)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.size = inner.size
        self.entries = inner.entries
        self.starts = inner.starts
        self.bytes_read = 0

    def read(self, offset: int, n: int) -> bytes:
        self.bytes_read += n
        return self.inner.read(offset, n)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    base = tmp_path_factory.mktemp("guestfs-store")
    src = base / "tree"
    make_tree(src)
    (src / "agent").mkdir()
    (src / "agent" / "transcript.jsonl").write_text('{"seq": 1}\n{"seq": 2, "lineage": "S"}\n')
    a = base / "a.img"
    build_ext4(src, a, 64, ["-b", "4096", "-T", "default"])
    b = base / "b.img"
    shutil.copyfile(a, b)
    with loop_mount(b, "rw") as mnt:  # the guest works on its disk between two checkpoints
        if mnt is None:
            pytest.skip("this machine cannot set up loop devices")
        (mnt / "work.txt").write_text("new work\n")
        same_mtime_write(mnt / "random.bin", 2_000_000, b"changed")
        (mnt / "a" / "top.txt").unlink()
        with open(mnt / "agent" / "transcript.jsonl", "a") as f:
            f.write('{"seq": 3, "lineage": "S"}\n{"seq": 4, "lin')
    store = ChunkStore.open(base / "store", create=True)
    manifests = []
    with store.ingest() as ingest:
        for img in (a, b):
            manifests.append(ingest.add_file(str(img), chunking="fixed").manifest)
        ingest.seal()
        with store.env.begin(write=True) as txn:
            ingest.commit(txn)
    yield store, src, a, b, manifests
    store.close()


def test_store_file_reads_as_the_source(setup) -> None:
    store, src, _, _, (ma, mb) = setup
    fs = GuestFS.open(store.open_file(ma))
    skip = ("lost+found", "agent")
    assert compare_with_dir(fs, src, exact=False, skip=skip) > 3000
    info = read_transcript(GuestFS.open(store.open_file(mb)))
    assert (info.last_seq, info.lineage, info.count) == (3, "S", 3)


def test_diff_between_checkpoints_uses_chunk_ids(setup) -> None:
    store, _, a, b, (ma, mb) = setup
    ra, rb = CountingReader(store.open_file(ma)), CountingReader(store.open_file(mb))
    fs_a, fs_b = GuestFS.open(ra), GuestFS.open(rb)
    changes = diff_trees(fs_a, fs_b)
    with loop_mount(a) as mnt_a, loop_mount(b) as mnt_b:
        assert {(c.kind, c.path) for c in changes} == diff_rq(mnt_a, mnt_b)
    assert {c.path for c in changes} == {"work.txt", "random.bin", "a/top.txt",
                                         "agent/transcript.jsonl"}
    # Unchanged same-size files (3 MiB random, 40 MiB sparse, islands, ...) were not read.
    same_size_bytes = sum(fs_a.stat(p).size for p in ("sparse.bin", "islands.bin"))
    assert ra.bytes_read + rb.bytes_read < same_size_bytes // 4


def test_damaged_chunk_fails_only_its_file(setup, tmp_path: Path) -> None:
    store, _, _, _, (ma, _) = setup
    fs = GuestFS.open(store.open_file(ma))
    vol = fs.volume
    inode = vol.inode(fs.resolve("random.bin"))
    ((_, _, phys),) = vol.runs(inode, 256, 257)  # 1 MiB into the file
    reader = store.open_file(ma)
    i = max(k for k, s in enumerate(reader.starts) if s <= phys * vol.bs)
    cid = reader.entries[i][0]
    loc = store.lookup(cid)
    path = os.path.join(store.packs_dir, f"{loc.pack:08d}.pack")
    with open(path, "r+b") as f:  # flip one byte of that chunk's stored record
        f.seek(loc.offset + loc.stored_len // 2 + 52)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    damaged = GuestFS.open(store.open_file(ma))
    with pytest.raises(IntegrityError):
        damaged.read("random.bin", 1 << 20, 4096)
    assert damaged.read("small.txt", 0, 100) == b"hello\n"
    assert damaged.read("random.bin", 0, 4096) == fs.read("random.bin", 0, 4096)


def test_threads_read_the_same_bytes(setup) -> None:
    """One GuestFS shared by threads (as the FUSE layer's worker threads share it)."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    store, _, _, _, (ma, _) = setup
    shared = GuestFS.open(store.open_file(ma))
    rnd = random.Random(3)
    names = [f"many/{n}" for n, _, _ in list(GuestFS.open(store.open_file(ma)).listdir("many"))[
        :300]] + ["random.bin", "islands.bin", "sparse.bin"] * 20
    jobs = [(name, rnd.randrange(0, 3 << 20), rnd.randrange(1, 200_000)) for name in names]
    single = GuestFS.open(store.open_file(ma))
    expected = [single.read(n, off, k) for n, off, k in jobs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda job: shared.read(*job), jobs))
    assert got == expected
