"""GuestFS: a read-only view of a guest's ext2/3/4 filesystem straight out of a disk image.

Paths and inode numbers are both accepted: the FUSE layer can use the guest's own inode numbers
(``lookup``/``stat``/``read`` by ino) and tools can use paths. Names are ``str`` decoded from the
guest's bytes as UTF-8 with surrogateescape, like ``os.listdir``, so any name round-trips.
Nothing here writes, extracts a whole file or reads an inode it was not asked about; anything it
cannot read exactly raises GuestFSUnreadable (or NoSuchFile for a name that is not there).
"""

from __future__ import annotations

import errno
import logging
import os
import stat as st
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ksfs.errors import BadInput, GuestFSUnreadable, IntegrityError, NoSuchFile, NotPermitted
from ksfs.guestfs import fscrypt, htree, layout
from ksfs.guestfs.image import NOT_READ, Partition, Reader, find_filesystems, read_exact
from ksfs.guestfs.journal import journal_overlay
from ksfs.guestfs.layout import Inode
from ksfs.guestfs.volume import LRU, Volume

log = logging.getLogger(__name__)

ROOT_INO = 2
FT_DIR = 2
XATTR_INDEX_ENCRYPTION = 9  # the fscrypt context ("c"), never listed


class GuestFileEncrypted(NotPermitted):
    """guest file {what} is encrypted (fscrypt) and ksfs has no key: its bytes cannot be read"""

    errno = errno.ENOKEY  # what the kernel's open(2) says of it without the key


@dataclass(frozen=True, slots=True)  # one per guest entry a mount was shown: kept small
class GuestStat:
    ino: int
    mode: int
    uid: int
    gid: int
    size: int
    mtime_ns: int
    atime_ns: int
    ctime_ns: int
    nlink: int
    blocks: int  # 512-byte units, as st_blocks
    rdev: int = 0

    @property
    def is_dir(self) -> bool:
        return st.S_ISDIR(self.mode)

    @property
    def is_file(self) -> bool:
        return st.S_ISREG(self.mode)

    @property
    def is_symlink(self) -> bool:
        return st.S_ISLNK(self.mode)


SCAN = object()  # _dx_lookup: no index to follow, scan the directory


def _encode(name: str | bytes) -> bytes:
    return name if isinstance(name, bytes) else name.encode("utf-8", "surrogateescape")


def _decode(name: bytes) -> str:
    return name.decode("utf-8", "surrogateescape")


SYMLINK_MAX = 4096  # PATH_MAX: the longest target a symlink can hold
NAMES_KEPT = 262_144  # names held by the lookup tables of one GuestFS (the newest table always)


class GuestFS:
    """A guest filesystem. Thread-safe: the reader is, and every cache takes its own lock."""

    def __init__(self, volume: Volume, where: str) -> None:
        self.volume = volume
        self.where = where
        # dir ino -> {name bytes: ino}, for lookups in directories without an index to follow;
        # bounded by names, not directories: one table of a 150,000-entry directory is ~20 MB
        self._names = LRU(NAMES_KEPT, weight=len)
        self._xattr_blocks = LRU(64)  # xattr block -> (its bytes, entries): often shared

    @classmethod
    def open(cls, reader: Reader, holding: str | bytes | None = None) -> GuestFS:
        """Find the filesystem in ``reader`` (whole disk, or the partition ``find_filesystems``
        puts first) and open it, replaying its journal in memory when the guest left committed
        transactions there.

        With ``holding`` (a path, such as the transcript's), the first partition in that order
        holding an ext filesystem in which the path exists. Otherwise (or in none of them), when
        several partitions of the first one's tier (same type and content class) hold ext, the
        first whose top directory holds ``etc`` (a root filesystem by its content), and failing
        that the first (the largest)."""
        parts = find_filesystems(reader)
        ext = [p for p in parts if p.content == "ext" and not p.why]
        opened: dict[Partition, GuestFS | None] = {}  # each partition opened (journal) once

        def attempt(part: Partition) -> GuestFS | None:
            if part not in opened:
                try:
                    opened[part] = cls._open_at(reader, part)
                except IntegrityError:  # GuestFSUnreadable, or a damaged chunk of the disk
                    opened[part] = None
            return opened[part]

        if holding is not None and ext and ext != parts[:1]:
            for p in ext:
                fs = attempt(p)
                if fs is not None and fs.holds(holding):
                    return fs
        if len(ext) > 1:
            same_tier = [p for p in ext if p.tier == parts[0].tier]
            if len(same_tier) > 1:
                for p in same_tier:
                    fs = attempt(p)
                    if fs is not None and fs.holds(b"etc", directory=True):
                        return fs
        first = opened.get(parts[0])  # opened already when it could be
        fs = first if first is not None else cls._open_at(reader, parts[0])  # (or its error)
        unread = [p for p in parts if p.content in NOT_READ]
        if unread and not fs.holds(b"etc", directory=True) and not (
                holding is not None and fs.holds(holding)):
            # An ext /boot beside a root on LVM, LUKS, RAID, XFS or btrfs: shown as the guest's
            # files it would be wrong, and `diff` would miss every change of the root (QA,
            # nineteenth session). A caller naming a path on it still gets it.
            raise GuestFSUnreadable(
                why=f"{unread[0].where} holds {NOT_READ[unread[0].content]}, and the ext "
                    f"filesystem beside it ({fs.where}) has no etc/: the guest's root is "
                    f"taken to be the one not read")
        return fs

    def holds(self, path: str | bytes, directory: bool = False) -> bool:
        """Whether ``path`` exists here (as a directory, with ``directory``)."""
        try:
            ino = self.resolve(path)
            return not directory or self.stat_ino(ino).is_dir
        except (IntegrityError, NoSuchFile, BadInput):
            return False

    @classmethod
    def _open_at(cls, reader: Reader, part: Partition) -> GuestFS:
        part.check()
        offset, length, where = part.offset, part.length, part.where
        raw = read_exact(reader, offset + 1024, 1024, "superblock")
        try:
            sb = layout.parse_superblock(raw, length)
        except GuestFSUnreadable as exc:
            raise GuestFSUnreadable(why=f"{where}: {exc.fields.get('why', exc)}") from None
        vol = Volume(reader, offset, length, sb)
        recover = sb.incompat & layout.INCOMPAT_RECOVER
        if recover and sb.compat & layout.COMPAT_HAS_JOURNAL and sb.journal_inum:
            # only then, as the kernel: without the flag it would wipe the log, not replay it
            overlay = journal_overlay(vol)
            if overlay:
                sb_block, within = divmod(1024, sb.block_size)
                raw = vol.read_blocks(sb_block, 1, "superblock")[within : within + 1024]
                vol.set_overlay(overlay, layout.parse_superblock(raw, length, checksum=False))
        elif recover:
            raise GuestFSUnreadable(why=f"{where}: needs recovery from an external journal")
        fs = cls(vol, where)
        if not st.S_ISDIR(vol.inode(ROOT_INO).mode):
            raise GuestFSUnreadable(why=f"{where}: inode 2 is not a directory")
        try:
            # The first entries of the root: a superblock whose features or counts were
            # damaged can still parse, and then every listing would fail with EIO instead of
            # the filesystem being refused once, with its reason.
            next(fs.listdir_ino(ROOT_INO), None)
        except (GuestFSUnreadable, NoSuchFile) as exc:
            raise GuestFSUnreadable(why=f"{where}: its root directory cannot be read "
                                        f"({exc.fields.get('why', exc)})") from None
        return fs

    @classmethod
    def open_or_reason(cls, reader: Reader, holding: str | bytes | None = None
                       ) -> tuple[GuestFS | None, str | None]:
        """(fs, None), or (None, why) when the disk holds nothing this can read exactly: what a
        checkpoint's ``fs/`` shows as an empty directory plus an ``fs.unreadable`` event."""
        try:
            return cls.open(reader, holding), None
        except IntegrityError as exc:  # GuestFSUnreadable, or a damaged chunk of the disk
            return None, str(exc)

    # --- inode-number based API (what a FUSE layer wants) -----------------------------------

    def stat_ino(self, ino: int) -> GuestStat:
        inode = self.volume.inode(ino)
        if inode.mode == 0 or inode.links == 0 and ino != ROOT_INO:
            raise NoSuchFile(what="guest inode", name=str(ino))
        rdev = 0
        if inode.kind in (layout.S_IFCHR, layout.S_IFBLK):
            old, new = int.from_bytes(inode.block[:4], "little"), int.from_bytes(
                inode.block[4:8], "little")
            if old:
                rdev = os.makedev((old >> 8) & 0xFF, old & 0xFF)
            else:
                rdev = os.makedev((new & 0xFFF00) >> 8, (new & 0xFF) | ((new >> 12) & 0xFFF00))
        blocks = inode.blocks_512
        size = inode.size
        if inode.flags & layout.FL_ENCRYPT and inode.kind == layout.S_IFLNK:
            # the kernel's fscrypt_symlink_getattr: the length of the target it shows
            size = len(self._nokey_target(inode))
        if inode.flags & layout.FL_INLINE_DATA and inode.kind == layout.S_IFREG:
            # as the kernel reports it, so tools do not take an inline file for a sparse one
            blocks += (inode.size + 511) >> 9
        return GuestStat(
            ino=ino, mode=inode.mode, uid=inode.uid, gid=inode.gid, size=size,
            mtime_ns=inode.mtime_ns, atime_ns=inode.atime_ns, ctime_ns=inode.ctime_ns,
            nlink=inode.links, blocks=blocks, rdev=rdev,
        )

    def lookup(self, dir_ino: int, name: str | bytes) -> int:
        """The inode number of ``name`` in directory ``dir_ino``; NoSuchFile when absent."""
        key = _encode(name)
        if key == b".":
            return dir_ino
        if key == b"..":
            # in the first block (the index's root block, which no hash leads to): read only
            # as far as it, not the whole directory into a name table
            for entry, ino, _, _ in self._iter_entries(dir_ino):
                if entry == b"..":
                    return ino
            raise NoSuchFile(what="guest file", name="..")
        if self._inode(dir_ino).flags & layout.FL_ENCRYPT:
            # a no-key name, as listed: the stored name it stands for (fscrypt.py)
            wanted = fscrypt.decode_nokey(key)
            if wanted is None:
                raise NoSuchFile(what="guest file", name=_decode(key))
            if wanted.name is None:  # the long form: by its prefix and digest, scanned
                for entry, ino, _, _ in self._iter_entries(dir_ino):
                    if entry not in (b".", b"..") and wanted.matches(entry):
                        return ino
                raise NoSuchFile(what="guest file", name=_decode(key))
            key = wanted.name
        found = self._dx_lookup(dir_ino, key)
        if found is not SCAN:
            if found is None:
                raise NoSuchFile(what="guest file", name=_decode(key))
            return found  # type: ignore[return-value]
        names = self._names.get(dir_ino)
        if names is None:
            names = {n: ino for n, ino, _, _ in self._iter_entries(dir_ino)}
            self._names.put(dir_ino, names)
        ino = names.get(key)
        if ino is None:
            raise NoSuchFile(what="guest file", name=_decode(key))
        return ino

    def _dx_lookup(self, dir_ino: int, key: bytes) -> int | None | object:
        """``key``'s inode number through the directory's htree index (ksfs.guestfs.htree),
        None when the index says it is absent, SCAN when there is no index to follow."""
        inode = self._inode(dir_ino)
        vol, sb = self.volume, self.volume.sb
        if not (sb.compat & layout.COMPAT_DIR_INDEX and inode.flags & layout.FL_INDEX) or \
                inode.kind != layout.S_IFDIR or \
                inode.flags & (layout.FL_INLINE_DATA | layout.FL_CASEFOLD):
            return SCAN
        n_blocks = (inode.size + vol.bs - 1) // vol.bs
        where = f"directory inode {dir_ino}"

        def read_block(lblk: int) -> bytes:
            runs = vol.runs(inode, lblk, lblk + 1) if lblk < n_blocks else []
            if not runs or runs[0][2] is None:
                raise htree.BadIndex(f"block {lblk} is a hole or past the end")
            return vol.read_dir_block(inode, lblk, runs[0][2], f"{where} block {lblk}")

        try:
            for lblk in htree.leaf_blocks(
                    read_block, vol.bs, key, sb.hash_unsigned, sb.hash_seed,
                    3 if sb.incompat & layout.INCOMPAT_LARGEDIR else 2,
                    sb.csum_seed is not None):
                for name, ino, _, _ in layout.iter_dirents(read_block(lblk), sb.has_filetype,
                                                           f"{where} block {lblk}", vol.bs):
                    if name == key:
                        return ino
            return None
        except htree.BadIndex as exc:
            log.info("%s: %s: index not followed (%s): scanned", self.where, where, exc)
            return SCAN

    def listdir_ino(self, dir_ino: int) -> Iterator[tuple[str, int, bool]]:
        """(name, ino, is_dir) of each entry but . and .., yielded block by block as read."""
        for name, ino, is_dir, _ in self.listdir_from(dir_ino):
            yield name, ino, is_dir

    def listdir_stats(self, dir_ino: int) -> Iterator[tuple[str, GuestStat]]:
        """(name, stat) of each entry whose inode can be read: an entry pointing at a cleared
        or unlinked inode (e2fsck's "deleted/unused inode"), or one past the inode table, is
        left out, as the kernel lists such a name but cannot stat it. One bad entry must not
        take its whole directory (or a diff of the tree) with it."""
        for name, stat, _ in self.listdir_stats_from(dir_ino):
            yield name, stat

    def listdir_stats_from(self, dir_ino: int, after: int = 0
                           ) -> Iterator[tuple[str, GuestStat, int]]:
        """``listdir_stats`` with each entry's cookie, past cookie ``after`` (listdir_from)."""
        for name, got, cookie in self.listdir_checked_from(dir_ino, after):
            if isinstance(got, GuestFSUnreadable):
                log.warning("%s: entry %r of directory inode %d left out: %s", self.where,
                            name, dir_ino, got)
                continue
            yield name, got, cookie

    def listdir_checked_from(self, dir_ino: int, after: int = 0
                             ) -> Iterator[tuple[str, GuestStat | GuestFSUnreadable, int]]:
        """(name, stat or why its inode cannot be read, cookie) of each entry past ``after``:
        an entry whose inode is damaged (it fails its checksum, say) comes with the error, so
        a comparison can say so; one pointing at a cleared or unlinked inode is left out, as
        no file is there."""
        for name, ino, _, cookie in self.listdir_from(dir_ino, after):
            try:
                got: GuestStat | GuestFSUnreadable = self.stat_ino(ino)
            except NoSuchFile as exc:
                log.warning("%s: entry %r of directory inode %d left out: %s", self.where,
                            name, dir_ino, exc)
                continue
            except GuestFSUnreadable as exc:
                got = exc
            yield name, got, cookie

    def listdir_from(self, dir_ino: int, after: int = 0) -> Iterator[tuple[str, int, bool, int]]:
        """(name, ino, is_dir, cookie) of each entry but . and .. past position ``after``.

        Cookies are positive and increase through the listing; ``listdir_from(d, cookie)``
        resumes right after the entry that had it, without rereading the blocks before it (a
        FUSE readdir's next offset).
        """
        filetype = self.volume.sb.has_filetype
        shown = self._nokey_names(dir_ino)
        for name, ino, ftype, cookie in self._iter_entries(dir_ino, after):
            if cookie <= after or name in (b".", b".."):
                continue
            if filetype:
                is_dir = ftype == FT_DIR
            else:
                is_dir = st.S_ISDIR(self.volume.inode(ino).mode)
            yield _decode(shown(name) if shown else name), ino, is_dir, cookie

    def _nokey_names(self, dir_ino: int) -> Callable[[bytes], bytes] | None:
        """For an encrypted directory, what turns a stored name into the no-key name the kernel
        lists without the key (None for any other directory). Its hashes are the ones the
        kernel's readdir passes: an indexed directory, and with ``dir_index`` one of a single
        block or inline (``is_dx_dir``), is read in hash order and hashes each stored name
        with the index's hash version (the superblock's default without an index); any other
        is read in block order, with zeros."""
        inode = self._inode(dir_ino)
        if not inode.flags & layout.FL_ENCRYPT:
            return None
        where = f"encrypted directory inode {dir_ino}"
        if inode.flags & layout.FL_CASEFOLD:
            # its names' hashes are SipHash of the plaintext, kept in each entry: not read
            raise GuestFSUnreadable(why=f"{where} is also casefolded (not read)")
        if not self._xattr_find(dir_ino, XATTR_INDEX_ENCRYPTION, b"c"):
            raise GuestFSUnreadable(why=f"{where} has no encryption context")
        vol, sb = self.volume, self.volume.sb
        version: int | None = None
        if sb.compat & layout.COMPAT_DIR_INDEX:
            if inode.flags & layout.FL_INDEX:
                version = self._root_hash_version(inode)
            elif inode.flags & layout.FL_INLINE_DATA or inode.size // vol.bs == 1:
                version = sb.def_hash_version
            if version is not None and version <= htree.TEA and sb.hash_unsigned:
                version += htree.UNSIGNED

        def shown(name: bytes) -> bytes:
            if len(name) < fscrypt.MIN_NAME:
                raise GuestFSUnreadable(why=f"{where} holds a name of {len(name)} bytes, "
                                            f"shorter than any encrypted name")
            pair = None if version is None else htree.dirhash_pair(name, version,
                                                                   sb.hash_seed)
            return fscrypt.nokey_name(name, *(pair or (0, 0)))

        return shown

    def _root_hash_version(self, inode: Inode) -> int | None:
        """The hash version of an indexed directory's root, or None when the kernel would not
        follow its index (then it reads the directory in block order)."""
        runs = self.volume.runs(inode, 0, 1) if inode.size else []
        if not runs or runs[0][2] is None:
            return None
        root = self.volume.read_dir_block(inode, 0, runs[0][2],
                                          f"directory inode {inode.ino} block 0")
        levels = 3 if self.volume.sb.incompat & layout.INCOMPAT_LARGEDIR else 2
        version = htree.root_hash_version(root, levels)
        return version if version in (htree.LEGACY, htree.HALF_MD4, htree.TEA) else None

    def read_ino(self, ino: int, offset: int, n: int) -> bytes:
        """Up to ``n`` bytes of a regular file at ``offset`` (fewer only at its end)."""
        if offset < 0 or n < 0:
            raise BadInput(f"cannot read {n} bytes at offset {offset}")
        inode = self._inode(ino)
        if inode.kind != layout.S_IFREG:
            raise BadInput(f"guest inode {ino} is not a regular file")
        if inode.flags & layout.FL_ENCRYPT:
            raise GuestFileEncrypted(what=f"inode {ino}")
        return self.volume.read_data(inode, offset, n)

    def require_readable(self, ino: int) -> None:
        """Raise what reading ``ino``'s bytes would, before any read (an open): an encrypted
        file is GuestFileEncrypted (ENOKEY), as the kernel's open says without the key."""
        inode = self._inode(ino)
        if inode.kind == layout.S_IFREG and inode.flags & layout.FL_ENCRYPT:
            raise GuestFileEncrypted(what=f"inode {ino}")

    def readlink_ino(self, ino: int) -> str:
        return _decode(self.readlink_bytes(ino))

    def readlink_bytes(self, ino: int) -> bytes:
        inode = self._inode(ino)
        if inode.kind != layout.S_IFLNK:
            raise BadInput(f"guest inode {ino} is not a symbolic link")
        if inode.flags & layout.FL_ENCRYPT:
            return self._nokey_target(inode)
        if inode.size > SYMLINK_MAX:
            # The kernel reads a target from one page at most; a larger size is damage, and
            # reading it whole could take the daemon's memory.
            raise GuestFSUnreadable(why=f"symlink inode {ino} claims {inode.size} bytes")
        if inode.flags & layout.FL_INLINE_DATA or inode.flags & layout.FL_EXTENTS:
            return self.volume.read_data(inode, 0, inode.size)
        sb = self.volume.sb
        ea_blocks = sb.cluster_size // 512 if inode.file_acl else 0
        if inode.blocks_512 - ea_blocks == 0:  # a fast symlink: the target sits in i_block
            if inode.size >= 60:
                raise GuestFSUnreadable(why=f"fast symlink inode {ino} claims {inode.size} bytes")
            return inode.block[: inode.size]
        return self.volume.read_data(inode, 0, inode.size)

    def _nokey_target(self, inode: Inode) -> bytes:
        """An encrypted symlink's target as the kernel shows it without the key: from i_block
        for a fast symlink, else from its first block (``ext4_encrypted_get_link``)."""
        sb = self.volume.sb
        ea_blocks = sb.cluster_size // 512 if inode.file_acl else 0
        if inode.flags & layout.FL_INLINE_DATA:
            data = self.volume.read_data(inode, 0, inode.size)
        elif inode.blocks_512 - ea_blocks == 0:
            data = inode.block
        else:
            runs = self.volume.runs(inode, 0, 1)
            if not runs or runs[0][2] is None:
                raise GuestFSUnreadable(why=f"encrypted symlink inode {inode.ino} has no block")
            data = self.volume.read_blocks(runs[0][2], 1, f"symlink inode {inode.ino}")
        target = fscrypt.nokey_symlink_target(data)
        if target is None:
            raise GuestFSUnreadable(why=f"encrypted symlink inode {inode.ino} is damaged")
        return target

    def listxattr_ino(self, ino: int) -> list[bytes]:
        """The names of the extended attributes of ``ino`` the kernel's ext4 lists, in its
        order (those inside the inode, then those of its xattr block): ``user.*``,
        ``trusted.*``, ``security.*``, ``system.posix_acl_access`` and ``_default``. Inline
        data's ``system.data`` and other systems' namespaces (lustre, richacl, hurd) are not
        listed, as the kernel does not list them."""
        return [name for name, _, _, _ in self._xattr_entries(ino)]

    def getxattr_ino(self, ino: int, name: str | bytes) -> bytes | None:
        """The value of extended attribute ``name`` of ``ino`` (None when it has none): the
        stored bytes, except a POSIX ACL, given in the form the kernel's getxattr gives it
        (ext4 keeps ACLs in a shorter form of its own)."""
        key = _encode(name)
        for full, area, value_start, entry in self._xattr_entries(ino):
            if full == key:
                return self._xattr_as_got(ino, area, value_start, entry)
        return None

    def xattrs_ino(self, ino: int) -> dict[bytes, bytes]:
        """Every attribute ``listxattr_ino`` lists with its value as ``getxattr_ino`` gives it,
        from one pass over the entries (what comparing two inodes wants)."""
        return {full: self._xattr_as_got(ino, area, value_start, entry)
                for full, area, value_start, entry in self._xattr_entries(ino)}

    def _xattr_as_got(self, ino: int, area: bytes, value_start: int,
                      entry: layout.XattrEntry) -> bytes:
        value = self._xattr_value(ino, area, value_start, entry)
        if entry.index in (layout.XATTR_INDEX_POSIX_ACL_ACCESS,
                           layout.XATTR_INDEX_POSIX_ACL_DEFAULT):
            return layout.acl_to_xattr(value, f"inode {ino}")
        return value

    def _xattr_find(self, ino: int, index: int, name: bytes) -> bytes | None:
        """The raw value of one attribute, listed or not (the fscrypt context), or None."""
        for area, value_start, e in self._xattr_all(ino):
            if e.index == index and e.name == name:
                return self._xattr_value(ino, area, value_start, e)
        return None

    def _xattr_entries(self, ino: int) -> list[tuple[bytes, bytes, int, layout.XattrEntry]]:
        """(full name, area, where its values count from, entry) of each listed attribute."""
        out = []
        for area, value_start, e in self._xattr_all(ino):
            prefix = layout.XATTR_PREFIXES.get(e.index)
            if prefix is not None:
                out.append((prefix + e.name, area, value_start, e))
        return out

    def _xattr_all(self, ino: int) -> list[tuple[bytes, int, layout.XattrEntry]]:
        """(area, where its values count from, entry) of every attribute: the inode's, then
        its block's."""
        inode = self._inode(ino)
        found: list[tuple[bytes, int, layout.XattrEntry]] = []
        area, entries = layout.in_inode_xattr_entries(inode)
        found.extend((area, 4, e) for e in entries)
        if inode.file_acl:
            block = inode.file_acl
            got = self._xattr_blocks.get(block)
            if got is None:
                raw = self.volume.read_blocks(block, 1, f"extended attribute block of inode {ino}")
                got = (raw, layout.parse_xattr_block(raw, block, self.volume.sb.csum_seed,
                                                     f"inode {ino}"))
                self._xattr_blocks.put(block, got)
            found.extend((got[0], 0, e) for e in got[1])
        return found

    def _xattr_value(self, ino: int, area: bytes, value_start: int,
                     e: layout.XattrEntry) -> bytes:
        if not e.value_inum:
            start = value_start + e.value_offs
            return area[start : start + e.value_size]
        # ea_inode: a large value is the data of an inode of its own, which must say so and
        # hold exactly the value (as the kernel's ext4_xattr_inode_get checks)
        vol = self.volume
        if not vol.sb.incompat & layout.INCOMPAT_EA_INODE:
            raise GuestFSUnreadable(why=f"an extended attribute of inode {ino} names an inode "
                                        f"without the ea_inode feature")
        ea = self._inode(e.value_inum)
        if not ea.flags & layout.FL_EA_INODE or ea.kind != layout.S_IFREG or \
                ea.size != e.value_size:
            raise GuestFSUnreadable(why=f"the extended attribute inode {e.value_inum} of inode "
                                        f"{ino} is damaged")
        return vol.read_data(ea, 0, e.value_size)

    # --- path based API ----------------------------------------------------------------------

    def resolve(self, path: str | bytes) -> int:
        """The inode of ``path`` (absolute or relative to the root); symlinks are not followed."""
        ino = ROOT_INO
        parts = [p for p in _encode(path).split(b"/") if p and p != b"."]
        for i, part in enumerate(parts):
            if part == b"..":
                ino = self.lookup(ino, b"..")
                continue
            if i and not st.S_ISDIR(self.volume.inode(ino).mode):
                raise NoSuchFile(what="guest directory", name=_decode(b"/".join(parts[:i])))
            ino = self.lookup(ino, part)
        return ino

    def _ino(self, where: int | str | bytes) -> int:
        return where if isinstance(where, int) else self.resolve(where)

    def stat(self, path: int | str | bytes) -> GuestStat:
        return self.stat_ino(self._ino(path))

    def listdir(self, path: int | str | bytes = "/") -> Iterator[tuple[str, int, bool]]:
        return self.listdir_ino(self._ino(path))

    def read(self, path: int | str | bytes, offset: int, n: int) -> bytes:
        return self.read_ino(self._ino(path), offset, n)

    def readlink(self, path: int | str | bytes) -> str:
        return self.readlink_ino(self._ino(path))

    def listxattr(self, path: int | str | bytes) -> list[bytes]:
        return self.listxattr_ino(self._ino(path))

    def getxattr(self, path: int | str | bytes, name: str | bytes) -> bytes | None:
        return self.getxattr_ino(self._ino(path), name)

    # --- internals ---------------------------------------------------------------------------

    def _inode(self, ino: int) -> Inode:
        inode = self.volume.inode(ino)
        if inode.flags & layout.FL_COMPR:
            raise GuestFSUnreadable(why=f"guest inode {ino} is compressed")
        return inode

    def _iter_entries(self, dir_ino: int,
                      after: int = 0) -> Iterator[tuple[bytes, int, int, int]]:
        """(name, ino, file type, cookie) of every live entry, from the block holding ``after``."""
        inode = self._inode(dir_ino)
        if inode.kind != layout.S_IFDIR:
            raise NoSuchFile(what="guest directory", name=str(dir_ino))
        vol = self.volume
        filetype = vol.sb.has_filetype
        where = f"directory inode {dir_ino}"
        if inode.flags & layout.FL_INLINE_DATA:
            # cookies are offsets into i_block, then 60 + offsets into the system.data value
            parent = int.from_bytes(inode.block[:4], "little")
            yield b"..", parent, FT_DIR, 4
            for name, ino, ftype, end in layout.iter_dirents(inode.block[4:], filetype, where,
                                                             vol.bs):
                yield name, ino, ftype, 4 + end
            more = layout.in_inode_xattr(inode, layout.XATTR_INDEX_SYSTEM, b"data")
            for name, ino, ftype, end in layout.iter_dirents(more or b"", filetype, where,
                                                             vol.bs):
                yield name, ino, ftype, 60 + end
            return
        n_blocks = (inode.size + vol.bs - 1) // vol.bs
        if inode.flags & layout.FL_EXTENTS:
            # One mapping of the whole size: its runs are the (cached) extents, so a hole of
            # any size (a damaged i_size of 2^40) is one run, skipped, as the kernel skips it.
            step = max(1, n_blocks)
        else:
            # Block-mapped directories are never sparse (ext2/3 grow them block by block): a
            # size past the blocks the inode holds is damage, not holes to walk one by one.
            held = inode.blocks_512 * 512 // vol.bs
            if held < n_blocks:
                log.warning("%s: directory inode %d claims %d blocks and holds %d: read as %d",
                            self.where, dir_ino, n_blocks, held, held)
                n_blocks = held
            step = 16  # map a few blocks at a time so a huge directory is never mapped whole
        for first in range(after // vol.bs, n_blocks, step):
            for lblk, count, phys in vol.runs(inode, first, min(n_blocks, first + step)):
                if phys is None:
                    continue  # a hole in a directory holds no entries
                for k in range(count):
                    block_where = f"{where} block {lblk + k}"
                    raw = vol.read_dir_block(inode, lblk + k, phys + k, block_where)
                    base = (lblk + k) * vol.bs
                    for name, ino, ftype, end in layout.iter_dirents(
                            raw, filetype, block_where, vol.bs):
                        yield name, ino, ftype, base + end
