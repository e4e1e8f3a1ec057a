"""Image pipeline benchmark: imagine-pack time and peak RSS, imagine per-step time against diffusers.

    python benchmarks/image.py [--quick] [--steps 8] [--size 256] [--write]

One seeded random Lumina-Image 2.0 pipeline (the test fixture's architecture, larger: Gemma-2
encoder hidden 512 x 6 layers, vocab 8192; Next-DiT hidden 512 x 8 layers + 2 x 2 refiners; an
8x AutoencoderKL with 16 latent channels), saved in bf16 as hub checkpoints are. Every row is a
fresh process reporting its own peak RSS (VmHWM, imports included); "import only" is the
baseline of the packing process (cmf.image + diffusers, which the packer uses to check configs
against weights).

- ``imagine-pack --quant Q``: wall time of :func:`cmf.image.packer.plan` (metadata, and every
  component built on the meta device to check its config against its weights) and of
  :func:`~cmf.image.packer.execute` (read, widen, encode, hash, write at final offsets, fsync,
  rename), and peak RSS, next to the largest tensor's f32 size.
- ``imagine``: :func:`cmf.image.loader.load_pipeline` (weights decoded from the file) then
  :func:`cmf.image.txt2img.generate`; ``diffusers``: ``Lumina2Pipeline.from_pretrained(folder,
  torch_dtype=float32)`` then the same ``generate`` call, so both are timed by the same code.
  s/step is the mean of steps 2..N (step 1 carries prompt encoding). Both compute in f32.
- The same two pipelines loaded in one process, their denoiser timed alternately at the
  benchmark's size (one CFG step: batch 2, 256 caption tokens), median and best of ``--repeat``:
  on a shared machine the per-process step times above carry whatever else ran at that moment.
- Quality: max |f32 pack - diffusers| on the decoded image, PSNR of q8/q4tp against f32.

``--write`` appends a dated entry to ``## image pipelines`` of RESULTS.md.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import append_entry, idle_fraction, machine, table  # noqa: E402

RESULTS = HERE / "RESULTS.md"
ROOT = HERE.parent
CONFIGS = {
    "te": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
               num_key_value_heads=4, head_dim=64, query_pre_attn_scalar=64, sliding_window=128),
    "dit": dict(sample_size=32, in_channels=16, hidden_size=512, num_layers=8, num_refiner_layers=2,
                num_attention_heads=8, num_kv_heads=4, multiple_of=256, axes_dim_rope=(32, 16, 16),
                axes_lens=(300, 128, 128), cap_feat_dim=512),
    "vae": dict(latent_channels=16, block_out_channels=(32, 64, 128, 128), layers_per_block=2, norm_num_groups=32),
}
QUICK = {"te": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2),
         "dit": dict(hidden_size=128, num_layers=2, num_refiner_layers=1, cap_feat_dim=128, multiple_of=64,
                     axes_dim_rope=(16, 8, 8), in_channels=4),
         "vae": dict(latent_channels=4)}

CHILD = r"""
import json, sys, time
mode, src, out, arg = sys.argv[1:5]
opts = json.loads(arg)
import numpy as np
import cmf.image.packer, cmf.image.modules
import diffusers  # the packer checks configs with it: part of the baseline
t0 = time.perf_counter()
res = {}
if mode == "pack":
    plan = cmf.image.packer.plan(src, opts["quant"])
    res["plan_hwm_mb"] = int([l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]) / 1024
    t1 = time.perf_counter()
    r = cmf.image.packer.execute(plan, out)
    res.update(bytes=r.bytes, source_bytes=r.source_bytes, plan_seconds=t1 - t0, seconds=time.perf_counter() - t1)
elif mode in ("imagine", "diffusers"):
    import torch
    from cmf.image.txt2img import generate
    if mode == "imagine":
        from cmf.image.loader import load_pipeline
        pipe = load_pipeline(src, dtype="f32").pipeline
    else:
        pipe = diffusers.Lumina2Pipeline.from_pretrained(src, torch_dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
    load = time.perf_counter() - t0
    g = generate(pipe, opts["prompt"], steps=opts["steps"], size=(opts["size"], opts["size"]), seed=opts["seed"])
    np.save(out, g.image)
    res = {"load_seconds": load, "step_seconds": g.mean_step_seconds, "first_seconds": g.first_seconds,
           "decode_seconds": g.decode_seconds, "seconds": g.seconds, "threads": torch.get_num_threads()}
elif mode == "ab":
    # Both pipelines in one process, their denoiser timed alternately: the machine's load hits both alike.
    import statistics, torch
    from cmf.image.loader import load_pipeline
    pipes = {"imagine": load_pipeline(out, dtype="f32").pipeline,
             "diffusers": diffusers.Lumina2Pipeline.from_pretrained(src, torch_dtype=torch.float32)}
    cfg = pipes["diffusers"].transformer.config
    side = opts["size"] // 8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, cfg.in_channels, side, side, generator=g)
    enc = torch.randn(2, 256, cfg.cap_feat_dim, generator=g)
    mask = torch.ones(2, 256, dtype=torch.bool)
    tt = torch.full((2,), 0.5)
    samples = {k: [] for k in pipes}
    with torch.no_grad():
        for i in range(opts["repeat"] + 1):
            for k, p in (list(pipes.items()) if i % 2 else list(pipes.items())[::-1]):  # either goes first
                t1 = time.perf_counter()
                p.transformer(hidden_states=x, timestep=tt, encoder_hidden_states=enc, encoder_attention_mask=mask,
                              return_dict=False)
                if i:  # the first round warms up
                    samples[k].append(time.perf_counter() - t1)
    res = {k: {"median": statistics.median(v), "best": min(v)} for k, v in samples.items()}
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
res["maxrss_mb"] = int(hwm[0].split()[1]) / 1024
print(json.dumps(res))
"""


def child(mode: str, src: Path, out: Path, **opts: object) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-c", CHILD, mode, str(src), str(out), json.dumps(opts)],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} {opts} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


def largest_f32_mb(folder: Path) -> tuple[float, int]:
    """(largest tensor's f32 MB, total parameters) over the packed components' safetensors."""
    from safetensors import safe_open

    big, total = 0, 0
    for sub in ("text_encoder", "transformer", "vae"):
        for f in sorted((folder / sub).glob("*.safetensors")):
            with safe_open(str(f), framework="np") as st:
                for k in st.keys():
                    n = int(np.prod(st.get_slice(k).get_shape()))
                    total += n
                    big = max(big, n)
    return big * 4 / 1e6, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny pipeline, to check the script runs")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--quants", default="f32,q8,q4tp")
    ap.add_argument("--repeat", type=int, default=10, help="alternated denoiser timings per pipeline")
    ap.add_argument("--write", action="store_true", help="append the tables to RESULTS.md (## image pipelines)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "src"))
    import image_fixtures

    base = Path(tempfile.mkdtemp(dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    configs = QUICK if args.quick else CONFIGS
    size = 64 if args.quick else args.size
    gen = dict(prompt="a photo of a lighthouse at night", steps=args.steps, size=size, seed=3)
    idle_share = idle_fraction(2.0)
    try:
        src = image_fixtures.build(base / "pipe", seed=0, dtype="bf16", **configs)
        src_mb = sum(p.stat().st_size for p in src.rglob("*.safetensors")) / 1e6
        big_mb, params = largest_f32_mb(src)
        idle = child("idle", src, base / "none", quant="")
        pack_rows = [["import only", "", "", "", "", "", f"{idle['maxrss_mb']:.0f}"]]
        files = {}
        for q in args.quants.split(","):
            r = child("pack", src, base / f"{q}.cmf", quant=q)
            files[q] = base / f"{q}.cmf"
            pack_rows.append([f"imagine-pack --quant {q}", f"{r['bytes'] / 1e6:.1f}", f"{r['plan_seconds']:.2f}",
                              f"{r['seconds']:.2f}", f"{r['source_bytes'] / 1e6 / r['seconds']:.0f}",
                              f"{r['plan_hwm_mb']:.0f}", f"{r['maxrss_mb']:.0f}"])
        run_rows, images = [], {}
        ref = child("diffusers", src, base / "ref.npy", **gen)
        images["diffusers"] = np.load(base / "ref.npy")
        run_rows.append(["diffusers (folder, f32)", f"{ref['load_seconds']:.2f}", f"{ref['first_seconds']:.2f}",
                         f"{ref['step_seconds']:.3f}", f"{ref['decode_seconds']:.2f}", f"{ref['maxrss_mb']:.0f}", "-"])
        for q, path in files.items():
            r = child("imagine", path, base / f"{q}.npy", **gen)
            images[q] = np.load(base / f"{q}.npy")
            cmp = (f"max abs {np.abs(images[q] - images['diffusers']).max():.1e} vs diffusers" if q == "f32"
                   else f"PSNR {psnr(images[q], images['f32']):.1f} dB vs f32")
            run_rows.append([f"imagine {q}.cmf", f"{r['load_seconds']:.2f}", f"{r['first_seconds']:.2f}",
                             f"{r['step_seconds']:.3f}", f"{r['decode_seconds']:.2f}", f"{r['maxrss_mb']:.0f}", cmp])
        ab = child("ab", src, files.get("f32", next(iter(files.values()))), size=size, repeat=args.repeat)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    t1 = table(["run", "file MB", "plan s (configs checked)", "write s", "source MB/s", "peak RSS after plan MB",
                "peak RSS MB"], pack_rows)
    t2 = table(["run", "load s", "prompt + step 1 s", "s/step", "VAE decode s", "peak RSS MB", "image"], run_rows)
    head = (f"pipeline: {params / 1e6:.1f}M parameters, {src_mb:.0f} MB bf16 safetensors, largest tensor "
            f"{big_mb:.1f} MB at f32; {size}x{size}, {args.steps} steps, cfg 4, seed 3, "
            f"{ref['threads']} torch threads; CPU idle before the runs: {100 * idle_share:.0f}%")
    t3 = table(["denoiser forward (one CFG step, batch 2), alternated in one process", "median s", "best s"],
               [[k, f"{v['median']:.3f}", f"{v['best']:.3f}"] for k, v in ab.items() if isinstance(v, dict)])
    print(head, t1, t2, t3, sep="\n\n")
    if args.write:
        import diffusers
        import torch

        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        entry = (f"### run {now}\n\n{machine()}; torch {torch.__version__}, diffusers {diffusers.__version__}. "
                 f"{head}.\n\n{t1}\n\n{t2}\n\n{t3}\n")
        intro = ("`python benchmarks/image.py --write`: a seeded random Lumina-Image 2.0 pipeline (bf16 "
                 "safetensors, page-cached), each row a fresh process; see the script's docstring.")
        append_entry(RESULTS, "## image pipelines (imagine-pack, imagine)", entry, intro)


if __name__ == "__main__":
    main()
