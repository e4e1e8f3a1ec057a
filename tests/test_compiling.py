"""The compile notice: pycmf's kernels compiling (a numba cache miss) is reported, cache loads are not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from numba.core import event

from cmf.kernels import compiling
from cmf.runtime.ops import decode
from cmf.tools import _runtime_args

# A child that calls one small pycmf kernel with numba's cache in a folder of the test's choosing,
# and prints the kernels whose compilation it was told about.
CHILD = r"""
import json, numpy as np
from cmf.kernels.compiling import on_compile
seen = []
on_compile(seen.append)
from cmf.runtime.ops.decode import add_into
x = np.ones((1, 8), np.float32)
add_into(x, np.ones((1, 8), np.float32))
assert float(x[0, 0]) == 2.0
print(json.dumps(seen))
"""


def _child(cache_dir: str) -> list[str]:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cold_cache_compiles_and_says_so_a_warm_one_loads_silently(tmp_path) -> None:
    cold = _child(str(tmp_path))
    assert "cmf.runtime.ops.decode.add_into" in cold
    assert _child(str(tmp_path)) == []  # the same cache folder, now filled


def test_only_pycmf_kernels_are_named() -> None:
    import numba

    @numba.njit
    def not_ours(a):  # pragma: no cover - never compiled here
        return a

    assert compiling.kernel_name({"dispatcher": decode.add_into}) == "cmf.runtime.ops.decode.add_into"
    assert compiling.kernel_name({"dispatcher": not_ours}) is None
    assert compiling.kernel_name({}) is None and compiling.kernel_name(None) is None


def test_callbacks_run_once_per_event_and_registering_twice_is_harmless() -> None:
    seen: list[str] = []
    compiling.on_compile(seen.append)
    compiling.on_compile(seen.append)
    try:
        with event.trigger_event("numba:compile", data={"dispatcher": decode.add_into, "args": (), "return_type": None}):
            pass
        import numba

        @numba.njit
        def foreign(a):  # pragma: no cover - never compiled here
            return a

        with event.trigger_event("numba:compile", data={"dispatcher": foreign, "args": (), "return_type": None}):
            pass
    finally:
        compiling._callbacks.remove(seen.append)
    assert seen == ["cmf.runtime.ops.decode.add_into"]


def test_the_command_line_prints_its_notice_once(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setitem(_runtime_args._notice, "shown", False)
    _runtime_args._print_notice("cmf.a")
    _runtime_args._print_notice("cmf.b")
    err = capsys.readouterr().err
    assert err.count(_runtime_args.COMPILE_NOTICE) == 1 and err.endswith("\n")
