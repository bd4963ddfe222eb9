"""Build ext4 disk images from a directory with e2fsprogs and util-linux, for tests and demos.

``build_ext4`` runs ``mkfs.ext4 -d``; ``build_partitioned`` lays such a filesystem into an MBR or
GPT disk made by ``sfdisk``. These shell out to host tools and write only the files they are
given; nothing in the reading path imports this module.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence

from ksfs.errors import KsfsError

SECTOR = 512
SWAP_GPT = "0657FD6D-A4AB-43C4-84E5-0933C84B4F4F"
LINUX_GPT = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"


def _run(*argv: str, stdin: str | None = None) -> str:
    proc = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        raise KsfsError(f"{argv[0]} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def have_tools(*names: str) -> bool:
    return all(shutil.which(n) for n in names)


def build_ext4(src: str | os.PathLike[str], out: str | os.PathLike[str], mib: int,
               options: Sequence[str] = (), index_dirs: bool = True) -> None:
    """An ext4 image of ``mib`` MiB at ``out`` holding a copy of the tree ``src``.

    ``options`` go to mkfs.ext4 as given (e.g. ``["-O", "inline_data"]``, ``["-b", "1024"]``,
    ``["-t", "ext3"]``). mkfs copies owners, modes and mtimes (seconds) from ``src``. mkfs -d
    writes every directory as a plain list; ``index_dirs`` then has ``e2fsck -D`` give the big
    ones an htree index, as the kernel would have.
    """
    with open(out, "wb") as f:
        f.truncate(mib << 20)
    _run("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0",
         *options, "-d", os.fspath(src), os.fspath(out))
    if index_dirs:
        proc = subprocess.run(["e2fsck", "-fyD", os.fspath(out)], capture_output=True,
                              text=True)
        if proc.returncode not in (0, 1):  # 1: "errors corrected", here the new indexes
            raise KsfsError(f"e2fsck -D failed: {proc.stdout.strip()}")


def build_partitioned(fs_image: str | os.PathLike[str], out: str | os.PathLike[str],
                      table: str = "gpt", logical: bool = False) -> int:
    """A disk at ``out`` whose first partition is a 1 MiB swap-typed one and whose next holds
    the bytes of ``fs_image``; returns that partition's byte offset. ``logical`` (MBR only)
    puts the filesystem in a logical partition inside an extended one."""
    fs_bytes = os.path.getsize(fs_image)
    fs_sectors = (fs_bytes + SECTOR - 1) // SECTOR
    first = 2048  # 1 MiB aligned
    swap_sectors = 2048
    if table == "gpt":
        script = (f"label: gpt\nstart={first}, size={swap_sectors}, type={SWAP_GPT}\n"
                  f"start={first + swap_sectors}, size={fs_sectors}, type={LINUX_GPT}\n")
        fs_start = first + swap_sectors
        total = fs_start + fs_sectors + 2048  # room for the backup GPT
    elif logical:
        ext_start = first + swap_sectors
        fs_start = ext_start + 2048
        script = (f"label: dos\nstart={first}, size={swap_sectors}, type=82\n"
                  f"start={ext_start}, size={fs_sectors + 2048}, type=5\n"
                  f"start={fs_start}, size={fs_sectors}, type=83\n")
        total = ext_start + fs_sectors + 2048 + 2048
    else:
        fs_start = first + swap_sectors
        script = (f"label: dos\nstart={first}, size={swap_sectors}, type=82\n"
                  f"start={fs_start}, size={fs_sectors}, type=83\n")
        total = fs_start + fs_sectors + 2048
    with open(out, "wb") as f:
        f.truncate(total * SECTOR)
    _run("sfdisk", "-q", "--no-reread", "--no-tell-kernel", os.fspath(out), stdin=script)
    _run("dd", f"if={os.fspath(fs_image)}", f"of={os.fspath(out)}", "bs=1M",
         f"seek={fs_start * SECTOR}", "oflag=seek_bytes", "conv=notrunc,sparse", "status=none")
    return fs_start * SECTOR


def build_disk(out: str | os.PathLike[str],
               parts: Sequence[tuple[str, str | os.PathLike[str] | int]],
               table: str = "gpt") -> list[int]:
    """A disk at ``out`` with one partition per ``(type, content)``, in order: ``type`` is a
    GPT type GUID or an MBR type in hex (``table="dos"``, primary partitions only), ``content``
    a filesystem image whose bytes fill the partition or a size in MiB for an empty one.
    Returns each partition's byte offset."""
    starts, sizes = [], []
    lba = 2048
    for _, content in parts:
        nbytes = (content << 20) if isinstance(content, int) else os.path.getsize(content)
        sectors = (nbytes + SECTOR - 1) // SECTOR
        starts.append(lba)
        sizes.append(sectors)
        lba += (sectors + 2047) // 2048 * 2048  # 1 MiB aligned
    script = f"label: {table}\n" + "".join(
        f"start={s}, size={n}, type={kind}\n"
        for s, n, (kind, _) in zip(starts, sizes, parts, strict=True))
    with open(out, "wb") as f:
        f.truncate((lba + 2048) * SECTOR)  # room for the backup GPT
    _run("sfdisk", "-q", "--no-reread", "--no-tell-kernel", os.fspath(out), stdin=script)
    for start, (_, content) in zip(starts, parts, strict=True):
        if not isinstance(content, int):
            _run("dd", f"if={os.fspath(content)}", f"of={os.fspath(out)}", "bs=1M",
                 f"seek={start * SECTOR}", "oflag=seek_bytes", "conv=notrunc,sparse",
                 "status=none")
    return [s * SECTOR for s in starts]
