"""The ksfs command line (click). Only this package imports click.

Commands live one family per module (store, ledger, vm, mount, gateway); this module holds the
root group, the global ``--store`` option and the one place that turns a KsfsError into one clear
line on stderr and its class's exit code.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from ksfs.errors import KsfsError


def default_store() -> str:
    return os.environ.get("KSFS_STORE") or str(Path.home() / ".local/share/ksfs")


class Context:
    """What every command gets: the store path, and the keeper (store + ledger) opened once.

    One process opens the LMDB environment once only (LMDB forbids opening it twice), so the store
    and ledger are always the keeper's.
    """

    def __init__(self, store_path: str) -> None:
        self.store_path = store_path
        self.keeper = None

    def open_keeper(self, create: bool = False):  # -> Keeper
        from ksfs.keeper import Keeper

        if self.keeper is None:
            self.keeper = Keeper(self.store_path, create=create)
        return self.keeper

    def store(self, create: bool = False):  # -> ChunkStore
        return self.open_keeper(create).store

    def ledger(self, create: bool = False):  # -> Ledger
        return self.open_keeper(create).ledger

    def close(self) -> None:
        if self.keeper is not None:
            self.keeper.close()
            self.keeper = None


pass_ctx = click.make_pass_decorator(Context)


def run_verb(ctx: Context, verb: str, **args: Any) -> Any:
    """Run a keeper verb in the running daemon when there is one, else here under the same locks.

    Either way the result comes back JSON-shaped, so commands print one kind of value.
    """
    from ksfs.daemon.client import NO_DAEMON, call_daemon
    from ksfs.daemon.protocol import VERBS, to_jsonable

    result = call_daemon(ctx.store_path, verb, **args)
    if result is not NO_DAEMON:
        return result
    keeper = ctx.open_keeper(create=verb in ("session_new", "session_adopt", "import"))
    return to_jsonable(getattr(keeper, VERBS[verb])(**args))


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, sort_keys=True))


class KsfsGroup(click.Group):
    """Turns every KsfsError, and click's own usage errors, into one line on stderr and the
    error's exit code (usage errors are bad input: 2).

    Only the store verbs are registered when ksfs.cli is imported, so ``ksfs cat`` and ``ksfs
    import`` start without importing the other families (and subprocess, datetime, ...). Looking
    up any other name, or reading ``commands`` (help, docs, tests), registers the rest first.
    """

    @property
    def commands(self) -> dict[str, click.Command]:
        _register_rest()
        return self._commands

    @commands.setter
    def commands(self, value: dict[str, click.Command]) -> None:
        self._commands = value

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        cmd = self._commands.get(cmd_name)
        return cmd if cmd is not None else self.commands.get(cmd_name)

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()  # a bare group: its help, as click shows it
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx else "ksfs"
            click.echo(f"ksfs: error: {exc.format_message()} (see '{where} --help')", err=True)
            sys.exit(2)
        except click.ClickException as exc:
            click.echo(f"ksfs: error: {exc.format_message()}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("ksfs: error: aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KsfsError as exc:
            click.echo(f"ksfs: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        finally:
            obj = ctx.find_object(Context)
            if obj is not None:
                obj.close()


@click.group(cls=KsfsGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--store",
    "store_path",
    envvar="KSFS_STORE",
    default=default_store,
    show_default="$KSFS_STORE or ~/.local/share/ksfs",
    help="The store directory.",
)
@click.version_option(package_name="ksfs")
@click.pass_context
def main(ctx: click.Context, store_path: str) -> None:
    """KeepState FS: durable virtual machines as a filesystem of sessions, checkpoints and forks.

    Exit codes: 0 ok, 1 other error, 2 bad input, 3 not found, 4 already exists, 5 not a store,
    6 damaged data, 7 chunker unavailable, 8 busy, 9 no space, 10 virtual machine error,
    11 gateway/budget, 12 read-only or not permitted, 13 daemon error.
    """
    from ksfs.heap import tune_for_bulk_reads

    tune_for_bulk_reads()  # imports, saves and reads stream 8 MiB batches: see ksfs/heap.py
    ctx.obj = Context(store_path)


FAMILIES = ("store_cmds", "ledger_cmds", "vm_cmds", "mount_cmds", "gateway_cmds")
_registered: list[str] = []
_loading = False  # a family's import adds commands through ``commands``: that must not recurse


def _register(families: tuple[str, ...]) -> None:
    # Each command family registers itself on import; a missing module (work in progress) must not
    # break the others.
    import importlib

    global _loading
    _loading = True
    try:
        for mod in families:
            if mod in _registered:
                continue
            try:
                importlib.import_module(f"ksfs.cli.{mod}")
            except ModuleNotFoundError as exc:
                if exc.name != f"ksfs.cli.{mod}":
                    raise
            # only now: a family whose import failed is tried again, not silently missing
            _registered.append(mod)
    finally:
        _loading = False


def _register_rest() -> None:
    if not _loading and len(_registered) < len(FAMILIES):
        _register(FAMILIES)


_register(FAMILIES[:1])
