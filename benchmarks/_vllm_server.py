"""vLLM's OpenAI server (CPU build, ``.venv-vllm``) for benchmarks/server.py: start, wait, stop."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import time
from pathlib import Path


def wait_ready(proc: subprocess.Popen, port: int, timeout: float, name: str,
               poll: float = 0.5) -> tuple[subprocess.Popen, str, int]:
    """Wait until an OpenAI server on 127.0.0.1:``port`` answers /v1/models; kill it and raise
    RuntimeError if it exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited at start")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/v1/models")
            if conn.getresponse().status == 200:
                return proc, "127.0.0.1", port
        except OSError:
            time.sleep(poll)
    proc.kill()
    raise RuntimeError(f"{name} did not start in {timeout:.0f} s")


def start_vllm_server(python: str, folder: Path, ctx: int, dtype: str = "bfloat16",
                      timeout: float = 1200.0) -> tuple[subprocess.Popen, str, int]:
    """``python -m vllm.entrypoints.openai.api_server`` on the Hugging Face ``folder`` (the same
    weights, exported by ``cmf export``), served as model "bench"; waits up to ``timeout`` s
    (a CPU engine start takes minutes on a shared 2-core machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench",
           "--max-model-len", str(ctx)]
    log = open(Path(folder) / "vllm-server.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return wait_ready(proc, port, timeout, f"vLLM's server (log: {log.name})", poll=2.0)

def version(python: str) -> str:
    r = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"
