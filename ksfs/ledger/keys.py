"""Key and value encodings of the ledger's LMDB databases. Pure functions, no I/O.

Keys are built so that LMDB's byte order is the order readers want: a lineage's events sort by
seq (big-endian u64 after the 16-byte lineage id), a lineage's checkpoints sort by seq in the
index. Values are compact JSON. Nothing here may touch a database: the ledger and verify use
these, so one change of layout is one change here.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from ksfs.errors import BadInput, RecordCorrupt

LINEAGE_BYTES = 16
SEQ = struct.Struct(">Q")

# ledger_meta keys
FORMAT_KEY = b"format"
FORMAT = {"format": "ksfs-ledger", "version": 1}
LINEAGE_PREFIX = b"lineage/"

# checkpoints keys, after the lineage id: by name, and the index by seq
CKPT_BY_NAME = b"n"
CKPT_BY_SEQ = b"s"


def new_lineage() -> str:
    """A fresh lineage id: 16 random bytes as hex, unique for ever."""
    return os.urandom(LINEAGE_BYTES).hex()  # what secrets.token_hex does, without its imports


def lineage_bytes(lineage: str) -> bytes:
    try:
        raw = bytes.fromhex(lineage)
    except (ValueError, TypeError):
        raise BadInput(f"lineage id {lineage!r} is not hex") from None
    if len(raw) != LINEAGE_BYTES:
        raise BadInput(f"lineage id {lineage!r} is not {LINEAGE_BYTES} bytes")
    return raw


def event_key(lineage: str, seq: int) -> bytes:
    return lineage_bytes(lineage) + SEQ.pack(seq)


def event_key_raw(lin: bytes, seq: int) -> bytes:
    return lin + SEQ.pack(seq)


def split_event_key(key: bytes) -> tuple[bytes, int]:
    """(lineage bytes, seq) of an event key; ValueError when the key has the wrong length."""
    if len(key) != LINEAGE_BYTES + SEQ.size:
        raise ValueError(f"event key of {len(key)} bytes")
    return key[:LINEAGE_BYTES], SEQ.unpack(key[LINEAGE_BYTES:])[0]


def ckpt_name_key(lin: bytes, name: str) -> bytes:
    return lin + CKPT_BY_NAME + name.encode("utf-8")


def ckpt_seq_key(lin: bytes, seq: int, name: str) -> bytes:
    # The name follows the seq so two records at one seq (never written by the keeper, but
    # possible by hand) cannot overwrite each other's index entry.
    return lin + CKPT_BY_SEQ + SEQ.pack(seq) + name.encode("utf-8")


def split_ckpt_key(key: bytes) -> tuple[bytes, str, int | None, str]:
    """(lineage bytes, kind 'n'|'s', seq or None, name) of a checkpoints-db key."""
    lin, kind, rest = key[:LINEAGE_BYTES], key[LINEAGE_BYTES : LINEAGE_BYTES + 1], key[17:]
    if len(lin) != LINEAGE_BYTES or kind not in (CKPT_BY_NAME, CKPT_BY_SEQ):
        raise ValueError("malformed checkpoint key")
    if kind == CKPT_BY_NAME:
        return lin, "n", None, rest.decode("utf-8")
    if len(rest) < SEQ.size:
        raise ValueError("malformed checkpoint index key")
    return lin, "s", SEQ.unpack(rest[: SEQ.size])[0], rest[SEQ.size :].decode("utf-8")


def lineage_meta_key(lin: bytes) -> bytes:
    return LINEAGE_PREFIX + lin


def prefix_end(prefix: bytes) -> bytes | None:
    """The smallest key greater than every key starting with ``prefix`` (None: no such key)."""
    p = bytearray(prefix)
    while p:
        if p[-1] < 0xFF:
            p[-1] += 1
            return bytes(p)
        p.pop()
    return None


def dumps(obj: Any, strict: bool = False) -> bytes:
    """Compact JSON with sorted keys; ``strict``: ValueError on NaN and Infinity (not JSON)."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True,
                      allow_nan=not strict).encode("utf-8")


def loads(raw: bytes) -> Any:
    """A ledger value; damage (bytes that no longer decode) is an IntegrityError, not a crash."""
    try:
        return json.loads(bytes(raw).decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise RecordCorrupt(why=str(exc)) from None
    except RecursionError:
        raise RecordCorrupt(why="it is nested too deeply to read") from None
