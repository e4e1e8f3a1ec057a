"""Converter benchmark: HF -> CMF throughput (source GB/s) and peak RSS, next to safetensors' load.

    python benchmarks/convert.py [--dir /dev/shm/x] [--quick] [--write]

Two seeded random Qwen3 checkpoints in bf16 safetensors (written by this script, no torch needed):

- ``qwen3-0.2b``: hidden 1024, FFN 3072, 12 layers, 16 heads / 8 KV, head_dim 64, vocab 32000,
  untied (217M parameters, 434 MB). Its largest tensor is the 32000x1024 embedding.
- ``qwen3-deep``: the same layers x 24 with vocab 8192 (319M parameters, 638 MB); its largest
  tensor is one 3072x1024 FFN matrix, so the whole model is ~50x its largest tensor and the peak
  RSS shows whether conversion really streams.

Each conversion runs in a fresh process (``--quant f16``, ``q8``, ``q4tp``) that reports its own
peak RSS (VmHWM); the baseline row is the same process importing everything and converting
nothing. ``safetensors load`` is ``safetensors.torch.load_file`` of the whole checkpoint with every
tensor copied into process memory (``load_file`` alone maps the file lazily; skipped without torch). Files live in the page cache for every run (written just before), so the figures
are CPU-bound, not disk-bound. ``--write`` puts the table into ``## convert`` of RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, table  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
MODELS = {
    "qwen3-0.2b": dict(hidden=1024, inter=3072, layers=12, heads=16, kv=8, head_dim=64, vocab=32000),
    "qwen3-deep": dict(hidden=1024, inter=3072, layers=24, heads=16, kv=8, head_dim=64, vocab=8192),
}
QUICK = {"qwen3-0.2b": dict(hidden=256, inter=768, layers=4, heads=4, kv=2, head_dim=64, vocab=4096)}


def tensors(m: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, hd = m["hidden"], m["inter"], m["head_dim"]
    out = [("model.embed_tokens.weight", (m["vocab"], h)), ("model.norm.weight", (h,)), ("lm_head.weight", (m["vocab"], h))]
    for n in range(m["layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (m["heads"] * hd, h)), (p + "self_attn.k_proj.weight", (m["kv"] * hd, h)),
                (p + "self_attn.v_proj.weight", (m["kv"] * hd, h)), (p + "self_attn.o_proj.weight", (h, m["heads"] * hd)),
                (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)), (p + "mlp.down_proj.weight", (h, i))]
    return out


def write_checkpoint(folder: Path, m: dict, seed: int = 0) -> int:
    """A bf16 safetensors checkpoint written tensor by tensor; returns its parameter count."""
    from cmf.quant import f32_to_bf16_bits

    folder.mkdir(parents=True, exist_ok=True)
    spec = tensors(m)
    head, at = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in spec:
        n = 2 * int(np.prod(shape))
        head[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(head).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    with open(folder / "model.safetensors", "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        for name, shape in spec:
            if len(shape) == 1:
                w = 1 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
            else:
                w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
            fh.write(f32_to_bf16_bits(w).astype("<u2").tobytes())
    cfg = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": m["hidden"],
           "intermediate_size": m["inter"], "num_hidden_layers": m["layers"], "num_attention_heads": m["heads"],
           "num_key_value_heads": m["kv"], "head_dim": m["head_dim"], "vocab_size": m["vocab"],
           "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(cfg))
    return sum(int(np.prod(s)) for _, s in spec)


CHILD = r"""
import json, resource, sys, time
import cmf.convert, cmf.quant, numpy
from cmf.convert import convert
mode, src, out, quant = sys.argv[1:5]
if mode == "load":
    from safetensors.torch import load_file  # import time is not load time
t0 = time.perf_counter()
n = 0
if mode == "convert":
    r = convert(src, out, quant=quant)
    n = r.source_bytes
elif mode == "load":
    # load_file maps the file lazily; copying each tensor makes it an actual load into memory
    sd = {k: v.clone() for k, v in load_file(src + "/model.safetensors").items()}
    n = sum(t.numel() * t.element_size() for t in sd.values())
secs = time.perf_counter() - t0
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking parent.
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
peak = int(hwm[0].split()[1]) / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"seconds": secs, "bytes": n, "maxrss_mb": peak}))
"""


def child(mode: str, src: Path, out: Path, quant: str = "") -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(src), str(out), quant], capture_output=True,
                          text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} {quant} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="work folder (default: a temp folder, /dev/shm when available)")
    ap.add_argument("--quick", action="store_true", help="a tiny model, to check the script runs")
    ap.add_argument("--quants", default="f16,q8,q4tp")
    ap.add_argument("--write", action="store_true", help="write the table into RESULTS.md (## convert)")
    args = ap.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    base.mkdir(parents=True, exist_ok=True)
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    rows = []
    models = QUICK if args.quick else MODELS
    try:
        for name, m in models.items():
            src = base / name
            params = write_checkpoint(src, m)
            size = (src / "model.safetensors").stat().st_size
            largest = max(int(np.prod(s)) for _, s in tensors(m))
            idle = child("idle", src, base / "none.cmf")
            rows.append([name, f"{params / 1e6:.0f}M", f"{size / 1e6:.0f}", f"{largest * 4 / 1e6:.0f}", "import only",
                         "", "", f"{idle['maxrss_mb']:.0f}"])
            if have_torch:
                r = child("load", src, base / "none.cmf")
                rows.append([name, "", "", "", "safetensors load (torch)", f"{r['seconds']:.2f}",
                             f"{r['bytes'] / 1e9 / r['seconds']:.2f}", f"{r['maxrss_mb']:.0f}"])
            for q in args.quants.split(","):
                out = base / f"{name}.{q}.cmf"
                r = child("convert", src, out, q)
                rows.append([name, "", "", "", f"convert --quant {q} ({out.stat().st_size / 1e6:.0f} MB)",
                             f"{r['seconds']:.2f}", f"{r['bytes'] / 1e9 / r['seconds']:.3f}", f"{r['maxrss_mb']:.0f}"])
                out.unlink()
            shutil.rmtree(src)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    headers = ["model", "params", "bf16 MB", "largest tensor f32 MB", "run", "seconds", "source GB/s", "peak RSS MB"]
    text = table(headers, rows)
    print(text)
    if args.write:
        import safetensors

        note = (f"Run {datetime.date.today()} on {machine()}; numpy {np.__version__}, safetensors "
                f"{safetensors.__version__}. Seeded random Qwen3 checkpoints in bf16 safetensors, page-cached; "
                "each row is a fresh process (peak RSS = its VmHWM, imports included). Source GB/s = "
                "checkpoint bytes read / wall time of `cmf.convert.convert` (reading, widening, encoding, "
                "hashing, the spool and the final atomic write with fsync). safetensors load = `load_file` + a copy of "
                "every tensor (the file is mapped lazily otherwise), bf16 kept as bf16.")
        section = f"## convert\n\n{note}\n\n{text}\n"
        body = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
        if "## convert\n" in body:
            start = body.index("## convert\n")
            nxt = body.find("\n## ", start + 1)
            body = body[:start] + section + ("\n" + body[nxt + 1:] if nxt >= 0 else "")
        else:
            body = body.rstrip("\n") + "\n\n\n" + section
        RESULTS.write_text(body)


if __name__ == "__main__":
    main()
