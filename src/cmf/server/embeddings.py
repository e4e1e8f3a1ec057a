"""``POST /v1/embeddings``: pooled hidden states of the served model.

A vector is the mean (``cmf.pooling: "mean"``, the default) or the last position (``"last"``) of
the last layer's final-normed hidden states over the input's tokens, L2-normalized as OpenAI's
are (``cmf.normalize: false`` keeps the raw pool). Inputs run one by one, each from a fresh cache,
on the engine's worker between decode steps (:meth:`Engine.call`), under the server's default
task and skill: a vector does not depend on what else runs or on its batch.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from . import schemas as S
from . import selection
from .jobs import EngineClosed
from .plumbing import read_json

if TYPE_CHECKING:
    from .app import _Api

log = logging.getLogger(__name__)

MAX_INPUTS = 2048  # OpenAI's cap on one request's inputs


@dataclass
class EmbeddingRequest:
    """A validated embeddings body."""

    model: str | None
    inputs: list[str | list[int]]
    encoding_format: str = "float"
    pooling: str = "mean"
    normalize: bool = True


def parse(body: Any, vocab: int) -> EmbeddingRequest:
    """Check an embeddings body; 400 naming the field."""
    if not isinstance(body, dict):
        raise S.bad("the request body must be a JSON object", None, "invalid_type")
    if body.get("dimensions") is not None:
        raise S.bad("'dimensions' is not supported: the vectors have the model's hidden size", "dimensions",
                    "unsupported_value")
    v = body.get("input")
    if v is None:
        raise S.bad("'input' is required", "input", "missing_field")
    if isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool)
                                                                for t in v)):
        inputs: list[Any] = [v]
    elif isinstance(v, list) and v:
        inputs = v
    else:
        raise S.bad("'input' must be a string, an array of strings, or token ids", "input", "invalid_type")
    if len(inputs) > MAX_INPUTS:
        raise S.bad(f"'input' holds at most {MAX_INPUTS} items, got {len(inputs)}", "input", "invalid_value")
    for i, x in enumerate(inputs):
        p = f"input[{i}]"
        if isinstance(x, str):
            if not x:
                raise S.bad(f"'{p}' must not be empty", p, "invalid_value")
        elif isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
            if any(not 0 <= t < vocab for t in x):
                raise S.bad(f"'{p}' holds a token id outside the vocabulary [0, {vocab})", p, "invalid_value")
        else:
            raise S.bad(f"'{p}' must be a non-empty string or array of token ids", p, "invalid_type")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise S.bad(f"'encoding_format' must be float or base64, got {str(fmt)[:40]!r}", "encoding_format",
                    "invalid_value")
    c = body.get("cmf") if isinstance(body.get("cmf"), dict) else {}
    pooling = c.get("pooling", "mean")
    if pooling not in ("mean", "last"):
        raise S.bad("'cmf.pooling' must be mean or last", "cmf.pooling", "invalid_value")
    normalize = c.get("normalize", True)
    if not isinstance(normalize, bool):
        raise S.bad("'cmf.normalize' must be a boolean", "cmf.normalize", "invalid_type")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise S.bad("'model' must be a string", "model", "invalid_type")
    return EmbeddingRequest(model, inputs, fmt, pooling, normalize)


def pooled(model: Any, ids: list[int], pooling: str, normalize: bool) -> np.ndarray:
    """One input's vector (float32 [hidden]); runs on the engine's worker."""
    cache = model.new_cache()
    step = max(1, int(getattr(model, "batch_size", 512)))
    total = None
    last = None
    for s in range(0, len(ids), step):
        h = model.hidden(ids[s:s + step], cache).astype(np.float64)
        total = h.sum(0) if total is None else total + h.sum(0)
        last = h[-1]
    vec = total / len(ids) if pooling == "mean" else last
    if normalize:
        n = float(np.linalg.norm(vec))
        vec = vec / n if n > 0 else vec
    return vec.astype(np.float32)


async def route(api: "_Api", request: Request) -> Response:
    """The embeddings route handler."""
    body = await read_json(request, api.max_body)
    req = parse(body, api.vocab)
    api._check_model(req.model)
    tok = api.engine.tokenizer
    id_lists: list[list[int]] = []
    for i, x in enumerate(req.inputs):
        ids = await run_in_threadpool(tok.encode, x, add_special_tokens=True) if isinstance(x, str) else list(x)
        if not ids:
            raise S.bad(f"'input[{i}]' encodes to no tokens", f"input[{i}]", "invalid_value")
        if len(ids) > api.model.ctx_size:
            raise S.bad(f"'input[{i}]' is {len(ids)} tokens; this model's context is {api.model.ctx_size}",
                        f"input[{i}]", "context_length_exceeded")
        id_lists.append(ids)
    skill = api.engine.default_skill if api.engine.default_skill not in ("auto",) else None
    key = (api.engine.default_task, None if skill == "none" else skill, None)

    def work(model: Any) -> list[np.ndarray]:
        selection.select(model, key)
        return [pooled(model, ids, req.pooling, req.normalize) for ids in id_lists]

    try:
        vecs = await asyncio.wrap_future(api.engine.call(work))
    except EngineClosed:
        raise S.RequestError(503, "the server is shutting down", code="unavailable") from None
    data = []
    for i, v in enumerate(vecs):
        emb: Any = base64.b64encode(v.astype("<f4").tobytes()).decode() if req.encoding_format == "base64" \
            else [float(x) for x in v]
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(len(x) for x in id_lists)
    request.state.usage = (n, 0, 0)
    return JSONResponse({"object": "list", "data": data, "model": api.model_id,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})
