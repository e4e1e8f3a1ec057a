"""What a request hands the engine (:class:`Job`) and what comes back (events, refusals).

A Job is the per-request interface of the engine: the prompt ids, the decoding options, and the
hooks a later feature plugs into without touching the engine loop — extra logits processors, a
token mask consulted at every step (grammar-constrained output), extra stop token ids. Events go
to ``sink``, a callable that must only hand them over (the HTTP side puts them on the request's
event loop); it is called from the engine thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

import numpy as np

from ..runtime.sampling import Processor
from .responses import TokenLogprob
from .schemas import Sampling

# A token mask: given the tokens generated so far, the allowed next tokens (bool [vocab]) or None
# for "any". Called once per step before sampling, after the logits processors.
TokenMask = Callable[[Sequence[int]], "np.ndarray | None"]


class QueueFull(Exception):
    """The engine has ``max_queue`` requests waiting already; ``retry_after``: seconds until a
    slot is expected to free (for the HTTP ``Retry-After``)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = max(1, int(retry_after))


class EngineClosed(Exception):
    """The engine has been shut down."""


class JobFailed(Exception):
    """A job ended in :class:`Failed` with an error that is not the client's (already logged by
    the engine): the HTTP side answers a generic 500."""


@dataclass
class Delta:
    """New text of a running job, with the logprobs of the tokens that produced it (if asked)."""

    text: str
    logprobs: list[TokenLogprob]


@dataclass
class Finished:
    """The job ended: ``finish_reason`` is "stop", "length" or "cancelled"."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token: float = 0.0  # from the start of its prefill (queue wait apart)
    prompt_tps: float = 0.0  # prompt tokens computed (cached ones apart) per second of prefill
    generation_tps: float = 0.0
    task: str | None = None
    skill: str | None = None
    spec_drafted: int = 0  # MTP drafts proposed / accepted (speculative decoding)
    spec_accepted: int = 0
    blend: dict[str, float] | None = None  # the blend that ran ("none" = the backbone)
    route: dict[str, Any] | None = None  # the routing decision, under an "auto" skill or blend
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    queued: float = 0.0  # seconds between submission and the start of its prefill


@dataclass
class Failed:
    """The job raised; the error is logged by the engine, the client gets a generic message."""

    error: BaseException


Event = Union[Delta, Finished, Failed]


@dataclass
class Job:
    """One generation request: prompt ids, sampling, logprobs wish, task/skill, and where events go.

    Per-request hooks (all optional): ``logits_processors`` run after the sampling options' own
    (logit bias, penalties) with ``(logits, tokens seen)``; ``token_mask`` then restricts the
    candidates; ``stop_ids`` end the answer like end-of-sequence (the id is not part of the text).
    """

    prompt_ids: list[int]
    sampling: Sampling
    max_tokens: int
    sink: Callable[[Event], None]
    logprobs: bool = False
    top_logprobs: int = 0
    task: str | None = None
    skill: str | None = None  # an id, None (the backbone) or "auto" (routed on route_prompt)
    blend: dict[str, float] | str | None = None  # {id or "none": weight} or "auto"; replaces skill
    route_prompt: Any = None  # what "auto" routes on: the chat messages, or the completion prompt
    logits_processors: list[Processor] = field(default_factory=list)
    token_mask: TokenMask | None = None
    stop_ids: frozenset[int] = frozenset()
    id: int = 0
    state: str = "new"  # new → queued → running → done | cancelled | failed | rejected
    generated: int = 0
    submitted_at: float = 0.0
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        """Stop this job (its client left); a no-op once it has finished."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()
