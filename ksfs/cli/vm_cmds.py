"""Machine verbs: session new/adopt/list/rm, save, restore, fork, pause, resume, status.

Each goes through the running daemon when there is one (so the mount and the CLI share one
keeper and its locks), else does the work here under the same locks.
"""

from __future__ import annotations

import os
import sys
import time

import click

from ksfs.cli import DONE_NOTE, emit_json, main, pass_ctx, run_verb
from ksfs.errors import VMError


def _json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")(f)


@main.group()
def session() -> None:
    """Create, adopt, list and remove sessions (a machine and its records).

    \b
    Example:
      ksfs session new agent --guest /var/cache/ksfs/guest
      ksfs session list
    """


def _as_session(rec: dict) -> dict:
    """A session record as --json gives it: its name as ``session`` too, the key every other
    verb's JSON names a session by (QA); ``name`` stays for the scripts that read it."""
    return {"session": rec["name"], **rec}


TRANSCRIPT_HELP = ("Where the guest writes its transcript, a path in its filesystem, read "
                   "from checkpoints and reconciled on restores")


@session.command("new")
@click.argument("name")
@click.option("--guest", type=click.Path(file_okay=False), help="A guest directory (guest.json).")
@click.option("--kernel", type=click.Path(dir_okay=False), help="Kernel to boot directly.")
@click.option("--initrd", type=click.Path(dir_okay=False),
              help="Initramfs for --kernel (none: a kernel that mounts its root itself).")
@click.option("--disk", type=click.Path(dir_okay=False), help="Disk image (raw or qcow2).")
@click.option("--disk-format", type=click.Choice(["raw", "qcow2"]),
              help="The disk's format (default: a guest.json's \"disk_format\", else read "
                   "from its header). A raw disk given so is never taken for another format, "
                   "whatever its guest wrote at its start.")
@click.option("--memory", type=click.IntRange(16, 1 << 20), help="Memory in MiB.")
@click.option("--vcpus", type=click.IntRange(1, 64), help="Virtual CPUs.")
@click.option("--cmdline", metavar="TEXT",
              help="Kernel command line (default: a guest.json's \"cmdline\", else "
                   "\"console=ttyS0 panic=-1 quiet\" plus \"root=/dev/vda rw\" when the disk is "
                   "a root filesystem (ext with /etc, xfs or btrfs), or \"root=/dev/vdaN rw\" "
                   "for the partition holding it; with none found, no root= and a warning: an "
                   "initrd that is the whole guest needs none).")
@click.option("--transcript", metavar="PATH", help=TRANSCRIPT_HELP + " (default: a guest.json's "
              "\"transcript\", else /agent/transcript.jsonl).")
@_json_option
@pass_ctx
def session_new(ctx, name, guest, kernel, initrd, disk, disk_format, memory, vcpus, cmdline,
                transcript, as_json) -> None:
    """Define and start domain ksfs-NAME as session NAME.

    Without --guest or --kernel/--initrd/--disk the default guest template is used
    ($KSFS_GUEST or default_guest in the store's config.json).

    Example: ksfs session new agent --guest /var/cache/ksfs/guest --memory 256
    """
    # Settled here, not where the verb runs: a running mount's daemon has its own directory
    # and environment (QA: a relative path, or this shell's $KSFS_GUEST, was the daemon's).
    guest, kernel, initrd, disk = (os.path.abspath(p) if p else p
                                   for p in (guest, kernel, initrd, disk))
    if not (guest or kernel or initrd or disk) and os.environ.get("KSFS_GUEST"):
        guest = os.path.abspath(os.environ["KSFS_GUEST"])
    rec = run_verb(ctx, "session_new", steps=f"session new {name}", name=name, guest=guest,
                   kernel=kernel, initrd=initrd, disk=disk, memory=memory, vcpus=vcpus,
                   cmdline=cmdline, transcript=transcript,
                   # sent only when given: a daemon started before it existed still serves
                   **({"disk_format": disk_format} if disk_format else {}))
    emit_json(_as_session(rec)) if as_json else click.echo(
        f"session {name} running as {rec['domain']}")


@session.command("adopt")
@click.argument("name")
@click.argument("domain")
@click.option("--transcript", metavar="PATH",
              help=TRANSCRIPT_HELP + " (default: /agent/transcript.jsonl).")
@click.option("--no-start", is_flag=True,
              help="Leave a shut-off DOMAIN shut off (by default it is started).")
@_json_option
@pass_ctx
def session_adopt(ctx, name, domain, transcript, no_start, as_json) -> None:
    """Take existing libvirt DOMAIN (file-backed raw or qcow2 disks) under ksfs as NAME.

    A shut-off DOMAIN is started, unless --no-start (then `ksfs resume NAME` boots it later).

    Example: ksfs session adopt myvm my-libvirt-domain --transcript /var/log/agent.jsonl
    """
    # start is sent only when not the default: a daemon started before --no-start existed
    # still serves a plain adopt
    rec = run_verb(ctx, "session_adopt", name=name, domain=domain, transcript=transcript,
                   **({"start": False} if no_start else {}))
    emit_json(_as_session(rec)) if as_json else click.echo(
        f"session {name} adopted domain {domain}")


@session.command("list")
@click.option("--all", "show_all", is_flag=True,
              help="Also sessions removed with --keep-checkpoints (state: removed).")
@_json_option
@pass_ctx
def session_list(ctx, show_all, as_json) -> None:
    """List sessions with their state, domain, seq and last checkpoint.

    Example: ksfs session list --json
    """
    rows = ctx.open_keeper().list_sessions(include_removed=show_all)
    if as_json:
        emit_json(rows)
        return
    # columns as wide as their longest entry (QA: a long name pushed its row out of line)
    name_w = max([20, *(len(r["session"]) for r in rows)])
    dom_w = max([24, *(len(r["domain"] or "-") for r in rows)])
    for r in rows:
        click.echo(f"{r['session']:{name_w}} {r['state']:9} {r['domain'] or '-':{dom_w}} "
                   f"seq={r['seq']} " + (f"last={r['last_checkpoint']}" if r['last_checkpoint']
                                          else "no checkpoint"))


@session.command("rm")
@click.argument("name")
@click.option("--keep-checkpoints", is_flag=True,
              help="Keep its checkpoints, read-only (cat, diff, fork); the name stays taken "
                   "until a later rm without this flag.")
@click.option("--release", is_flag=True,
              help="For an adopted session: hand the domain back instead of destroying it "
                   "(kept defined and running, on disk files of its own).")
@click.option("--damaged", is_flag=True,
              help="Forget a session whose record no longer decodes (every verb that lists "
                   "sessions then stops, exit 6): its record, checkpoint records and events "
                   "go; its machine, if it had one, is left for you to remove, since the "
                   "record that named it is what is lost.")
@_json_option
@pass_ctx
def session_rm(ctx, name, keep_checkpoints, release, damaged, as_json) -> None:
    """Destroy and undefine the session's domain and remove the session.

    An adopted domain is destroyed and undefined too, unless --release: then it stays defined
    and in its state, and only ksfs's files leave its disks. A disk whose chain root is still
    the domain's own file gets ksfs's layers committed into it; a disk a restore replaced is
    copied to a new file beside the domain's own (disk.released.qcow2 for disk.qcow2), which
    keeps the machine as it was before that restore.

    Example: ksfs session rm agent --keep-checkpoints
    """
    # release and damaged only when asked: a daemon started before they existed still serves rm
    extra = {"release": True} if release else {}
    if damaged:
        extra["damaged"] = True
    res = run_verb(ctx, "session_rm", steps=f"session rm {name}" if release else None,
                   name=name, keep_checkpoints=keep_checkpoints, **extra)
    click.get_current_context().meta[DONE_NOTE] = f"session {name} was removed"
    if as_json:
        emit_json(res)
        return
    if damaged:
        click.echo(f"forgot session {name} (its record was damaged)")
        if res.get("machine_files"):
            click.echo(f"its machine is left as it was: its files are in "
                       f"{res['machine_files']}; `virsh list --all` shows its domain")
        return
    click.echo(f"removed session {name}" + (" (its checkpoints kept)" if keep_checkpoints else ""))
    if res.get("destroyed_domain"):
        click.echo(f"the adopted domain {res['destroyed_domain']} was destroyed and undefined "
                   f"with it (--release hands an adopted domain back instead)")
    if "released" in res:
        rel = res["released"]
        click.echo(f"domain {rel['domain']} kept" + (
            " (transient: libvirt forgets it when it stops; `virsh define` keeps it)"
            if rel.get("transient") else "") + "".join(
            f"\n  {t}: {f}" for t, f in sorted(rel["disks"].items())))
        for t, where in sorted(rel.get("detached_disks", {}).items()):
            click.echo(f"  {t} (detached): {where['how']} -> {where['file']}")


@main.command()
@click.argument("session_name", metavar="SESSION")
@click.argument("name", required=False)
@click.option("--live/--no-live", default=True,
              help="Copy the memory while the guest runs, pausing it only at the end (the "
                   "default); --no-live pauses it for the whole copy.")
@_json_option
@pass_ctx
def save(ctx, session_name, name, live, as_json) -> None:
    """Take an atomic checkpoint of SESSION (named NAME, else c_<seq>).

    An unnamed checkpoint whose c_<seq> a user already took gets the next free c_ number.
    Prints the checkpoint's name alone on its last line.

    Example: ksfs save agent before-upgrade
    """
    # live=True (the default) is not sent: a daemon started before --no-live existed still
    # takes the plain save (review)
    rec = run_verb(ctx, "save", steps=f"save {session_name}", session=session_name, name=name,
                   **({} if live else {"live": False}))
    # taken: a report that cannot be written must not read as if the save failed
    click.get_current_context().meta[DONE_NOTE] = \
        f"checkpoint {session_name}/{rec['name']} was stored"
    if as_json:
        emit_json(rec)
        return
    logical = sum(f["size"] for f in rec["files"])
    stored = sum(f["stored"] for f in rec["files"])
    click.echo(f"{session_name}: checkpoint at seq {rec['seq']}, {logical} bytes, "
               f"{stored} new bytes stored")
    click.echo(rec["name"])


@main.command()
@click.argument("session_name", metavar="SESSION")
@click.argument("checkpoint")
@_json_option
@pass_ctx
def restore(ctx, session_name, checkpoint, as_json) -> None:
    """Save SESSION's current state, then bring its machine back to CHECKPOINT.

    A machine that is shut off or crashed has its disks saved (a checkpoint without memory),
    so nothing it wrote is lost; the result's saved_as names what was saved.

    Example: ksfs restore agent before-upgrade
    """
    res = run_verb(ctx, "restore", steps=f"restore {session_name}", session=session_name,
                   checkpoint=checkpoint)
    if as_json:
        emit_json(res)
        return
    outcome = res.get("reconcile", {}).get("outcome", "?")
    saved = res.get("saved_as")
    booted = "; booted from its disks, as it has no memory" if res.get("booted") else ""
    click.echo(f"{session_name} restored to {checkpoint} (reconcile: {outcome}{booted}"
               + (f"; the state before was saved as {saved})" if saved else ")"))


@main.command()
@click.argument("session_name", metavar="SESSION")
@click.argument("checkpoint")
@click.argument("new")
@_json_option
@pass_ctx
def fork(ctx, session_name, checkpoint, new, as_json) -> None:
    """Start NEW, a session running from SESSION's CHECKPOINT in its own domain.

    Example: ksfs fork agent before-upgrade agent-try2
    """
    rec = run_verb(ctx, "fork", steps=f"fork {new}", session=session_name,
                   checkpoint=checkpoint, new=new)
    emit_json(_as_session(rec)) if as_json else click.echo(
        f"session {new} forked from {session_name}/{checkpoint}, running as {rec['domain']}")


@main.command()
@click.argument("session_name", metavar="SESSION")
@_json_option
@pass_ctx
def pause(ctx, session_name, as_json) -> None:
    """Pause SESSION's machine (its CPUs stop; nothing is saved).

    Example: ksfs pause agent
    """
    res = run_verb(ctx, "pause", session=session_name)
    emit_json(res) if as_json else click.echo(f"{session_name} paused")


@main.command()
@click.argument("session_name", metavar="SESSION")
@_json_option
@pass_ctx
def resume(ctx, session_name, as_json) -> None:
    """Run SESSION's paused machine again; one that is shut off or crashed is booted (to go
    back in time, use restore), one the guest suspended to RAM is woken.

    Example: ksfs resume agent
    """
    res = run_verb(ctx, "resume", session=session_name)
    if as_json:
        emit_json(res)
    elif res.get("booted"):
        click.echo(f"{session_name} running (booted from its disks: what its memory held is "
                   f"gone; `ksfs restore {session_name} CHECKPOINT` goes back to a saved state)")
    elif res.get("woken"):
        click.echo(f"{session_name} running (woken from its suspend to RAM)")
    else:
        click.echo(f"{session_name} running")


@main.command()
@click.argument("session_name", metavar="SESSION")
@_json_option
@pass_ctx
def status(ctx, session_name, as_json) -> None:
    """What SESSION's machine is doing: its state, seq, last checkpoint, the checkpoint it
    runs from, its parent and the verb in progress (as MNT/sessions/SESSION/status).

    Asked of the mount's daemon when one runs (it knows the verb in progress), else read here.

    Example: ksfs status agent --json
    """
    from ksfs.daemon.protocol import RemoteError, to_jsonable

    try:
        st = run_verb(ctx, "status", session=session_name)
    except RemoteError as exc:
        if "has no verb" not in str(exc):
            raise
        # a daemon an older ksfs started (review): read here, without the verb in progress
        st = to_jsonable(ctx.open_keeper().status(session_name))
    if as_json:
        emit_json(st)
        return
    held = st.get("running_from")
    if held and st.get("running_from_deleted"):
        held += " (deleted since)"
    parent = st.get("parent")
    rows = [
        ("session", st["session"]),
        ("state", st["state"]),
        ("domain", st.get("domain") or "-"),
        ("seq", st["seq"]),
        ("last checkpoint", st.get("last_checkpoint") or "-"),
        ("running from", held or "-"),
        ("forked from", f"{parent['session']} at {parent['checkpoint']} (its seq "
                        f"{parent['seq']})" if parent else "-"),
        ("doing", _doing(st.get("doing"))),
    ]
    for key, value in rows:
        click.echo(f"{key:16} {value}")


def _doing(doing: dict | None) -> str:
    """The verb in progress (keeper.activity's entry) in words: "save, ingest 3/8, for 2 s"."""
    if not doing:
        return "-"
    out = str(doing.get("verb"))
    if doing.get("step"):
        out += f", {doing['step']}"
        if doing.get("total"):
            out += f" {doing.get('done') or 0}/{doing['total']}"
    if doing.get("since"):
        out += f", for {max(0.0, time.time() - doing['since']):.0f} s"
    return out


@main.command()
@_json_option
@pass_ctx
def recover(ctx, as_json) -> None:
    """Finish or roll back what a dead daemon or host left half done, and re-adopt machines.

    Interrupted checkpoints are marked failed (none was ever visible), and a session a killed
    import made and nothing filled is removed, as a failed import removes it; an interrupted
    restore is finished when the machine already holds its checkpoint, else marked failed (and
    run again when the machine is gone); a machine found shut off or crashed has its disks
    saved, then comes back from its last checkpoint; forks that never started are rolled back,
    and those that did are reconciled and run. Each session touched gets a `recover` event. Exits
    10 when some session could not be recovered. The mount runs this at start.

    Example: ksfs recover --json
    """
    report = run_verb(ctx, "recover", steps="recover")
    if as_json:
        emit_json(report)
    elif not report:
        click.echo("recover: nothing to do")
    for r in report if not as_json else ():
        for action in r["actions"]:
            click.echo(f"{r['session']}: {action}")
    failed = [r["session"] for r in report if r.get("failed")]
    if failed:
        click.echo(f"ksfs: error: could not recover {', '.join(failed)}", err=True)
        sys.exit(VMError.exit_code)
