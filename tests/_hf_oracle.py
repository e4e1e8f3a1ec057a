"""Shared HF-oracle helpers for the runtime tests of MoE, linear-attention, MLA and MTP models.

Everything is cached per process (fixtures, conversions, transformers models), so a family costs
one build, one conversion and one model load however many tests use it.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

import hf_fixtures as H

import cmf
from cmf.runtime.generate import generate_step
from cmf.runtime.sampling import make_sampler

TOL = 1e-4
MARGIN = 1e-3  # FIXTURES.md: greedy tokens are compared only where top-1 beats top-2 by this
_HF: dict[tuple, object] = {}


def variant_key(variant: dict) -> tuple:
    return tuple(sorted(variant.items()))


def hf_model(kind: str, **variant):
    """The transformers model of a fixture (f32, eval), loaded once."""
    key = (kind, variant_key(variant))
    if key not in _HF:
        _HF[key] = transformers.AutoModelForCausalLM.from_pretrained(
            str(H.fixture(kind, **variant)), dtype=torch.float32).eval()
    return _HF[key]


def prompt(seed: int = 0, n: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, H.VOCAB, n)


def hf_logits(kind: str, ids: np.ndarray, **variant) -> np.ndarray:
    with torch.no_grad():
        return hf_model(kind, **variant)(torch.tensor(ids)[None]).logits[0].float().numpy()


def hf_greedy(kind: str, ids: np.ndarray, n: int = 16) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and the top-1/top-2 margin of each step."""
    with torch.no_grad():
        out = hf_model(kind).generate(torch.tensor(ids)[None], max_new_tokens=n, do_sample=False,
                                      eos_token_id=None, pad_token_id=0, output_scores=True,
                                      return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    margins = []
    for s in out.scores:
        top = torch.topk(s[0].float(), 2).values
        margins.append(float(top[0] - top[1]))
    return tokens, margins


def greedy(model, ids, n: int = 16, **kw) -> list[int]:
    return [t for t, _ in generate_step(model, list(ids), sampler=make_sampler(0.0), max_tokens=n, **kw)]


def check_logits(kind: str) -> None:
    """Full-sequence logits, KV-cached step decode and chunked prefill (7-token chunks, and 24-token
    chunks, which take the chunked linear-attention path) all within TOL of transformers."""
    ids = prompt(0)
    ref = hf_logits(kind, ids)
    path = H.converted(kind)
    with cmf.load(path, batch_size=7) as m:
        full = m.prefill(ids, m.new_cache(), all_logits=True)
        np.testing.assert_allclose(full, ref, atol=TOL, rtol=0)
        cache = m.new_cache()
        steps = np.stack([m.forward([t], cache)[0] for t in ids])
        np.testing.assert_allclose(steps, ref, atol=TOL, rtol=0)
    with cmf.load(path, batch_size=24) as m:
        np.testing.assert_allclose(m.logits(ids), ref, atol=TOL, rtol=0)


def check_greedy(kind: str, seed: int = 2) -> None:
    """16 greedy tokens equal transformers' up to the first step whose margin is below MARGIN."""
    ids = prompt(seed)
    expected, margins = hf_greedy(kind, ids)
    with cmf.load(H.converted(kind)) as m:
        got = greedy(m, ids)
    for i, (a, b) in enumerate(zip(got, expected)):
        if margins[i] < MARGIN:  # a near-tie: the rest of both sequences is not comparable
            assert i >= 8, f"{kind}: near-tie at step {i}; choose another prompt"
            return
        assert a == b, f"{kind}: token {i}: {got} vs {expected}"
