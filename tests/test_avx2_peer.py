"""benchmarks/avx2_peer.py's pairing of pycmf files with llama.cpp types and its ratio table."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from _builders import header
from cmf.format.writer import CmfWriter

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import avx2_peer  # noqa: E402


def _file(path: Path, q8_rows: int, q4_rows: int) -> Path:
    rng = np.random.default_rng(0)
    with CmfWriter(path, header()) as w:
        w.add("model.embed_tokens.weight", "q8_row", (q8_rows, 64),
              rng.integers(0, 256, q8_rows * 64 + 2 * q8_rows, dtype=np.uint8).tobytes())
        w.add("model.layers.0.mlp.down_proj.weight", "q4_tiled", (q4_rows, 64),
              rng.integers(0, 256, 18 * (q4_rows * 64 // 32), dtype=np.uint8).tobytes())
        w.add("model.norm.weight", "f16", (64,), np.ones(64, "<f2").tobytes())
    return path


def test_peer_type_follows_the_matrix_bytes(tmp_path: Path) -> None:
    assert avx2_peer.peer_type(_file(tmp_path / "a.cmf", 256, 64)) == "Q8_0"
    assert avx2_peer.peer_type(_file(tmp_path / "b.cmf", 16, 256)) == "Q4_0"


def test_peer_lines_pair_each_round() -> None:
    results = {
        ("llama.cpp Q4_0", "native"): [{"decode": 100.0}, {"decode": 110.0}, {"decode": 90.0}],
        ("llama.cpp Q4_0", "haswell"): [{"decode": 90.0}, {"decode": 95.0}, {"decode": 80.0}],
        ("pycmf x", "native"): [{"decode": 120.0}, {"decode": 99.0}, {"decode": 90.0}],
        ("pycmf x", "haswell"): [{"decode": 99.0}, {"decode": 76.0}, {"decode": 88.0}],
    }
    lines = avx2_peer.peer_lines(results, {"pycmf x": "Q4_0"})
    # native: cells 99/100; rounds 1.2, 0.9, 1.0 -> 1.0. AVX2: cells 88/90; rounds 1.1, 0.8, 1.1 -> 1.1
    assert lines[-1] == "| pycmf x ÷ Q4_0 | 0.99× | 1.00× | 0.98× | 1.10× | 1.10 / 0.80 / 1.10 |"


def test_each_pycmf_cell_runs_beside_its_peer() -> None:
    """A round runs, on each target, each llama.cpp type and then the pycmf files set beside it,
    so a ratio's two cells are back to back (this host's speed drifts over minutes)."""
    peers = {"pycmf q8": "Q8_0", "pycmf q4": "Q4_0", "pycmf q4 +i8": "Q4_0"}
    cells = [(f"llama.cpp {k}", cpu, None) for k in ("Q8_0", "Q4_0") for cpu in ("native", "haswell")]
    cells += [(name, cpu, None) for name in peers for cpu in ("native", "haswell")]
    order = [(name, cpu) for name, cpu, _ in avx2_peer.adjacent(cells, peers)]
    assert order == [("llama.cpp Q8_0", "native"), ("pycmf q8", "native"), ("llama.cpp Q4_0", "native"),
                     ("pycmf q4", "native"), ("pycmf q4 +i8", "native"), ("llama.cpp Q8_0", "haswell"),
                     ("pycmf q8", "haswell"), ("llama.cpp Q4_0", "haswell"), ("pycmf q4", "haswell"),
                     ("pycmf q4 +i8", "haswell")]
    assert len(order) == len(cells)
