"""Names the daemon changes show at once through its mount.

Names of sessions and checkpoints are cached by the kernel for a second; when the daemon itself
publishes or deletes a checkpoint, or removes a session (a CLI verb through its control socket,
an rmdir), it drops that cached entry at once, so a name deleted and taken again never shows
the old one's files."""

from __future__ import annotations

import os

import pytest

from tests.cli_helpers import daemon_mount, ksfs


@pytest.mark.parametrize("removal", [["rm", "again", "c"], ["session", "rm", "again"]])
def test_a_name_removed_and_taken_again_shows_the_new_files_at_once(tmp_path, removal):
    env = dict(os.environ, KSFS_GUEST="")
    src = tmp_path / "f.img"
    with daemon_mount(tmp_path, env) as (store, mnt):
        f = mnt / "sessions" / "again" / "checkpoints" / "c" / "f.img"
        for round_ in range(3):
            data = f"version {round_}\n".encode()
            src.write_bytes(data)
            ksfs(store, env, "import", "again", "c", str(src))  # tells the daemon
            assert f.read_bytes() == data, round_
            ksfs(store, env, *removal)  # through the daemon
            assert not f.exists()
