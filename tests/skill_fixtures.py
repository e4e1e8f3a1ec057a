"""A tiny 4-layer Qwen3 base and donors that differ from it in chosen layers (skills tests).

The base is the ``qwen3`` fixture's architecture at four layers (hidden 64, FFN 96, vocab 384),
seeded and perturbed. A donor is the base's safetensors with the tensors of some layers moved by
seeded noise, as a fine-tune would move them; config, tokenizer and template are copied.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np

import hf_fixtures as H

WORDS = ["model", "tensor", "convert", "weight", "layer", "expert", "token", "hello", "world", "rope",
         "quant", "shard", "format", "header", "vocab", "attention", "norm", "bias", "gate", "router"]


def build_base(folder: Path) -> Path:
    """The 4-layer base checkpoint (HF folder)."""
    import torch
    import transformers

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    torch.manual_seed(3)
    cfg_name, cls_name, kwargs = H.SPECS["qwen3"]()
    cfg = getattr(transformers, cfg_name)(**dict(kwargs, num_hidden_layers=4))
    model = getattr(transformers, cls_name)(cfg).eval().float()
    H.perturb(model, 4)
    model.save_pretrained(str(folder), safe_serialization=True)
    H.train_tokenizer(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1], "do_sample": False}))
    return folder


def build_donor(base: Path, folder: Path, layers: tuple[int, ...], seed: int, scale: float = 0.05) -> Path:
    """``base`` with every tensor of ``layers`` moved by seeded noise (the other tensors untouched)."""
    from safetensors.numpy import load_file, save_file

    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(base, folder)
    sd = load_file(str(base / "model.safetensors"))
    rng = np.random.default_rng(seed)
    for k, v in sd.items():
        if any(k.startswith(f"model.layers.{i}.") for i in layers):
            sd[k] = (v + rng.standard_normal(v.shape).astype(v.dtype) * scale).astype(v.dtype)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def cmf_with_skill(tmp_path: Path, quant: str, skill: str = "d1") -> tuple[Path, Path]:
    """A converted base (``quant``) with one skill ``skill`` grafted from a donor that differs in
    layer 1: (the .cmf with the skill, the donor folder)."""
    from cmf.cli import main as cli_main
    from cmf.convert import convert

    base = build_base(tmp_path / "base")
    donor = build_donor(base, tmp_path / "donor", (1,), seed=5)
    convert(base, tmp_path / "base.cmf", quant=quant)
    out = tmp_path / "m.cmf"
    assert cli_main(["skill", "add", str(tmp_path / "base.cmf"), "--from", str(donor), "--id", skill,
                     "--layers", "1", "--tensors", "all", "-o", str(out)]) == 0
    return out, donor


def word_prompts(n: int, seed: int) -> list[str]:
    """Prose-like prompts made of the tokenizer's training words."""
    r = random.Random(seed)
    return [" ".join(r.choice(WORDS) for _ in range(r.randint(6, 14))) for _ in range(n)]


def digit_prompts(n: int, seed: int) -> list[str]:
    """Number-and-punctuation prompts: a clearly different input distribution."""
    r = random.Random(seed)
    return [" ".join(str(r.randint(0, 9999)) + r.choice([",", ";", ":", " =", " +"]) for _ in range(r.randint(5, 10)))
            for _ in range(n)]
