"""`cmf serve` under N concurrent streaming clients: requests/s, tokens/s, time to first token.

    python benchmarks/server.py [--models ../shared/models] [--quant q8] [--clients 1,4,16]
                                [--requests 4] [--max-tokens 64] [--write]

The benchmark model (../shared/models/base, a 3.67M-parameter Qwen3) is converted once at
``--quant``; ``cmf serve`` runs in a subprocess (so the clients here do not share its GIL) on a
loopback port. Each client thread sends ``--requests`` streaming chat requests one after the
other (prompts from texts/*-prompts.txt, greedy, end-of-sequence pushed down by ``logit_bias``
so every answer is ``--max-tokens`` long) and times the first content chunk (TTFT) and the whole
answer. The runtime's own decode speed on one sequence, without HTTP, is measured first.

When ``llama_cpp.server`` (llama-cpp-python with its server extra) is importable, the same load
runs against it on a Q8_0 GGUF that ``cmf.convert.gguf_export`` writes from the same file (or
``--gguf``). ``--write`` puts the result into the ``## server`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, table  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def prompts(models: Path) -> list[str]:
    out: list[str] = []
    for name in ("rust", "man", "py"):
        f = models / "texts" / f"{name}-prompts.txt"
        if f.is_file():
            out += [ln.strip() for ln in f.read_text().splitlines() if ln.strip()]
    return out or ["Explain what a tensor is."]


def start_server(model: Path, extra: list[str]) -> tuple[subprocess.Popen, str, int]:
    """``cmf serve`` in a subprocess on a free port; returns (process, host, port)."""
    cmd = [sys.executable, "-m", "cmf", "serve", str(model), "--port", "0", "--log-level", "warning",
           "--max-queue", "256", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if "serving" in line:
            url = line.split(" on ", 1)[1].split()[0]  # http://127.0.0.1:PORT/v1
            hostport = url.split("//", 1)[1].split("/", 1)[0]
            host, port = hostport.rsplit(":", 1)
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the pipe drained
            return proc, host, int(port)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise RuntimeError("cmf serve did not start")


# End-of-sequence ids pushed down with logit_bias so every answer runs to max_tokens on both servers
# (llama-cpp-python has no ignore_eos); set by main() from the model's tokenizer.
NO_EOS: dict[str, float] = {}


def one_request(host: str, port: int, prompt: str, max_tokens: int) -> tuple[float, float, int, float]:
    """One streaming chat request: (ttft s, total s, completion tokens, the engine's own decode t/s)."""
    body = json.dumps({"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0, "logit_bias": NO_EOS, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(host, port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    ttft = None
    tokens = chunks = 0
    engine_tps = 0.0
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if obj.get("choices") and obj["choices"][0]["delta"].get("content"):
            chunks += 1
            if ttft is None:
                ttft = time.perf_counter() - t0
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
        if obj.get("cmf"):
            engine_tps = obj["cmf"].get("generation_tps", 0.0)
    total = time.perf_counter() - t0
    conn.close()
    # a server without stream usage: one content chunk per token
    return (ttft if ttft is not None else total), total, tokens or chunks, engine_tps


def run_level(host: str, port: int, clients: int, per_client: int, texts: list[str],
              max_tokens: int) -> dict[str, float]:
    """``clients`` threads × ``per_client`` sequential requests; aggregate figures."""
    results: list[tuple[float, float, int, float]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        for j in range(per_client):
            try:
                res = one_request(host, port, texts[(i * per_client + j) % len(texts)], max_tokens)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    tokens = sum(r[2] for r in results)
    short = sum(1 for r in results if r[2] < max_tokens)  # answers cut before max_tokens

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")

    return {"clients": clients, "requests": len(results), "errors": len(errors), "short": short, "wall": wall,
            "rps": len(results) / wall, "tps": tokens / wall, "ttft_p50": pct(ttfts, 0.5),
            "ttft_p99": pct(ttfts, 0.99), "latency_p50": statistics.median(r[1] for r in results) if results else 0,
            "engine_tps": statistics.median(r[3] for r in results) if results else 0}


def start_llama_server(gguf: Path, ctx: int) -> tuple[subprocess.Popen, str, int]:
    """llama-cpp-python's OpenAI server on a free port (same thread count as the cores)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", str(ctx), "--n_threads", str(os.cpu_count() or 1), "--model_alias", "bench",
           # its default lets each new request cut the running one short; queue them instead, as cmf does
           "--interrupt_requests", "False"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("llama_cpp.server exited at start")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return proc, "127.0.0.1", port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("llama_cpp.server did not start")


def run_all(host: str, port: int, levels: list[int], args: argparse.Namespace, texts: list[str]) -> list[list]:
    one_request(host, port, texts[0], 4)  # warm-up
    rows = []
    for c in levels:
        r = run_level(host, port, c, args.requests, texts, args.max_tokens)
        print(json.dumps(r), file=sys.stderr)
        rows.append([c, r["requests"], f"{r['errors']} / {r['short']}", f"{r['rps']:.2f}", f"{r['tps']:.1f}",
                     f"{r['ttft_p50'] * 1e3:.0f}", f"{r['ttft_p99'] * 1e3:.0f}",
                     f"{r['latency_p50'] * 1e3:.0f}", f"{r['engine_tps']:.0f}" if r["engine_tps"] else ""])
    return rows


def runtime_reference(model: Path, prompt: str, max_tokens: int) -> float:
    """Decode tokens/s of the runtime alone on one sequence (the ceiling for one client)."""
    import cmf

    with cmf.load(model) as m:
        list(m.stream(prompt, max_tokens=8, ignore_eos=True))  # compile and warm
        rates = []
        for _ in range(5):
            last = None
            for last in m.stream(prompt, max_tokens=max_tokens, ignore_eos=True):
                pass
            assert last is not None
            rates.append(last.generation_tps)
        return statistics.median(rates)


def write_section(text: str) -> None:
    """Replace (or append) the ``## server`` section of RESULTS.md, leaving other sections alone."""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.strip() == "## server"), None)
    section = f"## server\n\n{text}\n"
    if start is None:
        new = old.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        new = "".join(lines[:start]) + section + "".join(lines[end:])
    RESULTS.write_text(new)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=str(Path(__file__).resolve().parents[2] / "shared" / "models"))
    ap.add_argument("--model", default=None, help="a .cmf to serve instead of converting models/base")
    ap.add_argument("--quant", default="q8")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests", type=int, default=4, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gguf", default=None, help="GGUF of the same model for llama_cpp.server")
    ap.add_argument("--write", action="store_true", help="update the ## server section of RESULTS.md")
    args = ap.parse_args()
    models = Path(args.models)
    texts = prompts(models)
    levels = [int(c) for c in args.clients.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model = Path(args.model)
        else:
            from cmf.convert import convert

            model = Path(tmp) / f"base-{args.quant}.cmf"
            convert(models / "base", model, quant=args.quant)
        load_before = os.getloadavg()[0]
        import cmf

        with cmf.load(model) as m:
            NO_EOS.update({str(i): -100 for i in sorted(m.tokenizer.eos_ids)})
        ref = runtime_reference(model, texts[0], args.max_tokens)
        print(f"runtime alone: {ref:.1f} tokens/s decode", file=sys.stderr)
        proc, host, port = start_server(model, ["--alias", "bench"])
        try:
            rows = run_all(host, port, levels, args, texts)
        finally:
            proc.send_signal(2)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        llama_rows: list[list] = []
        try:
            import llama_cpp.server  # noqa: F401

            gguf = Path(args.gguf) if args.gguf else Path(tmp) / "model-q8_0.gguf"
            if not args.gguf:
                from cmf.convert.gguf_export import export_gguf

                export_gguf(model, gguf, "Q8_0")
            lproc, lhost, lport = start_llama_server(gguf, 2048)
            try:
                llama_rows = run_all(lhost, lport, levels, args, texts)
                llama = f"GGUF Q8_0 exported by `cmf export --format gguf`, llama-cpp-python {llama_cpp.__version__}"
            finally:
                lproc.terminate()
                lproc.wait(30)
        except ImportError as exc:
            llama = f"not run: llama_cpp.server is not importable here ({exc.name or exc})"
        except Exception as exc:  # noqa: BLE001 - reported in the section instead
            llama = f"not run: {exc}"
        load_after = os.getloadavg()[0]
    numba_threads = os.environ.get("NUMBA_NUM_THREADS", "all cores")
    headers = ["clients", "requests", "errors / short", "requests/s", "tokens/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
               "latency p50 (ms)", "engine t/s"]
    text = (f"Run {datetime.date.today()} on {machine()} (`benchmarks/server.py --clients {args.clients} "
            f"--requests {args.requests} --max-tokens {args.max_tokens}`); model: ../shared/models/base "
            f"(Qwen3, 3.67M parameters) at {args.quant}; numba threads: {numba_threads}. Server and clients "
            "share the machine. Streaming chat, greedy, end-of-sequence suppressed by logit_bias, every answer "
            f"{args.max_tokens} tokens; TTFT = first content chunk as the client sees it (queueing included); "
            "engine t/s = the decode rate the engine itself reports for each request (median), which "
            "separates HTTP overhead from compute; short = answers that ended before max_tokens. "
            "Load average (1 min) before/after: "
            f"{load_before:.2f} / {load_after:.2f}.\n\n"
            f"Runtime alone, one sequence, no HTTP: **{ref:.1f} tokens/s** decode (median of 5).\n\n"
            "### cmf serve\n\n" + table(headers, rows)
            + "\n\nThe engine runs one sequence at a time (requests queue; no batched decode yet), so "
            "tokens/s stays at the single-stream rate while TTFT grows with the queue. The VM is shared: "
            "runs under a load average of 3-7 from other jobs measured both servers 2-4x slower, so compare "
            "figures within one run only.\n\n"
            f"### llama_cpp.server\n\n{llama}.\n")
    if llama_rows:
        text += "\n" + table(headers, llama_rows) + "\n"
    print(text)
    if args.write:
        write_section(text)


if __name__ == "__main__":
    main()
