"""kernels/registry: the fused families by dtype, declared by the families themselves."""

from __future__ import annotations

import pytest

from cmf.format.constants import Dtype
from cmf.kernels import registry
from cmf.kernels.floats import F32Linear, HalfLinear
from cmf.kernels.q1 import Q1Linear
from cmf.kernels.q8 import Q8Linear
from cmf.kernels.tiled import TiledLinear
from cmf.kernels.vbit import VbitLinear

WANT = {Dtype.F32: F32Linear, Dtype.F16: HalfLinear, Dtype.BF16: HalfLinear, Dtype.Q8_ROW: Q8Linear,
        Dtype.Q8_2F: Q8Linear, Dtype.Q4_BLOCK: TiledLinear, Dtype.Q4_TILED: TiledLinear, Dtype.Q4TP: TiledLinear,
        Dtype.Q2TP: TiledLinear, Dtype.VBIT: VbitLinear, Dtype.VBIT_RO: VbitLinear, Dtype.Q1: Q1Linear,
        Dtype.Q1S: Q1Linear, Dtype.Q1T: Q1Linear}


def test_the_table_is_every_family_and_its_dtypes() -> None:
    assert registry.registered() == WANT
    for d, cls in WANT.items():
        assert d in cls.DTYPES
        assert registry.family_for(d, (64, 64)) is cls


def test_a_dtype_without_a_kernel_and_a_declined_shape_get_none() -> None:
    # q4_block groups of 32 straddle rows of 48: the reference path decodes that matrix
    assert registry.family_for(Dtype.Q4_BLOCK, (4, 48)) is None
    assert registry.family_for(Dtype.Q4_BLOCK, (4, 64)) is TiledLinear
    assert registry.family_for(Dtype.Q4TP, (4, 64)) is TiledLinear
    unused = [d for d in Dtype if d not in WANT]
    for d in unused:
        assert registry.family_for(d, (64, 64)) is None


def test_a_dtype_cannot_run_through_two_families() -> None:
    with pytest.raises(ValueError, match="already runs through Q8Linear"):
        @registry.family(Dtype.Q8_ROW)
        class Other:  # noqa: F841 - registration is the test
            pass
    assert registry.registered()[Dtype.Q8_ROW] is Q8Linear
