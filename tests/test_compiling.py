"""Compiling pycmf's kernels (a numba cache miss) is reported, with its seconds, and kept out of
every tokens/s figure; cache loads are not compilations.

The cold-cache cases run in a child process with an empty ``NUMBA_CACHE_DIR``; the in-process
ones fire numba's compile event by hand around a sleep, as a stand-in for a compilation."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from numba.core import event

from cmf.cli import main
from cmf.kernels import compiling
from cmf.runtime.ops import decode
from cmf.tools import _runtime_args, _warmup
from cmf.tools import bench as bench_tool
from cmf.tools import chat as chat_tool

# A child that calls one small pycmf kernel with numba's cache in a folder of the test's choosing,
# and prints the kernels whose compilation it was told about.
CHILD = r"""
import json, numpy as np
from cmf.kernels.compiling import on_compile
seen = []
on_compile(seen.append)
from cmf.kernels.compiling import totals
from cmf.runtime.ops.decode import add_into
x = np.ones((1, 8), np.float32)
add_into(x, np.ones((1, 8), np.float32))
assert float(x[0, 0]) == 2.0
print(json.dumps([seen, totals().kernels, totals().seconds]))
"""
STATS = re.compile(r"\[(\d+) prompt tokens at ([\d.]+) t/s, (\d+) generated at ([\d.]+) t/s, finish: (\w+), "
                   r"peak \d+ MB(?:, compiled kernels in ([\d.]+) s \(([^)]*)\))?\]$")


def _child(cache_dir: str) -> tuple[list[str], int, float]:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen, kernels, seconds = json.loads(out.stdout.strip().splitlines()[-1])
    return seen, kernels, seconds


def test_a_cold_cache_compiles_and_says_so_a_warm_one_loads_silently(tmp_path) -> None:
    seen, kernels, seconds = _child(str(tmp_path))
    assert "cmf.runtime.ops.decode.add_into" in seen and kernels >= 1 and seconds > 0
    assert _child(str(tmp_path)) == ([], 0, 0.0)  # the same cache folder, now filled


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


# ----------------------------------------------------------------------------------- compile time apart


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The servers' numpy-built tiny qwen3 (tests/test_server.py) at q8."""
    pytest.importorskip("openai")  # test_server, whose builder this borrows, needs it to import
    from test_server import _tiny_qwen3

    from cmf.convert import convert

    root = tmp_path_factory.mktemp("compile-time")
    out = root / "tiny.cmf"
    convert(_tiny_qwen3(root / "hf"), out, quant="q8")
    return str(out)


def _cmf_run(model: str, cache_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, "-m", "cmf", "run", model, "-p", "hello model", "-n", "16", *extra],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_cmf_run_reports_compile_time_apart_from_its_rates(tiny_model: str, tmp_path: Path) -> None:
    cold = _cmf_run(tiny_model, tmp_path)  # an empty cache: the first run after an install
    line = cold.stderr.strip().splitlines()[-1]
    m = STATS.match(line)
    assert m and m.group(6) is not None, line
    assert _runtime_args.COMPILE_NOTICE in cold.stderr
    n_prompt, prompt_tps, n_gen, gen_tps, finish = int(m[1]), float(m[2]), int(m[3]), float(m[4]), m[5]
    compile_s = float(m[6])
    assert m[7] == _warmup.COMPILE_NOTE and finish == "length" and n_gen == 16
    assert compile_s > 1.0  # every kernel of the model compiled
    # the rates measure the model: neither phase carries the compile seconds
    assert prompt_tps > 0 and gen_tps > 0
    assert n_prompt / prompt_tps < compile_s / 5
    assert (n_gen - 1) / gen_tps < compile_s / 10

    warm = _cmf_run(tiny_model, tmp_path)  # the same cache, now filled: nothing compiles
    line = warm.stderr.strip().splitlines()[-1]
    m = STATS.match(line)
    assert m and m.group(6) is None and "compiled" not in warm.stderr, warm.stderr
    assert _runtime_args.COMPILE_NOTICE not in warm.stderr
    assert warm.stdout == cold.stdout  # the warm-up changed nothing of the answer
    assert json.loads(_cmf_run(tiny_model, tmp_path, "--json").stdout)["compile_seconds"] == 0.0


def _fake_compile(seconds: float) -> None:
    """What a kernel's compilation looks like to the listener: numba's event around a wait."""
    compiling.install()
    with event.trigger_event("numba:compile", data={"dispatcher": decode.add_into, "args": (), "return_type": None}):
        time.sleep(seconds)


def _compiling_on(model: Any, method: str, calls: set[int], seconds: float, monkeypatch) -> None:
    """Make the ``calls``-th calls (1-based) of ``model.<method>`` "compile" for ``seconds``."""
    real = getattr(model, method)
    count = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        count[0] += 1
        if count[0] in calls:
            _fake_compile(seconds)
        return real(*args, **kwargs)

    monkeypatch.setattr(model, method, wrapped)


def test_generation_rates_leave_compile_seconds_out(tiny_model: str, monkeypatch) -> None:
    import cmf

    with cmf.load(tiny_model) as model:
        model.generate("hello model", max_tokens=2)  # load the kernels from the cache (or compile them)
        # forward 1 is the prefill, 3 a decode step
        _compiling_on(model, "forward", {1, 3}, 1.5, monkeypatch)
        last = None
        for last in model.stream("hello model", max_tokens=12, ignore_eos=True):
            pass
    assert last is not None and last.generation_tokens == 12
    assert last.compile_seconds >= 3.0
    assert last.time_to_first_token >= 1.5  # the wait itself is real: only the rates leave it out
    assert last.prompt_tokens / last.prompt_tps < 1.0
    assert (last.generation_tokens - 1) / last.generation_tps < 1.0


def test_bench_warms_up_and_never_times_a_compile(tiny_model: str, monkeypatch, capsys) -> None:
    import cmf

    with cmf.load(tiny_model) as model:
        # prefill call 1 is the warm-up, 2 the first timed repetition: it is run again
        _compiling_on(model, "prefill", {2}, 1.5, monkeypatch)
        res = bench_tool.bench(model, 16, 4, 2)
    pp = res[0]
    assert pp["test"] == "pp16" and len(pp["samples"]) == 2
    assert all(16 / s < 1.0 for s in pp["samples"])

    def loaded(args: Any) -> Any:  # noqa: ANN401
        model = cmf.load(tiny_model)
        _compiling_on(model, "prefill", {1}, 0.3, monkeypatch)  # the untimed warm-up compiles
        return model

    monkeypatch.setattr(bench_tool, "load_model", loaded)
    assert main(["bench", tiny_model, "-p", "16", "-n", "4", "-r", "1", "-o", "json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["compile_seconds"] >= 0.3
    assert "cmf bench: compiled kernels in 0.3 s" in err and "not in the table" in err
    assert main(["bench", tiny_model, "-p", "16", "-n", "4", "-r", "1"]) == 0
    out, err = capsys.readouterr()
    assert "compiled" not in out and "| pp16 |" in out and "compiled kernels in" in err


def test_chat_says_when_it_compiled(tiny_model: str, monkeypatch, capsys) -> None:
    import cmf

    def loaded(args: Any) -> Any:  # noqa: ANN401
        model = cmf.load(tiny_model)
        # forward 1 is the warm-up's probe: "compiling" there runs the warm-up generation too;
        # forward 5 is in the first reply (warm-up: probe, prefill, one decode step)
        _compiling_on(model, "forward", {1, 5}, 0.2, monkeypatch)
        return model

    monkeypatch.setattr(chat_tool, "load_model", loaded)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nagain\n/exit\n"))
    assert main(["chat", tiny_model, "-n", "3"]) == 0
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("[compiled kernels in ")]
    assert len(lines) == 2 and all(ln.endswith(f"({_warmup.COMPILE_NOTE})]") for ln in lines), err
    assert out.count("\n") == 2  # two replies; the notes go to stderr only
