"""The domain type probe (ksfs/vm/probe.py), with the real qemu-system-x86_64 (no libvirt).

KVM is chosen only when its run of the probe guest finishes and beats TCG's. The KVM run used
to go first and to its end: where nested KVM crawls (3 s here, against 0.1 s for TCG) every new
store paid for it at its first machine. Now TCG runs first and the KVM run is stopped once it
has taken as long: past that it cannot win, so the choice is the same.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from ksfs.vm import probe

pytestmark = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="qemu-system-x86 missing")


def test_the_probe_chooses_kvm_only_when_it_beats_tcg_and_never_waits_past_tcg():
    t0 = time.monotonic()
    result = probe.probe()
    took = time.monotonic() - t0
    assert result["type"] in ("kvm", "qemu"), result
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        assert (result["type"], result["kvm_s"], result["tcg_s"]) == ("qemu", None, None)
        return
    tcg, kvm = result["tcg_s"], result["kvm_s"]
    assert tcg is not None and tcg > 0, result  # TCG runs the probe guest wherever QEMU does
    assert result["kvm_limit_s"] == tcg, result
    assert kvm is None or kvm <= tcg, result  # stopped at TCG's time, never let run on
    assert (result["type"] == "kvm") == (kvm is not None and kvm < tcg), result
    # the two runs, and nothing waited beyond them (QEMU's start and exit around each)
    assert took < 2 * tcg + 5, (took, result)


def test_a_kvm_run_past_its_limit_is_stopped_and_loses(tmp_path, monkeypatch):
    """A stand-in for a crawling KVM: a qemu-system-x86_64 on PATH that, asked for KVM, sleeps
    for a minute; asked for TCG, runs the real one."""
    real = shutil.which("qemu-system-x86_64")
    fake = tmp_path / "qemu-system-x86_64"
    fake.write_text("#!/bin/sh\n"
                    'case "$*" in *"-accel kvm"*) exec sleep 60;; esac\n'
                    f'exec {real} "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(probe.os, "access", lambda path, mode: True)  # as if /dev/kvm were usable
    t0 = time.monotonic()
    result = probe.probe()
    assert time.monotonic() - t0 < probe.TIMEOUT / 2, result  # not the minute, nor TIMEOUT
    assert result["tcg_s"] is not None and result["kvm_s"] is None, result
    assert result["type"] == "qemu"
    # and the choice is cached for the store: the next machine does not probe again
    cache = tmp_path / "vm" / "domain-type.json"
    monkeypatch.delenv("KSFS_DOMAIN_TYPE", raising=False)
    assert probe.domain_type(cache) == "qemu"
    assert json.loads(cache.read_text())["type"] == "qemu"
    monkeypatch.setattr(probe, "probe", lambda: pytest.fail("probed again"))
    assert probe.domain_type(cache) == "qemu"
