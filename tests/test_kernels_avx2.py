"""The integer dot paths of the 4-bit tile kernels (kernels/int_dot.py) agree bit for bit.

Every path this CPU can run (AVX-512 VNNI, AVX-VNNI, AVX2, portable) is compiled in this process
and its tile-group sums compared with a numpy oracle, extreme codes and activations included;
the paths it cannot run are compiled for a CPU that has them (no execution) and their assembly
checked. The feature detection follows the CPU numba compiles for (NUMBA_CPU_NAME /
NUMBA_CPU_FEATURES), checked in fresh processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest

from cmf.kernels import _ir, int_dot

RUNNABLE = [p for p in int_dot.PATHS if int_dot.path_supported(p)]
_KERNELS: dict = {}


def _kernel(width: int, pieces: int, path: str):  # noqa: ANN202 - a compiled function
    key = (width, pieces, path)
    if key not in _KERNELS:
        dot = _ir._make_tile_dot_i8(width, pieces, path)

        @numba.njit
        def run(planes, xv, S):  # pragma: no cover - compiled
            dot(planes, 0, xv, 0, S)

        _KERNELS[key] = run
    return _KERNELS[key]


def _oracle(planes: np.ndarray, x8: np.ndarray, width: int, pieces: int) -> np.ndarray:
    """S[r] for one tile-group: planes [words, 64 rows, 4 bytes], x8 [pieces, words, phases, 4]."""
    phases = 2 if width == 16 else 4
    bits = 8 // phases
    codes = np.stack([(planes >> (bits * p)) & ((1 << bits) - 1) for p in range(phases)], 1)  # [w, p, r, k]
    sums = np.einsum("wprk,jwpk->jr", codes.astype(np.int64), x8.astype(np.int64))
    total = sums[0]
    for j in range(1, pieces):
        total = total * 128 + sums[j]
    return total


def _case(rng: np.random.Generator, width: int, pieces: int, extreme: bool) -> tuple[np.ndarray, np.ndarray]:
    words, phases = width // 4, 2 if width == 16 else 4
    if extreme:  # every code at its largest, every activation at the int8 extremes
        planes = np.full((words, 64, 4), 255, np.uint8)
        x8 = np.where(rng.random((pieces, words, phases, 4)) < 0.5, -128, 127).astype(np.int8)
    else:
        planes = rng.integers(0, 256, (words, 64, 4), dtype=np.uint8)
        x8 = rng.integers(-128, 128, (pieces, words, phases, 4)).astype(np.int8)
    return planes, x8


@pytest.mark.parametrize("path", RUNNABLE)
@pytest.mark.parametrize("width,pieces", [(16, 1), (16, 3), (8, 1), (8, 3)])
def test_every_runnable_path_gives_the_oracles_sums(path: str, width: int, pieces: int) -> None:
    rng = np.random.default_rng(width * 10 + pieces)
    run = _kernel(width, pieces, path)
    for trial in range(6):
        planes, x8 = _case(rng, width, pieces, extreme=trial < 2)
        if pieces == 3 and trial < 2:  # exact mode's pieces 1 and 2 stay within ±64
            x8[1:] = np.clip(x8[1:], -64, 64)
        S = np.zeros(64, np.int32)
        run(planes.reshape(-1), x8.reshape(-1).view(np.int32), S)
        want = _oracle(planes, x8, width, pieces)
        assert np.array_equal(S.astype(np.int64), want), (path, trial)


def test_the_chosen_path_is_the_fastest_the_target_has() -> None:
    assert int_dot.DOT_PATH == RUNNABLE[0] == _ir.DOT_PATH
    from cmf.kernels import q4
    assert q4.EXACT_PIECES == (3 if int_dot.DOT_PATH != "portable" else 0)


def _probe(env: dict, code: str, *args: str) -> str:
    full = dict(os.environ, **env)
    for k in ("CMF_DOT_PATH", "CMF_NO_VNNI", "CMF_LADDER_SCALES"):
        if k not in env:
            full.pop(k, None)
    out = subprocess.run([sys.executable, "-c", code, *args], env=full, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("cpu,want", [("haswell", "avx2"), ("alderlake", "avxvnni"), ("icelake-server", "vnni512"),
                                      ("generic", "portable")])
def test_detection_follows_the_cpu_numba_compiles_for(cpu: str, want: str, tmp_path) -> None:
    """A CPU name with empty features is that CPU's own feature set (numba pairs a bare name
    with the host's features, so the detection follows the host then)."""
    env = {"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(tmp_path)}
    got = _probe(env, "from cmf.kernels import _ir, q4; print(_ir.DOT_PATH, q4.EXACT_PIECES)")
    assert got == f"{want} {3 if want != 'portable' else 0}"
    forced = _probe(dict(env, CMF_DOT_PATH="portable"), "from cmf.kernels import _ir; print(_ir.DOT_PATH)")
    assert forced == "portable"


def test_the_kernels_line_names_an_avx2_target(tmp_path) -> None:
    """``cmf --version`` / ``cmf bench``'s kernels line (``sysinfo.summary``) compiled for haswell
    (numba's name and its own features) shows no AVX-512 and the vpmaddubsw form, whatever the
    host has."""
    env = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(tmp_path)}
    out = _probe(env, "from cmf.kernels import sysinfo; print(sysinfo.summary())")
    assert out.startswith("numba ") and "target haswell (" in out
    assert ": AVX2 FMA F16C);" in out and "AVX512" not in out
    assert "integer dot avx2 (vpmaddubsw + vpmaddwd;" in out
    assert out.endswith("; q4tp/q2tp scales decoded")  # no mask registers: kept decoded


def test_ladder_scales_follow_the_target_or_the_override(tmp_path) -> None:
    """Decoded where the target has no mask registers, the ladder where it has AVX-512;
    ``CMF_LADDER_SCALES`` overrides either way, and a value it does not know is named in a
    warning and ignored."""
    code = "from cmf.kernels import ladder_scales as l; print(l.DECODED_SCALES)"
    for cpu, want in (("haswell", "True"), ("icelake-server", "False")):
        env = {"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(tmp_path)}
        assert _probe(env, code) == want
        assert _probe(dict(env, CMF_LADDER_SCALES="ladder"), code) == "False"
        assert _probe(dict(env, CMF_LADDER_SCALES="Decoded "), code) == "True"
    env = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(tmp_path),
           "CMF_LADDER_SCALES": "fast"}
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env), capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip() == "True"
    assert "CMF_LADDER_SCALES=fast is not 'decoded' or 'ladder'" in r.stderr


def test_a_forced_path_the_target_lacks_falls_back(tmp_path) -> None:
    env = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(tmp_path),
           "CMF_DOT_PATH": "vnni512"}
    assert _probe(env, "from cmf.kernels import _ir; print(_ir.DOT_PATH)") == "avx2"


ASM = """
import numba, numpy as np
from numba import types
from cmf.kernels import _ir
dot = _ir._make_tile_dot_i8(16, 3)
u8, i32 = types.Array(types.uint8, 1, "C"), types.Array(types.int32, 1, "C")
@numba.njit((u8, i32, i32))
def run(planes, xv, S):
    dot(planes, 0, xv, 0, S)
asm = "\\n".join(run.inspect_asm().values())
print(_ir.DOT_PATH, "vpdpbusd" in asm, "vpmaddubsw" in asm, "zmm" in asm)
"""


@pytest.mark.parametrize("cpu,want", [("icelake-server", "vnni512 True False True"),
                                      ("alderlake", "avxvnni True False False"),
                                      ("haswell", "avx2 False True False")])
def test_each_x86_path_compiles_to_its_instructions(cpu: str, want: str, tmp_path) -> None:
    """Compiled (not run) for a CPU of each kind: the paths this host cannot execute still
    lower to the intended instructions."""
    env = {"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": "", "NUMBA_CACHE_DIR": str(tmp_path)}
    assert _probe(env, ASM) == want


def _file_of(tmp_path: Path, w: np.ndarray, names: tuple) -> Path:
    """A CMF file ``tmp_path/m.cmf`` holding ``w`` encoded as each dtype in ``names`` (tensors
    named after their dtype)."""
    import cmf.quant as q
    from cmf.format.writer import CmfWriter

    from _builders import header

    path = tmp_path / "m.cmf"
    with CmfWriter(path, header()) as wr:
        for name in names:
            wr.add(name, name, w.shape, q.encode(w, name))
    return path


def test_int8_products_match_the_portable_path_bit_for_bit(tmp_path) -> None:
    """A whole q4tp / q1t product with int8 activations: this process's path against the
    portable one in a fresh process (same integer sums, same float epilogue)."""
    from cmf.format.reader import open as cmf_open
    from cmf.kernels import prepare

    rng = np.random.default_rng(9)
    path = _file_of(tmp_path, (rng.standard_normal((136, 256)) * 0.05).astype(np.float32), ("q4tp", "q1t"))
    x = rng.standard_normal((2, 256)).astype(np.float32)
    f = cmf_open(path)
    try:
        here = [prepare(f.tensor(n), int8_activations=True)(x).tolist() for n in ("q4tp", "q1t")]
    finally:
        f.close()
    code = ("import json, sys, numpy as np\n"
            "from cmf.format.reader import open as o\n"
            "from cmf.kernels import _ir, prepare\n"
            "f = o(sys.argv[1]); x = np.array(json.loads(sys.argv[2]), np.float32)\n"
            "print(json.dumps([_ir.DOT_PATH] + [prepare(f.tensor(n), int8_activations=True)(x).tolist()"
            " for n in ('q4tp', 'q1t')]))\n")
    env = dict(os.environ, CMF_DOT_PATH="portable", NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    out = subprocess.run([sys.executable, "-c", code, str(path), json.dumps(x.tolist())], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got[0] == "portable"
    for a, b in zip(here, got[1:]):
        assert np.array_equal(np.array(a, np.float32), np.array(b, np.float32))


def test_the_portable_dot_is_vector_code_for_aarch64() -> None:
    """The portable form, compiled for an ARM CPU (not run): NEON multiply-accumulates on int16
    lanes, no scalar loop."""
    import re

    from llvmlite import binding as ll
    from llvmlite import ir

    ll.initialize_all_targets()
    ll.initialize_all_asmprinters()
    try:
        target = ll.Target.from_triple("aarch64-unknown-linux-gnu")
    except RuntimeError:
        pytest.skip("this llvmlite has no AArch64 target")
    m = ir.Module("portable_dot")
    m.triple = "aarch64-unknown-linux-gnu"
    v16, i32, i64 = ir.VectorType(ir.IntType(32), 16), ir.IntType(32), ir.IntType(64)
    fn = ir.Function(m, ir.FunctionType(ir.VoidType(), [v16.as_pointer(), i32.as_pointer(), v16.as_pointer()]), "dot")
    b = ir.IRBuilder(fn.append_basic_block())
    codes = [b.load(b.gep(fn.args[0], [ir.Constant(i64, k)])) for k in range(8)]
    xs = [b.load(b.gep(fn.args[1], [ir.Constant(i64, k)])) for k in range(8)]
    b.store(int_dot.group_dot(b, list(zip(codes, xs)), "portable"), fn.args[2])
    b.ret_void()
    asm = target.create_target_machine(cpu="neoverse-n1", opt=3).emit_assembly(ll.parse_assembly(str(m)))
    ops = re.findall(r"^\s+([a-z0-9.]+)\s", asm, re.M)
    assert ops.count("mla") >= 32 and len(re.findall(r"v\d+\.8h", asm)) > 50


_SCALES: dict = {}


def _scales_kernel(mask_regs: bool):  # noqa: ANN202 - a compiled function
    if mask_regs not in _SCALES:
        from cmf.kernels import _jit

        gs = _jit._make_group_scales(mask_regs)

        @numba.njit
        def run(sc, planes, tg, t0, pw, s, mode):  # pragma: no cover - compiled
            gs(sc, planes, tg, t0, pw, s, mode)

        _SCALES[mask_regs] = run
    return _SCALES[mask_regs]


@pytest.mark.parametrize("mode", [1, 2])
def test_group_scales_without_mask_registers_equal_the_masked_form(mode: int) -> None:
    """The 4-bit ladder's per-row scales: the plane-mask table form (AVX2, NEON) gives the bits of
    the masked form (AVX-512) and of the rule s = t0·Π powers^bit in plane order, for every code
    (all 32 of them, code 31 a dead row in mode 2) and special values of t0."""
    from cmf.kernels import _jit

    rng = np.random.default_rng(11)
    groups = 6
    planes = rng.integers(0, 256, 40 * groups, dtype=np.uint8)
    planes[40:80] = 255  # every row code 31
    planes[80:120] = 0  # every row code 0
    codes = np.arange(64) % 32  # group 3: each code twice
    for p in range(5):
        planes[120 + 8 * p: 128 + 8 * p] = np.packbits((codes >> p) & 1, bitorder="little")
    t0 = (rng.random(64) * 1e-3).astype(np.float32)
    t0[5], t0[6], t0[7], t0[8] = np.nan, -0.0, np.inf, np.float32(1e-42)  # a subnormal too
    pw = (0.25 + 4 * rng.random(5 * 64)).astype(np.float32)
    sc = np.zeros(64 * groups, np.uint16)
    bits = np.unpackbits(planes.reshape(groups, 5, 8), axis=-1, bitorder="little")  # [g, p, row]
    for g in range(groups):
        want = t0.copy()
        for p in range(5):
            want = np.where(bits[g, p] == 1, want * pw[64 * p: 64 * p + 64], want)
        if mode == 2:
            want = np.where(bits[g].all(axis=0), np.float32(0), want)
        for regs in ([True, False] if _jit.MASK_REGS else [False]):
            s = np.full(64, 7.0, np.float32)
            _scales_kernel(regs)(sc, planes, g, t0, pw, s, mode)
            np.testing.assert_array_equal(s.view(np.uint32), want.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("mode", [1, 2])
def test_group_scales_fma_form_equals_the_masked_form(mode: int) -> None:
    """The table form's fma variant (modes 3 and 4: ``pw`` holds power − 1, each plane a single
    fma(v, d & mask, v)) gives the masked form's bits for every code, on ladders a codec writes
    (powers ≥ 1, a ratio up to 2^0.5) and on t0 values NaN, ±0 and subnormal."""
    from cmf.kernels import _jit

    rng = np.random.default_rng(12)
    groups = 5
    planes = rng.integers(0, 256, 40 * groups, dtype=np.uint8)
    planes[40:80] = 255
    codes = np.arange(64) % 32
    for p in range(5):
        planes[120 + 8 * p: 128 + 8 * p] = np.packbits((codes >> p) & 1, bitorder="little")
    t0 = (rng.random(64) * 1e-2).astype(np.float32)
    t0[5], t0[6], t0[7], t0[8] = np.nan, -0.0, 0.0, np.float32(1e-42)
    ratio = np.exp2(rng.random(64) * 0.5).astype(np.float32)
    ratio[9] = np.float32(1.0)  # a flat ladder: d = 0 where the bit is set
    pw = np.empty(5 * 64, np.float32)
    v = ratio.copy()
    for p in range(5):
        pw[64 * p: 64 * p + 64] = v
        v = (v * v).astype(np.float32)
    d = pw - np.float32(1)
    assert np.array_equal(pw.astype(np.float64) - 1.0, d.astype(np.float64))  # exact, as the form needs
    sc = np.zeros(64 * groups, np.uint16)
    for g in range(groups):
        want = np.full(64, 7.0, np.float32)
        _scales_kernel(_jit.MASK_REGS)(sc, planes, g, t0, pw, want, mode)
        got = np.full(64, 7.0, np.float32)
        _scales_kernel(False)(sc, planes, g, t0, d, got, mode + 2)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_only_ladders_with_exact_increments_take_the_fma_form() -> None:
    """``ladder_scales.increments_exact`` accepts a codec's ladders and refuses what would change bits in
    the fma form: a power whose increment rounds (below 1 or ≥ 2^24), NaN, an infinite or
    overflowing t0 (v + v·0 is NaN where v·1.0 stays infinite)."""
    from cmf.kernels import ladder_scales as ls

    def tile(base: float, ratio: float) -> np.ndarray:
        lad = np.empty((1, 2, ls.R), np.float32)
        lad[0, 0], lad[0, 1] = base, ratio
        lad[0, 1, 3] = 1.0
        return lad

    assert ls.increments_exact(0, tile(1e-3, 2 ** (1 / 31)))
    assert ls.increments_exact(0, tile(1e-30, 1.3))
    assert not ls.increments_exact(0, tile(1e-3, 0.3))  # 0.3 − 1 is not exact in float32
    assert not ls.increments_exact(0, tile(1e-3, 3.0))  # 3^16 ≥ 2^24: its increment rounds
    assert not ls.increments_exact(0, tile(np.inf, 1.1))
    assert not ls.increments_exact(0, tile(np.nan, 1.1))
    assert not ls.increments_exact(0, tile(1e37, 1.5))  # the top rung overflows


SPILLS = """
import re, sys, numpy as np
from cmf.format.reader import open as o
from cmf.kernels import int_dot, prepare, q4
op = prepare(o(sys.argv[1]).tensor("q4tp"))
rng = np.random.default_rng(0)
for t in (1, 64):  # the one-token tile loop, then a prefill block
    op(rng.standard_normal((t, op.in_features)).astype(np.float32))
out = [int_dot.DOT_PATH]
for fn in (q4.tiles_run, q4.tiles_block):
    asm = fn.inspect_asm(fn.signatures[0]).splitlines()
    at = [i for i, line in enumerate(asm) if "vpdpbusd" in line]
    body = asm[at[0]:at[-1]]
    out.append(sum(bool(re.search(r"\\(%rsp\\)", line)) and "zmm" in line for line in body))
print(*out)
"""


@pytest.mark.skipif(int_dot.DOT_PATH != "vnni512", reason="needs a CPU with AVX-512 VNNI (the tile loops are run)")
def test_exact_tile_loops_keep_their_vectors_in_registers(tmp_path) -> None:
    """The exact-mode (three-piece) 512-bit tile product inside the decode and prefill tile loops
    holds its accumulators and broadcast activations in zmm registers: broadcasting all 24 of a
    tile-group's activations up front spilled a third of them to the stack in both loops, and
    SmolLM2 q4tp exact prefill ran ~9% slower (docs/PERFORMANCE.md, "Back on the Zen 4 host, and
    the 512-bit tile dot's broadcasts")."""
    w = (np.random.default_rng(3).standard_normal((128, 256)) * 0.05).astype(np.float32)
    path = _file_of(tmp_path, w, ("q4tp",))
    # a fresh cache: compiled in that process, so its assembly is there to read
    dot_path, *moves = _probe({"NUMBA_CACHE_DIR": str(tmp_path / "numba")}, SPILLS, str(path)).split()
    # zmm moves to or from the stack between the loop's first and last vpdpbusd: 21 (decode) and
    # 18 (prefill) with the broadcasts up front, 0 and 1 with each word's own
    assert dot_path == "vnni512" and len(moves) == 2 and all(int(m) <= 2 for m in moves), moves


@pytest.mark.parametrize("dtype", ["q4tp", "q2tp"])
def test_decoded_ladder_scales_give_the_same_bits(tmp_path, dtype) -> None:
    """A ladder's scales kept decoded from packing (``ladder_scales.DECODED_SCALES``, the default without
    mask registers) and rebuilt from the codes in every product give the same outputs bit for
    bit: one token and small batches (the tile loop), exact and with int8 activations, a prefill
    block (block loop or dequantize + sgemm), row picks and dequantized rows."""
    from cmf.format.reader import open as cmf_open
    from cmf.kernels import prepare
    from cmf.kernels.ladder_scales import PACKED_DECODED, R

    rng = np.random.default_rng(21)
    w = (rng.standard_normal((200, 320)) * 0.05).astype(np.float32)
    w[:, 7] *= 30  # an outlier column: groups of the ladder's whole range
    path = _file_of(tmp_path, w, (dtype,))
    f = cmf_open(path)
    try:
        ops = []
        for decoded in (False, True):
            op = prepare(f.tensor(dtype))
            assert not op.ready.any()
            shape = (op.ntiles, op.in_features // 32, 2 * R) if decoded else (0, 0, 0)
            op.sc = np.zeros(shape, np.uint16)  # what the kernels look at to choose the form
            op.cw = np.zeros(0 if decoded else op.ntiles * (op.in_features // 32) * 40, np.uint8)  # codes' planes
            ops.append(op)
        rows = np.array([3, 64, 130, 199])  # 199: a tail row past the last whole tile
        for T in (1, 5, 64):
            x = rng.standard_normal((T, 320)).astype(np.float32)
            for int8 in (False, True):
                outs = []
                for op in ops:
                    op.use_int8_activations(int8)
                    outs.append((op(x), op.rows(rows, x)))
                for a, b in zip(*outs):
                    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
        ladder, decoded = ops
        assert (decoded.ready == PACKED_DECODED).all() and not (ladder.ready == PACKED_DECODED).any()
        np.testing.assert_array_equal(decoded.dequant_rows(rows).view(np.uint32),
                                      ladder.dequant_rows(rows).view(np.uint32))
        # the ladder form with no room for its codes refuses to pack instead of writing past them
        bad = prepare(f.tensor(dtype))
        bad.sc, bad.cw = np.zeros((0, 0, 0), np.uint16), np.zeros(0, np.uint8)
        with pytest.raises(ValueError, match="ladder codes array too small"):
            bad(x[:1])
    finally:
        f.close()
