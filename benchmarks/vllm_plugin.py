"""vLLM on a CMF file (``load_format="cmf"``) against vLLM on the exported Hugging Face folder.

Run with the vLLM venv (scripts/vllm_venv.sh): ``.venv-vllm/bin/python benchmarks/vllm_plugin.py
[--model HF_DIR_OR_CMF] [--dtype float32] [--tokens 64] [--quantized]``. Each side runs in a
process of its own (tests/_vllm_run.py, engine in-process so ru_maxrss covers it) and reports
engine start (load) time, peak RSS and greedy decode tokens/s; the two must give the same tokens.
``--quantized`` compares instead the .cmf served dequantized with the same file served with
``quantized: keep`` (int8/int4 weights kept), adding the resident set right after the engine
started and vLLM's "Model loading took" figure (logged by its GPU runner only; vLLM's CPU
kernels prepack linear weights outside the module, so counting parameters says nothing there);
tokens may differ (W8A8 quantizes activations too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "_vllm_run.py"


def run(spec: dict, level: str = "WARNING") -> dict:
    """One engine in a fresh process; the runner's RESULT line as a dict (plus vLLM's load figure)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_LOGGING_LEVEL=level, TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, str(RUNNER), json.dumps(spec)], capture_output=True, text=True, env=env)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    if r.returncode or line is None:
        raise SystemExit(f"vLLM run failed:\n{(r.stdout + r.stderr)[-3000:]}")
    out = json.loads(line[len("RESULT "):])
    m = re.search(r"Model loading took ([0-9.]+) GiB", r.stdout + r.stderr)
    out["vllm_load_gib"] = float(m.group(1)) if m else None
    return out


def compare_quantized(src: Path, dtype: str, tokens: int) -> int:
    """The .cmf dequantized against the same .cmf with quantized=keep (both through model=<file>)."""
    ids = [[3, 17, 42, 9, 88, 21, 5, 100, 7, 250]] * 4
    base = {"ids": ids, "n": tokens, "dtype": dtype, "model": str(src), "load_format": "cmf"}
    a = run(dict(base, extra={"quantized": "dequantize"}), "INFO")
    b = run(dict(base, extra={"quantized": "keep"}), "INFO")
    same = sum(x == y for x, y in zip(a["tokens"], b["tokens"]))
    first = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x)) for x, y in zip(a["tokens"], b["tokens"])]
    print(f"model {src}, dtype {dtype}, 4 prompts x {tokens} greedy tokens, identical sequences: {same}/4, "
          f"first difference at {first}\n")
    print("| side | engine start s | RSS after start MiB | peak RSS MiB | vLLM 'model loading' GiB | decode tok/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in (("quantized=dequantize", a), ("quantized=keep", b)):
        gib = "not logged" if r["vllm_load_gib"] is None else f"{r['vllm_load_gib']:.2f}"
        print(f"| {name} | {r['load_s']:.1f} | {r['rss_loaded_mb']:.0f} | {r['maxrss_mb']:.0f} | {gib} "
              f"| {r['tok_s']:.1f} |")
    return 0


def main() -> int:
    """Convert (if needed), export, run both sides, print a Markdown table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="/work/shared/models/base", help="an HF folder (converted at f32) or a .cmf")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--quantized", action="store_true", help="dequantized vs quantized=keep on a .cmf")
    args = ap.parse_args()
    if args.quantized:
        return compare_quantized(Path(args.model), args.dtype, args.tokens)
    from cmf.convert import convert, export
    from cmf.integrations.vllm import prepare

    work = Path(tempfile.mkdtemp(prefix="cmf-vllm-bench-"))
    src = Path(args.model)
    if src.suffix != ".cmf":
        convert(src, work / "m.cmf", quant="f32")
        src = work / "m.cmf"
    hf = export(src, work / "hf").folder
    folder = prepare(src, cache_dir=work / "cache")
    ids = [[3, 17, 42, 9, 88, 21, 5, 100, 7, 250]] * 4
    base = {"ids": ids, "n": args.tokens, "dtype": args.dtype}
    a = run(dict(base, model=str(folder), load_format="cmf"))
    b = run(dict(base, model=str(hf), load_format="safetensors"))
    same = a["tokens"] == b["tokens"]
    print(f"model {args.model}, dtype {args.dtype}, 4 prompts x {args.tokens} greedy tokens, same tokens: {same}\n")
    print("| side | engine start s | peak RSS MiB | decode tok/s |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in (("vLLM, load_format=cmf (CMF file)", a), ("vLLM, exported HF folder (safetensors)", b)):
        print(f"| {name} | {r['load_s']:.1f} | {r['maxrss_mb']:.0f} | {r['tok_s']:.1f} |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
