"""Bad import arguments are one line and their exit code, and make no store."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

KSFS = [sys.executable, "-m", "ksfs.cli"]


def ksfs(store: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(KSFS + ["--store", str(store), *args], capture_output=True, text=True,
                          timeout=300)


def one_line(res: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """The stderr of a command that must fail with ``code`` and one line holding ``words``."""
    err = res.stderr.strip()
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


# --- 5: bad input to import makes no store --------------------------------------------------


@pytest.mark.parametrize("args, code", [
    (["s", "c", "MISSING"], 3),
    (["s/x", "c", "FILE"], 2),
    (["s", "c/x", "FILE"], 2),
    (["s", "c"], 2),
    (["s", "c", "DIR"], 2),
    (["s", "c", "FILE", "FILE"], 2),
])
def test_import_with_bad_input_makes_no_store(tmp_path: Path, args: list[str], code: int) -> None:
    f = tmp_path / "memory"
    f.write_bytes(b"x" * 100)
    store = tmp_path / "store"
    args = [{"FILE": str(f), "DIR": str(tmp_path), "MISSING": str(tmp_path / "nope")}.get(a, a)
            for a in args]
    one_line(ksfs(store, "import", *args), code)
    assert not store.exists()
