"""The shared trained Qwen3 (../shared/models) converted once per test module at f32."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared" / "models"
BASE = SHARED / "base"


@pytest.fixture(scope="module")
def base_f32(tmp_path_factory) -> Path:
    """../shared/models/base as an f32 .cmf (skips when the shared models are absent)."""
    if not (BASE / "model.safetensors").exists():
        pytest.skip("../shared/models/base not present")
    from cmf.convert import convert

    out = tmp_path_factory.mktemp("base") / "base-f32.cmf"
    convert(BASE, out, "f32")
    return out
