"""Choose the libvirt domain type: ``kvm`` only where a short probe shows KVM really runs a guest.

The probe boots a 512-byte boot sector that makes 20000 port I/O exits and then writes to QEMU's
isa-debug-exit port, once under TCG and then under KVM. KVM wins only when it finishes and is
faster than TCG: nested KVM that exists but crawls (as on these machines) loses. So the KVM run is
stopped once it has taken as long as TCG took: past that it cannot win (it took 3 s here, where
TCG takes 0.1 s, and every new store paid for it at its first machine).
``KSFS_DOMAIN_TYPE`` overrides the probe; the result is cached in a small JSON file. Must never
touch libvirt or a running guest.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from ksfs.errors import StoreDamaged
from ksfs.regularfile import read_store_file
from ksfs.vm.state import write_whole_file

# cli; mov cx, 20000; l: out 0x80, al; loop l; mov al, 0; out 0xf4, al; hlt; jmp $-1
_BOOT_CODE = bytes.fromhex("fab9204ee680e2fcb000e6f4f4ebfd")
_CACHE_VERSION = 1
TIMEOUT = 20.0


def _boot_sector() -> bytes:
    return _BOOT_CODE + bytes(510 - len(_BOOT_CODE)) + b"\x55\xaa"


def _run(accel: str, image: Path, limit: float = TIMEOUT) -> float | None:
    """Seconds the probe guest took under ``accel``, or None when it failed or took ``limit``."""
    cmd = ["qemu-system-x86_64", "-accel", accel, "-display", "none", "-nodefaults",
           "-no-user-config", "-m", "16", "-drive", f"file={image},format=raw,if=ide",
           "-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"]
    t0 = time.monotonic()
    try:
        res = subprocess.run(cmd, capture_output=True, timeout=limit)
    except (OSError, subprocess.TimeoutExpired):
        return None
    # isa-debug-exit makes QEMU exit with (value << 1) | 1 = 1 for the value 0 written above.
    return time.monotonic() - t0 if res.returncode == 1 else None


def probe() -> dict:
    """Run the probe now: {"type": "kvm"|"qemu", "kvm_s": ..., "tcg_s": ...}; ``kvm_s`` None:
    no usable /dev/kvm, or KVM failed or did not finish within TCG's time (``kvm_limit_s``)."""
    result: dict = {"version": _CACHE_VERSION, "kvm_s": None, "tcg_s": None}
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        result["type"] = "qemu"
        return result
    with tempfile.TemporaryDirectory() as tmp:
        image = Path(tmp) / "probe.img"
        image.write_bytes(_boot_sector())
        result["tcg_s"] = _run("tcg", image)
        result["kvm_limit_s"] = TIMEOUT if result["tcg_s"] is None else result["tcg_s"]
        result["kvm_s"] = _run("kvm", image, result["kvm_limit_s"])
    kvm, tcg = result["kvm_s"], result["tcg_s"]
    result["type"] = "kvm" if kvm is not None and (tcg is None or kvm < tcg) else "qemu"
    return result


def domain_type(cache: Path | None = None) -> str:
    """``KSFS_DOMAIN_TYPE`` if set, else the cached probe result, else a fresh probe (cached)."""
    forced = os.environ.get("KSFS_DOMAIN_TYPE")
    if forced:
        return forced
    if cache is not None:
        try:
            data = json.loads(read_store_file(cache, cache.parent))
            if data.get("version") == _CACHE_VERSION and data.get("type") in ("kvm", "qemu"):
                return data["type"]
        except (OSError, ValueError, AttributeError):
            pass
        except StoreDamaged:  # a link or FIFO in its place: probed again, and replaced
            pass
    result = probe()
    if cache is not None:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_whole_file(cache, (json.dumps(result) + "\n").encode())
        except OSError:
            pass  # a cache we cannot write only costs a probe next time
    return result["type"]
