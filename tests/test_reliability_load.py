"""A short load run (tools/crash-trials --load 20): 8 readers through the mount, saves of a real
guest, deletions and ``ksfs gc``; every read equals ``ksfs cat``, the store checks clean and the
daemon holds no more fds or threads after the run than before it. The 2-minute run is
``tools/crash-trials --load 120``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.vm


def test_load_20_seconds() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from guest import ensure_guest, require_libvirt
    from mount_helpers import skip_without_fuse

    skip_without_fuse()
    require_libvirt()
    ensure_guest()
    res = subprocess.run([str(ROOT / "tools" / "crash-trials"), "--load", "20", "--json",
                          "--seed", "5"], capture_output=True, text=True, timeout=600)
    assert res.stdout.strip(), res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 0 and out["failures"] == [], out
    assert out["reads"] >= 8 and out["saves"] >= 2 and out["gcs"] >= 1, out
    # fds beyond the bounded pack cache are failures inside the script; threads must not grow
    assert out["daemon_threads"][1] <= out["daemon_threads"][0], out
