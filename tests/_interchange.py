"""Helpers for the interchange tests (docs/INTERCHANGE.md): files in the reference's layouts,
written with pycmf's own writer, and the logits checks run on them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

import hf_fixtures as H

import cmf
from cmf.format.writer import CmfWriter

TOL = 1e-4  # as tests/_hf_oracle.py


def build_hf(kind: str, folder: Path, cfg_name: str | None = None, cls_name: str | None = None,
             seed: int = 0, **overrides: Any) -> Path:
    """A tiny perturbed HF checkpoint like ``hf_fixtures.build``, with config ``overrides`` (and,
    for families hf_fixtures does not list, explicit config/model classes)."""
    import torch
    import transformers

    if kind in H.SPECS:
        c_name, m_name, kwargs = H.SPECS[kind]()
    else:
        c_name, m_name, kwargs = cfg_name, cls_name, {}
    kwargs = dict(kwargs, **overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, m_name)(getattr(transformers, c_name)(**kwargs)).eval().float()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if not torch.isfinite(p).all():
                p.copy_(torch.randn(p.shape) * 0.02)
    H.perturb(model, seed + 1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    H.train_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": 0}))
    return folder


def hf_tensors(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for p in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(p)))
    return out


def hf_logits(folder: Path, ids: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return m(torch.tensor(ids)[None]).logits[0].float().numpy()


def write_cmf(path: Path, header: dict[str, Any], arrays: dict[str, np.ndarray], vocab: bytes | None,
              masks: Any = None) -> Path:
    """A CMF file of f32 ``arrays`` with ``header`` (its arch as given), as any writer would."""
    with CmfWriter(path, header) as w:
        for name in sorted(arrays):
            w.add_array(name, np.ascontiguousarray(arrays[name], dtype=np.float32))
        w.set_vocab(vocab)
        if masks is not None:
            w.set_masks(masks)
    return path


def file_parts(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], bytes | None]:
    """(header dict, every tensor as f32, tokenizer.json) of a CMF file."""
    with cmf.open(path) as f:
        return f.header.to_dict(), {n: np.array(f.array(n)) for n in f.keys()}, f.tokenizer_json


def check_logits(path: Path, ref: np.ndarray, ids: np.ndarray, task: str | None = None) -> None:
    """Full-sequence logits, KV-cached step decode and chunked prefill within TOL of ``ref``."""
    with cmf.load(path, batch_size=7, task=task) as m:
        np.testing.assert_allclose(m.prefill(ids, m.new_cache(), all_logits=True), ref, atol=TOL, rtol=0)
        cache = m.new_cache()
        steps = np.stack([m.forward([t], cache)[0] for t in ids])
        np.testing.assert_allclose(steps, ref, atol=TOL, rtol=0)
    with cmf.load(path, batch_size=24, task=task) as m:
        np.testing.assert_allclose(m.logits(ids), ref, atol=TOL, rtol=0)


def prompt(seed: int = 0, n: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, H.VOCAB, n)
