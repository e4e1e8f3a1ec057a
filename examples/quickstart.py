"""End-to-end quick start on a small model built offline (no network).

1. take a small Hugging Face checkpoint: ``../shared/models/base`` when present (a trained Qwen3),
   else a tiny random Qwen3 built here with numpy + safetensors + a BPE tokenizer (no network);
2. convert it into one .cmf (``cmf.convert.convert``: quantized matrices, tokenizer, chat template);
3. verify the whole hash chain, sign it and check the signature;
4. print ``cmf info``;
5. generate a continuation (``--chat`` applies the file's chat template).

Run: ``scripts/demo.sh`` (or ``python examples/quickstart.py [--out DIR] [--hf FOLDER] [--quant q4tp]``).
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


def write_hf_folder(folder: Path, cfg: dict, weights: dict[str, np.ndarray], tokenizer_json: str) -> Path:
    """Save the random checkpoint the way Hugging Face does: config.json + model.safetensors + tokenizer."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": cfg["hidden"],
        "intermediate_size": cfg["inter"], "num_hidden_layers": cfg["layers"],
        "num_attention_heads": cfg["heads"], "num_key_value_heads": cfg["kv"], "head_dim": cfg["head_dim"],
        "vocab_size": cfg["vocab"], "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "eos_token_id": 2, "bos_token_id": None, "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="output folder (default: a temporary one)")
    ap.add_argument("--hf", default=None, help="a Hugging Face model folder to use instead of the built-in "
                    "choice (../shared/models/base when present, else a tiny random Qwen3)")
    ap.add_argument("--tiny", action="store_true", help="use the built-in tiny random model even when "
                    "../shared/models/base exists")
    ap.add_argument("--quant", default="q8", help="converter --quant (default q8)")
    ap.add_argument("--prompt", default="The borrow checker")
    ap.add_argument("--chat", action="store_true", help="apply the chat template (the base model is not chat-tuned)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="pycmf-quickstart-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    shared = Path(__file__).resolve().parents[2] / "shared" / "models" / "base"
    if args.hf:
        source = Path(args.hf)
        print(f"[1/5] source: {source}")
    elif shared.is_dir() and not args.tiny:
        source = shared
        print(f"[1/5] source: {source} (a small Qwen3 trained on technical prose)")
    else:
        cfg, weights = build_model()
        source = write_hf_folder(out_dir / "tiny-qwen3-hf", cfg, weights, build_tokenizer(cfg["vocab"]))
        print(f"[1/5] built a tiny random Qwen3 checkpoint ({sum(a.size for a in weights.values()):,} "
              f"parameters) in {source}")

    from cmf.convert import convert

    path = out_dir / f"model-{args.quant}.cmf"
    convert(source, path, quant=args.quant)
    print(f"[2/5] converted to {path} ({path.stat().st_size:,} bytes, --quant {args.quant})")

    from cmf.format.signature import sign_file, verify_signature

    with cmf.open(path) as f:
        problems = f.verify()
    if problems:
        print("verify found problems:", *problems, sep="\n  ")
        return 1
    sign_file(path, out_dir / "quickstart-signing.key")
    sig = verify_signature(path)
    print(f"[3/5] verify: every hash64 OK; detached Ed25519 signature: {'OK' if sig else 'missing'}")

    from cmf.cli import main as cli

    print("[4/5] cmf info:\n")
    cli(["info", str(path)])
    print(f"\n[5/5] generate (greedy, {'chat template' if args.chat else 'raw completion'}): {args.prompt!r}\n")
    with cmf.load(path) as model:
        last = None
        for r in model.stream(args.prompt, max_tokens=48, raw=not args.chat):
            print(r.text, end="", flush=True)
            last = r
        print(f"\n\n  [{last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s, finish: {last.finish_reason}]")
    print(f"\ndone in {time.perf_counter() - t0:.1f} s — files in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
