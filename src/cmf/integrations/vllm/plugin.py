"""vLLM plugin entry point (``vllm.general_plugins``: ``cmf``): registers the ``cmf`` load format.

vLLM calls :func:`register` in every process it starts (engine core, workers, the API server),
so the loader is known wherever ``load_format="cmf"`` is resolved. It also wraps
``EngineArgs.create_engine_config`` (:mod:`.direct`) so ``model`` may be a ``.cmf`` file. Without
vLLM installed the function is never called; importing this module needs nothing beyond pycmf.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_done = False


def register() -> None:
    """Register the ``cmf`` model loader with vLLM and let ``model`` be a .cmf file (idempotent)."""
    global _done
    if _done:
        return
    from . import direct, loader  # the @register_model_loader decorator runs on import

    direct.install()

    _done = True
    log.debug("cmf: vLLM load format %r registered", loader.LOAD_FORMAT)
