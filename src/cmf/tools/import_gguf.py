"""``cmf import-gguf``: a llama.cpp GGUF file (llama, qwen2, qwen3, qwen2moe, qwen3moe) into a .cmf."""

from __future__ import annotations

import argparse
from typing import Any

from . import fmt_bytes, print_json, sanitize
from ._calib_args import add_calib_arguments, add_size_arguments, calib_progress

NAME = "import-gguf"
SUMMARY = "convert a GGUF file (llama, qwen2, qwen3, qwen3moe) into a .cmf file"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY + ". Every ggml type the gguf "
                              "package reads (K-quants included) is dequantized, llama.cpp's conventions "
                              "are undone, and the tensors are re-encoded with --quant.")
    p.add_argument("file", metavar="FILE.gguf")
    p.add_argument("-o", "--output", required=True, metavar="OUT.cmf")
    p.add_argument("--quant", default="q8", help="target dtype policy, as for cmf convert (default q8)")
    p.add_argument("--tokenizer", default=None, metavar="tokenizer.json",
                   help="use this tokenizer.json (the model's Hugging Face one; its vocabulary must match "
                   "the GGUF's tokens) instead of synthesizing one from the GGUF vocabulary: needed when "
                   "tokenizer.ggml.pre is a name pycmf does not know or the vocabulary is not byte-level BPE")
    add_calib_arguments(p)
    add_size_arguments(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from ..convert.gguf import import_gguf

    with calib_progress(args) as cal_bar:
        res = import_gguf(args.file, args.output, args.quant, tokenizer=args.tokenizer, calib=args.calib,
                          calib_tokens=args.calib_tokens, calib_progress=cal_bar, target_mb=args.target_mb,
                          bpw=args.bpw, sensitivity_tokens=args.sensitivity_tokens)
    paths = [str(p) for p in res.paths]
    data = {"files": paths, "tensors": res.tensors, "bytes": res.bytes}
    if args.json:
        print_json(data)
    else:
        print(f"{sanitize(', '.join(paths))}: {res.tensors} tensors, {fmt_bytes(res.bytes)}")
    return 0
