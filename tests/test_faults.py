"""Faults that lose nothing (issue 28): disk full and EIO during every write path leave the old
file intact and no temporary file; a read-only target fails before work starts; ``kill -9`` at
random points of in-place appends never leaves a file that opens wrong.

Faults are injected at the os level for files inside the test's folder (tests/_faults.py), so
the writers run unchanged up to the fault.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cmf
from cmf.format.errors import IoError
from cmf.format.growth import append, compact
from cmf.format.writer import CmfWriter

from _builders import header, sample_masks, sample_tensors, write_sample
from _faults import Faults, snapshot

HERE = Path(__file__).parent


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.cmf"
    write_sample(path)
    return path


def assert_intact(folder: Path, before: dict[str, bytes], path: Path) -> None:
    """Same files, same bytes (so no temp file left), and the file opens and verifies."""
    assert snapshot(folder) == before
    with cmf.open(path) as f:
        assert f.verify() == []


def bigger_tensor(seed: int = 0) -> tuple[str, str, tuple[int, int], bytes]:
    a = np.random.default_rng(seed).standard_normal((64, 512)).astype("<f4")
    return (f"extra.{seed}.weight", "f32", a.shape, a.tobytes())


# ----------------------------------------------------------------------------------- the writer


@pytest.mark.parametrize("budget", [0, 100, 5000, 9000, 20_000, 40_000])
def test_writer_disk_full_replacing_a_file(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch,
                                           budget: int) -> None:
    before = snapshot(tmp_path)
    Faults(monkeypatch, tmp_path, budget=budget)
    with pytest.raises(IoError, match="no space left on the device.*target is unchanged") as ei:
        write_sample(model)  # a rewrite of the same target, which must survive
    assert ei.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert_intact(tmp_path, before, model)


def test_writer_eio_on_fsync(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = snapshot(tmp_path)
    faults = Faults(monkeypatch, tmp_path, fsync=True)
    with pytest.raises(IoError) as ei:
        write_sample(model)
    assert ei.value.errno == errno.EIO and faults.hits == 1
    monkeypatch.undo()
    assert_intact(tmp_path, before, model)


def test_writer_sharded_disk_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "s.cmf"
    Faults(monkeypatch, tmp_path, budget=30_000)
    with pytest.raises(IoError):
        write_sample(out, max_shard_bytes=8192)
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []  # no shard is renamed before all are written; no temp file


def _bytes_written(monkeypatch: pytest.MonkeyPatch, folder: Path, run) -> int:
    """What ``run()`` writes into ``folder`` (an unlimited budget counts it), then undone."""
    faults = Faults(monkeypatch, folder, budget=1 << 40)
    run()
    monkeypatch.undo()
    return faults.written


def _set_bytes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, hdr) -> int:  # noqa: ANN001
    """Bytes a fresh sharded sample set with header ``hdr`` writes (measured in a scratch folder)."""
    scratch = tmp_path / "count"
    scratch.mkdir()
    total = _bytes_written(monkeypatch, scratch, lambda: write_sample(scratch / "s.cmf", max_shard_bytes=8192, hdr=hdr))
    shutil.rmtree(scratch)
    return total


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.6, 0.8, 0.95, 0.999])
def test_sharded_set_replacement_disk_full_keeps_the_old_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             fraction: float) -> None:
    """A set written over an existing set of the same name: ENOSPC anywhere, in the spools or in
    any shard's file, leaves every old shard as it was (was: shards 1..k-1 already replaced)."""
    out = tmp_path / "s.cmf"
    old = write_sample(out, max_shard_bytes=8192)
    assert len(old) > 3
    before = snapshot(tmp_path)
    newer = header(provenance={"tool": "the replacement"})
    total = _set_bytes(monkeypatch, tmp_path, newer)
    faults = Faults(monkeypatch, tmp_path, budget=int(total * fraction))
    with pytest.raises(IoError, match="no space left on the device") as ei:
        write_sample(out, max_shard_bytes=8192, hdr=newer)
    assert ei.value.errno == errno.ENOSPC and faults.hits
    monkeypatch.undo()
    assert snapshot(tmp_path) == before
    with cmf.open(old[0]) as f:
        assert f.verify() == [] and f.header.provenance["tool"] == "pycmf-tests" and len(f.paths) == len(old)


def test_read_only_folder_fails_before_work(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = snapshot(tmp_path)
    Faults(monkeypatch, tmp_path, readonly=True)
    with pytest.raises(IoError, match=r"cannot write into this folder \(Read-only file system\); nothing was done") as ei:
        CmfWriter(tmp_path / "new.cmf", header())
    assert ei.value.errno == errno.EROFS
    with pytest.raises(IoError, match="cannot open the file for writing .*; nothing was changed"):
        append(model, [bigger_tensor()])
    monkeypatch.undo()
    assert_intact(tmp_path, before, model)


# ----------------------------------------------------------------------------------- append / compact


@pytest.mark.parametrize("budget", [0, 1000, 64 * 512 * 4 + 10, 64 * 512 * 4 * 2 + 500])
def test_append_disk_full_leaves_the_old_file(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch,
                                              budget: int) -> None:
    before = snapshot(tmp_path)
    Faults(monkeypatch, tmp_path, budget=budget)
    with pytest.raises(IoError, match="no space left on the device while appending; the file is unchanged") as ei:
        append(model, [bigger_tensor(0), bigger_tensor(1)], {"x_note": "grown"})
    assert ei.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert_intact(tmp_path, before, model)  # the partial tail was cut off too


def test_append_eio_on_fsync_before_commit(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = snapshot(tmp_path)
    Faults(monkeypatch, tmp_path, fsync=True)
    with pytest.raises(IoError) as ei:
        append(model, [bigger_tensor()])
    assert ei.value.errno == errno.EIO
    monkeypatch.undo()
    assert_intact(tmp_path, before, model)


@pytest.mark.parametrize("share", [0.0, 0.5, 0.9])
def test_mask_create_in_place_disk_full(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch,
                                        share: float) -> None:
    from cmf.tools._maskio import write_masks

    masks = sample_masks()
    masks.masks[1].name = "coding2"
    trial = tmp_path / "trial"
    trial.mkdir()
    (trial / "m.cmf").write_bytes(model.read_bytes())
    counter = Faults(monkeypatch, trial, budget=10**12)  # how many bytes the append writes
    write_masks(trial / "m.cmf", masks, in_place=True)
    monkeypatch.undo()
    before = snapshot(tmp_path)
    Faults(monkeypatch, tmp_path, budget=int(counter.written * share))
    with pytest.raises(IoError, match="while appending"):
        write_masks(model, masks, in_place=True)
    monkeypatch.undo()
    assert_intact(tmp_path, before, model)


def test_append_fault_at_the_commit_point(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trial = tmp_path / "trial"
    trial.mkdir()
    (trial / "m.cmf").write_bytes(model.read_bytes())
    counter = Faults(monkeypatch, trial, budget=10**12)
    append(trial / "m.cmf", [bigger_tensor()])
    monkeypatch.undo()
    old = model.read_bytes()
    Faults(monkeypatch, tmp_path, budget=counter.written - 128, err=errno.EIO)  # everything but the envelope
    with pytest.raises(IoError, match="while committing the append.*old or the new version"):
        append(model, [bigger_tensor()])
    monkeypatch.undo()
    with cmf.open(model) as f:  # the envelope was not written: the old version, plus dead tail bytes
        assert f.verify() == [] and "extra.0.weight" not in f
    assert model.read_bytes()[:len(old)] == old


@pytest.mark.parametrize("budget", [0, 6000, 30_000])
def test_compact_disk_full(tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    append(model, [bigger_tensor()], replace=False)
    dst = tmp_path / "c.cmf"
    write_sample(dst)  # an older compacted copy that must survive
    before = snapshot(tmp_path)
    Faults(monkeypatch, tmp_path, budget=budget)
    with pytest.raises(IoError):
        compact(model, dst)
    monkeypatch.undo()
    assert_intact(tmp_path, before, dst)


# ----------------------------------------------------------------------------------- tools


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory) -> Path:
    from server_fixtures import tiny_qwen3

    return tiny_qwen3(tmp_path_factory.mktemp("hf") / "tiny")


@pytest.mark.parametrize("budget", [0, 20_000])
def test_convert_disk_full(tmp_path: Path, hf_model: Path, monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    from cmf.convert import convert

    out = tmp_path / "tiny.cmf"
    write_sample(out)
    before = snapshot(tmp_path)
    Faults(monkeypatch, tmp_path, budget=budget)
    with pytest.raises(IoError) as ei:
        convert(hf_model, out, quant="q8")
    assert ei.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert_intact(tmp_path, before, out)


def test_convert_read_only_folder_fails_before_encoding(tmp_path: Path, hf_model: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from cmf import quant
    from cmf.convert import convert

    encoded: list[str] = []
    real = quant.encode
    monkeypatch.setattr(quant, "encode", lambda *a, **k: encoded.append("x") or real(*a, **k))
    Faults(monkeypatch, tmp_path, readonly=True)
    with pytest.raises(IoError, match="cannot write into this folder"):
        convert(hf_model, tmp_path / "tiny.cmf", quant="q8")
    assert encoded == [] and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("budget", [0, 20_000])
def test_requant_disk_full(tmp_path: Path, hf_model: Path, monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    from cmf.convert import convert
    from cmf.tools.requant import requant

    src, dst = tmp_path / "src.cmf", tmp_path / "dst.cmf"
    convert(hf_model, src, quant="f16")
    write_sample(dst)
    before = snapshot(tmp_path)
    Faults(monkeypatch, tmp_path, budget=budget)
    with pytest.raises(IoError):
        requant(src, dst, quant="q8")
    monkeypatch.undo()
    assert_intact(tmp_path, before, dst)
    assert_intact(tmp_path, before, src)


def _requant_total(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, src: Path) -> int:
    from cmf.tools.requant import requant

    scratch = tmp_path / "count"
    scratch.mkdir()
    shutil.copy(src, scratch / src.name)
    total = _bytes_written(monkeypatch, scratch, lambda: requant(scratch / src.name, quant="q8", in_place=True))
    shutil.rmtree(scratch)
    return total


@pytest.mark.parametrize("fraction", [0.0, 0.2, 0.5, 0.8, 0.99])
def test_requant_in_place_eio_midway_keeps_the_old_file(tmp_path: Path, hf_model: Path,
                                                        monkeypatch: pytest.MonkeyPatch, fraction: float) -> None:
    """EIO at any byte of ``requant --in-place`` (the spool of new payloads, the copy of the file,
    the patched slots, directory and envelope): the old file as it was, no temp file, a typed
    error (was: slots already overwritten, a file with hash mismatches)."""
    from cmf.convert import convert
    from cmf.tools.requant import requant

    src = tmp_path / "src.cmf"
    convert(hf_model, src, quant="f16")
    total = _requant_total(monkeypatch, tmp_path, src)
    before = snapshot(tmp_path)
    faults = Faults(monkeypatch, tmp_path, budget=int(total * fraction), err=errno.EIO)
    with pytest.raises(IoError, match="while recoding in place; the file is unchanged and no temporary file") as ei:
        requant(src, quant="q8", in_place=True)
    assert ei.value.errno == errno.EIO and faults.hits
    monkeypatch.undo()
    assert_intact(tmp_path, before, src)
    requant(src, quant="q8", in_place=True)  # and it works once the device does
    with cmf.open(src) as f:
        assert f.verify() == [] and any(t.dtype.label == "q8_row" for t in f.tensors())


@pytest.mark.slow
def test_faults_at_every_fortieth_of_the_writes(tmp_path: Path, hf_model: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The long variant of the two tests above: EIO at 40 points of ``requant --in-place`` and
    ENOSPC at 40 points of a shard set written over a set, each leaving the old bytes."""
    from cmf.convert import convert
    from cmf.tools.requant import requant

    src = tmp_path / "src.cmf"
    convert(hf_model, src, quant="f16")
    total = _requant_total(monkeypatch, tmp_path, src)
    out = tmp_path / "s.cmf"
    write_sample(out, max_shard_bytes=8192)
    newer = header(provenance={"tool": "the replacement"})
    set_total = _set_bytes(monkeypatch, tmp_path, newer)
    before = snapshot(tmp_path)
    for i in range(40):
        Faults(monkeypatch, tmp_path, budget=total * i // 40, err=errno.EIO)
        with pytest.raises(IoError, match="the file is unchanged"):
            requant(src, quant="q8", in_place=True)
        monkeypatch.undo()
        Faults(monkeypatch, tmp_path, budget=set_total * i // 40)
        with pytest.raises(IoError):
            write_sample(out, max_shard_bytes=8192, hdr=newer)
        monkeypatch.undo()
        assert snapshot(tmp_path) == before, i
    assert_intact(tmp_path, before, src)


def test_requant_in_place_eio_on_fsync_keeps_the_old_file(tmp_path: Path, hf_model: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from cmf.convert import convert
    from cmf.tools.requant import requant

    src = tmp_path / "src.cmf"
    convert(hf_model, src, quant="f16")
    before = snapshot(tmp_path)
    Faults(monkeypatch, tmp_path, fsync=True)
    with pytest.raises(IoError, match="the file is unchanged") as ei:
        requant(src, quant="q8", in_place=True)
    assert ei.value.errno == errno.EIO
    monkeypatch.undo()
    assert_intact(tmp_path, before, src)


# ----------------------------------------------------------------------------------- kill -9

_CHILD = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[2])
from cmf.format.growth import append
rng = np.random.default_rng(int(sys.argv[3]))
print("ready", flush=True)
i = 0
while True:
    a = rng.standard_normal((int(rng.integers(1, 64)), 256)).astype("<f4")  # < 256 KiB: no numba start-up
    append(sys.argv[1], [(f"grown.{i}", "f32", a.shape, a.tobytes())], {"x_grown": i})
    i += 1
"""


def kill_appends(tmp_path: Path, runs: int, seed: int) -> list[int]:
    """``runs`` times: a child appends in a loop, is SIGKILLed at a random moment; the file must
    open, verify, hold every original tensor and a consistent prefix of the grown ones."""
    rng = random.Random(seed)
    path = tmp_path / "k.cmf"
    write_sample(path)
    with cmf.open(path) as f:
        original = {n: bytes(f.raw(n)) for n in f.keys()}
    src = str(Path(cmf.__file__).parents[1])
    grown = []
    for run in range(runs):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path), src, str(run)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)
        assert child.stdout.readline() == b"ready\n"
        time.sleep(rng.uniform(0.0, 0.25))
        child.kill()
        child.wait()
        with cmf.open(path) as f:
            assert f.verify() == []
            for n, b in original.items():
                assert bytes(f.raw(n)) == b
            names = [n for n in f.keys() if n.startswith("grown.")]
            assert f.header.to_dict().get("x_grown", -1) == len(names) - 1
        grown.append(len(names))
        path.replace(tmp_path / "prev.cmf")  # the next child starts from a fresh copy of the sample
        write_sample(path)
    return grown


def test_kill_9_during_appends(tmp_path: Path) -> None:
    grown = kill_appends(tmp_path, 20, seed=28)
    assert len(grown) == 20


@pytest.mark.slow
def test_kill_9_during_appends_long(tmp_path: Path) -> None:
    grown = kill_appends(tmp_path, 300, seed=2828)
    assert max(grown) > 0
