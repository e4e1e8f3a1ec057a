"""A tiny, seeded Lumina-Image 2.0 pipeline folder built offline (diffusers + transformers).

The folder is what ``Lumina2Pipeline.save_pretrained`` writes: ``model_index.json``,
``text_encoder/`` (a Gemma-2 ``Gemma2Model``), ``tokenizer/`` (a Gemma-style BPE trained here in
~20 ms), ``transformer/`` (Next-DiT), ``vae/`` (an AutoencoderKL whose three up blocks give the
8x scale the pipeline assumes) and ``scheduler/``. Dimensions are tiny but every matrix has at
least 32 input columns, so the quantized packs really quantize; every parameter is perturbed
(``hf_fixtures.perturb``), so no norm weight or bias is constant (FIXTURES.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

TE_VOCAB = 384
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
WORDS = ("you are an assistant designed to generate superior images with the degree of image text alignment "
         "based on textual prompts or user prompt start a red cat sitting on blue chair mountain river sunset "
         "photo of lighthouse at night").split()

TE_CONFIG: dict[str, Any] = dict(vocab_size=TE_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                 max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=16,
                                 query_pre_attn_scalar=24, attn_logit_softcapping=50.0,
                                 final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=1, bos_token_id=2)
DIT_CONFIG: dict[str, Any] = dict(sample_size=4, patch_size=2, in_channels=4, hidden_size=64, num_layers=2,
                                  num_refiner_layers=1, num_attention_heads=4, num_kv_heads=2, multiple_of=32,
                                  ffn_dim_multiplier=None, norm_eps=1e-5, scaling_factor=1.0,
                                  axes_dim_rope=(8, 4, 4), axes_lens=(300, 64, 64), cap_feat_dim=64)
VAE_CONFIG: dict[str, Any] = dict(in_channels=3, out_channels=3, latent_channels=4,
                                  down_block_types=("DownEncoderBlock2D",) * 4,
                                  up_block_types=("UpDecoderBlock2D",) * 4,
                                  block_out_channels=(8, 16, 16, 32), layers_per_block=1, norm_num_groups=4,
                                  sample_size=32, use_quant_conv=False, use_post_quant_conv=False,
                                  shift_factor=0.0609, scaling_factor=1.5035)


def train_tokenizer(folder: Path) -> None:
    """A Gemma-style BPE (``▁`` for spaces, ``<bos>`` prepended, ids pad 0 / eos 1 / bos 2 / unk 3)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import GemmaTokenizer

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Replace("\u2581", " ")
    text = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(12)) for i in range(300)]
    trainer = trainers.BpeTrainer(vocab_size=TE_VOCAB - 32, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz0123456789<>.,:'\u2581"))
    tok.train_from_iterator(text, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 2)])
    GemmaTokenizer(tokenizer_object=tok, model_max_length=512).save_pretrained(str(folder))


def make_pipeline(seed: int = 0, te: dict[str, Any] | None = None, dit: dict[str, Any] | None = None,
                  vae: dict[str, Any] | None = None) -> Any:
    """The perturbed ``Lumina2Pipeline`` (f32, eval mode) with the tokenizer of a temp folder;
    ``te``/``dit``/``vae`` update the component configs (the benchmark's larger pipeline)."""
    import tempfile

    import torch
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, Lumina2Pipeline, Lumina2Transformer2DModel

    from hf_fixtures import perturb

    torch.manual_seed(seed)
    text_encoder = transformers.Gemma2Model(transformers.Gemma2Config(**{**TE_CONFIG, **(te or {})})).eval().float()
    perturb(text_encoder, seed + 1)
    transformer = Lumina2Transformer2DModel(**{**DIT_CONFIG, **(dit or {})}).eval().float()
    perturb(transformer, seed + 2)
    autoencoder = AutoencoderKL(**{**VAE_CONFIG, **(vae or {})}).eval().float()
    perturb(autoencoder, seed + 3)
    with tempfile.TemporaryDirectory() as tmp:
        train_tokenizer(Path(tmp))
        tokenizer = transformers.AutoTokenizer.from_pretrained(tmp)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return Lumina2Pipeline(transformer=transformer, scheduler=scheduler, vae=autoencoder, text_encoder=text_encoder,
                           tokenizer=tokenizer)


def build(folder: str | Path, seed: int = 0, dtype: str = "f32", **configs: dict[str, Any]) -> Path:
    """Write the fixture pipeline to ``folder`` (created; an existing one is replaced), its
    weights saved at ``dtype`` (f32 or bf16, as hub checkpoints are)."""
    import torch

    folder = Path(folder)
    if folder.exists():
        shutil.rmtree(folder)
    pipe = make_pipeline(seed, **configs)
    if dtype == "bf16":
        pipe.to(torch.bfloat16)
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return folder


def read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))
