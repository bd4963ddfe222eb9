"""Reading frozen layer chains with ChainSource, against qemu-img convert (no libvirt needed)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from ksfs.errors import VMError
from ksfs.vm.chain import ChainSource, create_overlay, materialize

pytestmark = pytest.mark.skipif(shutil.which("qemu-io") is None, reason="qemu-utils missing")
MiB = 1 << 20


def qemu_io(image: Path, fmt: str, *cmds: str) -> None:
    args = ["qemu-io", "-f", fmt]
    for c in cmds:
        args += ["-c", c]
    subprocess.run([*args, str(image)], check=True, capture_output=True)


def converted(top: Path) -> bytes:
    out = top.with_name(top.name + ".ref")
    subprocess.run(["qemu-img", "convert", "-U", "-O", "raw", str(top), str(out)], check=True)
    data = out.read_bytes()
    out.unlink()
    return data


@pytest.fixture
def chain(tmp_path: Path) -> tuple[Path, Path, Path]:
    """raw base (8 MiB, some data) <- ov1 (writes, a zeroed range) <- ov2 (writes)."""
    base = tmp_path / "base.raw"
    rnd = random.Random(7)
    with open(base, "wb") as f:
        f.truncate(8 * MiB)
        for off in (0, 3 * MiB + 4096, 7 * MiB):
            f.seek(off)
            f.write(rnd.randbytes(200_000))
    ov1 = tmp_path / "ov1.qcow2"
    create_overlay(ov1, base, "raw", "test")
    qemu_io(ov1, "qcow2", "write -P 0x11 1M 70k", "write -z 3M 128k", "write -P 0x22 8000k 4k")
    ov2 = tmp_path / "ov2.qcow2"
    create_overlay(ov2, ov1, "qcow2", "test")
    qemu_io(ov2, "qcow2", "write -P 0x33 64k 64k", "write -P 0x44 5M 1k")
    return base, ov1, ov2


def test_whole_chain_reads_equal_qemu_img_convert(chain: tuple[Path, Path, Path]) -> None:
    base, ov1, ov2 = chain
    for top in (base, ov1, ov2):
        src = ChainSource(top)
        try:
            assert src.size == 8 * MiB
            assert src.pread(0, src.size) == converted(top)
        finally:
            src.close()


def test_random_reads_match(chain: tuple[Path, Path, Path]) -> None:
    ref = converted(chain[2])
    src = ChainSource(chain[2])
    rnd = random.Random(3)
    try:
        for _ in range(300):
            off = rnd.randrange(0, src.size)
            n = rnd.randrange(0, 300_000)
            assert src.pread(off, n) == ref[off:off + n]
        assert src.pread(src.size - 10, 100) == ref[-10:]  # reads stop at the end
    finally:
        src.close()


def test_zeroed_clusters_read_as_zeros(chain: tuple[Path, Path, Path]) -> None:
    src = ChainSource(chain[1])
    try:
        assert src.pread(3 * MiB, 128 * 1024) == bytes(128 * 1024)
    finally:
        src.close()


def test_changed_ranges_are_the_top_layers_and_cover_their_writes(
        chain: tuple[Path, Path, Path]) -> None:
    base, ov1, ov2 = chain
    src = ChainSource(ov2)
    try:
        assert [str(f) for f in src.files] == [str(ov2), str(ov1), str(base)]
        top_only = src.changed_since(1)
        both = src.changed_since(2)
    finally:
        src.close()

    def covered(ranges: list[tuple[int, int]], off: int, n: int) -> bool:
        return any(a <= off and off + n <= a + ln for a, ln in ranges)

    assert covered(top_only, 64 * 1024, 64 * 1024) and covered(top_only, 5 * MiB, 1024)
    assert not covered(top_only, 1 * MiB, 70 * 1024)
    for off, n in ((1 * MiB, 70 * 1024), (3 * MiB, 128 * 1024), (8000 * 1024, 4096),
                   (64 * 1024, 64 * 1024), (5 * MiB, 1024)):
        assert covered(both, off, n)
    # only whole 64 KiB clusters, and no more than the clusters written
    assert sum(n for _, n in top_only) == 2 * 64 * 1024
    assert all(off % 65536 == 0 and n % 65536 == 0 for off, n in both)
    assert sum(n for _, n in both) <= 9 * 64 * 1024


def test_bytes_read_counts_only_data(chain: tuple[Path, Path, Path]) -> None:
    src = ChainSource(chain[2])
    try:
        for off, n in src.changed_since(1):
            src.pread(off, n)
        assert src.bytes_read <= 2 * 64 * 1024
    finally:
        src.close()


def test_compressed_clusters_are_refused(tmp_path: Path) -> None:
    raw = tmp_path / "r.raw"
    raw.write_bytes(b"abc" * 100_000)
    comp = tmp_path / "c.qcow2"
    subprocess.run(["qemu-img", "convert", "-c", "-O", "qcow2", str(raw), str(comp)], check=True)
    with pytest.raises(VMError, match="compressed"):
        ChainSource(comp)


class _Bytes:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.size = len(data)

    def read(self, offset: int, n: int) -> bytes:
        return self.data[offset:offset + n]


def test_materialize_is_sparse_and_exact(tmp_path: Path) -> None:
    data = bytearray(6 * MiB + 123)
    data[2 * MiB + 5:2 * MiB + 9] = b"ksfs"
    data[-3:] = b"end"
    out = tmp_path / "m.raw"
    written = materialize(_Bytes(bytes(data)), out, "test")
    assert out.read_bytes() == bytes(data)
    assert written == MiB + 123  # the two non-zero blocks only
    assert os.stat(out).st_blocks * 512 < 3 * MiB
    assert not list(tmp_path.glob("*.part"))


def test_guest_data_files_are_the_owners_alone(tmp_path: Path) -> None:
    """Materialized disks and memory images and the overlays ksfs makes hold a guest's bytes:
    no group or other bits, whatever the umask, and a killed run's world-readable leftover
    does not lend its mode to the new file."""
    old = os.umask(0o022)
    try:
        out = tmp_path / "m.raw"
        (tmp_path / "m.raw.part").write_bytes(b"left by a killed run")
        os.chmod(tmp_path / "m.raw.part", 0o644)
        materialize(_Bytes(b"guest bytes" * 100), out, "test")
        ov = tmp_path / "ov.qcow2"
        create_overlay(ov, out, "raw", "test")
    finally:
        os.umask(old)
    assert out.read_bytes() == b"guest bytes" * 100
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in tmp_path.iterdir()} == {
        "m.raw": "0o600", "ov.qcow2": "0o600"}


def test_materialize_short_read_fails_and_leaves_nothing(tmp_path: Path) -> None:
    class Short(_Bytes):
        def read(self, offset: int, n: int) -> bytes:
            return super().read(offset, n)[:-1]

    out = tmp_path / "m.raw"
    with pytest.raises(VMError, match="short read"):
        materialize(Short(b"x" * 1000), out, "test")
    assert list(tmp_path.iterdir()) == []
