"""Chat templates: the file's jinja2 template in a sandbox with Hugging Face semantics, or ChatML.

Rendering follows transformers' ``apply_chat_template``: an immutable sandbox, trim_blocks and
lstrip_blocks, loop controls, ``tojson``, ``raise_exception``, ``strftime_now``, the
``{% generation %}`` tag, and the context variables ``messages``, ``add_generation_prompt``,
``tools``, ``bos_token``/``eos_token`` and ``enable_thinking`` (only when set).
The sandbox's bounds on size, allocation, output and time are in ``chat_sandbox``.
Without a template (or when rendering fails) the ChatML fallback of REFERENCE_NOTES §1.15 builds
the ids directly.
"""

from __future__ import annotations

import datetime
import json
import logging
from functools import lru_cache
from typing import Any, Sequence

from ..format.errors import CmfError

log = logging.getLogger(__name__)

NO_THINK = "<think>\n\n</think>\n\n"


class ChatTemplateError(CmfError):
    """The template raised (``raise_exception``) or is not valid jinja."""


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2 import nodes
    from jinja2.ext import Extension

    from .chat_sandbox import MAX_TEMPLATE_CHARS, BoundedSandbox, _bounded_filter

    if len(template) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"chat template is {len(template)} characters; the limit is {MAX_TEMPLATE_CHARS}")
    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body unchanged (HF marks assistant spans)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", GenerationTag])
    env.filters["tojson"] = _bounded_filter(_tojson)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(template: str, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                tools: list | None = None, enable_thinking: bool | None = None, bos_token: str | None = None,
                eos_token: str | None = None, **extra: Any) -> str:
    """Render ``messages`` with ``template`` like transformers' apply_chat_template(tokenize=False)."""
    from jinja2 import TemplateError

    ctx: dict[str, Any] = dict(extra)
    ctx.update(messages=list(messages), add_generation_prompt=add_generation_prompt)
    if tools is not None:
        ctx["tools"] = tools
    if enable_thinking is not None:
        ctx["enable_thinking"] = enable_thinking
    if bos_token is not None:
        ctx["bos_token"] = bos_token
    if eos_token is not None:
        ctx["eos_token"] = eos_token
    from .chat_sandbox import render_bounded

    # Output bound: a template's text around the conversation is small; 8 characters of prompt per
    # character of input (messages, tools) plus 1 MiB is far above any real one.
    given = sum(len(str(m.get("content") or "")) for m in ctx["messages"] if isinstance(m, dict))
    given += len(json.dumps(tools, default=str)) if tools else 0
    try:
        return render_bounded(_compile(template), ctx, max_chars=8 * given + (1 << 20))
    except ChatTemplateError:
        raise
    except TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}") from exc
    except RecursionError:  # a macro calling itself
        raise ChatTemplateError("chat template error: recursion too deep") from None
    except Exception as exc:  # noqa: BLE001 - the template is code from the file: any failure is its own
        raise ChatTemplateError(f"chat template error: {type(exc).__name__}: {str(exc)[:200]}") from None


def _insert_no_think(text: str) -> str:
    """After the line holding the last 'assistant', insert an empty think block (REFERENCE_NOTES §1.15)."""
    if "</think>" in text:
        return text
    at = text.rfind("assistant")
    if at < 0:
        return text + NO_THINK
    nl = text.find("\n", at)
    cut = len(text) if nl < 0 else nl + 1
    return text[:cut] + NO_THINK + text[cut:]


def chatml_ids(tok, messages: Sequence[dict], *, thinking: bool | None = None) -> list[int]:
    """The ChatML fallback, assembled from ids exactly as REFERENCE_NOTES §1.15 describes."""
    start = tok.token_to_id("<|im_start|>")
    end = tok.token_to_id("<|im_end|>")
    ids: list[int] = []
    for m in messages:
        if start is not None:
            ids.append(start)
        ids += tok.encode(f"{m['role']}\n{message_text(m)}", add_special_tokens=False)
        if end is not None:
            ids.append(end)
        ids += tok.encode("\n", add_special_tokens=False)
    if start is not None:
        ids.append(start)
    ids += tok.encode("assistant\n", add_special_tokens=False)
    if thinking is False:
        ids += tok.encode(NO_THINK, add_special_tokens=False)
    return ids


def message_text(m: dict) -> str:
    """A message's content as text (string content or a list of text parts)."""
    c = m.get("content")
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type", "text") == "text")
    return str(c)


def chat_ids(tok, template: str | None, messages: Sequence[dict], *, tools: list | None = None,
             thinking: bool | None = None, add_generation_prompt: bool = True) -> list[int]:
    """Prompt ids for a conversation: the file's template if it renders, else the ChatML fallback."""
    if template:
        try:
            bos = tok.id_to_token(tok.bos_id) if tok.bos_id is not None else None
            eos_id = min(tok.eos_ids) if tok.eos_ids else None
            text = render_chat(template, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                               enable_thinking=thinking, bos_token=bos,
                               eos_token=tok.id_to_token(eos_id) if eos_id is not None else None)
            if thinking is False:
                text = _insert_no_think(text)
            return tok.encode(text, add_special_tokens=False)
        except ChatTemplateError as exc:
            log.warning("chat template failed (%s); using the ChatML fallback", exc)
    return chatml_ids(tok, messages, thinking=thinking)
