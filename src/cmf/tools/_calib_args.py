"""``--calib TEXT`` / ``--calib-tokens N`` and ``--target-mb N`` / ``--bpw B`` for convert, import-gguf and
requant, and the calibration progress bar."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Iterator

from ..calib import DEFAULT_MAX_TOKENS, DEFAULT_SENSITIVITY_TOKENS, MIN_TOKENS, Progress


def add_calib_arguments(p: argparse.ArgumentParser) -> None:
    """The calibration options (docs/QUANT.md)."""
    p.add_argument("--calib", metavar="TEXT",
                   help="a UTF-8 text the model is run on first: each matrix is then encoded for the inputs it "
                        f"sees (importance-weighted scales, GPTQ rounding); at least {MIN_TOKENS} tokens")
    p.add_argument("--calib-tokens", type=int, default=DEFAULT_MAX_TOKENS, metavar="N",
                   help=f"calibration tokens read from the text (default {DEFAULT_MAX_TOKENS})")


def add_size_arguments(p: argparse.ArgumentParser) -> None:
    """The target-size options (cmf.convert.budget, docs/QUANT.md)."""
    size = p.add_mutually_exclusive_group()
    size.add_argument("--target-mb", type=float, metavar="N",
                      help="fit the file in N MB (10^6 bytes): each matrix gets a rung of the ladder (q2tp, vbit 3 bits, "
                           "q4tp, vbit 5 or 6 bits, q8_row), whichever mix loses least (predicted from --calib when given)")
    size.add_argument("--bpw", type=float, metavar="B",
                      help="as --target-mb, as file bits per weight (file size × 8 / all tensor elements)")
    p.add_argument("--sensitivity-tokens", type=int, default=None, metavar="N",
                   help="with --calib and a target size: measure how much each matrix's quantization error "
                        "moves the output on N tokens of the text (one forward pass per matrix) and weigh "
                        f"the budget by it (default {DEFAULT_SENSITIVITY_TOKENS}; 0: do not measure)")


@contextlib.contextmanager
def calib_progress(args: argparse.Namespace) -> Iterator[Progress | None]:
    """tqdm bars over the calibration tokens, then the matrices the sensitivity measurement probes,
    when stderr is a terminal (else None)."""
    if getattr(args, "calib", None) is None or not sys.stderr.isatty():
        yield None
        return
    from tqdm import tqdm

    units = {"calibrate": " tok", "sensitivity": " matrix"}
    bars: dict[str, tqdm] = {}

    def update(stage: str, done: int, total: int) -> None:
        bar = bars.get(stage)
        if bar is None:
            bar = bars[stage] = tqdm(total=total, unit=units.get(stage, ""), desc=stage, file=sys.stderr,
                                     leave=False)
        bar.update(done)

    try:
        yield update
    finally:
        for bar in bars.values():
            bar.close()
