"""Tamper evidence: every single-bit flip in a hashed region is reported by open() or verify().

The hash chain (spec §8.1, REFERENCE_NOTES §1.1): envelope 0x70 = hash64(header JSON), 0x78 =
hash64(directory), ``section_hashes`` in the header cover masks/vocab/index, and every directory
record carries its tensor's hash64. The envelope's other fields and the zero padding between
tensors are deliberately not hashed, so they are not flipped here.

A flip is applied in place with ``pwrite`` (and undone afterwards), so each case costs one
open+verify of a small file; every bit of every covered byte is tried.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import cmf
from cmf.format.directory import decode_directory
from cmf.format.errors import CmfError
from cmf.format.masks import MaskSet, TaskMask
from cmf.format.writer import CmfWriter

from _builders import arch, vbit_payload

VOCAB = b'{"version":"1.0","model":{"type":"BPE","vocab":{"a":0},"merges":[]}}'


def small_header() -> dict:
    """A minimal valid header (no provenance) to keep the header section short."""
    return {"version": 2, "arch": arch(), "quant_type": "F16"}


def small_tensors() -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """A few tiny tensors of distinct dtypes (fixed-size and validated variable-size)."""
    rng = np.random.default_rng(11)
    return [
        ("model.norm.weight", "f16", (32,), rng.standard_normal(32).astype("<f2").tobytes()),
        ("model.layers.0.q.weight", "q8_row", (2, 32), rng.integers(0, 256, 2 * 32 + 4, dtype=np.uint8).tobytes()),
        ("model.layers.0.v.weight", "vbit_ro", (2, 32), vbit_payload(2, 32, [3, 8], seed=5, ro=True)),
        ("lm_head.weight", "f32", (3, 5), rng.standard_normal(15).astype("<f4").tobytes()),
    ]


def small_masks() -> MaskSet:
    """One mask: keeps the masks section (meta + blob) a few hundred bytes."""
    rng = np.random.default_rng(2)
    m = TaskMask(task_id=0, name="general", sparsity=0.25, quality=None, ffn=rng.random((2, 96)) < 0.75,
                 heads=np.ones((2, 4), bool), gates=np.ones(2, bool))
    return MaskSet(default_task="general", masks=[m])


@pytest.fixture(scope="module")
def small_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid file with every hashed region present: header, dir, tensors, masks, vocab, index."""
    path = tmp_path_factory.mktemp("tamper") / "small.cmf"
    with CmfWriter(path, small_header(), sparse_index=True) as w:
        for name, dtype, shape, payload in small_tensors():
            w.add(name, dtype, shape, payload)
        w.set_masks(small_masks())
        w.set_vocab(VOCAB)
    with cmf.open(path) as f:
        assert f.verify() == []
        assert all(f.envelope.section(s).present for s in ("masks", "vocab", "index"))
    return path


def envelope_sections(data: bytes) -> dict[str, tuple[int, int]]:
    """(off, len) of the six envelope sections."""
    vals = struct.unpack_from("<12Q", data, 0x10)
    names = ("header", "dir", "data", "masks", "vocab", "index")
    return {n: (vals[2 * i], vals[2 * i + 1]) for i, n in enumerate(names)}


def tensor_spans(data: bytes) -> dict[str, tuple[int, int]]:
    """Absolute (off, len) of each tensor payload."""
    secs = envelope_sections(data)
    d_off, d_len = secs["dir"]
    rec, names = decode_directory(data[d_off:d_off + d_len])
    data_off = secs["data"][0]
    return {n: (data_off + int(r["off"]), int(r["nbytes"])) for n, r in zip(names, rec)}


def detected(path: Path) -> bool:
    """True when open() raises a CmfError or verify() reports a problem."""
    try:
        with cmf.open(path) as f:
            return bool(f.verify())
    except CmfError:
        return True


def flip_positions(off: int, length: int) -> Iterator[tuple[int, int]]:
    """Every (byte position, bit) in [off, off + length)."""
    for pos in range(off, off + length):
        for bit in range(8):
            yield pos, bit


def undetected_flips(path: Path, flips: Iterator[tuple[int, int]]) -> tuple[int, list[tuple[int, int]]]:
    """Apply each flip in place, check it, undo it. Returns (flips tried, flips not reported)."""
    missed: list[tuple[int, int]] = []
    tried = 0
    fd = os.open(path, os.O_RDWR)
    try:
        for pos, bit in flips:
            orig = os.pread(fd, 1, pos)[0]
            os.pwrite(fd, bytes([orig ^ (1 << bit)]), pos)
            try:
                if not detected(path):
                    missed.append((pos, bit))
            finally:
                os.pwrite(fd, bytes([orig]), pos)
            tried += 1
    finally:
        os.close(fd)
    assert not detected(path), "the file was not restored after the flips"
    return tried, missed


@pytest.fixture
def work_copy(small_file: Path, tmp_path: Path) -> Path:
    path = tmp_path / "t.cmf"
    path.write_bytes(small_file.read_bytes())
    return path


@pytest.mark.parametrize("section", ["header", "dir", "masks", "vocab", "index"])
def test_every_bit_of_section(work_copy: Path, section: str) -> None:
    off, length = envelope_sections(work_copy.read_bytes())[section]
    assert length > 0
    tried, missed = undetected_flips(work_copy, flip_positions(off, length))
    assert tried == 8 * length
    assert not missed, f"{len(missed)} undetected flips in {section}, first (pos, bit): {missed[:10]}"


@pytest.mark.parametrize("name", [t[0] for t in small_tensors()])
def test_every_bit_of_tensor(work_copy: Path, name: str) -> None:
    off, length = tensor_spans(work_copy.read_bytes())[name]
    tried, missed = undetected_flips(work_copy, flip_positions(off, length))
    assert tried == 8 * length
    assert not missed, f"{len(missed)} undetected flips in tensor {name!r}, first: {missed[:10]}"


def test_every_bit_of_envelope_hashes(work_copy: Path) -> None:
    tried, missed = undetected_flips(work_copy, flip_positions(0x70, 16))
    assert tried == 128 and not missed, missed


def test_tensor_flip_names_the_tensor(work_copy: Path) -> None:
    off, _ = tensor_spans(work_copy.read_bytes())["lm_head.weight"]
    with open(work_copy, "r+b") as fh:
        fh.seek(off + 3)
        b = fh.read(1)[0]
        fh.seek(off + 3)
        fh.write(bytes([b ^ 0x10]))
    with cmf.open(work_copy) as f:
        problems = f.verify()
    assert len(problems) == 1 and "lm_head.weight" in problems[0]


@pytest.mark.parametrize("section", ["header", "dir", "masks", "vocab", "index"])
def test_section_flip_names_the_section(work_copy: Path, section: str) -> None:
    """A flip that still opens is reported as a verify problem naming its section."""
    off, length = envelope_sections(work_copy.read_bytes())[section]
    data = bytearray(work_copy.read_bytes())
    # Pick a byte whose flip keeps the file openable: for JSON regions, a digit inside a number
    # or a letter inside a string changes content without breaking syntax; binary regions are
    # probed until one opens.
    for pos in range(off + length - 1, off - 1, -1):
        data[pos] ^= 0x01
        work_copy.write_bytes(bytes(data))
        try:
            with cmf.open(work_copy) as f:
                problems = f.verify()
        except CmfError:
            data[pos] ^= 0x01
            continue
        assert problems and any(section in p for p in problems), problems
        return
    pytest.skip(f"no single-bit flip of {section} keeps the file openable")


# ----------------------------------------------------------------------------- the larger sample file


@pytest.fixture(scope="module")
def sample_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared sample (7 tensors incl. 4096-aligned ones, two masks, vocab, sparse index)."""
    from _builders import write_sample

    path = write_sample(tmp_path_factory.mktemp("tamper-sample") / "sample.cmf", sparse_index=True)[0]
    with cmf.open(path) as f:
        assert f.verify() == []
    return path


def test_seeded_flips_in_sample_sections(sample_file: Path, tmp_path: Path) -> None:
    """2,500 seeded random bit positions over header/dir/masks/vocab/index of the sample file."""
    path = tmp_path / "s.cmf"
    path.write_bytes(sample_file.read_bytes())
    secs = envelope_sections(path.read_bytes())
    covered = np.concatenate([np.arange(o, o + n) for s, (o, n) in secs.items() if s != "data"])
    rng = np.random.default_rng(20240613)
    picks = rng.choice(covered.size * 8, size=2500, replace=False)
    flips = ((int(covered[p // 8]), int(p % 8)) for p in picks)
    tried, missed = undetected_flips(path, flips)
    assert tried == 2500 and not missed, missed[:10]


def test_seeded_flips_in_sample_tensors(sample_file: Path, tmp_path: Path) -> None:
    """One seeded bit in each of 2,000 random payload bytes, spread over every tensor."""
    path = tmp_path / "s.cmf"
    path.write_bytes(sample_file.read_bytes())
    spans = tensor_spans(path.read_bytes())
    covered = np.concatenate([np.arange(o, o + n) for o, n in spans.values()])
    rng = np.random.default_rng(7)
    positions = rng.choice(covered, size=2000, replace=False)
    bits = rng.integers(0, 8, size=positions.size)
    tried, missed = undetected_flips(path, zip(positions.tolist(), bits.tolist()))
    assert tried == 2000 and not missed, missed[:10]
