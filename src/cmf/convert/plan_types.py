"""What a conversion will do and what it did: :class:`PlanItem`, :class:`Plan`, :class:`ConvertResult`
(built by :func:`cmf.convert.hf.plan`, carried out by :func:`cmf.convert.execute.execute`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import ModelConfig
from .policy import Choice, Policy
from .source import Checkpoint
from .tokenizer import TokenizerFiles


@dataclass
class PlanItem:
    """One output tensor: its CMF name, where it comes from and how it is stored."""

    name: str
    source: str
    cut: Cut | None
    shape: tuple[int, ...]
    source_dtype: str
    source_bytes: int
    choice: Choice = field(default_factory=lambda: Choice("f32"))
    out_bytes: int = 0
    out_exact: bool = True  # False when the dtype's size depends on the data (vbit, q1s, q1t)


@dataclass
class Plan:
    """Everything a conversion will do, before it does it (``--dry-run`` prints this)."""

    model: str
    folder: Path
    config: ModelConfig
    policy: Policy
    header: dict[str, Any]
    items: list[PlanItem]
    tokenizer: TokenizerFiles
    checkpoint: Checkpoint
    dropped: list[str]
    route_counts: dict[int, list[float]] | None = None
    shard_max_bytes: int | None = None
    packed: bool = False  # every payload on 64 bytes, none on a page (a size budget's file: budget_padding)
    calibration: Any = None  # a cmf.calib.Calibration: activation-aware encoding (convert/calibrate.py)

    @property
    def source_bytes(self) -> int:
        """Bytes read from the checkpoint."""
        return sum(i.source_bytes for i in self.items)

    @property
    def out_bytes(self) -> int:
        """Tensor payload bytes written (estimated for variable-length dtypes)."""
        return sum(i.out_bytes for i in self.items)

    def close(self) -> None:
        self.checkpoint.close()

    def summary(self) -> dict[str, Any]:
        """JSON-ready description: arch, options, per-tensor dtypes and sizes, totals."""
        by_dtype: dict[str, list[int]] = {}
        for i in self.items:
            agg = by_dtype.setdefault(i.choice.dtype, [0, 0, 0])
            agg[0] += 1
            agg[1] += int(np.prod(i.shape, dtype=np.int64))
            agg[2] += i.out_bytes
        return {
            "model": self.model, "folder": str(self.folder), "model_type": self.config.source_type,
            "arch": self.header["arch"], "quant_type": self.header["quant_type"],
            "options": self.header["provenance"]["options"],
            "tensors": [{"name": i.name, "source": i.source, "shape": list(i.shape), "source_dtype": i.source_dtype,
                         "dtype": i.choice.dtype, "reason": i.choice.reason, "source_bytes": i.source_bytes,
                         "bytes": i.out_bytes, "exact": i.out_exact} for i in self.items],
            "dtypes": {k: {"tensors": v[0], "params": v[1], "bytes": v[2]} for k, v in sorted(by_dtype.items())},
            "dropped": self.dropped, "source_bytes": self.source_bytes, "bytes": self.out_bytes,
            "vocab_bytes": len(self.tokenizer.tokenizer_json or b""),
            "chat_template": bool(self.tokenizer.bundle and self.tokenizer.bundle.get("chat_template")),
        }


@dataclass
class ConvertResult:
    """What a conversion wrote."""

    paths: list[Path]
    tensors: int
    source_bytes: int
    bytes: int
    seconds: float
    plan: Plan

    def to_dict(self) -> dict[str, Any]:
        return {"paths": [str(p) for p in self.paths], "tensors": self.tensors, "source_bytes": self.source_bytes,
                "bytes": self.bytes, "seconds": round(self.seconds, 3),
                "source_gb_per_s": round(self.source_bytes / 1e9 / max(self.seconds, 1e-9), 3)}
