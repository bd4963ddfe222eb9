"""The content-addressed chunk store (layer 2): chunking, packs, index, manifests, reads, GC.

Pure synchronous Python over files and LMDB; never imports trio, pyfuse3, libvirt or click.
"""

from ksfs.cas.ingest import Ingest, IngestedFile
from ksfs.cas.reader import FileReader, changed_share
from ksfs.cas.store import ChunkStore

__all__ = ["ChunkStore", "FileReader", "Ingest", "IngestedFile", "changed_share"]
