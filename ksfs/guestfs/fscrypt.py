"""Encrypted (fscrypt) directories as the kernel shows them without the key.

ksfs never has a guest's keys. The kernel, listing an encrypted directory without its key,
shows each entry under a "no-key name" (``fs/crypto/fname.c``, ``fscrypt_fname_disk_to_usr``):
the base64url encoding, without padding, of a ``struct fscrypt_nokey_name``: the entry's
directory hash and minor hash (two little-endian u32, zeros when the directory gave none), then
the ciphertext name, or for a ciphertext over 149 bytes its first 149 bytes and the SHA-256 of
the rest (189 bytes, 252 characters). Looking such a name up decodes it back
(``fscrypt_setup_filename``, ``fscrypt_match_name``): a short form names its ciphertext
exactly, whatever hash it carries; a long form matches an entry by the 149 bytes and the digest.
An encrypted symlink's target is shown the same way, with zero hashes. Contents cannot be
read (the kernel's open says ENOKEY). Pure functions, no I/O; never decrypts anything.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from typing import NamedTuple

MIN_NAME = 16  # FSCRYPT_FNAME_MIN_MSG_LEN: a shorter stored name is damage (EUCLEAN)
HASHES = 8  # dirhash[2]
PREFIX = 149  # bytes[149]
LONG = HASHES + PREFIX + 32  # FSCRYPT_NOKEY_NAME_MAX: with the SHA-256 of the rest
LONG_ENCODED = -(-LONG * 4 // 3)  # 252 characters
SYMLINK_HEADER = 2  # struct fscrypt_symlink_data: __le16 len, then the ciphertext


class NoKeyLookup(NamedTuple):
    """A no-key name decoded for a lookup: ``name`` is the whole ciphertext of a short form;
    a long form has ``prefix`` and ``digest`` instead."""

    name: bytes | None
    prefix: bytes
    digest: bytes | None

    def matches(self, stored: bytes) -> bool:
        if self.name is not None:
            return stored == self.name
        return (len(stored) > PREFIX and stored[:PREFIX] == self.prefix
                and hashlib.sha256(stored[PREFIX:]).digest() == self.digest)


def _encode(raw: bytes) -> bytes:
    return base64.urlsafe_b64encode(raw).rstrip(b"=")


def nokey_name(stored: bytes, hash_: int = 0, minor_hash: int = 0) -> bytes:
    """The no-key name of the stored (encrypted) name of an entry that is not . or ..; the
    caller has checked it is at least MIN_NAME bytes."""
    head = struct.pack("<II", hash_, minor_hash)
    if len(stored) <= PREFIX:
        return _encode(head + stored)
    return _encode(head + stored[:PREFIX] + hashlib.sha256(stored[PREFIX:]).digest())


def decode_nokey(name: bytes) -> NoKeyLookup | None:
    """What a looked-up no-key name stands for, or None when it is none (the kernel: ENOENT)."""
    if len(name) > LONG_ENCODED or len(name) % 4 == 1:
        return None
    try:
        raw = base64.b64decode(name + b"=" * (-len(name) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        return None
    if _encode(raw) != name:  # not canonical (stray bits in the last character)
        return None
    if len(raw) < HASHES + 1 or (HASHES + PREFIX < len(raw) != LONG):
        return None
    if len(raw) == LONG:
        return NoKeyLookup(None, raw[HASHES : HASHES + PREFIX], raw[HASHES + PREFIX :])
    return NoKeyLookup(raw[HASHES:], b"", None)


def nokey_symlink_target(data: bytes) -> bytes | None:
    """The no-key form of an encrypted symlink's stored data (``fscrypt_get_symlink``: ``data``
    is the 60 bytes of i_block of a fast symlink, else its first block), or None when the data
    is damaged (the kernel: EUCLEAN)."""
    if len(data) < SYMLINK_HEADER + 1:
        return None
    (n,) = struct.unpack_from("<H", data, 0)
    if n < MIN_NAME or SYMLINK_HEADER + n > len(data):
        return None
    return nokey_name(data[SYMLINK_HEADER : SYMLINK_HEADER + n])
