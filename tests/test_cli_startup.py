"""The CLI registers only the store verbs at import (``ksfs cat`` and ``ksfs import`` start
faster); every other command is still found by name, listed by --help and seen by the docs."""

from __future__ import annotations

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
