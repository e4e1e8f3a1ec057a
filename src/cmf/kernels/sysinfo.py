"""What the kernels were compiled for on this machine, in a line a bug report or benchmark can carry.

numba compiles for the host CPU (or ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``), and the 4-bit
and q1t products pick one of four integer dot forms from that target's features
(``int_dot.DOT_PATH``): the same bits on every form, very different speeds (docs/PERFORMANCE.md,
"Without AVX-512"). ``cmf bench`` and ``cmf --version`` print :func:`summary`, as llama-bench
prints its CPU features, so a figure can be read against the code that produced it.
"""

from __future__ import annotations

import platform

# (LLVM feature, shown as): the features the kernels choose between, in the order they are shown
_SHOWN = (("avx2", "AVX2"), ("fma", "FMA"), ("f16c", "F16C"), ("avx512f", "AVX512F"), ("avx512bw", "AVX512BW"),
          ("avx512vnni", "AVX512-VNNI"), ("avxvnni", "AVX-VNNI"), ("neon", "NEON"), ("dotprod", "DOTPROD"),
          ("i8mm", "I8MM"))

# what each integer dot form means for a user, in a few words
DOT_NOTES = {
    "vnni512": "512-bit vpdpbusd",
    "avxvnni": "256-bit vpdpbusd",
    "avx2": "vpmaddubsw + vpmaddwd; 4-bit exact mode does three int8 dots where --int8-act does one",
    "portable": "generic vectorized int16 form; 4-bit exact mode uses the float kernels",
}


def info() -> dict:
    """``{"numba", "machine", "target", "features", "dot", "ladder_scales"}``: numba's version,
    the machine architecture, the LLVM CPU numba compiles for, which of the features the kernels
    care about it has (shown names), the integer dot form the 4-bit products use, and whether
    q4tp/q2tp tiles keep their scales decoded (``decoded``: faster without mask registers, 4
    bytes a row and group more memory) or rebuild them from the ladder (``ladder``)."""
    import numba

    from ..numba_prims import target_cpu
    from .int_dot import DOT_PATH
    from .ladder_scales import DECODED_SCALES

    name, have = target_cpu()
    return {"numba": numba.__version__, "machine": platform.machine(), "target": name or "unknown",
            "features": [shown for feature, shown in _SHOWN if feature in have], "dot": DOT_PATH,
            "ladder_scales": "decoded" if DECODED_SCALES else "ladder"}


def summary() -> str:
    """One line, e.g. ``numba 0.68.1, target znver4 (x86_64: AVX2 FMA F16C AVX512F AVX512BW
    AVX512-VNNI); integer dot vnni512 (512-bit vpdpbusd); q4tp/q2tp scales ladder``."""
    d = info()
    feats = " ".join(d["features"]) or "none of the kernels' features"
    return (f"numba {d['numba']}, target {d['target']} ({d['machine']}: {feats}); "
            f"integer dot {d['dot']} ({DOT_NOTES[d['dot']]}); q4tp/q2tp scales {d['ladder_scales']}")


__all__ = ["DOT_NOTES", "info", "summary"]
