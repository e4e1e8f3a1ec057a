"""Tokenizer files -> the vocab section and the chat bundle (spec §6, REFERENCE_NOTES §1.15).

The vocab section is ``tokenizer.json`` byte for byte. The chat bundle (``header.tokenizer_config``)
takes the template from a non-blank ``chat_template.jinja`` (transformers 5 writes it there), else
``chat_template.json``, else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
named templates: "default" wins). Stop ids are the generation config's ``eos_token_id`` (int or
list; config.json's when there is no generation config) plus the id of tokenizer_config's
``eos_token`` — the union the reference Python writer takes, so a chat model whose generation
config names only ``<|endoftext|>`` still stops at ``<|im_end|>``. bos/pad come from the
generation config, else config.json. The block is omitted when there is neither a template nor
a stop id.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConvertError

log = logging.getLogger(__name__)

_U32 = 2**32


@dataclass
class TokenizerFiles:
    """What the tokenizer files of a checkpoint contribute to a CMF file."""

    tokenizer_json: bytes | None
    bundle: dict[str, Any] | None
    tokenizer_config: dict[str, Any] | None  # trimmed copy for provenance (export restores it)
    generation_config: dict[str, Any] | None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConvertError(f"{path}: not readable JSON ({exc})") from None


def _ids(value: Any, what: str) -> list[int]:
    vals = value if isinstance(value, list) else [value]
    out = []
    for v in vals:
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < _U32:
            log.warning("ignoring %s %r: not a token id", what, v)
            continue
        out.append(v)
    return out


def _one_id(value: Any, what: str) -> int | None:
    ids = _ids(value, what)
    return ids[0] if ids else None


def token_content(tok: Any) -> str | None:
    """The text of a tokenizer_config special token (a string or an AddedToken-style dict)."""
    if isinstance(tok, str):
        return tok
    if isinstance(tok, dict) and isinstance(tok.get("content"), str):
        return tok["content"]
    return None


def token_id(tokenizer: dict[str, Any] | None, content: str) -> int | None:
    """Id of ``content`` in a parsed tokenizer.json: added tokens first, then the model vocab."""
    if not tokenizer:
        return None
    for t in tokenizer.get("added_tokens") or []:
        if isinstance(t, dict) and t.get("content") == content and isinstance(t.get("id"), int):
            return t["id"]
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(content), int):
        return vocab[content]
    return None


def _template(folder: Path, tok_cfg: dict[str, Any] | None) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        text = jinja.read_text(encoding="utf-8")
        if text.strip():
            return text
    cj = folder / "chat_template.json"
    if cj.is_file():
        data = _read_json(cj)
        if isinstance(data, dict) and isinstance(data.get("chat_template"), str) and data["chat_template"].strip():
            return data["chat_template"]
    t = (tok_cfg or {}).get("chat_template")
    if isinstance(t, str) and t.strip():
        return t
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        pick = named.get("default") or next((v for v in named.values() if isinstance(v, str)), None)
        if isinstance(pick, str) and pick.strip():
            return pick
    return None


def read_tokenizer(folder: Path, config: dict[str, Any], text_config: dict[str, Any]) -> TokenizerFiles:
    """Read tokenizer.json, tokenizer_config.json, chat templates and generation_config.json."""
    tj_path = folder / "tokenizer.json"
    tj_bytes = tj_path.read_bytes() if tj_path.is_file() else None
    parsed = None
    if tj_bytes is not None:
        try:
            parsed = json.loads(tj_bytes.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ConvertError(f"{tj_path}: not valid UTF-8 JSON ({exc})") from None
        if not isinstance(parsed, dict):
            raise ConvertError(f"{tj_path}: not a tokenizer.json object")
    else:
        log.warning("%s: no tokenizer.json; the model will carry no vocab section", folder)
    tc_path = folder / "tokenizer_config.json"
    tok_cfg = _read_json(tc_path) if tc_path.is_file() else None
    if tok_cfg is not None and not isinstance(tok_cfg, dict):
        raise ConvertError(f"{tc_path}: not a JSON object")
    gc_path = folder / "generation_config.json"
    gen = _read_json(gc_path) if gc_path.is_file() else None
    if gen is not None and not isinstance(gen, dict):
        raise ConvertError(f"{gc_path}: not a JSON object")

    def from_config(key: str) -> Any:
        return text_config.get(key) if text_config.get(key) is not None else config.get(key)

    eos: list[int] = []
    if gen is not None and gen.get("eos_token_id") is not None:
        eos += _ids(gen["eos_token_id"], "eos_token_id")
    else:
        eos += _ids(from_config("eos_token_id"), "eos_token_id")
    eos_text = token_content((tok_cfg or {}).get("eos_token"))
    if eos_text is not None:
        tid = token_id(parsed, eos_text)
        if tid is not None:
            eos.append(tid)
    eos = list(dict.fromkeys(eos))
    bos = _one_id(gen.get("bos_token_id") if gen and gen.get("bos_token_id") is not None
                  else from_config("bos_token_id"), "bos_token_id")
    pad = _one_id(gen.get("pad_token_id") if gen and gen.get("pad_token_id") is not None
                  else from_config("pad_token_id"), "pad_token_id")
    template = _template(folder, tok_cfg)
    bundle = None
    if template is not None or eos:
        bundle = {"chat_template": template, "eos_token_ids": eos, "bos_token_id": bos, "pad_token_id": pad}
    trimmed = None
    if tok_cfg is not None:
        # The added-token table is large and already in tokenizer.json; the template is in the bundle.
        trimmed = {k: v for k, v in tok_cfg.items() if k not in ("added_tokens_decoder", "chat_template")}
    return TokenizerFiles(tj_bytes, bundle, trimmed, gen)
