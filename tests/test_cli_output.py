"""Where the command line's output goes wrong, through the real command line (a subprocess per
call): standard output closed, full, or a pipe whose reader went away; Ctrl-C; option values out
of range or missing; an empty --store; gc's human report; examples in every group's help."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli_store import ksfs, store_snapshot

KSFS = [sys.executable, "-m", "ksfs.cli"]
FULL = "cannot write to standard output: No space left on device"


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A fresh store holding s/c1 (one file, 'memory', 200 KB)."""
    store = tmp_path / "store"
    f = tmp_path / "memory"
    f.write_bytes(os.urandom(100_000) * 2)
    ksfs(store, "import", "s", "c1", str(f))
    return store


def one_line(res: subprocess.CompletedProcess) -> str:
    err = res.stderr.decode() if isinstance(res.stderr, bytes) else res.stderr
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ksfs: error: "), err
    return lines[0]


def with_stdout(stdout, store: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(KSFS + ["--store", str(store), *args], stdout=stdout,
                          stderr=subprocess.PIPE, timeout=120, **kw)


# --- 1. an integer packed as u64 ---------------------------------------------------------------


def test_since_beyond_u64_is_one_line_exit_2(store: Path) -> None:
    for bad in (str(2**64), str(2**70), "-1", "x"):
        res = ksfs(store, "events", "s", "--since", bad, check=False)
        assert res.returncode == 2, res.stderr
        assert "--since" in one_line(res) and b"Traceback" not in res.stderr
    assert ksfs(store, "events", "s", "--since", str(2**64 - 1)).stdout == b""
    assert ksfs(store, "events", "s", "--since", "1").stdout.split()[0] == b"1"


# --- 2. standard output: full, closed, or its reader gone ---------------------------------------


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["cat", "s", "c1", "memory"], ["stats"], ["stats", "--json"],
                                  ["events", "s"], ["checkpoints", "s"], ["--help"]])
def test_a_full_stdout_is_one_line_exit_9(store: Path, args: list[str]) -> None:
    with open("/dev/full", "wb") as full:
        res = with_stdout(full, store, *args)
    # no space, as every full disk (QA, fifteenth session: it was 1)
    assert res.returncode == 9, res.stderr
    assert one_line(res) == f"ksfs: error: {FULL}"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_stdout_after_import_says_the_checkpoint_was_stored(store: Path,
                                                                   tmp_path: Path) -> None:
    f = tmp_path / "memory"
    with open("/dev/full", "wb") as full:
        res = with_stdout(full, store, "import", "s", "c2", str(f))
    assert res.returncode == 9, res.stderr
    assert one_line(res) == f"ksfs: error: {FULL} (checkpoint s/c2 was stored)"
    names = [c["name"] for c in json.loads(ksfs(store, "checkpoints", "s", "--json").stdout)]
    assert names == ["c1", "c2"]


@pytest.mark.parametrize("args", [["cat", "s", "c1", "memory"], ["stats"], ["events", "s"],
                                  ["import", "s", "c2", "FILE"], ["rm", "s", "c1"], ["gc"]])
def test_a_closed_stdout_is_refused_before_anything(store: Path, tmp_path: Path,
                                                    args: list[str]) -> None:
    args = [str(tmp_path / "memory") if a == "FILE" else a for a in args]
    before = store_snapshot(store)
    res = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *KSFS, "--store", str(store), *args],
                         capture_output=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert one_line(res) == "ksfs: error: standard output is closed"
    assert store_snapshot(store) == before


@pytest.mark.parametrize("args", [["cat", "s", "c1", "memory"], ["stats"], ["stats", "--json"],
                                  ["events", "s"], ["checkpoints", "s"], ["gc"],
                                  ["import", "s", "c2", "FILE"]])
def test_a_reader_gone_is_quiet_exit_141(store: Path, tmp_path: Path, args: list[str]) -> None:
    """The pipe's read end is closed before ksfs writes: every write fails with EPIPE. Every
    command ends the same way: nothing on stderr (no "Exception ignored"), exit 141 (as if
    killed by SIGPIPE, like GNU tools: a pipefail script sees the output was cut short)."""
    args = [str(tmp_path / "memory") if a == "FILE" else a for a in args]
    r, w = os.pipe()
    os.close(r)
    try:
        res = with_stdout(w, store, *args)
    finally:
        os.close(w)
    assert (res.returncode, res.stderr) == (141, b"")
    if args[0] == "import":
        assert "c2" in ksfs(store, "checkpoints", "s").stdout.decode()


def test_a_reader_that_stops_early_is_quiet(store: Path) -> None:
    """`ksfs cat ... | head -c1`: the reader takes one byte and goes."""
    proc = subprocess.Popen(KSFS + ["--store", str(store), "cat", "s", "c1", "memory"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(proc.stdout.read(1)) == 1
    proc.stdout.close()
    err = proc.stderr.read()
    assert (proc.wait(timeout=60), err) == (141, b"")


# --- 3. an empty --store ------------------------------------------------------------------------


def test_an_empty_store_option_is_bad_input(store: Path, tmp_path: Path) -> None:
    """Run from inside a store, --store "" would have meant that store: refused, unchanged."""
    before = store_snapshot(store)
    for args in (["stats"], ["import", "s", "c2", str(tmp_path / "memory")], ["rm", "s", "c1"]):
        res = subprocess.run(KSFS + ["--store", "", *args], capture_output=True, cwd=store,
                             timeout=120)
        assert res.returncode == 2, res.stderr
        assert "--store is empty" in one_line(res)
    assert store_snapshot(store) == before


def test_an_empty_ksfs_store_variable_still_means_the_default(tmp_path: Path) -> None:
    env = dict(os.environ, KSFS_STORE="", HOME=str(tmp_path))
    res = subprocess.run(KSFS + ["stats"], capture_output=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert res.returncode == 5, res.stderr
    assert str(tmp_path / ".local/share/ksfs") in one_line(res)


def test_a_tilde_in_the_store_option_or_variable_is_the_home(tmp_path: Path) -> None:
    """Issue #2 review: --store '~/x' (quoted) and KSFS_STORE='~/x' (no shell expands a tilde
    inside a value) made a directory named ~ under the working directory."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    src = tmp_path / "memory"
    src.write_bytes(b"tilde" * 1000)
    for how, store in ((["--store", "~/by-option"], "by-option"), ([], "by-variable")):
        env = dict(os.environ, HOME=str(home), KSFS_STORE="~/by-variable")
        res = subprocess.run(KSFS + how + ["import", "s", "c1", str(src)], capture_output=True,
                             env=env, cwd=work, timeout=120)
        assert res.returncode == 0, res.stderr
        assert (home / store / "ksfs.json").is_file(), how
        res = subprocess.run(KSFS + how + ["cat", "s", "c1", "memory"], capture_output=True,
                             env=env, cwd=work, timeout=120)
        assert res.stdout == src.read_bytes(), res.stderr
    assert list(work.iterdir()) == []  # no directory named ~
    env = dict(os.environ, HOME=str(home))
    res = subprocess.run(KSFS + ["--store", "~", "stats"], capture_output=True, env=env,
                         cwd=work, timeout=120)
    assert res.returncode == 5 and f"{home} is not a ksfs store" in one_line(res), res.stderr


def test_an_empty_home_means_the_accounts_home_not_the_working_directory(tmp_path: Path
                                                                         ) -> None:
    """QA (tenth session): with HOME set but empty the default store was under the working
    directory (or /, where root would have made it)."""
    import pwd

    env = dict(os.environ, KSFS_STORE="", HOME="")
    res = subprocess.run(KSFS + ["stats"], capture_output=True, env=env, cwd=tmp_path,
                         timeout=120)
    home = pwd.getpwuid(os.getuid()).pw_dir
    if (Path(home) / ".local/share/ksfs").is_dir():  # the account has a store: stats of it
        assert res.returncode == 0, res.stderr
    else:
        assert str(Path(home) / ".local/share/ksfs") in one_line(res), res.stderr
    assert not (tmp_path / ".local").exists()


# --- 4. gc's human report -----------------------------------------------------------------------


def test_gc_prints_a_short_summary_and_json_as_before(store: Path, tmp_path: Path) -> None:
    ksfs(store, "rm", "s", "c1")
    out = ksfs(store, "gc").stdout.decode().splitlines()
    assert len(out) == 1 and out[0].startswith("gc: freed "), out
    # (QA: it said "1 packs")
    assert " in " in out[0] and "chunks" in out[0] and "removed 1 pack," in out[0]
    assert "=" not in out[0] and "[" not in out[0], out
    freed = int(out[0].split()[2])
    assert freed > 100_000  # the 200 KB file (100 KB stored twice over, compressed or not)
    data = json.loads(ksfs(store, "gc", "--json").stdout)
    assert {"chunks_freed", "bytes_freed", "packs_removed", "packs_repacked"} <= set(data)
    assert data["bytes_freed"] == 0  # nothing left to free


# --- 5. Ctrl-C ----------------------------------------------------------------------------------

INTERRUPT = """
import os, signal, sys
# As at a terminal: a shell that starts a job in the background (CI's runner may) makes it
# ignore SIGINT, and Python keeps an ignored SIGINT ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
from {module} import {cls} as patched
method = patched.{method}
def interrupted(self, *a, **k):
    os.kill(os.getpid(), signal.{sig})  # Ctrl-C (or a kill) while the command works
    return method(self, *a, **k)
patched.{method} = interrupted
from ksfs.cli import main
main(sys.argv[1:], prog_name="ksfs")
"""


def interrupted(store: Path, where: tuple[str, str, str],
                *args: str, sig: str = "SIGINT") -> subprocess.CompletedProcess:
    module, cls, method = where
    code = INTERRUPT.format(module=module, cls=cls, method=method, sig=sig)
    return subprocess.run([sys.executable, "-c", code, "--store", str(store), *args],
                          capture_output=True, timeout=120)


def test_ctrl_c_during_import_exits_130_and_records_the_failure(store: Path,
                                                                tmp_path: Path) -> None:
    res = interrupted(store, ("ksfs.cas.ingest", "Ingest", "add_file"),
                      "import", "s", "c2", str(tmp_path / "memory"))
    assert res.returncode == 128 + signal.SIGINT, res.stderr
    assert res.stderr.decode() == "ksfs: error: aborted\n"
    names = [c["name"] for c in json.loads(ksfs(store, "checkpoints", "s", "--json").stdout)]
    assert names == ["c1"]
    events = [json.loads(ln) for ln in ksfs(store, "events", "s", "--json").stdout.splitlines()]
    assert events[-1]["type"] == "checkpoint.failed"
    assert {k: v for k, v in events[-1]["body"].items() if k != "begin_seq"} == \
        {"name": "c2", "reason": "interrupted"}
    assert ksfs(store, "check").returncode == 0


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_sigterm_during_import_exits_143_and_records_the_failure(store: Path, tmp_path: Path,
                                                                  sig: str) -> None:
    """QA (eleventh session): SIGTERM killed an import outright, leaving its checkpoint.begin
    unanswered until a recover; it now ends as Ctrl-C does, and says so. QA (fifteenth
    session): SIGHUP (the terminal closed) still did, leaving its pack bytes."""
    res = interrupted(store, ("ksfs.cas.ingest", "Ingest", "add_file"),
                      "import", "s", "c2", str(tmp_path / "memory"), sig=sig)
    assert res.returncode == 128 + getattr(signal, sig), res.stderr
    assert res.stderr.decode() == "ksfs: error: terminated\n"
    events = [json.loads(ln) for ln in ksfs(store, "events", "s", "--json").stdout.splitlines()]
    assert events[-1]["type"] == "checkpoint.failed"
    assert events[-1]["body"]["reason"] == "terminated"
    report = json.loads(ksfs(store, "check", "--json").stdout)
    assert report["ok"] and report["unfinished_packs"] == 0, report


def test_ctrl_c_once_the_work_is_done_says_it_is(store: Path, tmp_path: Path) -> None:
    """QA (eighteenth session): a verb whose work was done (its output written) and whose
    closing was cut short by Ctrl-C said "aborted" alone."""
    res = interrupted(store, ("ksfs.cli", "Context", "close"),
                      "import", "s", "c2", str(tmp_path / "memory"))
    assert res.returncode == 130, res.stderr
    assert res.stderr.decode() == "ksfs: error: aborted (checkpoint s/c2 was stored)\n"
    names = [c["name"] for c in json.loads(ksfs(store, "checkpoints", "s", "--json").stdout)]
    assert names == ["c1", "c2"]


def test_session_list_keeps_its_columns_for_long_names(store: Path, tmp_path: Path) -> None:
    """QA (eighteenth session): a 65-character name pushed its row's columns out of line."""
    long = "l" * 65
    ksfs(store, "import", long, "c1", str(tmp_path / "memory"))
    rows = ksfs(store, "session", "list").stdout.decode().splitlines()
    assert len(rows) == 2 and {r.index(" offline ") for r in rows} == {65}, rows
    assert {r.index(" seq=") for r in rows} == {65 + 1 + 9 + 1 + 24}, rows


def test_ctrl_c_in_a_reading_command_exits_130(store: Path) -> None:
    res = interrupted(store, ("ksfs.keeper", "Keeper", "stats"), "stats")
    assert res.returncode == 130, res.stderr
    assert res.stderr.decode() == "ksfs: error: aborted\n"


def fd_links(pid: int) -> list[str]:
    """What process ``pid``'s open files are (those still open as they are read)."""
    out = []
    for f in Path(f"/proc/{pid}/fd").iterdir():
        try:
            out.append(os.readlink(f))
        except FileNotFoundError:  # closed meanwhile
            pass
    return out


def test_a_command_stopped_while_the_daemon_runs_its_verb_says_the_daemon_finishes_it(
        tmp_path: Path) -> None:
    """QA (seventeenth session): SIGTERM of a command whose verb the mount daemon ran said
    "terminated" alone, while the daemon went on and finished it (a whole restore)."""
    from ksfs.keeper.locks import session_lock
    from tests.cli_helpers import daemon_mount, flock_waited_on
    from tests.cli_helpers import ksfs as ksfs_with

    env = dict(os.environ, KSFS_GUEST="")
    src = tmp_path / "f.img"
    src.write_bytes(b"kept\n")
    with daemon_mount(tmp_path, env) as (store, mnt):
        ksfs_with(store, env, "import", "s", "c", str(src))
        with session_lock(store, "s") as held:  # the daemon's rm waits for it
            proc = subprocess.Popen(KSFS + ["--store", str(store), "rm", "s", "c"], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                # The daemon waiting on the lock proves the request reached it (a socket in
                # the command's files, which an earlier version waited for, comes before the
                # connect and the send).
                deadline = time.monotonic() + 60
                while not flock_waited_on(held):
                    assert proc.poll() is None and time.monotonic() < deadline
                    time.sleep(0.02)
                assert any(link.startswith("socket:") for link in fd_links(proc.pid))
                proc.send_signal(signal.SIGTERM)
                _, err = proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert proc.returncode == 128 + signal.SIGTERM, err
        assert err.decode() == ("ksfs: warning: the mount daemon finishes the rm it had begun; "
                                "this command only stops waiting for it\n"
                                "ksfs: error: terminated\n")
        # and it did: the checkpoint goes once the lock is free
        deadline = time.monotonic() + 60
        while (mnt / "sessions" / "s" / "checkpoints" / "c").exists():
            assert time.monotonic() < deadline, "the daemon did not finish the rm"
            time.sleep(0.1)


# --- 6. usage errors name the sub-command's help -----------------------------------------------


@pytest.mark.parametrize("args,where", [
    (["events", "s", "--since"], "events"),
    (["import", "s", "c", "--disk"], "import"),
    (["session", "new", "x", "--memory"], "session new"),
    (["ledger", "verify", "--bogus"], "ledger verify"),
    (["events"], "events"),
    (["--bogus"], ""),
    (["nosuch"], ""),
])
def test_usage_errors_point_at_the_right_help(store: Path, args: list[str], where: str) -> None:
    res = ksfs(store, *args, check=False)
    assert res.returncode == 2, res.stderr
    line = one_line(res)
    assert line.endswith(f"(see 'python -m ksfs.cli {where} --help')".replace("  ", " ")), line


# --- 7. every group's help has an example -------------------------------------------------------


@pytest.mark.parametrize("group", [[], ["ledger"], ["session"], ["gateway"]])
def test_every_group_help_has_an_example(store: Path, group: list[str]) -> None:
    out = ksfs(store, *group, "--help").stdout.decode()
    example = out[out.index("Example:"):].splitlines()
    assert any(ln.removeprefix("Example:").strip().startswith("ksfs ") for ln in example[:3]), out


def test_every_command_and_group_has_an_example() -> None:
    import click

    from ksfs.cli import main

    def walk(cmd: click.Command, path: list[str]):
        yield path, cmd
        if isinstance(cmd, click.Group):
            for name, sub in cmd.commands.items():
                yield from walk(sub, path + [name])

    missing = [" ".join(p) for p, cmd in walk(main, ["ksfs"]) if "Example:" not in cmd.help]
    assert missing == []


def test_ctrl_c_while_the_command_line_loads_is_one_line(tmp_path: Path) -> None:
    """QA (eighteenth session): Ctrl-C in the first tens of milliseconds (while click and the
    command's modules were imported) printed a traceback."""
    code = """
import builtins, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
real = builtins.__import__
def importing(name, *a, **k):
    if name == "click":
        os.kill(os.getpid(), signal.SIGINT)
    return real(name, *a, **k)
builtins.__import__ = importing
from ksfs._entry import main
sys.argv = ["ksfs", "--store", sys.argv[1], "stats"]
main()
"""
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=60)
    assert (res.returncode, res.stderr) == (130, "ksfs: error: aborted\n"), res
    script = (Path(sys.executable).parent / "ksfs")
    if script.exists():  # the installed command goes through it
        assert "ksfs._entry" in script.read_text(), script.read_text()


def test_status_says_what_the_mounts_status_file_says(store: Path, tmp_path: Path) -> None:
    """QA (twenty-second session): a session's status was only a file of the mount; `ksfs
    status SESSION` says the same, in words or as the file's JSON, with or without a mount
    (with one, through its daemon), and an unknown session is one line, exit 3."""
    from cli_helpers import daemon_mount
    from mount_helpers import skip_without_fuse

    res = ksfs(store, "status", "s", "--json")
    offline = json.loads(res.stdout)
    assert offline["session"] == "s" and offline["state"] == "offline", offline
    assert offline["last_checkpoint"] == "c1" and offline["doing"] is None, offline
    words = ksfs(store, "status", "s").stdout.decode().splitlines()
    assert words[:2] == ["session          s", "state            offline"], words
    assert "last checkpoint  c1" in words, words
    gone = subprocess.run(KSFS + ["--store", str(store), "status", "nosuch"],
                          capture_output=True, text=True, timeout=120)
    assert gone.returncode == 3 and gone.stdout == "", gone
    assert one_line(gone) == "ksfs: error: no session named 'nosuch'"
    skip_without_fuse()
    assert store == tmp_path / "store"  # the store daemon_mount mounts
    with daemon_mount(tmp_path, dict(os.environ, KSFS_GUEST="")) as (_, mnt):
        shown = json.loads((mnt / "sessions" / "s" / "status").read_text())
        assert json.loads(ksfs(store, "status", "s", "--json").stdout) == shown == offline


def test_status_asked_of_an_older_daemon_is_read_here(store: Path, monkeypatch) -> None:
    """Review: a mount's daemon started by a ksfs before `status` answers 'the daemon has no
    verb' (exit 2); the command then reads the status itself, as without a daemon."""
    from click.testing import CliRunner

    from ksfs.cli import main, vm_cmds
    from ksfs.daemon.protocol import RemoteError

    def older_daemon(ctx, verb, **args):
        raise RemoteError({"message": f"the daemon has no verb {verb!r}", "exit_code": 2})

    monkeypatch.setattr(vm_cmds, "run_verb", older_daemon)
    res = CliRunner().invoke(main, ["--store", str(store), "status", "s", "--json"])
    assert res.exit_code == 0, res.output
    st = json.loads(res.output)
    assert (st["session"], st["state"], st["last_checkpoint"]) == ("s", "offline", "c1"), st
    gone = CliRunner().invoke(main, ["--store", str(store), "status", "nosuch"])
    assert gone.exit_code == 3, gone.output
