"""The CLI registers only the store verbs at import (``ksfs cat`` and ``ksfs import`` start
faster); every other command is still found by name, listed by --help and seen by the docs."""

from __future__ import annotations

import os
import subprocess
import sys

from click.testing import CliRunner

FAMILIES = ("store_cmds", "ledger_cmds", "vm_cmds", "mount_cmds", "gateway_cmds")


def _modules_after(code: str) -> set[str]:
    code += "\nimport sys\nprint(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return set(out.split())


def test_import_registers_only_the_store_verbs() -> None:
    mods = _modules_after("import ksfs.cli")
    assert "ksfs.cli.store_cmds" in mods
    assert not {f"ksfs.cli.{m}" for m in FAMILIES[1:]} & mods
    assert "subprocess" not in mods


def test_other_commands_are_found_listed_and_documented() -> None:
    mods = _modules_after("from ksfs.cli import main\nnames = sorted(main.commands)")
    assert {f"ksfs.cli.{m}" for m in FAMILIES} <= mods
    from ksfs.cli import main

    runner = CliRunner()
    res = runner.invoke(main, ["--help"])
    for name in ("cat", "import", "session", "mount", "gateway", "events", "ledger", "save"):
        assert f"  {name} " in res.output
    res = runner.invoke(main, ["session", "--help"])
    assert res.exit_code == 0 and "new" in res.output
    res = runner.invoke(main, ["nosuch"])
    assert res.exit_code == 2 and "No such command 'nosuch'" in res.output


def _entry(store: str, *args: str, before: str = "", text: bool = True
           ) -> subprocess.CompletedProcess:
    """Run the ``ksfs`` command's entry point (the installed script's code) in a fresh
    interpreter, with ``before`` run first in it."""
    code = (f"{before}\nimport sys\nfrom ksfs._entry import main\n"
            f"sys.argv = ['ksfs', '--store', {store!r}, *{list(args)!r}]\nmain()\n")
    # standard output buffered, as wherever PYTHONUNBUFFERED is not set
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=text,
                          timeout=60, env=env)


def test_a_finished_command_leaves_without_teardown_but_loses_nothing(tmp_path) -> None:
    """A command leaves without the interpreter's teardown (15-30 ms of freeing objects after
    an import): its output is whole, its status kept, the exit handlers still run; objects are
    not freed one by one (a __del__ never runs), which is the time saved."""
    store = str(tmp_path / "store")
    src = tmp_path / "f.bin"
    src.write_bytes(bytes(range(256)) * 4096)  # 1 MiB through a pipe: nothing left in a buffer
    before = ("import atexit, sys\n"
              "atexit.register(lambda: print('exit handler ran', file=sys.stderr))\n"
              "atexit.register(lambda: print('and wrote this', end=''))\n"
              "class Noisy:\n"
              "    def __del__(self): print('torn down', file=sys.stderr)\n"
              "kept = Noisy()\n")
    res = _entry(store, "import", "s", "c1", str(src), before=before)
    assert res.returncode == 0, res
    assert res.stderr == "exit handler ran\n", res.stderr
    assert res.stdout.endswith("\nc1\nand wrote this"), res.stdout  # buffered, flushed
    res = _entry(store, "cat", "s", "c1", "f.bin", text=False)
    assert (res.returncode, res.stdout) == (0, src.read_bytes()), res.returncode
    missing = _entry(store, "cat", "s", "nosuch", "f.bin", before=before)
    assert missing.returncode == 3 and missing.stderr.endswith("exit handler ran\n"), missing


def test_a_thread_still_running_at_the_end_is_waited_for(tmp_path) -> None:
    """Where another thread still runs when the command is done, the command leaves as Python
    does, waiting for it: leaving at once would cut its work off."""
    done = tmp_path / "done"
    before = ("import threading, time\n"
              "def late():\n"
              "    time.sleep(0.5)\n"
              f"    open({str(done)!r}, 'w').write('finished')\n"
              "threading.Thread(target=late).start()\n")
    res = _entry(str(tmp_path / "nostore"), "stats", before=before)
    assert res.returncode == 5 and "is not a ksfs store" in res.stderr, res
    assert done.read_text() == "finished"
