"""docs/cli.md is what tools/gen-cli-docs makes of the click commands now, and every command's
--help shows an example.

Both read the real click command tree; nothing is started and nothing is written.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ksfs.cli import main

ROOT = Path(__file__).resolve().parent.parent


def leaf_commands(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of every command that is not a group (groups list their subcommands)."""
    found = []
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            found.extend(leaf_commands(cmd, path + (name,)))
        else:
            found.append(path + (name,))
    return found


def test_cli_md_is_current() -> None:
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "gen-cli-docs"), "--stdout"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    current = (ROOT / "docs" / "cli.md").read_text()
    assert res.stdout == current, (
        "docs/cli.md is stale: run `.venv/bin/python tools/gen-cli-docs` and commit docs/cli.md")


def test_cli_md_names_every_command_and_exit_code() -> None:
    text = (ROOT / "docs" / "cli.md").read_text()
    for path in leaf_commands(main):
        assert f"`ksfs {' '.join(path)}`" in text
    import ksfs.errors as errors

    for obj in vars(errors).values():
        if isinstance(obj, type) and issubclass(obj, errors.KsfsError):
            assert f"| {obj.exit_code} |" in text and f"`{obj.__name__}" in text


@pytest.mark.parametrize("path", leaf_commands(main), ids=" ".join)
def test_help_has_an_example(path: tuple[str, ...]) -> None:
    res = CliRunner().invoke(main, [*path, "--help"])
    assert res.exit_code == 0, res.output
    lines = [line.strip() for line in res.output.splitlines()]
    examples = [line for line in lines if line.startswith("Example:")]
    assert examples, f"`ksfs {' '.join(path)} --help` has no 'Example:' line:\n{res.output}"
    # The example is a real invocation of this very command.
    at = lines.index(examples[0])
    example = " ".join([examples[0], *lines[at + 1:at + 3]])
    assert f"ksfs {' '.join(path)}" in example, example
