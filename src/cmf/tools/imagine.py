"""``cmf imagine``: text -> PNG with a pipeline container (spec §12), through diffusers.

The pipeline is built from the file alone (:func:`cmf.image.loader.load_pipeline`); the
denoising steps get a progress bar (tqdm, stderr, only on a TTY). The PNG records the prompt,
seed, settings and the file's header/directory hashes as text chunks. stdout carries the PNG's
path (or ``--json``); the timing line goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from . import sanitize

NAME = "imagine"
SUMMARY = "generate an image from a prompt with a pipeline container (.cmf from imagine-pack)"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``cmf imagine``."""
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY + ". Needs the image extra: "
                              "pip install 'pycmf[image]'.")
    p.add_argument("model", metavar="MODEL", help="a pipeline container (.cmf written by cmf imagine-pack)")
    p.add_argument("-p", "--prompt", required=True, help="what to draw")
    p.add_argument("-o", "--output", required=True, metavar="OUT.png", help="the PNG to write")
    p.add_argument("--negative-prompt", metavar="TEXT", help="what to steer away from (default: empty)")
    p.add_argument("--steps", type=int, default=30, metavar="N", help="denoising steps (default 30)")
    p.add_argument("--size", metavar="WxH", help="image size, multiples of 16 (default: the model's native size)")
    p.add_argument("-s", "--seed", type=int, default=0, help="noise seed (default 0)")
    p.add_argument("--cfg", type=float, default=4.0, metavar="C", help="classifier-free guidance scale (default 4)")
    p.add_argument("--dtype", default="f32", choices=("f32", "bf16", "f16"),
                   help="compute dtype of the decoded weights (default f32)")
    p.add_argument("--device", default="cpu", metavar="DEV",
                   help="torch device to run on (default cpu; e.g. cuda, mps; the noise is drawn on the CPU)")
    p.add_argument("-t", "--threads", type=int, metavar="N", help="torch CPU threads")
    p.add_argument("--verify", action="store_true", help="check every hash of the file before running")
    p.add_argument("--json", action="store_true", help="print one JSON object (path, settings, timings)")
    p.set_defaults(run=run)
    return p


def _progress(steps: int) -> tuple[Callable[[int, int], None] | None, Any]:
    if not sys.stderr.isatty():
        return None, None
    from tqdm import tqdm

    bar = tqdm(total=steps, desc="denoise", unit="step", file=sys.stderr, leave=False)
    return (lambda i, n: bar.update(i - bar.n)), bar


def run(args: argparse.Namespace) -> int:
    """Execute ``cmf imagine``."""
    from ..image.loader import load_pipeline
    from ..image.txt2img import generate, parse_size, save_png

    size = parse_size(args.size) if args.size else None
    if args.threads:
        import torch

        torch.set_num_threads(max(1, int(args.threads)))
    loaded = load_pipeline(args.model, dtype=args.dtype, verify=args.verify, device=args.device)
    progress, bar = _progress(args.steps)
    try:
        result = generate(loaded.pipeline, args.prompt, steps=args.steps, size=size, seed=args.seed, cfg=args.cfg,
                          negative_prompt=args.negative_prompt, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    path = save_png(result, args.output, loaded.identity())
    data = {"path": str(path), **result.to_dict(), "load_seconds": round(loaded.seconds, 3), **loaded.identity()}
    if args.json:
        print(json.dumps(data, ensure_ascii=False))
    else:
        print(sanitize(path))
        sys.stderr.write(f"[{result.width}x{result.height}, {result.steps} steps at "
                         f"{result.mean_step_seconds:.3f} s/step; prompt + step 1 {result.first_seconds:.2f} s, "
                         f"VAE decode {result.decode_seconds:.2f} s, load {loaded.seconds:.2f} s, "
                         f"total {result.seconds:.2f} s]\n")
    return 0
