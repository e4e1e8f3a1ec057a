"""Calibration: activation statistics from a text, for activation-aware quantization.

    cal = cmf.calib.collect("model-f16.cmf", "calib.txt")       # run the model on the text
    data = cmf.calib.encode(w, "q4tp", cal.get("model.layers.0.mlp.down_proj.weight"))

:func:`collect` runs a CMF model over windows of a text and records, per decoder matrix, the
mean squared activation of each input feature (the importance matrix) and, within a memory
budget, the full input Hessian ``E[x xᵀ]``. :func:`encode` then writes ordinary bytes of the
dtype: the scales are searched with the importance as error weights and the rounding takes
GPTQ-style error feedback over the Hessian (:mod:`.feedback`). Every CMF reader decodes the
result; only the encoder's choices change. The converter's ``--calib`` (convert, import-gguf,
requant) is built on these two calls. Figures: docs/QUANT.md.
"""

from __future__ import annotations

import codecs
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..format.errors import CmfError
from .encoding import calibrated_dtypes, encode
from .sensitivity import DEFAULT_SAMPLE_TOKENS
from .stats import Collector, InputStats, Recorder

__all__ = ["Calibration", "CalibrationError", "Progress", "DEFAULT_MAX_TOKENS", "DEFAULT_SENSITIVITY_TOKENS",
           "DEFAULT_WINDOW", "MIN_TOKENS", "collect",
           "calibrated_dtypes", "encode"]

log = logging.getLogger(__name__)

MIN_TOKENS = 1024  # below this the statistics are noise: refused (docs/QUANT.md)
DEFAULT_MAX_TOKENS = 16384  # ~10 s of prefill for a 135M model on 2 cores; more measured no better
DEFAULT_WINDOW = 512
DEFAULT_SENSITIVITY_TOKENS = DEFAULT_SAMPLE_TOKENS  # each matrix's probe sample (budgets only; docs/QUANT.md)
DEFAULT_MAX_HESSIAN_BYTES = 4 << 30  # full Hessians kept up to this total; the rest get the diagonal
_READ_CHUNK = 1 << 16

#: ``progress(stage, done, total)``: ``done`` more units of ``total`` in ``stage``, which is
#: "calibrate" (tokens run) or "sensitivity" (matrices probed).
Progress = Callable[[str, int, int], None]


class CalibrationError(CmfError):
    """The calibration text cannot be used (missing, not UTF-8, too short)."""


@dataclass
class Calibration:
    """Per-matrix input statistics of one model on one text."""

    stats: dict[str, InputStats]
    text: str  # the text file's name
    text_sha256: str  # of the bytes read
    tokens: int
    windows: int
    window: int
    diagonal_only: list[str] = field(default_factory=list)
    # {matrix: KL per unit relative output error} when measured (sensitivity.measure); the
    # target-size budget weighs each matrix's candidates by it
    sensitivity: dict[str, float] = field(default_factory=dict)
    # {token table: {rung label: KL}} when measured with the sensitivities (sensitivity.measure_table)
    table_loss: dict[str, dict[str, float]] = field(default_factory=dict)

    def get(self, name: str) -> InputStats | None:
        """The statistics of matrix ``name`` (None: the calibration never ran it)."""
        return self.stats.get(name)

    def provenance(self) -> dict[str, object]:
        """What the header records about the calibration."""
        return {"calib_text": self.text, "calib_sha256": self.text_sha256, "calib_tokens": self.tokens,
                "calib_window": self.window, "calib_matrices": len(self.stats),
                "calib_diagonal_only": len(self.diagonal_only)}


def _paragraphs(path: Path, digest) -> Iterator[str]:  # noqa: ANN001 - a hashlib object
    """Paragraphs (separated by blank lines) read incrementally: a big text is never whole in memory."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    buf, offset = "", 0
    try:
        with open(path, "rb") as fh:
            while True:
                chunk = fh.read(_READ_CHUNK)
                digest.update(chunk)
                try:
                    buf += decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as e:
                    raise CalibrationError(f"{path}: not UTF-8 text ({e.reason} near byte {offset + e.start})") from None
                offset += len(chunk)
                *done, buf = buf.split("\n\n")
                yield from done
                if not chunk:
                    break
    except FileNotFoundError:
        raise CalibrationError(f"{path}: calibration text not found") from None
    except IsADirectoryError:
        raise CalibrationError(f"{path}: is a folder; give a text file") from None
    if buf:
        yield buf


def token_windows(tokenizer, path: str | os.PathLike, window: int, max_tokens: int,  # noqa: ANN001
                  digest=None) -> list[list[int]]:  # noqa: ANN001
    """The text's tokens (``cmf ppl``'s protocol: paragraphs + blank line, no special tokens) cut
    into windows of ``window``, stopping at ``max_tokens``. Raises CalibrationError below MIN_TOKENS."""
    path = Path(path)
    digest = digest if digest is not None else hashlib.sha256()
    ids: list[int] = []
    for para in _paragraphs(path, digest):
        if para.strip():
            ids += tokenizer.encode(para + "\n\n", add_special_tokens=False)
            if len(ids) >= max_tokens:
                break
    ids = ids[:max_tokens]
    if len(ids) < MIN_TOKENS:
        raise CalibrationError(f"{path}: {len(ids)} tokens; calibration needs a text of at least {MIN_TOKENS} "
                               f"tokens (a few pages), ideally {DEFAULT_MAX_TOKENS}")
    wins = [ids[i:i + window] for i in range(0, len(ids), window)]
    if len(wins) > 1 and len(wins[-1]) < window // 4:
        wins.pop()  # a short tail adds little and skews nothing if dropped
    return wins


def collect(model: str | os.PathLike, text: str | os.PathLike, *, window: int = DEFAULT_WINDOW,
            max_tokens: int = DEFAULT_MAX_TOKENS, max_hessian_bytes: int = DEFAULT_MAX_HESSIAN_BYTES,
            progress: Progress | None = None, sensitivity_tokens: int = 0) -> Calibration:
    """Run the CMF model ``model`` over ``text`` and collect every decoder matrix's input statistics.

    ``progress("calibrate", n, total)`` is called with the tokens of each window done. The token
    table and the output head are not recorded (they are stored q8_row under the sub-8-bit quants,
    docs/QUANT.md). ``sensitivity_tokens`` > 0 also measures each matrix's sensitivity on that many
    tokens of the text (:mod:`.sensitivity`: one forward pass per matrix, each reported as
    ``progress("sensitivity", 1, matrices)``).
    """
    from ..runtime.model import load

    if window < 16:
        raise CalibrationError(f"calibration window of {window} tokens is too short (at least 16)")
    if max_tokens < MIN_TOKENS:
        raise CalibrationError(f"--calib-tokens {max_tokens} is below the minimum of {MIN_TOKENS}")
    digest = hashlib.sha256()
    with load(model) as m:
        window = min(window, m.ctx_size)
        wins = token_windows(m.tokenizer, text, window, max_tokens, digest)
        collector = Collector(max_hessian_bytes)
        skip = {m.plan.embed, m.plan.lm_head}
        w = m.weights
        plain = w.linear
        recorders: dict[str, Recorder] = {}

        def linear(name: str):  # noqa: ANN202 - a LinearOp
            op = plain(name)
            if name in skip:
                return op
            rec = recorders.get(name)
            if rec is None:
                rec = recorders[name] = Recorder(op, name, collector)
            return rec

        w.linear = linear  # the blocks take their ops from here: rebuilt below with recorders
        try:
            m._prepare()
            tokens, total = 0, sum(map(len, wins))
            for ids in wins:
                m.hidden(ids, m.new_cache())
                collector.flush()
                tokens += len(ids)
                if progress is not None:
                    progress("calibrate", len(ids), total)
        finally:
            del w.linear
        sens: dict[str, float] = {}
        table: dict[str, dict[str, float]] = {}
        if sensitivity_tokens > 0:
            from .sensitivity import measure, measure_table

            def hessian(name: str):  # noqa: ANN202 - as the budget's candidates see it
                st = collector.stats.get(name)
                return st.mean_hessian() if st is not None else None

            names = sorted(collector.stats)
            probed = (None if progress is None else
                      lambda n, _p=progress, _t=len(names): _p("sensitivity", n, _t))
            sens = measure(m, wins, names, hessian, tokens=sensitivity_tokens, progress=probed)
            table = measure_table(m, wins, tokens=sensitivity_tokens)
    if collector.diagonal_only:
        log.warning("calibration: %d matrices past the %.1f GB Hessian budget get importance only (no error "
                    "feedback)", len(collector.diagonal_only), max_hessian_bytes / 1e9)
    log.info("calibration: %d tokens in %d windows, %d matrices, %.0f MB of Hessians", tokens, len(wins),
             len(collector.stats), collector.hessian_bytes / 1e6)
    return Calibration(collector.stats, Path(text).name, digest.hexdigest(), tokens, len(wins), window,
                       collector.diagonal_only, sens, table)
