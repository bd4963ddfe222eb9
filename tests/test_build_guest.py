"""tools/build-guest reads kernel modules however the kernel package ships them: plain .ko
(Debian 12's cloud kernel) or compressed (.ko.xz from Debian 13 on, .ko.zst and .ko.gz
elsewhere). Checked on the real modules of the test guest's kernel, compressed here."""

from __future__ import annotations

import gzip
import importlib.machinery
import importlib.util
import json
import lzma
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.guest import ROOT, ensure_guest


def build_guest_module():
    loader = importlib.machinery.SourceFileLoader("build_guest", str(ROOT / "tools" /
                                                                     "build-guest"))
    spec = importlib.util.spec_from_loader("build_guest", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def compress(src: Path, dest_dir: Path, how: str) -> None:
    data = src.read_bytes()
    if how == "xz":
        (dest_dir / (src.name + ".xz")).write_bytes(lzma.compress(data, lzma.FORMAT_XZ))
    elif how == "gz":
        (dest_dir / (src.name + ".gz")).write_bytes(gzip.compress(data))
    else:
        subprocess.run(["zstd", "-q", "-o", str(dest_dir / (src.name + ".zst")), str(src)],
                       check=True)


@pytest.mark.parametrize("how", ["xz", "gz", "zst"])
def test_compressed_modules_load_in_the_same_order_as_plain_ones(tmp_path: Path, how: str
                                                                  ) -> None:
    if how == "zst" and shutil.which("zstd") is None:
        pytest.skip("zstd is not installed")
    meta = json.loads((ensure_guest() / "guest.json").read_text())
    moddir = next((ensure_guest() / "kernel" / meta["kernel_package"] / "lib" / "modules")
                  .glob("*/kernel"))
    bg = build_guest_module()
    plain_order, plain_files = bg.module_order(moddir)
    assert plain_order[-1] == "pvpanic_mmio" and "pvpanic" in plain_order  # (after its dependency)
    assert "virtio_blk" in plain_order and "qemu_fw_cfg" in plain_order
    packed = tmp_path / "kernel"
    packed.mkdir()
    for name in plain_order:
        compress(plain_files[name], packed, how)
    order, files = bg.module_order(packed)
    assert order == plain_order
    for name in order:
        assert files[name].name.endswith(f".ko.{how}")
        assert bg.module_bytes(files[name]) == plain_files[name].read_bytes()
