"""`cmf serve` under abuse, on loopback, for a bounded time (issue 28).

    python benchmarks/server_abuse.py [--model FILE.cmf] [--seconds 60] [--idle 1000] [--slow 50]
                                      [--json] [--write]

All at once against one ``cmf serve`` subprocess (``--max-body 1 MiB``):

- **idle**: ``--idle`` connections that send nothing (as many as the file-descriptor limit allows,
  said in the figures), reopened as the server drops them;
- **slow**: ``--slow`` clients sending a request head one byte a second (slowloris);
- **header floods**: a 64 KiB header line, and 4,000 small headers, back to back;
- **big bodies**: a 2 MiB body with its Content-Length, and a 2 MiB chunked body;
- **disconnects**: bursts of 8 streaming chats every 2 s, each closed after its first chunk;
- **probes**: ``GET /health`` every 0.5 s and a small chat every second, which must keep
  being answered; the server's RSS is sampled every second.

Every answer to an abusive request is checked: a 4xx whose body is OpenAI's error shape
(``{"error": {"message", "type", "param", "code"}}``). Without ``--model``,
../shared/models/base is converted at q8. ``--write`` appends a dated entry to the
``## server abuse`` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import resource
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_entry, machine, table  # noqa: E402
from server import start_server, stop  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
MAX_BODY = 1 << 20
CHAT = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}


class Tally:
    """Thread-safe counters and samples."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.samples: dict[str, list[float]] = {}

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def sample(self, key: str, v: float) -> None:
        with self.lock:
            self.samples.setdefault(key, []).append(v)


def openai_shaped(body: bytes) -> bool:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and set(err) >= {"message", "type", "param", "code"}


def read_response(sock: socket.socket, timeout: float = 30.0) -> tuple[int, bytes]:
    """(status, body) of one response on a raw socket; (0, b"") if the server closed first."""
    sock.settimeout(timeout)
    buf = b""
    try:
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            if not chunk:
                return 0, b""
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = next((int(ln.split(b":", 1)[1]) for ln in head.split(b"\r\n")
                       if ln.lower().startswith(b"content-length:")), None)
        while length is not None and len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return status, body
    except (OSError, ValueError, IndexError):
        return 0, b""


def refused(t: Tally, kind: str, status: int, body: bytes) -> None:
    """Record an abusive request's answer: a 4xx with the OpenAI error shape is the only good one."""
    t.add(f"{kind}:{status}")
    if 400 <= status < 500 and openai_shaped(body):
        t.add("refused_ok")
    elif status == 0:
        t.add("refused_closed")  # dropped without an answer (counted, not an error by itself)
    else:
        t.add("refused_bad")


def readable(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    """The sockets with data or EOF (poll: select() stops at descriptor 1024)."""
    if not socks:
        time.sleep(timeout)
        return []
    p = select.poll()
    by_fd = {s.fileno(): s for s in socks}
    for fd in by_fd:
        p.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return [by_fd[fd] for fd, _ in p.poll(timeout * 1000)]


def connect(host: str, port: int) -> socket.socket:
    return socket.create_connection((host, port), timeout=10)


# ----------------------------------------------------------------------------------- attackers


def idle_flood(host: str, port: int, n: int, stop_at: float, t: Tally) -> None:
    socks: list[socket.socket] = []
    while time.monotonic() < stop_at:
        while len(socks) < n:
            try:
                socks.append(connect(host, port))
                t.add("idle_opened")
            except OSError:
                t.add("idle_connect_failed")
                break
        for s in readable(socks, 1.0):  # the server closed it (the head deadline)
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:
                t.add("idle_dropped_by_server")
                socks.remove(s)
                s.close()
    t.sample("idle_held_at_end", len(socks))
    for s in socks:
        s.close()


def slow_clients(host: str, port: int, n: int, stop_at: float, t: Tally) -> None:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 2\r\n\r\n{}")
    conns: list[list] = []  # [socket, bytes sent, opened at]
    while time.monotonic() < stop_at:
        while len(conns) < n:
            try:
                conns.append([connect(host, port), 0, time.monotonic()])
            except OSError:
                t.add("slow_connect_failed")
                break
        for c in list(conns):
            s, sent, opened = c
            try:
                s.send(head[sent:sent + 1])
                c[1] += 1
            except OSError:
                pass
            if readable([s], 0) or c[1] >= len(head):
                status, body = read_response(s, timeout=5)
                if c[1] < len(head):  # cut before the head was complete
                    refused(t, "slow", status, body)
                    t.sample("slow_held_s", time.monotonic() - opened)
                else:
                    t.add("slow_completed_head")
                s.close()
                conns.remove(c)
        time.sleep(max(0.0, 1.0 - 0.0005 * len(conns)))  # one byte a second per client
    for c in conns:
        c[0].close()


def header_floods(host: str, port: int, stop_at: float, t: Tally) -> None:
    big_line = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Junk: " + b"a" * 65536 + b"\r\n\r\n"
    many = b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(4000)) + b"\r\n"
    while time.monotonic() < stop_at:
        for kind, payload in (("flood_line", big_line), ("flood_many", many)):
            try:
                s = connect(host, port)
                s.sendall(payload)
                status, body = read_response(s)
                s.close()
            except OSError:
                status, body = 0, b""
            refused(t, kind, status, body)
        time.sleep(0.05)


def big_bodies(host: str, port: int, stop_at: float, t: Tally) -> None:
    blob = b'{"messages": "' + b"x" * (2 * MAX_BODY) + b'"}'
    while time.monotonic() < stop_at:
        try:
            s = connect(host, port)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(blob) + blob)
            status, body = read_response(s)
            s.close()
        except OSError:
            status, body = 0, b""
        refused(t, "body_length", status, body)
        try:
            s = connect(host, port)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n")
            for i in range(0, len(blob), 65536):
                part = blob[i:i + 65536]
                s.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
            s.sendall(b"0\r\n\r\n")
            status, body = read_response(s)
            s.close()
        except OSError:
            status, body = 0, b""
        refused(t, "body_chunked", status, body)
        time.sleep(0.2)


def disconnect_bursts(host: str, port: int, stop_at: float, t: Tally) -> None:
    body = json.dumps(dict(CHAT, max_tokens=200, stream=True, ignore_eos=True)).encode()
    while time.monotonic() < stop_at:
        socks = []
        for _ in range(8):
            try:
                s = connect(host, port)
                s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
                socks.append(s)
            except OSError:
                t.add("burst_connect_failed")
        for s in socks:
            s.settimeout(30)
            try:
                got = s.recv(4096)
                t.add("burst_first_chunk" if b"data:" in got or b" 200 " in got else "burst_other")
            except OSError:
                t.add("burst_no_answer")
            s.close()
        t.add("bursts")
        time.sleep(2.0)


def request(host: str, port: int, path: str, body: dict | None = None, timeout: float = 60) -> tuple[int, bytes]:
    """One well-formed request on a fresh connection (GET without a body, else a JSON POST):
    (status, response body)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET" if body is None else "POST", path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def probes(host: str, port: int, stop_at: float, t: Tally) -> None:
    last_chat = 0.0
    while time.monotonic() < stop_at:
        for path, body in (("/health", None), ("/v1/chat/completions", CHAT)):
            if body is not None and time.monotonic() - last_chat < 1.0:
                continue
            kind = "health" if body is None else "chat"
            t0 = time.perf_counter()
            try:
                ok = request(host, port, path, body)[0] == 200
            except OSError:
                ok = False
            t.add(f"{kind}_{'ok' if ok else 'failed'}")
            t.sample(f"{kind}_s", time.perf_counter() - t0)
            if body is not None:
                last_chat = time.monotonic()
        time.sleep(0.5)


def rss_sampler(pid: int, stop_at: float, t: Tally) -> None:
    while time.monotonic() < stop_at + 3:
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        t.sample("rss_mb", int(line.split()[1]) / 1024)
        except OSError:
            return
        time.sleep(1.0)


# ----------------------------------------------------------------------------------- run


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def warm_up(host: str, port: int) -> None:
    """One chat, then four at once: a cold numba cache compiles the one-sequence and the batched
    decode kernels here, not during the measured seconds, where compiling stalls the health
    probes (the slow test's floor of answers failed on a cold cache)."""
    def chat() -> None:
        request(host, port, "/v1/chat/completions", CHAT, timeout=300)

    chat()
    together = [threading.Thread(target=chat, daemon=True) for _ in range(4)]
    for th in together:
        th.start()
    for th in together:
        th.join(300)


def run(model: Path, seconds: float, idle: int, slow: int) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fd_room = soft - 200 - slow - 64  # this process holds every attacker's sockets too
    idle_n = max(0, min(idle, fd_room))
    proc, host, port = start_server(model, ["--max-body", str(MAX_BODY), "--parallel", "8"])
    t = Tally()
    try:
        warm_up(host, port)
        stop_at = time.monotonic() + seconds
        jobs = [threading.Thread(target=fn, args=args, daemon=True) for fn, args in (
            (rss_sampler, (proc.pid, stop_at, t)), (probes, (host, port, stop_at, t)),
            (idle_flood, (host, port, idle_n, stop_at, t)), (slow_clients, (host, port, slow, stop_at, t)),
            (header_floods, (host, port, stop_at, t)), (big_bodies, (host, port, stop_at, t)),
            (disconnect_bursts, (host, port, stop_at, t)))]
        for j in jobs:
            j.start()
        for j in jobs:
            j.join(seconds + 90)
        alive = proc.poll() is None
        status, data = request(host, port, "/health", timeout=30)
        health_after = json.loads(data) if status == 200 else {}
    finally:
        stop(proc)
    c, s = t.counts, t.samples
    rss = s.get("rss_mb", [float("nan")])
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
        "seconds": seconds, "idle_asked": idle, "idle_held": idle_n, "fd_soft_limit": soft, "slow": slow,
        "alive": alive, "engine_after": health_after.get("engine", {}),
        "health_ok": c["health_ok"], "health_failed": c["health_failed"],
        "health_p50_ms": 1e3 * _pct(s.get("health_s", []), 0.5), "health_p99_ms": 1e3 * _pct(s.get("health_s", []), 0.99),
        "health_max_ms": 1e3 * max(s.get("health_s", [0])),
        "chat_ok": c["chat_ok"], "chat_failed": c["chat_failed"],
        "chat_p50_ms": 1e3 * _pct(s.get("chat_s", []), 0.5), "chat_max_ms": 1e3 * max(s.get("chat_s", [0])),
        "rss_start_mb": rss[0], "rss_max_mb": max(rss), "rss_end_mb": rss[-1],
        "idle_opened": c["idle_opened"], "idle_dropped_by_server": c["idle_dropped_by_server"],
        "idle_connect_failed": c["idle_connect_failed"],
        "slow_cut": sum(v for k, v in c.items() if k.startswith("slow:")),
        "slow_held_median_s": statistics.median(s["slow_held_s"]) if s.get("slow_held_s") else float("nan"),
        "slow_completed_head": c["slow_completed_head"],
        "bursts": c["bursts"], "burst_first_chunk": c["burst_first_chunk"],
        "refused_ok": c["refused_ok"], "refused_bad": c["refused_bad"], "refused_closed": c["refused_closed"],
        "statuses": {k: v for k, v in sorted(c.items()) if ":" in k},
    }


def entry(r: dict) -> str:
    rows = [
        ["/health answered", f"{r['health_ok']} ok, {r['health_failed']} failed; p50 {r['health_p50_ms']:.1f} ms, "
                             f"p99 {r['health_p99_ms']:.1f} ms, max {r['health_max_ms']:.0f} ms"],
        ["small chats answered", f"{r['chat_ok']} ok, {r['chat_failed']} failed; p50 {r['chat_p50_ms']:.0f} ms, "
                                 f"max {r['chat_max_ms']:.0f} ms"],
        ["server RSS", f"{r['rss_start_mb']:.0f} MB at start, {r['rss_max_mb']:.0f} MB max, "
                       f"{r['rss_end_mb']:.0f} MB at the end"],
        ["idle connections", f"{r['idle_held']} held at once (asked {r['idle_asked']}, fd soft limit "
                             f"{r['fd_soft_limit']}); {r['idle_opened']} opened, {r['idle_dropped_by_server']} "
                             f"dropped by the server's head deadline"],
        ["slow clients (1 byte/s)", f"{r['slow']} at once; {r['slow_cut']} cut by the head deadline after a median "
                                    f"{r['slow_held_median_s']:.1f} s"],
        ["disconnect bursts", f"{r['bursts']} bursts of 8 streams closed after the first chunk "
                              f"({r['burst_first_chunk']} got one)"],
        ["refused requests", f"{r['refused_ok']} 4xx with the OpenAI error shape, **{r['refused_bad']} without**, "
                             f"{r['refused_closed']} closed without an answer"],
        ["answers by kind", ", ".join(f"{k} ×{v}" for k, v in r["statuses"].items())],
        ["after the run", f"server alive: {'yes' if r['alive'] else '**no**'}; engine cancelled "
                          f"{r['engine_after'].get('cancelled', '?')}, failed {r['engine_after'].get('failed', '?')}"],
    ]
    return (f"### {r['date']} — {r['machine']}\n\n"
            f"`python benchmarks/server_abuse.py --seconds {r['seconds']:g} --idle {r['idle_asked']} "
            f"--slow {r['slow']}`: all attacks at once for {r['seconds']:g} s against `cmf serve "
            f"--max-body 1048576 --parallel 8` (the 3.67M-parameter base model at q8), on loopback.\n\n"
            + table(["", "figure"], rows) + "\n")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--models", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared" / "models")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--idle", type=int, default=1000)
    ap.add_argument("--slow", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            model = Path(tmp) / "base.cmf"
            subprocess.run([sys.executable, "-m", "cmf", "convert", "-m", str(args.models / "base"), "-o", str(model),
                            "--quant", "q8"], check=True, stdout=subprocess.DEVNULL)
        r = run(model, args.seconds, args.idle, args.slow)
    print(json.dumps(r, indent=1) if args.json else entry(r))
    if args.write:
        append_entry(RESULTS, "## server abuse", entry(r),
                     intro="`benchmarks/server_abuse.py`: slow clients, idle connections, header floods, bodies "
                           "over the limit and mid-stream disconnects at once (issue 28).")


if __name__ == "__main__":
    main()
