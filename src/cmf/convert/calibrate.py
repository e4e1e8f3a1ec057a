"""``--calib TEXT`` for ``convert`` and ``import-gguf``: statistics from the source model itself.

The source (a Hugging Face folder) is first written as an f16 CMF file beside the output (a
temporary file, removed afterwards: it needs 2 bytes per parameter of disk for the duration),
the runtime runs it over the calibration text (:func:`cmf.calib.collect`), and the real
conversion then encodes every decoder matrix with its statistics (:func:`cmf.calib.encode`).
``requant`` needs no such step: its input is already a CMF model.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Callable

from .. import calib
from .errors import ConvertError

log = logging.getLogger(__name__)


def sensitivity_tokens_for(tokens: int | None, target_mb: float | None, bpw: float | None) -> int:
    """Tokens of the sensitivity measurement: ``tokens`` when given, else the default sample when
    a target size is set (its budget is the only user), else 0 (none)."""
    if tokens is not None:
        if tokens < 0:
            raise calib.CalibrationError(f"--sensitivity-tokens {tokens} must be >= 0")
        return tokens
    return calib.DEFAULT_SENSITIVITY_TOKENS if target_mb is not None or bpw is not None else 0


def check_text(text: str | os.PathLike) -> Path:
    """Fail before any work when the calibration text is missing, a folder, unreadable or empty."""
    path = Path(text)
    if not path.exists():
        raise calib.CalibrationError(f"{path}: calibration text not found")
    if path.is_dir():
        raise calib.CalibrationError(f"{path}: is a folder; give a text file")
    if not os.access(path, os.R_OK):
        raise calib.CalibrationError(f"{path}: calibration text is not readable")
    if path.stat().st_size == 0:
        raise calib.CalibrationError(f"{path}: calibration text is empty")
    return path


def calibrate_source(write_f16: Callable[[Path], None], text: str | os.PathLike, work_dir: Path, *,
                     tokens: int = calib.DEFAULT_MAX_TOKENS, window: int = calib.DEFAULT_WINDOW,
                     progress: calib.Progress | None = None,
                     sensitivity_tokens: int = 0) -> calib.Calibration:
    """Calibration statistics on ``text`` of the model that ``write_f16(path)`` writes as an f16
    CMF file (the converter's own plan of the source, with the arch keys the real conversion
    adds, such as import-gguf's ``rope_freq_factors``, so the calibrated model is the one being
    written); see the module docstring. ``sensitivity_tokens`` > 0 also measures each matrix's
    sensitivity (:mod:`cmf.calib.sensitivity`), for a target-size budget."""
    text = check_text(text)
    if not work_dir.is_dir():
        raise ConvertError(f"{work_dir}: output folder does not exist")
    fd, name = tempfile.mkstemp(prefix=".calib-", suffix=".cmf", dir=work_dir)
    os.close(fd)
    tmp = Path(name)
    try:
        log.info("calibration: writing the source at f16 to %s", tmp)
        write_f16(tmp)
        return calib.collect(tmp, text, window=window, max_tokens=tokens, progress=progress,
                             sensitivity_tokens=sensitivity_tokens)
    finally:
        tmp.unlink(missing_ok=True)
