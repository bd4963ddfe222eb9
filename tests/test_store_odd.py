"""Odd sources given to the store: files that change under an import, and paths that are no
regular file, through the chunk store's own API (the command line checks its arguments first,
but the store must not rely on that)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ksfs.cas import ChunkStore
from ksfs.errors import BadInput

TRUNCATED_WHILE_MAPPED = """
import subprocess, sys, time
from ksfs.cas.chunking import BATCH_BYTES, FileSource, iter_fixed
from ksfs.errors import BadInput

path = sys.argv[1]
src = FileSource(path, mappable=True)
batches = iter_fixed(src)
next(batches)  # the first batch, read through the mapping
# another process cuts it (a blocking open for writing, as most writers open: truncate(1)
# opens with O_NONBLOCK and gets EAGAIN while the import holds its lease)
cut = subprocess.Popen([sys.executable, "-c", "import os, sys; "
                        "os.ftruncate(os.open(sys.argv[1], os.O_WRONLY), 65536)", path])
time.sleep(0.3)
try:
    for _ in batches:
        pass
except BadInput as exc:  # the reads after it saw the file end early
    assert "ended at byte" in str(exc), exc
cut.wait(timeout=60)
print("CHANGE", src.change(), flush=True)
src.close()
"""


def test_a_mapped_disk_image_cut_short_meanwhile_is_an_error_not_sigbus(tmp_path: Path) -> None:
    """QA review: `ksfs import disk.raw` while another process truncated the image died of
    SIGBUS (exit 135, no message): the import reads disk images through a mapping."""
    path = tmp_path / "disk.raw"
    path.write_bytes(b"\x01" * (24 << 20))
    res = subprocess.run([sys.executable, "-c", TRUNCATED_WHILE_MAPPED, str(path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, (res.returncode, res.stderr)
    # the truncation waited for the mapping to go; what was read is then refused as changed
    assert res.stdout == f"CHANGE {24 << 20} bytes when its import began, 65536 now\n"


@pytest.mark.parametrize("path", ["/dev/zero", "DIR", "FIFO"])
def test_a_path_that_is_no_regular_file_is_refused(tmp_path: Path, path: str) -> None:
    """/dev/zero (size 0) was stored as an empty file without a word, a directory failed on its
    read, and a FIFO hung the ingest in open()."""
    where = {"DIR": tmp_path, "FIFO": tmp_path / "fifo"}.get(path, Path(path))
    if path == "FIFO":
        os.mkfifo(where)
    with ChunkStore.open(tmp_path / "s", create=True) as s:
        before = s.stats()
        with s.ingest() as ing, pytest.raises(BadInput, match="not a regular file"):
            ing.add_file(str(where), chunking="cdc")
        assert s.stats() == before
