"""kernels/registry: the fused families by dtype, declared by the families themselves."""

from __future__ import annotations

import pytest

from cmf.format.constants import Dtype
from cmf.kernels import families, registry
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
    assert families.registered() == WANT
    for d, cls in WANT.items():
        assert d in cls.DTYPES
        assert families.family_for(d, (64, 64)) is cls


def test_a_dtype_without_a_kernel_and_a_declined_shape_get_none() -> None:
    # q4_block groups of 32 straddle rows of 48: the reference path decodes that matrix
    assert families.family_for(Dtype.Q4_BLOCK, (4, 48)) is None
    assert families.family_for(Dtype.Q4_BLOCK, (4, 64)) is TiledLinear
    assert families.family_for(Dtype.Q4TP, (4, 64)) is TiledLinear
    unused = [d for d in Dtype if d not in WANT]
    for d in unused:
        assert families.family_for(d, (64, 64)) is None


def test_a_dtype_cannot_run_through_two_families() -> None:
    with pytest.raises(ValueError, match="already runs through Q8Linear"):
        @registry.family(Dtype.Q8_ROW)
        class Other:  # noqa: F841 - registration is the test
            pass
    assert families.registered()[Dtype.Q8_ROW] is Q8Linear


def _op(dtype: str, rows: int = 64, cols: int = 64):  # noqa: ANN202 - a prepared LinearOp
    import types

    import numpy as np

    from cmf import kernels, quant

    w = np.random.default_rng(rows + cols).standard_normal((rows, cols)).astype(np.float32)
    data = np.frombuffer(quant.encode(w, dtype), np.uint8)
    t = types.SimpleNamespace(numpy=lambda: data, dtype=quant.resolve_dtype(dtype), shape=(rows, cols),
                              name=dtype, nbytes=data.nbytes)
    return kernels.prepare(t)


# the group kernel each family names, and how many arguments per matrix it takes
GROUPS = {"f32": ("rows", 4), "f16": ("rows", 4), "bf16": ("rows", 4), "q8_row": ("rows", 4), "q8_2f": ("rows", 4),
          "q4tp": ("tiled", 12), "q2tp": ("tiled", 12), "q4_tiled": ("tiled", 12), "vbit": ("vbit", 4),
          "q1": ("q1", 4), "q1s": ("q1", 4)}


@pytest.mark.parametrize("dtype", sorted(GROUPS))
def test_each_family_names_a_group_kernel_and_hands_it_its_arrays(dtype: str) -> None:
    from cmf.kernels.gemv import GROUP_KERNELS, MatvecGroup

    op = _op(dtype)
    kernel, arity = GROUPS[dtype]
    assert op.group_family.partition(":")[0] == kernel and kernel in GROUP_KERNELS
    assert len(op.group_arrays()) == arity
    assert MatvecGroup([op]).kernel == kernel


def test_q1t_and_mixed_families_run_op_by_op_and_an_unknown_kernel_is_refused() -> None:
    from cmf.kernels.gemv import MatvecGroup

    assert _op("q1t", 128, 64).group_family is None
    assert MatvecGroup([_op("q8_row"), _op("f16")]).kernel is None  # two families: one product each
    op = _op("q8_row")
    op.__class__ = type("Odd", (type(op),), {"group_family": "nope:1"})
    with pytest.raises(ValueError, match="no such group kernel"):
        MatvecGroup([op])
