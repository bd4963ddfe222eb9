"""Read-only access to a guest's ext2/3/4 filesystem straight out of a disk image (a store file
or any reader with ``.size`` and ``.read(offset, n)``), its transcript, and diffs between two
such filesystems. Layer 2b: imports only ksfs.errors, ksfs.model and ksfs.cas; never trio,
pyfuse3, libvirt or click; never writes to the image.
"""

from ksfs.guestfs.diff import Change, diff_trees
from ksfs.guestfs.fs import ROOT_INO, GuestFileEncrypted, GuestFS, GuestStat
from ksfs.guestfs.image import FileImageReader, Partition, find_filesystem, find_filesystems
from ksfs.guestfs.transcript import DEFAULT_TRANSCRIPT, read_transcript
from ksfs.model import TranscriptInfo

__all__ = [
    "DEFAULT_TRANSCRIPT",
    "ROOT_INO",
    "Change",
    "FileImageReader",
    "GuestFS",
    "GuestFileEncrypted",
    "GuestStat",
    "Partition",
    "TranscriptInfo",
    "diff_trees",
    "find_filesystem",
    "find_filesystems",
    "read_transcript",
]
