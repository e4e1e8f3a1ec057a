"""The coverage-guided fuzz harnesses (benchmarks/fuzz/harnesses.py) run here without atheris:
each on its seed corpus and on deterministic mutations of it, so a harness that breaks (or a
surface that starts raising an untyped error on its seeds) fails the suite, not only a campaign.
Findings of a campaign get their regression test in this file or tests/test_malformed.py.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks" / "fuzz"), str(ROOT / "benchmarks")]

import harnesses as H  # noqa: E402


def mutations(seed: bytes, n: int, rng: random.Random) -> list[bytes]:
    out = []
    for _ in range(n):
        b = bytearray(seed)
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            if op < 0.5 and b:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif op < 0.7 and b:
                i = rng.randrange(len(b))
                del b[i:i + rng.randint(1, 64)]
            elif op < 0.85:
                b[rng.randrange(len(b) + 1):0] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            elif b:
                b = b[: rng.randrange(len(b))]
        out.append(bytes(b))
    return out


@pytest.mark.parametrize("name", sorted(H.HARNESSES))
def test_harness_on_seeds_and_mutations(name: str, tmp_path: Path) -> None:
    make, one = H.HARNESSES[name]
    seeds = make(tmp_path)
    assert seeds, f"{name}: no seed"
    rng = random.Random(28)
    for s in seeds:
        one(s)  # a seed is valid input: it must pass without a finding
    for s in seeds[:3]:
        for m in mutations(s, 15, rng):
            one(m)


def test_harness_table_matches_the_campaign() -> None:
    import fuzz_campaign

    assert set(fuzz_campaign.HARNESS_NAMES) == set(H.HARNESSES)
