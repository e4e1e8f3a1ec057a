"""``python -m cmf.integrations.vllm prepare MODEL.cmf``: print the folder to pass as vLLM's ``--model``."""

from __future__ import annotations

import argparse
import sys

from . import prepare


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and print the materialised folder."""
    p = argparse.ArgumentParser(prog="python -m cmf.integrations.vllm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="write (or find) the config/tokenizer folder for a .cmf")
    pp.add_argument("model", metavar="MODEL.cmf")
    pp.add_argument("--cache-dir", help="where folders are kept (default $PYCMF_VLLM_CACHE or ~/.cache/pycmf/vllm)")
    pp.add_argument("--quantized", choices=("dequantize", "keep"), default="dequantize",
                    help="keep: q8_row / 4-bit group weights stay integers in vLLM (docs/SCALING.md)")
    pp.add_argument("--skill", help="with --quantized keep: the skill to be served (its tensors' dtypes count)")
    args = p.parse_args(argv)
    print(prepare(args.model, cache_dir=args.cache_dir, quantized=args.quantized, skill=args.skill))
    return 0


if __name__ == "__main__":
    sys.exit(main())
