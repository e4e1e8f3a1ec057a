"""``cmf.kernels.sysinfo``: the kernels' target as cmf bench and cmf --version print it."""

from __future__ import annotations

import os
import subprocess
import sys

from cmf.kernels import int_dot, sysinfo
from cmf.numba_prims import target_cpu, target_has


def test_info_reads_the_target_numba_compiles_for() -> None:
    d = sysinfo.info()
    name, _ = target_cpu()
    assert d["target"] == (name or "unknown") and d["dot"] == int_dot.DOT_PATH
    assert ("AVX2" in d["features"]) == target_has("avx2")
    assert ("AVX512-VNNI" in d["features"]) == target_has("avx512vnni")
    assert sysinfo.summary().endswith(f"integer dot {int_dot.DOT_PATH} ({sysinfo.DOT_NOTES[int_dot.DOT_PATH]})")


def test_an_avx2_target_is_named_as_such() -> None:
    """Compiled for haswell (numba's name and its own features), the line shows no AVX-512 and the
    vpmaddubsw form, whatever the host has."""
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES="")
    for k in ("CMF_DOT_PATH", "CMF_NO_VNNI"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", "from cmf.kernels import sysinfo; print(sysinfo.summary())"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out.startswith("numba ") and "target haswell (" in out
    assert ": AVX2 FMA F16C);" in out and "AVX512" not in out
    assert "integer dot avx2 (vpmaddubsw + vpmaddwd;" in out
