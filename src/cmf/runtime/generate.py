"""Generation as a stack of generators (see STYLE.md):

``generate_step`` yields (token, logits) → ``stream_generate`` yields text deltas with ids, finish
reason and stats → ``generate`` returns the text.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from ..kernels.compiling import install as install_compile_timer
from ..kernels.compiling import totals as compile_totals
from .sampling import Processor, Sampler, make_logits_processors, make_sampler
from .speculative import SpecStats, speculative_generate_step


@dataclass
class GenerationResponse:
    """One streamed step: the new text, its token, and running statistics."""

    text: str
    token: int | None
    finish_reason: str | None  # None while generating, then "stop" or "length"
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_mb: float
    time_to_first_token: float = 0.0
    spec_rounds: int = 0  # speculative decoding: verify rounds that carried drafts
    spec_drafted: int = 0
    spec_accepted: int = 0
    # Seconds this generation spent compiling kernels (numba cache misses: a first run after an
    # install), left out of prompt_tps (compiled before the first token) and generation_tps.
    compile_seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted MTP tokens (0 without speculative decoding)."""
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0


def generate_step(model, prompt_ids: Sequence[int], *, sampler: Sampler, processors: Sequence[Processor] = (),
                  max_tokens: int = 256, cache=None, spec: str | bool = "off", spec_k: int = 3,
                  spec_stats=None) -> Iterator[tuple[int, np.ndarray]]:
    """Prefill ``prompt_ids`` then yield (token, logits) forever or up to ``max_tokens``.

    ``spec`` ("on"/True, "auto", "off"/False): MTP speculative decoding with ``spec_k`` drafts per
    round (runtime/speculative.py) — the same tokens, fewer forwards when drafts are accepted.
    It needs a greedy sampler and a file with an MTP head: "on" raises otherwise, "auto" quietly
    decodes plainly. ``spec_stats`` (a ``SpecStats``) receives the counters.
    """
    mode = ("on" if spec else "off") if spec is None or isinstance(spec, bool) else spec
    if mode not in ("on", "auto", "off"):
        raise ValueError(f"spec must be 'on', 'auto' or 'off', not {spec!r}")
    if mode != "off":
        greedy = bool(getattr(sampler, "greedy", False))
        if mode == "on" and not greedy:
            raise ValueError("speculative decoding reproduces greedy decoding: it needs temperature 0")
        if greedy and (mode == "on" or model.has_mtp):
            yield from speculative_generate_step(model, prompt_ids, sampler=sampler, processors=processors,
                                                 max_tokens=max_tokens, k=spec_k, mode=mode, cache=cache,
                                                 stats=spec_stats)
            return
    cache = cache if cache is not None else model.new_cache()
    seen: list[int] = list(prompt_ids)
    logits = model.prefill(prompt_ids, cache)[-1]
    n = 0
    while max_tokens < 0 or n < max_tokens:
        for proc in processors:
            logits = proc(logits, seen)
        token = sampler(logits)
        yield token, logits
        seen.append(token)
        n += 1
        if max_tokens >= 0 and n >= max_tokens:
            return
        logits = model.forward([token], cache)[-1]


def prompt_ids_for(model, prompt, *, raw: bool = False, system: str | None = None, thinking: bool | None = None,
                   tools: list | None = None) -> list[int]:
    """Token ids for a prompt: ids as given, raw text, or a chat (string or messages) through the template."""
    if isinstance(prompt, (list, tuple)) and (not prompt or isinstance(prompt[0], (int, np.integer))):
        return [int(t) for t in prompt]
    tok = model.tokenizer
    if raw and isinstance(prompt, str):
        return tok.encode(prompt, add_special_tokens=True)
    from .chat import chat_ids

    messages = list(prompt) if not isinstance(prompt, str) else [{"role": "user", "content": prompt}]
    if system is not None:
        messages = [{"role": "system", "content": system}] + messages
    bundle = model.file.chat_config
    template = bundle.chat_template if bundle is not None else None
    return chat_ids(tok, template, messages, tools=tools, thinking=thinking)


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def stream_generate(model, prompt, *, max_tokens: int = 256, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, min_p: float = 0.0, repetition_penalty: float | None = None,
                    presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                    logit_bias: dict | None = None, seed: int | None = None, stop: Sequence[str] | str | None = None,
                    raw: bool = False, system: str | None = None, thinking: bool | None = None,
                    tools: list | None = None, ignore_eos: bool = False,
                    on_token: Callable[[int, np.ndarray], None] | None = None, spec: str | bool = "off",
                    spec_k: int = 3) -> Iterator[GenerationResponse]:
    """Yield text deltas; the last response carries ``finish_reason`` ("stop" or "length").

    The rates leave out the time spent compiling kernels (``compile_seconds``): they measure the
    model, not numba's first run. Callers that want them measured without any compile in the
    timed span warm the kernels first (``cmf run`` does).

    ``spec``/``spec_k``: MTP speculative decoding (see :func:`generate_step`); responses carry its
    counters (``spec_rounds``, ``spec_drafted``, ``spec_accepted``, ``acceptance_rate``).

    ``on_token(token, logits)`` is called for every sampled token (EOS included) with the processed
    logits it was drawn from, before its text is emitted: the server computes logprobs there, and
    an exception raised by it stops the generation (how a disconnected client cancels its work).
    """
    ids = prompt_ids_for(model, prompt, raw=raw, system=system, thinking=thinking, tools=tools)
    if not ids:
        raise ValueError("the prompt is empty")
    tok = model.tokenizer
    sampler = make_sampler(temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    procs = make_logits_processors(repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                                   frequency_penalty=frequency_penalty, logit_bias=logit_bias)
    stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
    hold = max((len(s) for s in stops), default=1) - 1  # chars kept back while a stop string may be forming
    decoder = tok.stream_decoder()
    install_compile_timer()
    c0 = compile_totals().seconds
    t0 = time.perf_counter()
    t_first = c_first = None
    text_so_far, emitted = "", 0
    n = 0

    def response(text: str, token: int | None, finish: str | None) -> GenerationResponse:
        now = time.perf_counter()
        c_now = compile_totals().seconds
        c_pre = (c_now if c_first is None else c_first) - c0
        c_dec = 0.0 if c_first is None else c_now - c_first
        pre = (t_first or now) - t0
        dec = now - (t_first or now) - c_dec
        return GenerationResponse(text, token, finish, len(ids), n,
                                  len(ids) / (pre - c_pre) if pre - c_pre > 0 else 0.0,
                                  (n - 1) / dec if dec > 0 and n > 1 else 0.0, _peak_mb(), pre,
                                  stats.rounds, stats.drafted, stats.accepted, c_pre + c_dec)

    finish = "length"
    stats = SpecStats()
    steps = generate_step(model, ids, sampler=sampler, processors=procs, max_tokens=max_tokens, spec=spec,
                          spec_k=spec_k, spec_stats=stats)
    for token, logits in steps:
        if t_first is None:
            t_first, c_first = time.perf_counter(), compile_totals().seconds
        n += 1
        if on_token is not None:
            on_token(token, logits)
        if token in tok.eos_ids and not ignore_eos:
            finish = "stop"
            break
        text_so_far += decoder.step(token)
        if stops:
            cut = min((i for i in (text_so_far.find(s) for s in stops) if i >= 0), default=-1)
            if cut >= 0:
                if cut > emitted:
                    yield response(text_so_far[emitted:cut], token, None)
                emitted = cut
                finish = "stop"
                break
            safe = max(emitted, len(text_so_far) - hold)
        else:
            safe = len(text_so_far)
        if safe > emitted:
            yield response(text_so_far[emitted:safe], token, None)
            emitted = safe
    if finish == "length" and emitted < len(text_so_far):
        yield response(text_so_far[emitted:], None, None)
    yield response("", None, finish)


def generate(model, prompt, **kwargs) -> str:
    """The whole generated text."""
    return "".join(r.text for r in stream_generate(model, prompt, **kwargs))
