"""OpenAI-compatible HTTP server: ``schemas`` (pure validation and shapes), ``engine`` (one worker
thread owning the model, running the requests together: continuous batching, a prefix cache, a
bounded queue), ``app`` (Starlette routes, run by uvicorn).

Needs the ``server`` extra (``pip install 'pycmf[server]'``). Typical use::

    model = cmf.load("model.cmf")
    engine = Engine(model, parallel=16, max_queue=64)
    with ServerThread(create_app(engine, model_id="model")) as s:
        print(s.url)
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "ServerThread", "create_app"]


def __getattr__(name: str) -> Any:
    # Lazy: `cmf.server.schemas` stays importable (and cheap) without starlette installed.
    if name == "Engine":
        from .engine import Engine

        return Engine
    if name in ("ServerThread", "create_app"):
        from . import app

        return getattr(app, name)
    raise AttributeError(name)
