"""Ledger verbs: events, checkpoints, lineage, ledger verify. Read-only; they open the store here.

Each prints a human form by default and JSON with ``--json`` (the shapes are in docs/ledger.md).
They never write to the ledger.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import click

from ksfs.cli import U64, counted, emit_json, human_bytes, main, pass_ctx
from ksfs.errors import IntegrityError


def iso(t: float) -> str:
    """A UTC time to the millisecond, as in 2026-12-02T11:41:21.123Z."""
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@main.command()
@click.argument("session")
@click.option("--since", "since", type=U64, default=0, metavar="SEQ",
              help="Show events with seq >= SEQ (default 0: all).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@pass_ctx
def events(ctx, session: str, since: int, as_json: bool) -> None:
    """The host event log of SESSION: one line per event (seq, UTC time, type, body).

    Example: ksfs events demo --since 40 --json
    """
    for ev in ctx.ledger().events(session, since):
        if as_json:
            emit_json(ev.to_dict())
        else:
            body = json.dumps(ev.body, sort_keys=True, separators=(",", ":"))
            click.echo(f"{ev.seq:>6}  {iso(ev.time)}  {ev.type:<20}  {body}")


@main.command()
@click.argument("session")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON array of {name, seq, created, size, stored, files}.")
@pass_ctx
def checkpoints(ctx, session: str, as_json: bool) -> None:
    """The checkpoints of SESSION in seq order: name, seq, time, logical size, stored size.

    Logical size is the files' true byte size; stored size the compressed bytes each checkpoint
    was the first to bring into the store.

    Example: ksfs checkpoints demo --json
    """
    rows = ctx.ledger().checkpoint_summaries(session)
    if as_json:
        emit_json([
            {"name": r.name, "seq": r.seq, "created": r.created, "size": r.size,
             "stored": r.stored, "files": r.files}
            for r in rows
        ])
        return
    width = max([len(r.name) for r in rows] + [4])
    click.echo(f"{'NAME':<{width}}  {'SEQ':>6}  {'CREATED':<24}  {'SIZE':>10}  {'STORED':>10}")
    for r in rows:
        click.echo(f"{r.name:<{width}}  {r.seq:>6}  {iso(r.created):<24}  "
                   f"{human_bytes(r.size):>10}  {human_bytes(r.stored):>10}")


@main.command()
@click.argument("session")
@click.option("--json", "as_json", is_flag=True,
              help="One JSON object: {session, lineage, removed, chain: [{session, "
                   "checkpoint, seq, lineage, removed}]}.")
@pass_ctx
def lineage(ctx, session: str, as_json: bool) -> None:
    """The chain from SESSION back to its root: each parent session, branch checkpoint and seq.

    A parent that was removed, or whose branch checkpoint was deleted, still shows: the branch
    point is kept in the child's own records. "(removed)" marks a removed session (SESSION
    itself when it was removed with its checkpoints kept).

    Example: ksfs lineage demo-fork
    """
    led = ctx.ledger()
    rec = led.session(session)
    chain: list[dict[str, Any]] = []
    for fp in led.lineage(session):
        info = led.lineage_info(fp.lineage)
        chain.append({"session": fp.session, "checkpoint": fp.checkpoint, "seq": fp.seq,
                      "lineage": fp.lineage, "removed": info.removed is not None})
    if as_json:
        emit_json({"session": rec.name, "lineage": rec.lineage,
                   "removed": rec.removed is not None, "chain": chain})
        return
    gone = "  (removed)" if rec.removed is not None else ""
    click.echo(f"{rec.name}  lineage {rec.lineage}{gone}")
    for hop in chain:
        gone = "  (removed)" if hop["removed"] else ""
        click.echo(f"  <- {hop['session']} at {hop['checkpoint']} (seq {hop['seq']})  "
                   f"lineage {hop['lineage']}{gone}")
    if not chain:
        click.echo("  (root)")


@main.group("ledger")
def ledger_group() -> None:
    """The host ledger of the store: sessions, lineages, event logs, checkpoint records.

    Example: ksfs ledger verify
    """


@ledger_group.command()
@click.option("--json", "as_json", is_flag=True,
              help="Print {clean, problems, and the counts} as JSON (same exit codes).")
@pass_ctx
def verify(ctx, as_json: bool) -> None:
    """Check the ledger: rebuild every lineage from its own chain, gapless seqs from 0, every
    event decodes, every checkpoint's manifests in the store, every fork's parent recorded.

    Exit 0 and "ledger: clean" with counts when clean; else one line per problem and exit 6.

    Example: ksfs ledger verify
    """
    led = ctx.ledger()
    problems = led.verify(ctx.store())
    if as_json:
        emit_json(dict(led.stats(), clean=not problems, problems=list(problems)))
        if problems:
            raise click.exceptions.Exit(IntegrityError.exit_code)
        return
    if not problems:
        st = led.stats()
        click.echo(f"ledger: clean ({counted(st['sessions'], 'session')}, "
                   f"{counted(st['lineages'], 'lineage')}, {counted(st['events'], 'event')}, "
                   f"{counted(st['checkpoints'], 'checkpoint')})")
        return
    for p in problems:
        click.echo(f"ledger: {p}")
    click.echo(f"ledger: {counted(len(problems), 'problem')}", err=True)
    raise click.exceptions.Exit(IntegrityError.exit_code)
