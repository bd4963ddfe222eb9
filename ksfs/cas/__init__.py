"""The content-addressed chunk store (layer 2): chunking, packs, index, manifests, reads, GC.

Pure synchronous Python over files and LMDB; never imports trio, pyfuse3, libvirt or click.
The ingest's modules load when first asked for (``store.ingest()`` or ``ksfs.cas.Ingest``): a
command that only reads, ``ksfs cat`` say, starts without them.
"""

from typing import Any

from ksfs.cas.reader import FileReader, changed_share
from ksfs.cas.store import ChunkStore

__all__ = ["ChunkStore", "FileReader", "Ingest", "IngestedFile", "changed_share"]


def __getattr__(name: str) -> Any:
    if name in ("Ingest", "IngestedFile"):
        from ksfs.cas import ingest

        return getattr(ingest, name)
    raise AttributeError(f"module 'ksfs.cas' has no attribute {name!r}")
