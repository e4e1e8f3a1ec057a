"""vLLM plugin entry point (``vllm.general_plugins``: ``cmf``): registers the ``cmf`` load format.

vLLM calls :func:`register` in every process it starts (engine core, workers, the API server),
so the loader is known wherever ``load_format="cmf"`` is resolved. Without vLLM installed the
function is never called; importing this module needs nothing beyond pycmf.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

_done = False


def register() -> None:
    """Register the ``cmf`` model loader with vLLM (idempotent)."""
    global _done
    if _done:
        return
    from . import loader  # noqa: F401  # the @register_model_loader decorator runs on import
    from .materialize import redirect_file

    # vLLM loads plugins in EngineArgs before it builds ModelConfig, which applies
    # VLLM_MODEL_REDIRECT_PATH: pointing it at prepare()'s table lets `model="model.cmf"` resolve
    # to the materialised folder. A redirect the user set is left alone.
    red = redirect_file()
    if "VLLM_MODEL_REDIRECT_PATH" not in os.environ and red.is_file():
        os.environ["VLLM_MODEL_REDIRECT_PATH"] = str(red)
        log.info("cmf: VLLM_MODEL_REDIRECT_PATH=%s (prepared .cmf paths resolve to their folders)", red)
    _done = True
    log.debug("cmf: vLLM load format %r registered", loader.LOAD_FORMAT)
