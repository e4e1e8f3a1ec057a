"""Small, deterministic CMF files for container tests (no model knowledge needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cmf.format.masks import MaskSet, TaskMask
from cmf.format.writer import CmfWriter


def arch(**overrides: Any) -> dict[str, Any]:
    a = {
        "arch_name": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_layers": 2,
        "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 128,
        "layer_types": ["FullAttention", "FullAttention"], "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256, "norm_style": "qwen", "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    a.update(overrides)
    return a


def header(**overrides: Any) -> dict[str, Any]:
    h = {"format": "cmf", "version": 2, "arch": arch(), "quant_type": "F32",
         "provenance": {"tool": "pycmf-tests", "unknown_key": [1, 2, {"x": None}]}}
    h.update(overrides)
    return h


def vbit_payload(rows: int, cols: int, widths: list[int], seed: int = 0, ro: bool = False) -> bytes:
    """A well-formed vbit / vbit_ro payload with random codes."""
    rng = np.random.default_rng(seed)
    gpr = cols // 32
    scales = rng.uniform(0.01, 0.1, rows * gpr).astype("<f2").tobytes()
    row_bytes = [(w * cols + 7) // 8 for w in widths]
    packed = b"".join(rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in row_bytes)
    out = bytes(widths) + scales
    if ro:
        offs = np.concatenate([[0], np.cumsum(row_bytes)]).astype("<u4").tobytes()
        out += offs
    return out + packed


def sample_tensors(seed: int = 0) -> list[tuple[str, str, tuple[int, ...], bytes]]:
    """A mix of dtypes with valid payload lengths (contents random where the reader does not decode)."""
    rng = np.random.default_rng(seed)
    f32 = rng.standard_normal((128, 64)).astype("<f4")
    norm = (1 + 0.1 * rng.standard_normal(64)).astype("<f2")
    big = rng.standard_normal((96, 64)).astype("<f4")  # 24 KiB: placed on a 4096 boundary
    q8 = rng.integers(0, 256, 96 * 64 + 2 * 96, dtype=np.uint8).tobytes()
    q4 = rng.integers(0, 256, 18 * (64 * 96 // 32), dtype=np.uint8).tobytes()
    return [
        ("model.embed_tokens.weight", "f32", (128, 64), f32.tobytes()),
        ("model.norm.weight", "f16", (64,), norm.tobytes()),
        ("model.layers.0.mlp.up_proj.weight", "f32", (96, 64), big.tobytes()),
        ("model.layers.0.mlp.gate_proj.weight", "q8_row", (96, 64), q8),
        ("model.layers.0.mlp.down_proj.weight", "q4_tiled", (64, 96), q4),
        ("model.layers.1.mlp.gate_proj.weight", "vbit_ro", (4, 64), vbit_payload(4, 64, [3, 4, 8, 6], ro=True)),
        ("lm_head.weight", "bf16", (128, 64), rng.integers(0, 1 << 16, 128 * 64, dtype=np.uint16).astype("<u2").tobytes()),
    ]


def sample_masks() -> MaskSet:
    rng = np.random.default_rng(1)
    general = TaskMask(task_id=0, name="general", sparsity=0.0, quality=None, priority="Fallback",
                       ffn=np.ones((2, 96), bool), heads=np.ones((2, 4), bool), gates=np.ones(2, bool))
    coding = TaskMask(task_id=1, name="coding", sparsity=0.5, priority="Normal",
                      quality={"metric": "heldout_ppl_ratio", "value": 1.02, "baseline_dense": 6.1,
                               "n_samples": 512, "dataset_sha256": "ab" * 32},
                      ffn=rng.random((2, 96)) < 0.5, heads=np.array([[1, 1, 0, 1], [1, 0, 1, 1]], bool),
                      gates=np.array([True, False]))
    return MaskSet(default_task="general", masks=[general, coding])


def write_sample(path: Path, *, masks: bool = True, vocab: bool = True, sparse_index: bool = False,
                 max_shard_bytes: int | None = None, hdr: dict | None = None) -> list[Path]:
    with CmfWriter(path, hdr or header(), max_shard_bytes=max_shard_bytes, sparse_index=sparse_index) as w:
        for name, dtype, shape, payload in sample_tensors():
            w.add(name, dtype, shape, payload)
        if masks:
            w.set_masks(sample_masks())
        if vocab:
            w.set_vocab(b'{"version":"1.0","model":{"type":"BPE","vocab":{},"merges":[]}}')
    return w.outputs


def present_pages(addr: int, length: int) -> np.ndarray:
    """Whether each 4 KiB page of [addr, addr + length) is mapped into this process (pagemap bit
    63; readable without privileges, which only hides the frame numbers)."""
    import mmap

    page = mmap.PAGESIZE
    first, last = addr // page, (addr + length - 1) // page
    with open("/proc/self/pagemap", "rb") as fh:
        fh.seek(first * 8)
        raw = np.frombuffer(fh.read((last - first + 1) * 8), "<u8")
    return (raw >> np.uint64(63)) & np.uint64(1) == 1
