"""Store verbs: import, cat, stats, check, rm, gc."""

from __future__ import annotations

import os
import sys

import click

from ksfs.cli import (
    DONE_NOTE,
    counted,
    emit_json,
    human_bytes,
    main,
    making_store,
    pass_ctx,
    run_verb,
    steps_on_terminal,
)
from ksfs.errors import ChunkMissing, IntegrityError, KsfsError


def progress_bar(label: str):
    """A callback(done, total) drawing a bar on a terminal; None when stderr is piped (or
    closed: QA, `ksfs import ... 2>&-` failed with exit 1 and no word) or a terminal that
    cannot redraw a line (TERM=dumb)."""
    from ksfs.cli.stepline import drawing_terminal

    if sys.stderr is None or not drawing_terminal():
        return None, lambda: None
    state: dict = {}

    def update(done: int, total: int) -> None:
        bar = state.get("bar")
        if bar is None:
            bar = state["bar"] = click.progressbar(
                length=max(total, 1), label=label, file=sys.stderr, show_pos=False
            )
            bar.__enter__()
        bar.update(done - bar.pos)

    def finish() -> None:
        if "bar" in state:
            state["bar"].__exit__(None, None, None)

    return update, finish


@main.command("import")
@click.argument("session")
@click.argument("checkpoint")
@click.argument("files", nargs=-1, type=click.Path(readable=False))
@click.option("--disk", "disks", multiple=True, type=click.Path(readable=False),
              help="A file to chunk as a disk image (fixed 64 KiB), whatever its name.")
@click.option("--json", "as_json", is_flag=True, help="Print the checkpoint record as JSON.")
@pass_ctx
def import_(ctx, session: str, checkpoint: str, files, disks, as_json: bool) -> None:
    """Store FILES as checkpoint CHECKPOINT of SESSION (created offline when missing).

    Each file is stored under its base name. disk*.raw, *.img and --disk files are chunked at
    fixed 64 KiB boundaries, memory images at their page records, everything else by content
    (FastCDC). Chunks that changed since the file of the same name in SESSION's latest
    checkpoint are stored as deltas against their old versions where that saves bytes. The
    names a checkpoint directory shows of its own (domain.xml, meta.json, transcript, forks, fs)
    cannot be imported. A file named twice (by any path: f, ./f and $PWD/f are one) is
    refused, unless once as FILE and once with --disk: then it is stored once, as a disk.

    Example: ksfs import demo c1 disk.raw memory
    """
    from ksfs.keeper.offline import import_paths

    import_paths(session, checkpoint, files, disks)  # bad input makes no store
    update, finish = progress_bar(f"import {checkpoint}")
    # (a store it makes is removed again when it fails: QA, a file cut while it was read)
    with making_store(ctx) as keeper:
        try:
            # this process is only this import: disk images may be mapped (cas/chunking.py)
            record = keeper.import_files(session, checkpoint, files, disks=disks,
                                         progress=update, map_files=True)
        finally:
            finish()
    # committed: a report that cannot be written must not read as if the import failed
    click.get_current_context().meta[DONE_NOTE] = f"checkpoint {session}/{record.name} was stored"
    tell_daemon(ctx, session, record.name)
    if as_json:
        emit_json(record.to_dict())
    else:
        click.echo(
            f"{session}/{record.name}: {len(record.files)} "
            f"file{'' if len(record.files) == 1 else 's'}, "
            f"{record.logical_bytes} bytes, {record.stored_bytes} new bytes stored"
        )
        click.echo(record.name)


@main.command()
@click.argument("session")
@click.argument("checkpoint")
@click.argument("file")
@pass_ctx
def cat(ctx, session: str, checkpoint: str, file: str) -> None:
    """Write FILE of SESSION's CHECKPOINT to standard output.

    Into a regular file (> out) holes are skipped, not written, so a disk image comes out
    sparse as it went in.

    Example: ksfs cat demo c1 disk.raw | sha256sum
    """
    keeper = ctx.open_keeper()
    record = keeper.checkpoint_record(session, checkpoint)
    reader = keeper.open_file(session, checkpoint, file, record=record)
    try:
        _cat(reader)
    except ChunkMissing as exc:  # deleted and collected under us is not damage: say which
        raise keeper.gone_error(session, record, file, exc) from None


def tell_daemon(ctx, session: str, checkpoint: str) -> None:
    """Tell a running daemon that this process published a checkpoint, so its mount shows the
    name's new files at once (imports run here, with their progress bar and mapped reads)."""
    from ksfs.daemon.client import call_daemon

    ctx.close()  # the daemon reads the store next: nothing of ours held open
    try:
        call_daemon(ctx.store_path, "checkpoint_changed", timeout=2, session=session,
                    checkpoint=checkpoint)
    except (KsfsError, OSError, ValueError):
        pass  # a courtesy: the mount shows it within a second anyway


def _cat(reader) -> None:
    out = sys.stdout.buffer
    try:
        out.flush()
        fd = out.fileno()
    except (AttributeError, OSError, ValueError):  # not a file (click's test runner): write()
        fd = None
    # A write that fails (a full disk, the reader gone) is the root group's to report: see
    # ksfs/cli/__init__.py
    sparse = fd is not None and _may_skip_holes(fd)
    for pieces in reader.stream():
        if fd is None:
            for piece in pieces:
                out.write(piece)
        elif sparse:
            write_sparse(fd, pieces)
        else:
            write_all(fd, pieces)
    if sparse:
        end = os.lseek(fd, 0, os.SEEK_CUR)
        if os.fstat(fd).st_size < end:  # a hole at the end: the file still gets its size
            os.ftruncate(fd, end)
    out.flush()


def _may_skip_holes(fd: int) -> bool:
    """Whether holes may be seeked over instead of written: standard output is a regular file
    (``> out``), not appended to, and holds nothing from where we write on (so what a seek
    leaves unwritten reads as zeros). A restored disk image then stays sparse, as ``cp`` keeps
    it."""
    import fcntl
    import stat as stat_

    try:
        st = os.fstat(fd)
        if not stat_.S_ISREG(st.st_mode) or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
            return False
        return st.st_size <= os.lseek(fd, 0, os.SEEK_CUR)
    except OSError:
        return False


def write_sparse(fd: int, pieces: list) -> None:
    """``write_all``, but runs of hole pieces of 64 KiB or more are seeked over."""
    from ksfs.cas.reader import is_hole

    run: list = []
    i = 0
    while i < len(pieces):
        j = i
        while j < len(pieces) and is_hole(pieces[j]):
            j += 1
        gap = sum(len(p) for p in pieces[i:j])
        if gap >= 64 * 1024:
            write_all(fd, run)
            run = []
            os.lseek(fd, gap, os.SEEK_CUR)
            i = j
        else:
            run.append(pieces[i])
            i += 1
    write_all(fd, run)


def write_all(fd: int, pieces: list) -> None:
    """Write the pieces in order with writev: one system call for many chunks and no joined
    copy; a short write (a pipe, a signal) goes on where it stopped."""
    i = 0
    while i < len(pieces):
        n = os.writev(fd, pieces[i : i + 1024])  # 1024: IOV_MAX on Linux
        while i < len(pieces) and n >= len(pieces[i]):
            n -= len(pieces[i])
            i += 1
        if n:
            pieces[i] = memoryview(pieces[i])[n:]


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object.")
@pass_ctx
def stats(ctx, as_json: bool) -> None:
    """Show the store figures: logical and stored bytes, chunks, packs, checkpoints, dedup ratio.

    checkpoints counts every checkpoint the store holds, those kept by `session rm
    --keep-checkpoints` too; sessions counts the sessions not removed. stored_bytes are the
    bytes the store's chunks take in its packs, compressed, with their record headers (a
    deleted checkpoint's count until gc). --json adds manifests, pack_bytes (the committed
    bytes of the packs counted in packs: stored bytes and the dead records gc has yet to
    repack) and uncommitted_pack_bytes (bytes in pack files that no commit counts: a running
    import's, or a killed one's, which gc gives back).

    Example: ksfs stats --json | jq .dedup_ratio
    """
    figures = ctx.open_keeper().stats()
    if as_json:
        emit_json(figures)
        return
    for key in ("logical_bytes", "stored_bytes", "chunks", "packs", "checkpoints", "sessions",
                "dedup_ratio"):
        value = figures.get(key)
        click.echo(f"{key:14} {'-' if value is None else value}")  # no ratio of 0 bytes


@main.command()
@click.option("--read-data", is_flag=True, help="Also read, decompress and hash every chunk.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as JSON: ok, findings (one record per finding, with its "
                   "kind), problems (the same as sentences), summary and the counts checked.")
@pass_ctx
def check(ctx, read_data: bool, as_json: bool) -> None:
    """Check the store; exit 0 if clean, else name each damaged chunk, pack, checkpoint and file.

    Without --json, one line per finding, grouped. Each damaged pack is followed by every
    damaged or missing chunk the index places in it (all of them: a pack cut short names each
    chunk it lost); damaged chunks of sound packs follow in pack order, then the chunks no pack
    holds, then the manifests that are damaged or need such chunks (each with how many it
    needs; --json lists them). Each checkpoint that depends on any of it then has a line,
    followed by a line for each of its files that does. A summary line ends the report; exit 6
    when anything was found.

    Example: ksfs check --read-data
    """
    try:
        keeper = ctx.open_keeper()
        with steps_on_terminal("check"):
            report = keeper.check(read_data=read_data)
    except IntegrityError as exc:
        if as_json:  # a script still gets its report: the index itself is the finding
            emit_json({"ok": False, "problems": [str(exc)],
                       "findings": [{"kind": "damaged_index", "why": str(exc)}],
                       "summary": "store DAMAGED: its index cannot be read",
                       "chunks_checked": 0, "manifests_checked": 0, "packs_checked": 0,
                       "data_read": False})
        raise  # (and said on stderr, exit 6, as for every command)
    problems = report.lines()
    if as_json:
        emit_json({"ok": report.ok, "problems": problems, "findings": report.findings(),
                   "summary": report.summary(), "chunks_checked": report.chunks_checked,
                   "manifests_checked": report.manifests_checked,
                   "packs_checked": report.packs_checked, "data_read": report.data_read,
                   "unfinished_packs": len(report.orphan_packs),
                   "unfinished_bytes": report.orphan_bytes,
                   "in_use_packs": len(report.in_use_packs),
                   "in_use_bytes": report.in_use_bytes})
    else:
        for line in report.text_lines():
            click.echo(line)
        click.echo(report.summary())
    if problems:
        raise SystemExit(IntegrityError.exit_code)


@main.command("rm")
@click.argument("session")
@click.argument("checkpoint")
@click.option("--json", "as_json", is_flag=True,
              help="Print what was deleted (its files, sizes, event seq) as JSON.")
@pass_ctx
def rm(ctx, session: str, checkpoint: str, as_json: bool) -> None:
    """Delete CHECKPOINT of SESSION (its chunks are freed by the next gc).

    Example: ksfs rm demo c1 && ksfs gc
    """
    res = run_verb(ctx, "rm", session=session, checkpoint=checkpoint)  # the daemon's if mounted
    emit_json(res) if as_json else click.echo(f"deleted {session}/{checkpoint}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print what was freed as JSON.")
@pass_ctx
def gc(ctx, as_json: bool) -> None:
    """Free chunks no checkpoint uses, repack sparse packs, and drop the gateway's stored
    responses that no session can replay any more.

    The disk it says it gave back (disk_bytes_reclaimed) is net: the pack bytes it removed,
    less those of the packs it wrote (disk_bytes_written) to hold the live chunks of the
    packs it repacked.

    Example: ksfs gc --json
    """
    keeper = ctx.open_keeper()
    with steps_on_terminal("gc"):
        result = keeper.gc()
    data = result if isinstance(result, dict) else getattr(result, "__dict__", {"result": result})
    if as_json:
        emit_json(data)
        return
    for line in gc_summary(data):
        click.echo(line)


def gc_summary(d: dict) -> list[str]:
    """What a gc did, for people: one line, plus one per thing it left for later."""
    freed = d.get("bytes_freed", 0)
    lines = [f"gc: freed {freed} bytes ({human_bytes(freed)}) in "
             f"{counted(d.get('chunks_freed', 0), 'chunk')}; removed "
             f"{counted(len(d.get('packs_removed') or ()), 'pack')}, repacked "
             f"{len(d.get('packs_repacked') or ())}; "
             f"{human_bytes(d.get('disk_bytes_reclaimed', 0))} of disk given back"]
    if d.get("deltas_flattened"):
        lines.append(f"gc: {d['deltas_flattened']} deltas stored whole so their bases could go "
                     f"({human_bytes(d.get('bytes_rewritten', 0))} written for them: the stored "
                     f"bytes fell by {human_bytes(freed - d.get('bytes_rewritten', 0))}; the "
                     f"disk space of packs still in use comes back as later gcs repack them)")
    if d.get("manifests_rebased"):
        lines.append(f"gc: {counted(d['manifests_rebased'], 'manifest')} stored again on a "
                     "live base: the manifest they were deltas on went with its checkpoint")
    if d.get("gateway_responses_freed"):
        lines.append(f"gc: dropped {d['gateway_responses_freed']} stored model responses "
                     f"({human_bytes(d.get('gateway_bytes_freed', 0))})")
    for pack, (before, now) in sorted((d.get("settled_packs") or {}).items()):
        lines.append(f"gc: pack {pack}'s size was {before} bytes where its file and the records "
                     f"the index places in it say {now}: it is now {now}")
    for pack, why in sorted((d.get("skipped_packs") or {}).items()):
        lines.append(f"gc: pack {pack} left as it was: {why} (see ksfs check)")
    if d.get("flatten_skipped"):
        lines.append(f"gc: deltas not flattened, left for the next gc: {d['flatten_skipped']}")
    return lines


def _xattrs_moved(moved: dict) -> str:
    """``xattrs +user.new -user.old ~user.tag``: added, removed, set to another value."""
    if moved.get("unreadable"):
        return "xattrs unreadable"
    return "xattrs " + " ".join(mark + quote_name(n) for key, mark in (
        ("added", "+"), ("removed", "-"), ("changed", "~")) for n in moved.get(key, ()))


@main.command()
@click.argument("session")
@click.argument("a")
@click.argument("b")
@click.option("--json", "as_json", is_flag=True, help="Print the whole difference as JSON.")
@pass_ctx
def diff(ctx, session: str, a: str, b: str, as_json: bool) -> None:
    """What changed from checkpoint A to checkpoint B of SESSION.

    Files inside the guest (added +, removed -, changed M with sizes; a change of mode, owner or
    extended attributes alone is M too, as "mode 644 -> 600", "owner 0:0 -> 1000:1000" or
    "xattrs +user.new -user.old ~user.tag": added, removed, value changed), the checkpoints' own
    stored files (+ added, - removed, M changed with the chunks their manifests say changed,
    = identical), changed disk clusters out of those that hold data, the share of memory chunks
    that differ, and the events between them. The guest files come from disk.raw, or from a
    checkpoint's only disk image (disk*.raw, *.img). Name a checkpoint of another session (a
    fork's parent, say) as OTHER/CHECKPOINT.

    Events between: those after A's checkpoint.published up to and including B's (so B's own
    checkpoint.begin and .published are in, A's are not; A against itself has none; with B
    before A, the same events as from B to A). Across a fork they are the events along the
    fork tree's path: each fork log A is in, from its start up to A; the log both share, from
    the earlier place to the later (a fork counts as at the checkpoint it was made from); each
    fork log B is in, from its start to B. Each line then names its session, and "along:" lists
    the stretches. Sessions of unrelated lineages have no events between.

    A name with control characters, a backslash, a double quote or bytes that are not UTF-8 is
    printed in double quotes with C escapes (\\n, \\t, \\ooo), as git quotes paths; --json
    gives names exactly: a byte that is not UTF-8 as a \\udcXX escape (os.fsencode turns it
    back), and such a name's bytes in hex as path_hex.

    Example: ksfs diff agent first second
    """
    d = ctx.open_keeper().diff(session, a, b)
    if as_json:
        for c in (d["files"] or []) + (d.get("attr_changes") or []):
            # JSON strings are Unicode: a name with bytes that are not UTF-8 also goes as its
            # bytes, in hex, so tools other than Python's json get it exactly too (QA: jq
            # printed U+FFFD for the byte)
            raw = c["path"].encode("utf-8", "surrogateescape")
            if raw.decode("utf-8", "replace") != c["path"]:
                c["path_hex"] = raw.hex()
        emit_json(d)
        return
    click.echo(f"--- {d['a']}\n+++ {d['b']}")
    if d["files"] is None:
        click.echo(f"files: not compared "
                   f"({d['files_error'] or d.get('files_not_compared') or 'no disk image'})")
    else:
        mark = {"added": "+", "removed": "-", "changed": "M", "attrs": "M"}
        only_attrs = d.get("attr_changes") or []
        # one list in diff -r's order: each directory's names sorted bytewise, depth first
        for c in sorted(d["files"] + only_attrs, key=lambda c: [
                part.encode("utf-8", "surrogateescape") for part in c["path"].split("/")]):
            what = []
            if c["kind"] != "attrs":
                what.append(f"{_types(c['type_a'], c['type_b'])}, "
                            f"{c['size_a'] if c['size_a'] is not None else '-'} -> "
                            f"{c['size_b'] if c['size_b'] is not None else '-'}")
            moved = c.get("attrs") or {}
            if "rdev" in moved:
                what.append(f"device {moved['rdev'][0]} -> {moved['rdev'][1]}")
            if "mode" in moved:
                what.append(f"mode {moved['mode'][0]:o} -> {moved['mode'][1]:o}")
            if "uid" in moved:
                (ua, ub), (ga, gb) = moved["uid"], moved["gid"]
                what.append(f"owner {ua}:{ga} -> {ub}:{gb}")
            if "xattrs" in moved:
                what.append(_xattrs_moved(moved["xattrs"]))
            click.echo(f"{mark[c['kind']]} {quote_name(c['path'])}  ({'; '.join(what)})")
        click.echo(f"files: {len(d['files']) + len(only_attrs)} changed" + (
            f" ({len(only_attrs)} in mode, owner or extended attributes only)"
            if only_attrs else ""))
    stored = d.get("stored_files") or []
    if stored:
        counts = {k: sum(1 for f in stored if f["kind"] == k)
                  for k in ("added", "removed", "changed", "identical")}
        click.echo("stored files: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    for f in stored:
        mark = {"added": "+", "removed": "-", "changed": "M", "identical": "="}[f["kind"]]
        what = (f"{f['size_a'] if f['size_a'] is not None else '-'} -> "
                f"{f['size_b'] if f['size_b'] is not None else '-'} bytes")
        if f["kind"] == "changed" and f.get("chunking") == "fixed":
            what += (f"; {f['changed_chunks']} of {f['chunks']} stored 64 KiB clusters "
                     f"changed, {f['changed_bytes']} bytes")
        elif f["kind"] == "changed":
            what += (f"; {f['changed_chunks']} of {f['chunks']} chunks not in A, "
                     f"{f['changed_bytes']} bytes")
        click.echo(f"  {mark} {quote_name(f['name'])}  ({what})")
    if d["disk"]:
        disk = d["disk"]
        images = list(dict.fromkeys((disk.get("file_a", "disk.raw"),
                                     disk.get("file_b", "disk.raw"))))
        names = "" if images == ["disk.raw"] else " in " + " -> ".join(images)
        if "stored_clusters" in disk:
            grown = "" if disk["size_a"] == disk["size_b"] else (
                f"; its size {disk['size_a']} -> {disk['size_b']} bytes")
            click.echo(f"disk{names}: {disk['changed_clusters']} of {disk['stored_clusters']} "
                       f"stored 64 KiB clusters (of {disk['disk_clusters']}) changed{grown}")
        else:
            click.echo(f"disk: {disk['changed_clusters']} of {disk['clusters']} "
                       f"64 KiB clusters changed")
    if d["memory"]:
        click.echo(f"memory: {d['memory']['share_differing']:.1%} of chunks differ "
                   f"({d['memory']['differing_chunks']} of {d['memory']['chunks']})")
    path = d.get("events_path")
    if path is None:
        click.echo("events between: none (the two sessions share no lineage)")
        return
    click.echo(f"events between: {len(d['events'])}")
    # Across a fork, each line names its session, also when all come from one log that is not
    # SESSION's (QA: a fork's own events read as if they were A's)
    named = len(path) > 1 or any(p["session"] != session for p in path)
    if named:
        click.echo("  along: " + ", ".join(
            f"{p['session']} seq {p['from_seq']}..{p['to_seq']}" for p in path))
    for e in d["events"]:
        where = f"{e['session']} " if named else ""
        click.echo(f"  {where}{e['seq']:>6} {e['type']}")


_C_ESCAPES = {"\a": "\\a", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\v": "\\v",
              "\f": "\\f", "\r": "\\r", '"': '\\"', "\\": "\\\\"}


def quote_name(name: str) -> str:
    """A guest path for a human line: as it is when plain, otherwise in double quotes with C
    escapes (control characters, non-printable characters and bytes that are not UTF-8 as
    octal \\ooo of their bytes), the way git quotes paths. Used by ``diff``'s human output."""
    if all(c.isprintable() and c not in '"\\' for c in name):
        return name
    out = []
    for c in name:
        if c in _C_ESCAPES:
            out.append(_C_ESCAPES[c])
        elif c.isprintable():
            out.append(c)
        else:  # a control character, or a byte surrogateescape kept from a non-UTF-8 name
            out.append("".join(f"\\{b:03o}" for b in c.encode("utf-8", "surrogateescape")))
    return '"' + "".join(out) + '"'


def _types(a: str | None, b: str | None) -> str:
    """A changed entry's type, or both when it changed type (a directory that became a file:
    "dir -> file"; QA, fifteenth session: only the new type was shown)."""
    return f"{a} -> {b}" if a and b and a != b else b or a or "-"
