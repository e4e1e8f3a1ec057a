"""``cmf serve``: an OpenAI-compatible HTTP server for one model (see docs/SERVER.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from . import UsageError, sanitize
from ..server.defaults import (DEFAULT_KV_BUDGET_MB, DEFAULT_PARALLEL, DEFAULT_PREFILL_CHUNK, DEFAULT_PREFIX_CACHE_MB,
                               STREAM_INTERVAL)
from ._runtime_args import add_model_options, announce_compiles, resolve_model

NAME = "serve"
SUMMARY = "serve a model over an OpenAI-compatible HTTP API (/v1/chat/completions, ...)"

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(NAME, help=SUMMARY, description=SUMMARY)
    add_model_options(p, sampling=False, int8_default=True, kv_default="f16")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="TCP port (default 8080; 0 = any free port)")
    p.add_argument("--api-key", default=os.environ.get("CMF_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on all routes but /health and the UI "
                        "(default: $CMF_API_KEY)")
    p.add_argument("--alias", default=None, help="model id clients use (default: the file name without .cmf)")
    p.add_argument("--parallel", "-np", type=int, default=DEFAULT_PARALLEL, metavar="N",
                   help=f"sequences decoded together in one batch (default {DEFAULT_PARALLEL})")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for a free sequence slot before 429 (default 64; 0: none wait)")
    p.add_argument("--kv-budget", type=float, default=DEFAULT_KV_BUDGET_MB, metavar="MB",
                   help=f"KV cache memory of the running sequences and the prefix cache together "
                        f"(default {DEFAULT_KV_BUDGET_MB} MB); past it new requests wait and the newest "
                        "running ones are preempted")
    p.add_argument("--prefix-cache", type=float, default=DEFAULT_PREFIX_CACHE_MB, metavar="MB",
                   help=f"KV of finished requests kept for the prompts that follow (default "
                        f"{DEFAULT_PREFIX_CACHE_MB} MB, within --kv-budget; 0: off)")
    p.add_argument("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, metavar="N",
                   help=f"prompt tokens fed between two decode steps (default {DEFAULT_PREFILL_CHUNK}): "
                        "smaller keeps running streams flowing, larger starts new ones sooner")
    p.add_argument("--stream-interval", type=float, default=STREAM_INTERVAL * 1000, metavar="MS",
                   help="least milliseconds between two writes of one stream: tokens generated meanwhile go "
                        f"out together, the first and the last at once (default {STREAM_INTERVAL * 1000:g}; "
                        "0: every token as it comes)")
    p.add_argument("--exact-act", action="store_true",
                   help="float activations in every product (the other commands' default); without it the "
                        "server runs int8 activations on q8, 4-bit and q1t files (--int8-act): batched "
                        "decode ~2.6x and prefill ~3.9x faster, one stream as fast, ~0.5%% perplexity on "
                        "q8 (docs/SERVER.md); or CMF_INT8_ACT=0")
    p.add_argument("--max-body", type=int, default=4 << 20, metavar="BYTES",
                   help="largest request body accepted (default 4 MiB; larger gets 413)")
    p.add_argument("--spec", choices=("auto", "off"), default="auto",
                   help="MTP speculative decoding for greedy requests when the file has an MTP head "
                        "(same tokens, fewer forwards; default auto)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="answer at once, without the start's short warm-up generation (which compiles "
                        "the kernels on the first start after an install, up to ~2 min, instead of making "
                        "the first request wait)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                   help="server log level (access lines are at info)")
    p.set_defaults(run=run)
    return p


def _warm_up(engine: Any) -> None:  # noqa: ANN401 - a server Engine (imported lazily)
    """The start's warm-up (server/warmup.py), said on stderr: it may compile for a minute."""
    from ..server.warmup import warm_up
    from ._warmup import compile_clause

    sys.stderr.write("cmf: warming up (a short generation; the first start after an install compiles "
                     "the CPU kernels, up to ~2 min) ...\n")
    sys.stderr.flush()
    done = warm_up(engine)
    note = f"; {compile_clause(done.compile_seconds)}" if done.kernels else ""
    sys.stderr.write(f"cmf: warmed up in {done.seconds:.1f} s{note}\n")
    sys.stderr.flush()


def _announcing_server(base: type, config: Any, line: str) -> Any:  # noqa: ANN401 - uvicorn's, imported lazily
    """A uvicorn ``Server`` that writes ``line`` (the ``serving ... on URL`` line) once it has
    started: uvicorn's Ctrl-C handlers are in place by then, so a client or supervisor that waits
    for the line can stop the server with SIGINT at once (sent earlier, it could be lost in
    asyncio's start-up and leave the server running)."""

    class AnnouncingServer(base):  # type: ignore[misc, valid-type]
        async def startup(self, sockets: Any = None) -> None:  # noqa: ANN401
            await super().startup(sockets=sockets)
            if not self.should_exit:
                sys.stderr.write(line + "\n")
                sys.stderr.flush()

    return AnnouncingServer(config)


def server_int8(args: argparse.Namespace) -> bool:
    """Whether the server runs int8 activations: on unless ``--exact-act`` or ``CMF_INT8_ACT`` set
    to 0/false/off/no (``--int8-act`` says so explicitly). The one-stream commands keep exact
    activations by default; a server batches, where integer products are ~2.6× faster at 16
    sequences (docs/SERVER.md has the figures and the quality cost)."""
    if getattr(args, "exact_act", False):
        if getattr(args, "int8_act", None):
            raise UsageError("--int8-act and --exact-act contradict each other; give one")
        return False
    if getattr(args, "int8_act", None):
        return True
    env = os.environ.get("CMF_INT8_ACT", "").strip().lower()
    return env not in ("0", "false", "off", "no")


def server_kv_cache(args: argparse.Namespace) -> str:
    """The server's KV cache type: ``--kv-cache``, else ``CMF_KV_CACHE``, else f16 — a batched step
    reads every running sequence's whole cache, and f16 halves those bytes and the memory each
    sequence holds (docs/SERVER.md); the one-stream commands keep f32 unless asked."""
    if getattr(args, "kv_cache", None):
        return args.kv_cache
    env = os.environ.get("CMF_KV_CACHE", "").strip().lower()
    if env and env not in ("f32", "f16"):
        raise UsageError(f"CMF_KV_CACHE must be f32 or f16, got {env!r}")
    return env or "f16"


def run(args: argparse.Namespace) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"cmf serve needs the server extra: pip install 'pycmf[server]' ({exc})") from None
    if args.max_queue < 0:
        raise UsageError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.parallel < 1:
        raise UsageError(f"--parallel must be >= 1, got {args.parallel}")
    if args.kv_budget <= 0 or args.prefix_cache < 0 or args.prefill_chunk < 1:
        raise UsageError("--kv-budget must be > 0, --prefix-cache >= 0 and --prefill-chunk >= 1")
    if args.max_body < 1024:
        raise UsageError(f"--max-body must be >= 1024 bytes, got {args.max_body}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")

    from ..runtime.model import load
    from ..server.app import bind, create_app
    from ..server.engine import Engine

    level = getattr(logging, args.log_level.upper())
    cmf_log = logging.getLogger("cmf")
    if not getattr(args, "verbose", False):
        cmf_log.setLevel(level)
    handler = logging.StreamHandler(sys.stderr)  # uvicorn's own start/stop messages
    handler.setFormatter(logging.Formatter("cmf: %(levelname)s: %(name)s: %(message)s"))
    uv_log = logging.getLogger("uvicorn.error")
    uv_log.addHandler(handler)
    uv_log.setLevel(level)

    int8 = server_int8(args)
    kv_cache = server_kv_cache(args)
    path = resolve_model(args.model)
    announce_compiles()
    # load() opens (and so validates) the file; a skill file or a damaged file stops here.
    model = load(path, task=args.task, skill=args.skill, threads=args.threads, ctx_size=args.ctx_size,
                 batch_size=args.batch_size, int8_activations=int8,
                 verify=getattr(args, "verify", False), kv_cache=kv_cache)
    engine = None
    try:
        model_id = args.alias or Path(path).name.removesuffix(".cmf")
        engine = Engine(model, max_queue=args.max_queue, parallel=args.parallel, kv_budget_mb=args.kv_budget,
                        prefix_cache_mb=args.prefix_cache, prefill_chunk=args.prefill_chunk,
                        default_task=args.task, default_skill=args.skill, speculative=args.spec == "auto")
        app = create_app(engine, model_id=model_id, api_key=args.api_key, max_body=args.max_body,
                         stream_interval=max(0.0, args.stream_interval) / 1000)
        sock = bind(args.host, args.port)  # first: a port in use fails before the warm-up
        if args.warmup:
            try:
                _warm_up(engine)
            except BaseException:
                sock.close()
                raise
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        acts = "int8 activations" if int8 else "exact activations"
        line = sanitize(f"cmf: serving {model_id} ({Path(path).name}, ctx {model.ctx_size}, parallel "
                        f"{args.parallel}, {acts}, {kv_cache} KV cache) on http://{shown}:{port}/v1 (Ctrl-C stops)")
        import uvicorn

        from ..server.protocol import GuardedH11Protocol  # request-head deadline, JSON 400s

        config = uvicorn.Config(app, log_level=level, access_log=False, log_config=None, lifespan="off",
                                timeout_graceful_shutdown=5, http=GuardedH11Protocol)
        try:
            _announcing_server(uvicorn.Server, config, line).run(sockets=[sock])
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: a normal stop
            pass
        finally:
            sock.close()
    finally:
        uv_log.removeHandler(handler)
        if engine is not None:
            engine.close()
        if engine is None or not engine.alive:  # unmap only once the worker no longer reads it
            model.close()
    return 0
