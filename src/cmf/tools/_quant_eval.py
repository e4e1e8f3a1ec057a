"""``cmf quant-report MODEL.cmf --eval TEXT [--calib TEXT]``: perplexity of each quant as a file.

Each dtype asked for is written as a real file (``cmf requant``, the converter's policy: token
table q8_row, norms f16, ...) in a temporary folder beside nothing the user has, scored with
``cmf ppl``'s protocol on the evaluation text, and deleted. With ``--calib`` every dtype is
written twice, plainly and calibrated (one calibration, reused), so the table shows what
calibration buys per dtype.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

# spec labels of quant-report -> the converter's --quant names
_QUANT_NAME = {"q8_row": "q8", "q4_block": "q4", "q4_tiled": "q4t"}


def eval_report(source: str | Path, quants: Sequence[str], eval_text: str | Path, *,
                calib_text: str | Path | None = None, calib_tokens: int | None = None, window: int = 512,
                chunks: int = 8, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """{"rows": [{dtype, mb, ppl, ppl_calib}], "source_ppl", "windows"} for a .cmf ``source``."""
    from .. import calib as _calib
    from ..convert.calibrate import check_text
    from ..format.errors import CmfError
    from ..runtime.model import load
    from .perplexity import encode_text, perplexity
    from .requant import requant

    source = Path(source)
    if source.is_dir():
        raise CmfError(f"{source}: --eval needs a .cmf model to run (convert the folder first)")
    text = check_text(eval_text).read_text(encoding="utf-8", errors="replace")
    with load(source) as m:
        ids = encode_text(m.tokenizer, text)
        window = min(window, m.ctx_size)
        n = min(chunks, len(ids) // window)
        if n < 1:
            raise CmfError(f"{eval_text}: {len(ids)} tokens, fewer than one window of {window}")
        base = perplexity(m, ids, window, n)["ppl"]
    cal = None
    if calib_text is not None:
        cal = _calib.collect(source, check_text(calib_text), max_tokens=calib_tokens or _calib.DEFAULT_MAX_TOKENS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cmf-quant-eval-") as d:
        for q in quants:
            name = _QUANT_NAME.get(q, q)
            row: dict[str, Any] = {"dtype": q}
            for label, c in (("ppl", None), ("ppl_calib", cal)):
                if label == "ppl_calib" and cal is None:
                    continue
                out = Path(d) / f"{name}-{label}.cmf"
                requant(source, out, quant=name, calib=c)
                row["mb"] = out.stat().st_size / 1e6
                with load(out) as m:
                    row[label] = perplexity(m, ids, window, n)["ppl"]
                out.unlink()
            rows.append(row)
            if progress is not None:
                progress(1)
    return {"source_ppl": base, "windows": n, "window": window, "rows": rows,
            "calib": None if cal is None else cal.provenance()}


def render_eval(d: dict[str, Any]) -> list[str]:
    """Lines of the perplexity table."""
    from . import table

    head = ["dtype", "MB", "PPL", "× source"] + (["PPL --calib", "× source"] if d["calib"] else [])
    rows = []
    for r in d["rows"]:
        row = [r["dtype"], f"{r['mb']:.1f}", f"{r['ppl']:.3f}", f"{r['ppl'] / d['source_ppl']:.3f}"]
        if d["calib"]:
            row += [f"{r['ppl_calib']:.3f}", f"{r['ppl_calib'] / d['source_ppl']:.3f}"]
        rows.append(row)
    return [f"perplexity on the --eval text ({d['windows']} windows of {d['window']}): source "
            f"{d['source_ppl']:.3f}", table(rows, head, right=tuple(range(1, len(head))))]
