"""``cmf.kernels.sysinfo``: the kernels' target as cmf bench and cmf --version print it."""

from __future__ import annotations

from cmf.kernels import int_dot, sysinfo
from cmf.numba_prims import target_cpu, target_has


def test_info_reads_the_target_numba_compiles_for() -> None:
    d = sysinfo.info()
    name, _ = target_cpu()
    assert d["target"] == (name or "unknown") and d["dot"] == int_dot.DOT_PATH
    assert ("AVX2" in d["features"]) == target_has("avx2")
    assert ("AVX512-VNNI" in d["features"]) == target_has("avx512vnni")
    from cmf.kernels.ladder_scales import DECODED_SCALES

    assert d["ladder_scales"] == ("decoded" if DECODED_SCALES else "ladder")
    assert sysinfo.summary().endswith(f"integer dot {int_dot.DOT_PATH} ({sysinfo.DOT_NOTES[int_dot.DOT_PATH]}); "
                                      f"q4tp/q2tp scales {d['ladder_scales']}")
