"""The real-guest corpus of tools/bench-store: checkpoints of the ksfs test guest, and their floor.

``make_guest_corpus`` boots the guest (tools/build-guest) as a session of a throwaway store, takes
checkpoints with `ksfs save` a few seconds apart, exports each one's disk.raw and memory with
`ksfs cat`, and always (also on failure) removes the session, its domain and the store.

``guest_floor`` computes what a perfect store must keep of those files:
- disk: zstd-3 of the first image's non-zero 4 KiB blocks, plus for each later checkpoint zstd-3
  of the 4 KiB blocks that differ from the previous image;
- memory: zstd-3 of the first image, plus for each later checkpoint zstd-3 of the guest pages
  whose content differs from the page at the same address (RAM block, offset) in the previous
  image and of everything that is not a RAM page record (libvirt header and XML, section
  headers, device state).
Each part is one zstd-3 stream per checkpoint and file.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import secrets
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import zstandard

from ksfs.cas.pagecut import GROUP_PAGES  # the floor's breakdown counts changed groups

ROOT = Path(__file__).resolve().parent.parent
KSFS = [str(ROOT / ".venv" / "bin" / "ksfs")]
PAGE = 4096
URI = os.environ.get("KSFS_LIBVIRT_URI", "qemu:///system")
COUNTER = re.compile(rb"ksfs-counter (\d+)")
# the guest init's file writes: `head -c $((1024 * (step % 7 + 1))) /run/busy > "$f"`
FILE_WRITE = "head -c $((1024 * (step % 7 + 1))) /run/busy"

# QEMU migration stream (migration/savevm.c, migration/ram.c of QEMU 7.2)
SEC_START, SEC_PART, SEC_END, SEC_FULL, SEC_FOOTER = 0x01, 0x02, 0x03, 0x04, 0x7E
F_ZERO, F_MEM_SIZE, F_PAGE, F_EOS, F_CONT = 0x02, 0x04, 0x08, 0x10, 0x20
_u64 = struct.Struct(">Q")
_u32 = struct.Struct(">I")


def _zstream() -> zstandard.ZstdCompressionObj:
    return zstandard.ZstdCompressor(level=3).compressobj()


class ZLen:
    """Compressed size of one zstd-3 stream fed piece by piece."""

    def __init__(self) -> None:
        self.obj = _zstream()
        self.n = 0
        self.fed = 0

    def feed(self, b: bytes) -> None:
        if b:
            self.n += len(self.obj.compress(b))
            self.fed += len(b)

    def done(self) -> int:
        return self.n + len(self.obj.flush()) if self.fed else 0


# --- the corpus ---------------------------------------------------------------------------------

def _ksfs(store: Path, *args: str, out=None, timeout: float = 600) -> str:
    res = subprocess.run([*KSFS, "--store", str(store), *args], stdout=out or subprocess.PIPE,
                         stderr=subprocess.PIPE, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"ksfs {' '.join(args)} -> {res.returncode}: "
                           f"{res.stderr.decode(errors='replace')[-2000:]}")
    return res.stdout.decode() if out is None else ""


def _derived_guest(src: Path, dst: Path, interval: float, disk_scale: int) -> dict:
    """A guest directory using src's kernel and disk, with ksfs.interval on the command line and,
    for disk_scale > 1, an initrd whose init writes files disk_scale times larger."""
    spec = json.loads((src / "guest.json").read_text())
    spec["cmdline"] = f"{spec.get('cmdline', '')} ksfs.interval={interval:g}".strip()
    if disk_scale > 1:
        with gzip.open(spec["initrd"], "rb") as f:
            archive = f.read()
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["cpio", "-i", "--quiet", "init"], input=archive, cwd=tmp, check=True)
            init = (Path(tmp) / "init").read_text()
            if FILE_WRITE not in init:
                raise RuntimeError("the guest's init has no file write to scale; rebuild the guest "
                                   "or run without --disk-scale")
            init = init.replace(FILE_WRITE,
                                f"head -c $((1024 * {disk_scale} * (step % 7 + 1))) /run/busy")
            (Path(tmp) / "init").write_text(init)
            (Path(tmp) / "init").chmod(0o755)
            extra = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet", "-R", "0:0"],
                                   input=b"init\n", cwd=tmp, capture_output=True,
                                   check=True).stdout
        # a second archive appended: the kernel unpacks both, the later /init wins
        initrd = dst / "initrd.img"
        with open(initrd, "wb") as out:
            out.write(Path(spec["initrd"]).read_bytes())
            out.write(gzip.compress(extra))
        initrd.chmod(0o644)
        spec["initrd"] = str(initrd)
    (dst / "guest.json").write_text(json.dumps(spec, indent=1))
    return spec


def _wait_counter(log: Path, at_least: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        try:
            seen = [int(m) for m in COUNTER.findall(log.read_bytes())]
        except FileNotFoundError:
            seen = []
        if seen and seen[-1] >= at_least:
            return seen[-1]
        if time.monotonic() > deadline:
            raise RuntimeError(f"the guest printed no counter >= {at_least} in {timeout:.0f} s")
        time.sleep(0.5)


def _virsh(*args: str) -> None:
    subprocess.run(["virsh", "-q", "-c", URI, *args], capture_output=True, timeout=120)


def make_guest_corpus(d: Path, guest: Path, images: int, interval: float, memory: int,
                      disk_scale: int, guest_interval: float, warmup: int) -> dict:
    """Checkpoints of a running guest exported to d/cN/{disk.raw,memory}; returns facts."""
    tmp = Path(tempfile.mkdtemp(prefix="ksfs-bench-store-", dir="/var/tmp"))
    tmp.chmod(0o755)  # QEMU (user libvirt-qemu) must reach the session's disk under the store
    store, gdir = tmp / "store", tmp / "guest"
    gdir.mkdir()
    gdir.chmod(0o755)
    name = f"bench-{secrets.token_hex(4)}"
    domain = f"ksfs-{name}"
    facts: dict = {"session": name, "memory_mib": memory, "disk_scale": disk_scale,
                   "guest_interval": guest_interval, "interval": interval, "saves": []}
    try:
        _derived_guest(guest, gdir, guest_interval, disk_scale)
        t = time.perf_counter()
        _ksfs(store, "session", "new", name, "--guest", str(gdir), "--memory", str(memory))
        log = store / "vm" / name / "console.log"
        facts["counter_at_start"] = _wait_counter(log, warmup, 300)
        facts["boot_seconds"] = time.perf_counter() - t
        print(f"guest {domain} up: counter {facts['counter_at_start']} after "
              f"{facts['boot_seconds']:.0f} s", flush=True)
        for i in range(images):
            if i:
                time.sleep(interval)
            t = time.perf_counter()
            _ksfs(store, "save", name, f"c{i}")
            facts["saves"].append(round(time.perf_counter() - t, 2))
            print(f"  saved c{i} in {facts['saves'][-1]:.1f} s", flush=True)
        facts["counter_at_end"] = _wait_counter(log, 0, 5)
        _ksfs(store, "session", "rm", "--keep-checkpoints", name)
        for i in range(images):
            cdir = d / f"c{i}"
            cdir.mkdir(parents=True)
            for f in ("disk.raw", "memory"):
                with open(cdir / f, "wb") as out:
                    _ksfs(store, "cat", name, f"c{i}", f, out=out)
    finally:
        try:
            if store.exists():
                subprocess.run([*KSFS, "--store", str(store), "session", "rm", name],
                               capture_output=True, timeout=300)
        finally:
            _virsh("destroy", domain)
            _virsh("undefine", "--nvram", domain)
            _virsh("undefine", domain)
            shutil.rmtree(tmp, ignore_errors=True)
    left = subprocess.run(["virsh", "-q", "-c", URI, "list", "--all", "--name"],
                          capture_output=True, text=True).stdout.split()
    if domain in left:
        print(f"WARNING: domain {domain} is still defined", file=sys.stderr)
    return facts


# --- parsing the memory image -------------------------------------------------------------------

def stream_start(head: bytes) -> int:
    if head.startswith(b"QEVM"):
        return 0
    if head.startswith(b"LibvirtQemudSave"):
        _, data_len, _, compressed = struct.unpack_from("<4I", head, 16)
        if compressed == 0:
            return 92 + data_len
    raise ValueError("not an uncompressed libvirt save image or QEMU stream")


def parse_memory(buf: bytes) -> tuple[dict[tuple[str, int], int], list[tuple[int, int]], dict]:
    """Pages and other bytes of a libvirt save image.

    Returns ({(ram block, offset): start of the page's data, or -1 for a zero page},
    [(start, end) of every byte range that is not a RAM page record], facts).
    """
    s = stream_start(buf[:4096])
    if buf[s:s + 4] != b"QEVM":
        raise ValueError("no QEVM magic")
    # the ram SECTION_START header: section id, "ram", instance 0, version 4
    m = re.compile(rb"\x01(....)\x03ram\x00\x00\x00\x00\x00\x00\x00\x04", re.S).search(
        buf, s, s + (1 << 20))
    if m is None:
        raise ValueError("no ram section")
    ram_id = m.group(1)
    p = m.end()
    hdr = _u64.unpack_from(buf, p)[0]
    if not hdr & F_MEM_SIZE:
        raise ValueError("no RAM_SAVE_FLAG_MEM_SIZE")
    total = hdr & ~0xFFF
    p += 8
    blocks: dict[str, int] = {}
    while sum(blocks.values()) < total:
        n = buf[p]
        block = buf[p + 1:p + 1 + n].decode()
        blocks[block] = _u64.unpack_from(buf, p + 1 + n)[0]
        p += 1 + n + 8
    other = [(0, p)]  # libvirt header, XML, configuration, ram setup
    pages: dict[tuple[str, int], int] = {}
    facts = {"blocks": blocks, "records": 0, "zero_records": 0}
    block = ""
    while True:
        # at the end of a section's RAM part: EOS, then a footer, then the next section
        hdr = _u64.unpack_from(buf, p)[0]
        if (hdr & 0xFFF) == F_EOS:
            q = p + 8
            if buf[q] == SEC_FOOTER:
                q += 5
            if buf[q] in (SEC_PART, SEC_END) and buf[q + 1:q + 5] == ram_id:
                other.append((p, q + 5))
                p = q + 5
                continue
            other.append((p, len(buf)))  # device state, EOF, vmdesc JSON
            break
        flags = hdr & 0xFFF
        if flags & ~(F_ZERO | F_PAGE | F_CONT) or not flags & (F_ZERO | F_PAGE):
            raise ValueError(f"unexpected RAM record flags {flags:#x} at {p}")
        start = p
        p += 8
        if not flags & F_CONT:
            n = buf[p]
            block = buf[p + 1:p + 1 + n].decode()
            p += 1 + n
        if p > start + 8:
            other.append((start + 8, p))  # the block name: not page content
        facts["records"] += 1
        key = (block, hdr & ~0xFFF)
        if flags & F_ZERO:
            if buf[p] != 0:
                raise ValueError(f"zero page record with fill byte {buf[p]} at {p}")
            pages[key] = -1
            facts["zero_records"] += 1
            p += 1
        else:
            pages[key] = p
            p += PAGE
    facts["pages"] = len(pages)
    facts["pages_by_block"] = {}
    for b, _ in pages:
        facts["pages_by_block"][b] = facts["pages_by_block"].get(b, 0) + 1
    facts["other_bytes"] = sum(e - s for s, e in other)
    return pages, other, facts


# --- the floor ----------------------------------------------------------------------------------

def _blocks(path: Path, size: int) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        off = 0
        while True:
            buf = f.read(4 << 20)
            if not buf:
                return
            yield off, buf
            off += len(buf)


def guest_floor(corpus: Path, names: list[str]) -> dict:
    """The floor of a real-guest corpus (see the module's docstring), with diagnostics."""
    zero_page = bytes(PAGE)
    floor = {"disk": 0, "memory": 0, "first": 0, "per": [], "check": {}}
    prev_disk: Path | None = None
    prev_pages: dict[tuple[str, int], bytes] = {}  # digests
    for i, n in enumerate(names):
        row: dict = {"name": n}
        # disk
        disk = corpus / n / "disk.raw"
        z = ZLen()
        z64 = ZLen()  # the same at 64 KiB granularity: what fixed 64 KiB chunks must store
        changed = changed64 = 0
        if prev_disk is None:
            for _, buf in _blocks(disk, 0):
                for o in range(0, len(buf), PAGE):
                    blk = buf[o:o + PAGE]
                    if blk != zero_page:
                        z.feed(blk)
                        changed += 1
            z64 = None
        else:
            with open(prev_disk, "rb") as pf:
                for _, buf in _blocks(disk, 0):
                    old = pf.read(len(buf))
                    if old == buf:
                        continue
                    for o in range(0, len(buf), 16 * PAGE):
                        c, oc = buf[o:o + 16 * PAGE], old[o:o + 16 * PAGE]
                        if c == oc:
                            continue
                        z64.feed(c)
                        changed64 += 1
                        for q in range(0, len(c), PAGE):
                            if c[q:q + PAGE] != oc[q:q + PAGE]:
                                z.feed(c[q:q + PAGE])
                                changed += 1
        row["disk_blocks"] = changed
        row["disk"] = z.done()
        if z64 is not None:
            row["disk_64k_clusters"] = changed64
            row["disk_64k"] = z64.done()
        prev_disk = disk
        # memory
        buf = (corpus / n / "memory").read_bytes()
        pages, other, facts = parse_memory(buf)
        cur = {k: hashlib.blake2b(buf[s:s + PAGE] if s >= 0 else zero_page,
                                  digest_size=16).digest() for k, s in pages.items()}
        if i == 0:
            floor["check"] = {k: v for k, v in facts.items() if k != "pages_by_block"}
            floor["check"]["pages_by_block"] = facts["pages_by_block"]
            z = ZLen()
            for o in range(0, len(buf), 4 << 20):
                z.feed(buf[o:o + (4 << 20)])
            row["memory"] = z.done()
            row["memory_pages"] = len(cur)
        else:
            zp, zo = ZLen(), ZLen()
            changed = 0
            groups: set[tuple[str, int]] = set()
            for k, v in cur.items():
                if prev_pages.get(k) != v:
                    s = pages[k]
                    zp.feed(buf[s:s + PAGE] if s >= 0 else zero_page)
                    changed += 1
                    groups.add((k[0], k[1] // (GROUP_PAGES * PAGE)))
            for s, e in other:
                zo.feed(buf[s:e])
            row["memory_pages"] = changed
            row["memory_groups"] = len(groups)
            row["memory_page_bytes"] = zp.done()
            row["memory_other_bytes"] = zo.done()
            row["memory_other_raw"] = facts["other_bytes"]
            row["memory"] = row["memory_page_bytes"] + row["memory_other_bytes"]
        prev_pages = cur
        del buf
        floor["disk"] += row["disk"]
        floor["memory"] += row["memory"]
        if i == 0:
            floor["first"] = row["disk"] + row["memory"]
        floor["per"].append(row)
        print(f"  floor {n}: disk {row['disk_blocks']} blocks of 4 KiB -> {row['disk'] / 1024:.0f}"
              f" KiB, memory {row['memory_pages']} pages -> {row['memory'] / 1024:.0f} KiB",
              flush=True)
    return floor


# --- where ksfs's stored bytes go -----------------------------------------------------------------

def ksfs_breakdown(store_dir: Path, manifests: dict[tuple[str, str], str], names: list[str]
                   ) -> dict:
    """Stored bytes of a ksfs store split by file kind and part, first checkpoint vs the rest.

    Each chunk is charged to the first checkpoint and file that referenced it: its zstd payload,
    its record header in the pack, and its index entry; every manifest to its own checkpoint.
    """
    sys.path.insert(0, str(ROOT))
    from ksfs.cas import ChunkStore
    from ksfs.cas import format as fmt

    seen: set[bytes] = set()
    out: dict = {}
    with ChunkStore.open(store_dir) as st:
        for i, n in enumerate(names):
            part = "first" if i == 0 else "later"
            for f in ("disk.raw", "memory"):
                info = st.load_manifest(manifests[(n, f)])
                row = out.setdefault(f"{f}:{part}", {"chunks": 0, "plain": 0, "payload": 0,
                                                     "headers": 0, "manifest": 0,
                                                     "sizes": {}})
                with st.env.begin(db=st.db["manifests"]) as txn:  # as stored: maybe a delta
                    row["manifest"] += len(txn.get(bytes.fromhex(manifests[(n, f)])))
                for cid, _ in info.entries:
                    if cid is None or cid in seen:
                        continue
                    seen.add(cid)
                    loc = st.lookup(cid)
                    row["chunks"] += 1
                    row["plain"] += loc.plain_len
                    row["payload"] += loc.stored_len
                    row["headers"] += fmt.HEADER_SIZE
                    k = str(loc.plain_len // 1024)
                    row["sizes"][k] = row["sizes"].get(k, 0) + 1
    files = [(p.name, p.stat().st_size) for p in store_dir.rglob("*") if p.is_file()]
    out["files"] = {
        "packs": sum(v for k, v in files if k.endswith(".pack")),
        "lmdb": sum(v for k, v in files if k.endswith(".mdb")),
        "other": sum(v for k, v in files if not k.endswith((".pack", ".mdb"))),
    }
    return out


def print_breakdown(b: dict, floor: dict) -> None:
    """What ksfs stores per file kind against the floor (first checkpoint, then the rest)."""
    per = floor["per"]
    fl = {"disk.raw:first": per[0]["disk"], "memory:first": per[0]["memory"],
          "disk.raw:later": sum(r["disk"] for r in per[1:]),
          "memory:later": sum(r["memory"] for r in per[1:])}
    print("\nksfs stored bytes by part (KiB; each chunk charged to the first checkpoint using it):")
    print(f"  {'part':16} {'chunks':>7} {'plain':>9} {'payload':>9} {'rec hdrs':>9} "
          f"{'manifests':>9} {'floor':>9} {'payload/floor':>13}")
    for k in ("disk.raw:first", "memory:first", "disk.raw:later", "memory:later"):
        r = b.get(k)
        if r is None:
            continue
        ratio = r["payload"] / fl[k] if fl[k] else float("nan")
        print(f"  {k:16} {r['chunks']:7d} {r['plain'] / 1024:9.0f} {r['payload'] / 1024:9.0f} "
              f"{r['headers'] / 1024:9.0f} {r['manifest'] / 1024:9.0f} {fl[k] / 1024:9.0f} "
              f"{ratio:13.2f}")
    f = b["files"]
    print(f"  files: packs {f['packs'] / 1024:.0f} KiB, LMDB {f['lmdb'] / 1024:.0f} KiB, other "
          f"{f['other'] / 1024:.0f} KiB")
    later = per[1:]
    if later:
        pages = sum(r["memory_pages"] for r in later)
        groups = sum(r["memory_groups"] for r in later)
        other = sum(r["memory_other_bytes"] for r in later)
        d4 = sum(r["disk"] for r in later)
        d64 = sum(r["disk_64k"] for r in later)
        print(f"  after the first: {pages} changed pages in {groups} page groups of "
              f"{GROUP_PAGES} ({groups * GROUP_PAGES} pages, "
              f"{groups * GROUP_PAGES / max(pages, 1):.1f}x the changed ones); "
              f"non-RAM state {other / 1024:.0f} KiB zstd of the memory floor")
        print(f"  disk: {sum(r['disk_blocks'] for r in later)} changed 4 KiB blocks "
              f"({d4 / 1024:.0f} KiB zstd) in {sum(r['disk_64k_clusters'] for r in later)} "
              f"64 KiB clusters ({d64 / 1024:.0f} KiB zstd)")
