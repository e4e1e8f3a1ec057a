"""``cmf bench --compare``: pycmf next to transformers and llama.cpp on the same model.

Each engine runs in a fresh process (``python -m cmf.tools.bench_compare ENGINE ...``), and the
engines are interleaved repetition by repetition so machine noise hits them alike. The peers get
the same weights: ``cmf export`` to a Hugging Face folder for transformers (f32, or bf16 for an
f16/bf16 file), ``cmf export --format gguf`` for llama.cpp (F32, F16, Q8_0 for the q8 family,
Q4_0 for 4-bit and below).
"""

from __future__ import annotations

import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import UsageError

log = logging.getLogger(__name__)

ENGINES = ("pycmf", "pycmf-int8", "hf", "llama.cpp")
FOUR_BIT = {"q4_block", "q4_tiled", "q4tp", "q2tp"}
INT8_ACT = FOUR_BIT | {"q8_row", "q8_2f"}  # the dtypes int8 activations apply to
PROMPT_FOR_DECODE = 32


def gguf_type_for(dtypes: set[str]) -> str:
    """The llama.cpp type closest to a file's matrix dtypes."""
    if dtypes <= {"f32"}:
        return "F32"
    if dtypes & {"f16", "bf16"} and not dtypes & {"q8_row", "q8_2f"}:
        return "F16"
    if dtypes & {"q8_row", "q8_2f"} and not dtypes & FOUR_BIT:
        return "Q8_0"
    return "Q4_0"  # the 4-bit family (with its q8_row token table, as llama.cpp's Q4_0 keeps it wide too)


def _matrix_dtypes(path: Path) -> set[str]:
    from ..format.reader import open as cmf_open

    with cmf_open(path) as f:
        return {t.dtype.label for t in f.tensors() if len(t.shape) == 2 and not t.name.startswith("skill.")}


def _peak_mb() -> float:
    """Peak RSS of this process: VmHWM (ru_maxrss survives execve on Linux and would report the parent's)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ------------------------------------------------------------------------------ engine workers


def _time_pycmf(model: str, n_prompt: int, n_gen: int, threads: int | None,
                int8: bool = False) -> dict[str, float]:
    from ..runtime.model import load

    m = load(model, threads=threads, int8_activations=int8)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, m.plan.vocab, max(n_prompt, PROMPT_FOR_DECODE))
    warm = m.new_cache()  # load every kernel from numba's cache before timing: the small-batch
    m.prefill(ids[:8], warm)  # products, and the one-token step's drivers (decode_tps is the
    m.forward(ids[8:9], warm)  # steady rate; time to first token is measured on its own)
    m.forward(ids[9:10], warm)
    out: dict[str, float] = {}
    if n_prompt:
        t0 = time.perf_counter()
        m.prefill(ids[:n_prompt], m.new_cache())
        out["prefill_tps"] = n_prompt / (time.perf_counter() - t0)
    if n_gen:
        cache = m.new_cache()
        logits = m.prefill(ids[:PROMPT_FOR_DECODE], cache)
        tok = int(np.argmax(logits[-1]))
        t0 = time.perf_counter()
        for _ in range(n_gen):
            tok = int(np.argmax(m.forward([tok], cache)[-1]))
        out["decode_tps"] = n_gen / (time.perf_counter() - t0)
    return out


def _time_hf(folder: str, n_prompt: int, n_gen: int, threads: int | None) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    dtype = torch.bfloat16 if cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16" else torch.float32
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    vocab = m.config.vocab_size
    ids = torch.tensor(np.random.default_rng(0).integers(0, vocab, max(n_prompt, PROMPT_FOR_DECODE)))[None]
    out: dict[str, float] = {}
    with torch.inference_mode():
        m(ids[:, :8])
        if n_prompt:
            t0 = time.perf_counter()
            m(ids[:, :n_prompt])
            out["prefill_tps"] = n_prompt / (time.perf_counter() - t0)
        if n_gen:
            res = m(ids[:, :PROMPT_FOR_DECODE], use_cache=True)
            past, tok = res.past_key_values, res.logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            for _ in range(n_gen):
                res = m(tok, past_key_values=past, use_cache=True)
                past, tok = res.past_key_values, res.logits[:, -1:].argmax(-1)
            out["decode_tps"] = n_gen / (time.perf_counter() - t0)
    return out


def _time_llama(gguf_path: str, n_prompt: int, n_gen: int, threads: int | None) -> dict[str, float]:
    from llama_cpp import Llama

    n_ctx = max(n_prompt, PROMPT_FOR_DECODE + n_gen) + 16
    llm = Llama(gguf_path, n_ctx=n_ctx, n_batch=512, n_threads=threads or os.cpu_count(), verbose=False)
    vocab = llm.n_vocab()
    ids = np.random.default_rng(0).integers(0, vocab, max(n_prompt, PROMPT_FOR_DECODE)).tolist()
    out: dict[str, float] = {}
    llm.eval(ids[:8])
    if n_prompt:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids[:n_prompt])
        out["prefill_tps"] = n_prompt / (time.perf_counter() - t0)
    if n_gen:
        llm.reset()
        llm.eval(ids[:PROMPT_FOR_DECODE])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t0 = time.perf_counter()
        for _ in range(n_gen):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out["decode_tps"] = n_gen / (time.perf_counter() - t0)
    return out


def _time_pycmf_int8(model: str, n_prompt: int, n_gen: int, threads: int | None) -> dict[str, float]:
    return _time_pycmf(model, n_prompt, n_gen, threads, int8=True)


_WORKERS = {"pycmf": _time_pycmf, "pycmf-int8": _time_pycmf_int8, "hf": _time_hf, "llama.cpp": _time_llama}


def worker_main(argv: list[str]) -> int:
    """Entry of the per-engine child process: prints one JSON line."""
    engine, path, n_prompt, n_gen, threads = argv[0], argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    res = _WORKERS[engine](path, n_prompt, n_gen, threads or None)
    res["peak_rss_mb"] = _peak_mb()
    print(json.dumps(res))
    return 0


# ------------------------------------------------------------------------------ orchestration


def llama_cpp_missing() -> str | None:
    """Why llama.cpp's Python binding cannot run here, or None. An install without its shared
    library (built with ``LLAMA_BUILD=OFF`` and no ``LLAMA_CPP_LIB_PATH``) fails at import with a
    RuntimeError, not an ImportError: the peer is then skipped with that reason, not a crash."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama_cpp (llama-cpp-python) is not importable: pip install llama-cpp-python"
    except (OSError, RuntimeError) as exc:
        return f"llama_cpp (llama-cpp-python) is installed but does not load: {exc}"
    return None


def prepare_peers(model: Path, engines: list[str], workdir: Path) -> dict[str, tuple[str, str] | str]:
    """Export the model for each peer; returns engine → (path, format label) or a reason it is skipped."""
    out: dict[str, tuple[str, str] | str] = {"pycmf": (str(model), "cmf")}
    dtypes = _matrix_dtypes(model)
    label = "/".join(sorted(dtypes))
    out["pycmf"] = (str(model), label)
    if "pycmf-int8" in engines:
        out["pycmf-int8"] = ((str(model), f"{label}, int8 activations") if dtypes & INT8_ACT else
                             "int8 activations apply to 4-bit and q8 files only (q4_block, q4_tiled, q4tp, q2tp, "
                             "q8_row, q8_2f)")
    if "hf" in engines:
        try:
            import torch  # noqa: F401
            import transformers  # noqa: F401

            from ..convert.export import export

            dt = "bf16" if dtypes & {"f16", "bf16"} and not dtypes - {"f16", "bf16"} else "f32"
            folder = workdir / "hf"
            export(model, folder, dt)
            out["hf"] = (str(folder), f"safetensors {dt}")
        except ImportError:
            out["hf"] = "transformers/torch not installed"
    if "llama.cpp" in engines:
        reason = llama_cpp_missing()
        if reason:
            out["llama.cpp"] = reason
        else:
            from ..convert.gguf_export import export_gguf

            gtype = gguf_type_for(dtypes)
            g = workdir / f"model-{gtype}.gguf"
            export_gguf(model, g, gtype)
            out["llama.cpp"] = (str(g), f"GGUF {gtype}")
    return out


def compare(model: str | os.PathLike[str], engines: list[str], *, n_prompt: int = 512, n_gen: int = 64,
            reps: int = 3, threads: int | None = None,
            before_run: Callable[[], None] | None = None) -> dict[str, Any]:
    """Interleaved fresh-process runs of each engine; medians per engine. ``before_run`` is called
    before each engine process starts (benchmarks/runtime.py waits there for a quiet machine).

    The ratios to pycmf are paired: each round runs every engine once, in the listed order on even
    rounds and reversed on odd ones, and a round's ratio compares runs made minutes apart at most;
    the table gives the median of the rounds' ratios and their range. On a shared machine whose
    memory bandwidth drifts by 2× within twenty minutes, a ratio of two medians taken from
    different stretches of time measures the drift as much as the engines."""
    model = Path(model)
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise UsageError(f"unknown engine(s) {', '.join(unknown)} (known: {', '.join(ENGINES)})")
    if "pycmf" not in engines:
        engines = ["pycmf"] + engines
    with tempfile.TemporaryDirectory(prefix="cmf-bench-") as d:
        peers = prepare_peers(model, engines, Path(d))
        runnable = [e for e in engines if isinstance(peers.get(e), tuple)]
        samples: dict[str, list[dict[str, float]]] = {e: [] for e in runnable}
        for r in range(max(1, reps)):
            for e in (runnable if r % 2 == 0 else runnable[::-1]):
                path = peers[e][0]  # type: ignore[index]
                if before_run is not None:
                    before_run()
                cmd = [sys.executable, "-m", "cmf.tools.bench_compare", e, path, str(n_prompt), str(n_gen),
                       str(threads or 0)]
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
                if proc.returncode != 0:
                    raise RuntimeError(f"{e} run failed: {proc.stderr.strip()[-800:]}")
                samples[e].append(json.loads(proc.stdout.strip().splitlines()[-1]))
        sizes = {e: _size(peers[e][0]) for e in runnable}  # type: ignore[index]
    rows = []
    med = {e: {k: statistics.median(s[k] for s in samples[e]) for k in samples[e][0]} for e in runnable}
    for e in runnable:
        m = med[e]
        row = {"engine": e, "format": peers[e][1], "size_bytes": sizes[e],  # type: ignore[index]
               "decode_tps": m.get("decode_tps"), "prefill_tps": m.get("prefill_tps"), "peak_rss_mb": m["peak_rss_mb"]}
        for key, n in (("decode", n_gen), ("prefill", n_prompt)):
            ratios = [a[f"{key}_tps"] / b[f"{key}_tps"] for a, b in zip(samples[e], samples["pycmf"])] if n else []
            row[f"{key}_ratio_to_pycmf"] = statistics.median(ratios) if ratios else None
            row[f"{key}_ratio_range"] = (min(ratios), max(ratios)) if ratios else None
        rows.append(row)
    skipped = {e: peers[e] for e in engines if isinstance(peers.get(e), str)}
    return {"model": str(model), "n_prompt": n_prompt, "n_gen": n_gen, "reps": reps, "threads": threads,
            "rows": rows, "skipped": skipped}


def _size(p: str) -> int:
    path = Path(p)
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return path.stat().st_size


def render(res: dict[str, Any]) -> str:
    lines = [f"| engine | format | size | decode t/s (tg{res['n_gen']}) | prefill t/s (pp{res['n_prompt']}) | "
             "peak RSS | decode vs pycmf | prefill vs pycmf |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    def f(x: float | None, fmt: str) -> str:
        return "—" if x is None else format(x, fmt)

    def ratio(r: dict[str, Any], key: str) -> str:
        mid, span = r[f"{key}_ratio_to_pycmf"], r.get(f"{key}_ratio_range")
        if mid is None:
            return "—"
        if r["engine"] == "pycmf" or span is None or res["reps"] < 2:
            return f"{mid:.2f}×"
        return f"{mid:.2f}× ({span[0]:.2f}–{span[1]:.2f})"

    for r in res["rows"]:
        lines.append(f"| {r['engine']} | {r['format']} | {r['size_bytes'] / 2**20:.1f} MiB "
                     f"| {f(r['decode_tps'], '.1f')} | {f(r['prefill_tps'], '.1f')} | {r['peak_rss_mb']:.0f} MB "
                     f"| {ratio(r, 'decode')} | {ratio(r, 'prefill')} |")
    if res["reps"] > 1:
        lines.append("\nRatios: median (and range) of the rounds' paired ratios; each round runs every engine "
                     "once, the order reversed every other round.")
    for e, why in res["skipped"].items():
        lines.append(f"\n{e}: skipped — {why}")
    return "\n".join(lines)


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(worker_main(sys.argv[1:]))
