"""The reference converter's MLA row permutations, written independently of pycmf's tables.

infosave2007/cmf, crates/cortiq-cli/src/convert.rs, ``run_convert``: every query head of
``q_proj`` / ``q_b_proj`` goes rope-first (``[nope | rope]`` -> ``[rope | nope]``); for DeepSeek
(interleaved rotary, not NoPE) the rope rows are stored even-first (0, 2, …, 1, 3, …) there and in
the rope tail of ``kv_a_proj_with_mqa``. NoPE (Kimi) and half-split sources only move the rope
rows. Used to build reference-layout fixtures and the expected tensors of converter tests.
"""

from __future__ import annotations

import torch


def _even_first(rows: torch.Tensor) -> torch.Tensor:
    return torch.cat([rows[0::2], rows[1::2]])


def q_rows(t: torch.Tensor, nope: int, rope: int, even_first: bool) -> torch.Tensor:
    """q_proj / q_b_proj weight [heads·(nope+rope), C] in the reference layout."""
    heads = t.shape[0] // (nope + rope)
    out = []
    for h in t.reshape(heads, nope + rope, *t.shape[1:]):
        r = h[nope:]
        out += [_even_first(r) if even_first else r, h[:nope]]
    return torch.cat(out)


def kv_a_rows(t: torch.Tensor, rank: int, rope: int, even_first: bool) -> torch.Tensor:
    """kv_a_proj_with_mqa weight (or bias) [rank + rope, …] in the reference layout."""
    assert t.shape[0] == rank + rope
    return torch.cat([t[:rank], _even_first(t[rank:])]) if even_first else t


def reference_rows(name: str, t: torch.Tensor, nope: int, rope: int, rank: int, even_first: bool) -> torch.Tensor:
    """``t`` as the reference converter stores tensor ``name`` (unchanged when not permuted)."""
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
        return q_rows(t, nope, rope, even_first)
    if name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
        return kv_a_rows(t, rank, rope, even_first)
    return t
