"""End-to-end quick start on a small model built offline (no network).

1. build a tiny Qwen3-shaped checkpoint (seeded random weights) and a byte-level BPE tokenizer;
2. write it as one .cmf (matrices quantized, norms f16, tokenizer + chat template embedded, a task mask);
3. reopen it, verify the whole hash chain, sign it and check the signature;
4. print `cmf info` and `cmf masks`.

Run: ``scripts/demo.sh`` (or ``python examples/quickstart.py [--out DIR] [--quant q8_row]``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import cmf
from cmf.format.masks import MaskSet, TaskMask
from cmf.format.writer import CmfWriter

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "A CMF file carries quantized weights, the tokenizer, the chat template and task masks.",
    "Every tensor has a 64-bit hash, so a truncated download cannot become a bad model.",
    "The reader maps the file and checks every offset before it touches a byte.",
] * 20


def build_tokenizer(vocab_size: int) -> str:
    """Train a tiny byte-level BPE tokenizer with the `tokenizers` library (a fraction of a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok.to_str()


def build_model(seed: int = 0) -> tuple[dict, dict[str, np.ndarray]]:
    """Config + seeded random weights of a tiny Qwen3-shaped decoder (norms perturbed, not constant)."""
    cfg = dict(hidden=64, inter=160, layers=2, heads=4, kv=2, head_dim=16, vocab=384)
    rng = np.random.default_rng(seed)
    w: dict[str, np.ndarray] = {}
    h, d = cfg["hidden"], cfg["head_dim"]

    def mat(r: int, c: int) -> np.ndarray:
        return (rng.standard_normal((r, c)) * 0.05).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w["model.embed_tokens.weight"] = mat(cfg["vocab"], h)
    for i in range(cfg["layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = mat(cfg["heads"] * d, h)
        w[p + "self_attn.k_proj.weight"] = mat(cfg["kv"] * d, h)
        w[p + "self_attn.v_proj.weight"] = mat(cfg["kv"] * d, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, cfg["heads"] * d)
        w[p + "self_attn.q_norm.weight"] = norm(d)
        w[p + "self_attn.k_norm.weight"] = norm(d)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "mlp.gate_proj.weight"] = mat(cfg["inter"], h)
        w[p + "mlp.up_proj.weight"] = mat(cfg["inter"], h)
        w[p + "mlp.down_proj.weight"] = mat(h, cfg["inter"])
    w["model.norm.weight"] = norm(h)
    w["lm_head.weight"] = mat(cfg["vocab"], h)
    return cfg, w


def header_for(cfg: dict, quant_label: str) -> dict:
    return {
        "format": "cmf", "version": 2, "quant_type": "Q8_ROW" if quant_label.startswith("q8") else "F16",
        "arch": {
            "arch_name": "qwen3", "hidden_size": cfg["hidden"], "intermediate_size": cfg["inter"],
            "num_layers": cfg["layers"], "num_attention_heads": cfg["heads"], "num_kv_heads": cfg["kv"],
            "head_dim": cfg["head_dim"], "vocab_size": cfg["vocab"],
            "layer_types": ["FullAttention"] * cfg["layers"], "rms_norm_eps": 1e-6,
            "max_position_embeddings": 512, "norm_style": "qwen", "rope_theta": 1000000.0,
            "tie_word_embeddings": False,
        },
        "tokenizer_config": {"chat_template": CHATML, "eos_token_ids": [2], "bos_token_id": None,
                             "pad_token_id": 0},
        "provenance": {"tool": f"pycmf {cmf.__version__} quickstart", "source_model": "random tiny qwen3"},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default: a temporary one)")
    ap.add_argument("--quant", default="q8_row", help="dtype for 2-D matrices (default q8_row)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="pycmf-quickstart-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tiny-qwen3.cmf"

    t0 = time.perf_counter()
    cfg, weights = build_model()
    tokenizer_json = build_tokenizer(cfg["vocab"])
    print(f"[1/4] built a tiny qwen3 ({sum(a.size for a in weights.values()):,} parameters) and a "
          f"{len(json.loads(tokenizer_json)['model']['vocab'])}-token BPE tokenizer")

    rng = np.random.default_rng(1)
    coding = TaskMask(task_id=1, name="coding", ffn=rng.random((cfg["layers"], cfg["inter"])) < 0.5,
                      heads=np.ones((cfg["layers"], cfg["heads"]), bool), gates=np.ones(cfg["layers"], bool))
    general = TaskMask(task_id=0, name="general", ffn=np.ones((cfg["layers"], cfg["inter"]), bool),
                       heads=np.ones((cfg["layers"], cfg["heads"]), bool), gates=np.ones(cfg["layers"], bool))
    with CmfWriter(path, header_for(cfg, args.quant)) as w:
        for name, a in weights.items():
            dtype = args.quant if a.ndim == 2 and a.size >= 32 else "f16"
            w.add_array(name, a, dtype)
        w.set_vocab(tokenizer_json)
        w.set_masks(MaskSet(default_task="general", masks=[general, coding]))
    print(f"[2/4] wrote {path} ({path.stat().st_size:,} bytes, matrices as {args.quant})")

    with cmf.open(path) as f:
        problems = f.verify()
        err = max(float(np.abs(f.array(n) - weights[n]).max()) for n in f.keys() if weights[n].ndim == 2)
    if problems:
        print("verify found problems:", *problems, sep="\n  ")
        return 1
    from cmf.format.signature import sign_file, verify_signature

    sign_file(path, out_dir / "quickstart-signing.key")
    sig = verify_signature(path)
    print(f"[3/4] verify: OK (every hash64), max |decoded - source| = {err:.2e}; signature: "
          f"{'OK' if sig else 'missing'}")

    from cmf.cli import main as cli

    print("[4/4] cmf info / cmf masks:\n")
    cli(["info", str(path)])
    print()
    cli(["masks", str(path)])
    print(f"\ndone in {time.perf_counter() - t0:.1f} s — files in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
