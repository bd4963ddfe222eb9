"""The ksfs command line (click). Only this package imports click.

Commands live one family per module (store, ledger, vm, mount, gateway); this module holds the
root group, the global ``--store`` option and the one place that turns a KsfsError into one clear
line on stderr and its class's exit code.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import click

from ksfs import __version__
from ksfs.errors import BadInput, DaemonError, KsfsError, NoSpace, Terminated, from_foreign


def default_store() -> str:
    if os.environ.get("KSFS_STORE"):
        return os.environ["KSFS_STORE"]
    return str(Path(_home()) / ".local/share/ksfs")


def _home() -> str:
    # HOME set but empty (env HOME= ...) would put the store under the working directory or
    # /: the account's own home then, as when HOME is unset
    return os.environ.get("HOME") or _account_home()


def expand_home(path: str) -> str:
    """``path`` with a leading ``~`` or ``~user`` expanded as the shell does. A quoted
    --store '~/x', or KSFS_STORE='~/x' (the shell expands no ``~`` inside a value), reaches ksfs
    as it is, and made a directory named ``~`` under the working directory (issue #2 review).
    Plain ``~`` is the same home the default store lives in."""
    if path == "~" or path.startswith("~/"):
        return _home().rstrip("/") + path[1:] or "/"
    return os.path.expanduser(path)


def _account_home() -> str:
    import pwd

    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:  # a uid with no account: the old behaviour
        return str(Path.home())


class Context:
    """What every command gets: the store path, and the keeper (store + ledger) opened once.

    One process opens the LMDB environment once only (LMDB forbids opening it twice), so the store
    and ledger are always the keeper's.
    """

    def __init__(self, store_path: str) -> None:
        self.store_path = store_path
        self.keeper = None
        self.daemon_answered: str | None = None  # the verb whose result a daemon gave

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


def run_verb(ctx: Context, verb: str, steps: str | None = None, **args: Any) -> Any:
    """Run a keeper verb in the running daemon when there is one, else here under the same locks.

    Either way the result comes back JSON-shaped, so commands print one kind of value. With
    ``steps`` (a label), a terminal's standard error shows the verb's progress meanwhile.
    """
    from ksfs import progress
    from ksfs.cli.stepline import StepLine
    from ksfs.daemon.client import NO_DAEMON, call_daemon
    from ksfs.daemon.protocol import VERBS, to_jsonable

    line = StepLine.for_terminal(steps) if steps else None
    try:
        result = call_daemon(ctx.store_path, verb, progress=line, **args)
        if result is not NO_DAEMON:
            ctx.daemon_answered = verb  # a result of another shape is its error: see _foreign
            return result
        create = verb in ("session_new", "session_adopt", "import")
        with making_store(ctx) if create else contextlib.nullcontext(ctx.open_keeper()) \
                as keeper, progress.reporting(line):
            return to_jsonable(getattr(keeper, VERBS[verb])(**args))
    finally:
        if line is not None:
            line.close()


def _unused(ctx: Context) -> bool:
    """Whether the store just made holds nothing and no other command is in a verb on it (two
    first commands on one new store: the one refused must not remove the other's)."""
    try:
        keeper = ctx.open_keeper()
        fd = keeper.store.lock(exclusive=True, timeout=0)  # Busy (a KsfsError) when held
    except KsfsError:
        return False
    try:
        return not keeper.ledger.sessions(include_removed=True) \
            and keeper.store.stats()["chunks"] == 0
    except KsfsError:
        return False
    finally:
        os.close(fd)


@contextlib.contextmanager
def making_store(ctx: Context) -> Iterator[Any]:
    """The keeper of the store for a verb that makes it when missing (session new, adopt,
    import): held shared while the block runs, so a store another such verb is making
    something in is never taken for one made for nothing, and removed again when the block
    fails having made it (_unmade_on_failure)."""
    with _unmade_on_failure(ctx):
        keeper = ctx.open_keeper(create=True)
        held = keeper.store.lock(exclusive=False)
        try:
            yield keeper
        finally:
            os.close(held)


@contextlib.contextmanager
def _unmade_on_failure(ctx: Context) -> Iterator[None]:
    """A store the block creates is removed again when the block fails: the verb changed
    nothing, so it made no store either (QA: a `session new` refused at a mistyped --store left
    a whole store there, which later commands then took for the user's)."""
    from ksfs.cas.store import MARKER

    path = Path(ctx.store_path).absolute()
    if (path / MARKER).exists():
        yield
        return
    top = None  # the first directory of the path that is not there yet
    at = path
    while not os.path.lexists(at) and at != at.parent:
        top, at = at, at.parent
    before = set(os.listdir(path)) if top is None and path.is_dir() else None
    try:
        yield
    except BaseException:
        if not (path / MARKER).exists() or not _unused(ctx):
            raise  # none was made, or another command is using it
        ctx.close()
        import shutil  # here: with its bz2 and lzma it would cost every command 2 ms at start

        if top is not None:
            shutil.rmtree(top, ignore_errors=True)
        elif before is not None:  # an empty directory given as the store: emptied again
            for name in set(os.listdir(path)) - before:
                made = path / name
                if made.is_dir() and not made.is_symlink():
                    shutil.rmtree(made, ignore_errors=True)
                else:
                    made.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def steps_on_terminal(label: str) -> Iterator[None]:
    """Show the steps of what runs in the block on a terminal's standard error (as run_verb's
    ``steps``), for verbs the command runs here (check, gc)."""
    from ksfs import progress
    from ksfs.cli.stepline import StepLine

    line = StepLine.for_terminal(label)
    try:
        with progress.reporting(line):
            yield
    finally:
        if line is not None:
            line.close()


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, sort_keys=True))


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


#: A whole number the store packs as an unsigned 64-bit integer (a seq): anything outside
#: 0..2**64-1 is refused while parsing, before it can reach struct.pack.
U64 = click.IntRange(min=0, max=2**64 - 1)

#: Key of ``click.Context.meta`` (shared by every context of one run): what a command already
#: changed before printing its report, so a failed write of that report does not read as if
#: nothing happened.
DONE_NOTE = "ksfs.done"


def _writes_stdout(exc: OSError) -> bool:
    """Whether ``exc`` was raised writing standard output: by click.echo to stdout or by a
    command writing fd 1 itself (cat). Judged from the frame that raised it, since click.echo
    flushes after every call: any other OSError is not an output error and keeps its traceback.
    """
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    for name in ("file", "out", "fd"):
        target = tb.tb_frame.f_locals.get(name)
        if target is None:
            continue
        if isinstance(target, int) and not isinstance(target, bool):
            if target == 1:
                return True
            continue
        try:
            if target.fileno() == 1:
                return True
        except (AttributeError, OSError, ValueError):  # not a file (click's test runner)
            continue
    return False


def _stdout_to_devnull() -> None:
    # What is still buffered in sys.stdout is flushed again when Python exits; onto a broken fd
    # that prints "Exception ignored ... BrokenPipeError" (or ENOSPC) after our own line.
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    os.dup2(devnull, 1)
    os.close(devnull)


def _output_failed(ctx: click.Context | None, exc: OSError) -> NoReturn:
    _stdout_to_devnull()
    if exc.errno == errno.EPIPE:
        # The reader went away (head, a pager closed early): quietly, and the same for every
        # command, with the status a process killed by SIGPIPE has (141), as GNU tools end:
        # a `set -o pipefail` script must not take a cut-short `ksfs check` for a whole one.
        sys.exit(128 + signal.SIGPIPE)
    done = ctx.meta.get(DONE_NOTE) if ctx is not None else None
    click.echo(f"ksfs: error: cannot write to standard output: {exc.strerror or exc}"
               + (f" ({done})" if done else ""), err=True)
    # a full disk has its own status, as everywhere else (QA: `> /dev/full` exited 1)
    sys.exit(NoSpace.exit_code if exc.errno == errno.ENOSPC else 1)


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

    _argv: tuple[str, list[str]] = ("ksfs", [])

    def make_context(self, info_name: str | None, args: list[str],
                     parent: click.Context | None = None, **extra: Any) -> click.Context:
        if parent is None and not extra.get("resilient_parsing"):
            # kept to name the sub-command in a usage error click raises without a context
            self._argv = (info_name or "ksfs", list(args))
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except OSError as exc:  # --help or --version written to a full disk or a closed pipe
            if not _writes_stdout(exc):
                raise
            _output_failed(None, exc)

    def _command_path(self) -> str:
        """The deepest command the recorded argv names, found the way shell completion does:
        parsing again without callbacks or errors (resilient_parsing)."""
        prog, args = self._argv
        try:
            ctx = self.make_context(prog, list(args), resilient_parsing=True)
            while isinstance(ctx.command, click.Group):
                # click keeps the sub-command's name apart (protected_args, deprecated to read)
                rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
                if not rest:
                    break
                name, cmd, rest = ctx.command.resolve_command(ctx, rest)
                if cmd is None:
                    break
                ctx = cmd.make_context(name, rest, parent=ctx, resilient_parsing=True)
            return ctx.command_path
        except (click.ClickException, click.exceptions.Exit):
            return prog

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        _terminate_like_interrupt()
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as exc:
            exc.show()  # a bare group: its help, as click shows it
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            # click raises some parse errors of a sub-command (an option missing its value)
            # with no context, or the root's: the hint must still name the sub-command.
            if exc.ctx is not None and exc.ctx.parent is not None:
                where = exc.ctx.command_path
            else:
                where = self._command_path()
            message = exc.format_message()
            if isinstance(exc, click.BadParameter) and isinstance(exc.param, click.Option) \
                    and exc.message:  # (a missing option has none: click's own words then)
                message = f"{'/'.join(exc.param.opts)}: {exc.message}"  # the option first
            click.echo(f"ksfs: error: {one_line(message)} (see '{where} --help')", err=True)
            sys.exit(2)
        except click.ClickException as exc:
            click.echo(f"ksfs: error: {one_line(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort as exc:
            if sys.stderr is not None and sys.stderr.isatty():
                click.echo(err=True)  # ends the terminal's "^C" line; piped, one line only
            done = str(exc)  # what the verb finished before the interruption, if it did
            click.echo("ksfs: error: aborted" + (f" ({done})" if done else ""), err=True)
            sys.exit(130)  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KsfsError as exc:
            click.echo(f"ksfs: error: {one_line(str(exc))}", err=True)
            sys.exit(exc.exit_code)
        except Terminated as exc:
            _say_terminated(ctx, exc)
        except KeyboardInterrupt:
            # raised as Abort here so click does not first print a blank line of its own;
            # QA (eighteenth session): a save interrupted once its checkpoint was published
            # said "aborted" alone
            _abort(ctx)
        except OSError as exc:
            if _writes_stdout(exc):
                _output_failed(ctx, exc)
            else:
                _foreign(ctx, exc)
        except Exception as exc:
            _foreign(ctx, exc)
        finally:
            obj = ctx.find_object(Context)
            if obj is not None:
                try:
                    obj.close()
                except Terminated as exc:
                    _say_terminated(ctx, exc)
                except KeyboardInterrupt:  # the verb done, its closing cut short
                    _abort(ctx)


def _abort(ctx: click.Context) -> NoReturn:
    """Ctrl-C: "aborted", with what the verb had done by then (DONE_NOTE)."""
    raise click.Abort(ctx.meta.get(DONE_NOTE) or "") from None


def _say_terminated(ctx: click.Context, exc: Terminated) -> NoReturn:
    done = ctx.meta.get(DONE_NOTE)
    click.echo("ksfs: error: terminated" + (f" ({done})" if done else ""), err=True)
    sys.exit(128 + exc.signum)  # as a shell reports it: 143 SIGTERM, 129 SIGHUP


def _terminate_like_interrupt() -> None:
    """SIGTERM and SIGHUP raise Terminated in the main thread, unless something chose
    otherwise (a parent that ignores them for us, as nohup does for SIGHUP; trio's own handler
    in the daemon and the gateway). QA (fifteenth session): an import cut by SIGHUP left its
    pack bytes, where SIGTERM's cleaned up."""
    import signal

    def on_term(signum: int, frame: Any) -> None:
        raise Terminated(signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) is signal.SIG_DFL:
            signal.signal(signum, on_term)


def _foreign(ctx: click.Context, exc: Exception) -> None:
    """An error a lower library raised past its layer: its ksfs class when it is one ksfs knows
    (a damaged index, a full disk, a refused permission, a daemon's result that could not be
    read), else a bug, raised as it is."""
    obj = ctx.find_object(Context)
    known = from_foreign(exc, obj.store_path if obj is not None else "the store")
    if known is None and obj is not None and obj.daemon_answered \
            and isinstance(exc, (TypeError, KeyError, IndexError, AttributeError, ValueError)):
        # What a daemon answered is read by each command as the verb's result; one of another
        # shape (a daemon of another ksfs version, or whatever listens on a planted socket)
        # failed reading it with a traceback (security QA F13): the daemon's error instead.
        known = DaemonError(
            f"the daemon of {obj.store_path} answered {obj.daemon_answered.replace('_', ' ')} "
            f"with a result this ksfs cannot read ({type(exc).__name__}: {exc}); a daemon "
            "another ksfs version started is replaced by `ksfs umount` and `ksfs mount`")
    if known is None:
        raise exc
    click.echo(f"ksfs: error: {one_line(str(known))}", err=True)
    sys.exit(known.exit_code)


def one_line(text: str) -> str:
    """An error as one line: a newline, a terminal escape or another unprintable character in
    a path or name it quotes is written as its escape (\\n, \\x1b)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


@click.group(cls=KsfsGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--store",
    "store_path",
    envvar="KSFS_STORE",
    default=default_store,
    show_default="$KSFS_STORE or ~/.local/share/ksfs",
    help="The store directory (a leading ~ is the home directory, in $KSFS_STORE too).",
)
@click.version_option(version=__version__, package_name="ksfs")
@click.pass_context
def main(ctx: click.Context, store_path: str) -> None:
    """KeepState FS: durable virtual machines as a filesystem of sessions, checkpoints and forks.

    Exit codes: 0 ok, 1 other error, 2 bad input, 3 not found, 4 already exists, 5 not a store,
    6 damaged data, 7 chunker unavailable, 8 busy, 9 no space, 10 virtual machine error,
    11 not used, 12 read-only or not permitted, 13 daemon error, 14 the daemon did not answer
    (for 30 s, or $KSFS_DAEMON_SILENCE seconds) or still holds the store, 130 interrupted (Ctrl-C),
    141 the reader of the output went away (as if killed by SIGPIPE), 143 or 129 terminated
    (SIGTERM or SIGHUP: a verb ends as on Ctrl-C).

    \b
    Example:
      ksfs --store /srv/ksfs import demo c1 disk.raw memory
      ksfs --store /srv/ksfs checkpoints demo
    """
    if sys.stdout is None:
        # fd 1 was closed when we started: the next file we open (the store's) would get fd 1
        # and our output would land in it, or be dropped unseen. Refuse before opening anything.
        raise BadInput("standard output is closed")
    if not store_path:
        # an empty --store would silently mean the current directory; an empty $KSFS_STORE
        # never gets here (click treats it as unset and default_store skips it)
        raise BadInput("--store is empty: name the store directory")
    from ksfs.heap import tune_for_bulk_reads

    tune_for_bulk_reads()  # imports, saves and reads stream 8 MiB batches: see ksfs/heap.py
    keep_others_from_writing()
    _log_lines_like_errors()
    ctx.obj = Context(os.path.abspath(expand_home(store_path)))


def keep_others_from_writing() -> None:
    """Mask group and other write bits whatever the caller's umask: under umask 000 the store,
    its vm/ directory and the daemon's log were world-writable, so any local user could plant
    symlinks in them or rewrite the log (QA, fifteenth session). Read bits stay the caller's."""
    os.umask(os.umask(0o022) | 0o022)


class _LineFormatter:
    """``ksfs: warning: ...``: one line, as errors are written."""

    def format(self, record: Any) -> str:
        return f"ksfs: {record.levelname.lower()}: {one_line(record.getMessage())}"


def _log_lines_like_errors() -> None:
    # What a verb logs beside its answer (a disk handed back, a leftover removed) would reach
    # stderr through Python's last-resort handler, bare; the daemon and the mount log to files.
    import logging

    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(_LineFormatter())  # type: ignore[arg-type]
        handler.setLevel(logging.WARNING)
        root.addHandler(handler)


def counted(count: int, word: str) -> str:
    """``1 chunk``, ``2 chunks``: a count with its noun, for people."""
    return f"{count} {word}{'' if count == 1 else 's'}"


class Seconds(click.ParamType):
    """A number of seconds > 0 (a wait): not negative, 0, nan or infinite."""

    name = "seconds"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        import math

        try:
            secs = float(value)
        except (TypeError, ValueError):
            self.fail(f"must be a number of seconds > 0, not {value!r}", param, ctx)
        if not math.isfinite(secs) or secs <= 0:
            self.fail(f"must be a number of seconds > 0, not {value}", param, ctx)
        return secs


SECONDS = Seconds()


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
