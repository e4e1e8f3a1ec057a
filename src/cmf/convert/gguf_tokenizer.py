"""GGUF vocabulary ↔ Hugging Face tokenizer.json (byte-level BPE, the `gpt2` GGUF tokenizer model).

The split of text into words before BPE is not stored in a GGUF, only named
(``tokenizer.ggml.pre``); :mod:`cmf.convert.gguf_pretok` maps every name llama.cpp knows to the
Hugging Face pre-tokenizer it stands for. The synthesized tokenizer.json records the name under
``pre_tokenizer.gguf_pre`` (readers ignore the key) so that GGUF export writes it back.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from .gguf_pretok import build, pre_name, split_for
from .gguf_scan import GgufError

log = logging.getLogger(__name__)

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5
PRE_KEY = "gguf_pre"  # where a synthesized tokenizer.json keeps the GGUF's tokenizer.ggml.pre


def tokenizer_json_from_gguf(meta: dict[str, Any]) -> str:
    """Synthesize tokenizer.json from ``tokenizer.ggml.*`` metadata (byte-level BPE only)."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GgufError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2'); "
                        f"pass a tokenizer.json with --tokenizer")
    tokens: list[str] = _list_of(meta, "tokens", str, [])
    merges: list[str] = _list_of(meta, "merges", str, [])
    types: list[int] = _list_of(meta, "token_type", int, [TOKEN_NORMAL] * len(tokens))
    if not tokens or len(types) != len(tokens):
        raise GgufError("GGUF vocabulary is empty or its token_type list has the wrong length")
    try:
        return _synthesize(meta, tokens, merges, types)
    except GgufError:
        raise
    except BaseException as exc:  # noqa: BLE001 - see below
        # Found by fuzzing: the tokenizers library refuses a vocabulary it cannot build (a merge of
        # tokens absent after duplicates collapse, a special token with a space) with a bare
        # Exception or ValueError, and a Rust panic arrives as pyo3's PanicException, a BaseException.
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit, MemoryError)):
            raise
        raise GgufError(f"GGUF vocabulary cannot be built into a tokenizer: {str(exc)[:200] or type(exc).__name__}"
                        ) from None


def _list_of(meta: dict[str, Any], key: str, kind: type, default: list) -> list:
    """``tokenizer.ggml.{key}`` as a list whose items are all ``kind`` (GgufError otherwise)."""
    v = meta.get(f"tokenizer.ggml.{key}")
    if v is None:
        return default
    if not isinstance(v, list) or not all(isinstance(x, kind) and not isinstance(x, bool) for x in v):
        raise GgufError(f"GGUF metadata tokenizer.ggml.{key} is not a list of {kind.__name__}s")
    return v


def _synthesize(meta: dict[str, Any], tokens: list[str], merges: list[str], types: list[int]) -> str:
    """The tokenizer.json of checked token, merge and type lists (the library may still refuse them)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise GgufError(f"GGUF merge {m[:40]!r} is not 'left right'")
        pairs.append((a, b))
    name, split = split_for(meta.get("tokenizer.ggml.pre"))  # raises for a name we cannot honour
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=split.ignore_merges))
    normalizer, pre = build(split)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=(ty == TOKEN_CONTROL), normalized=False)
                for t, ty in zip(tokens, types) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    if specials:
        tok.add_tokens(specials)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if not isinstance(bos, int) or isinstance(bos, bool):
        bos = None  # absent, or not a token id: no BOS template
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None and 0 <= bos < len(tokens):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    data = json.loads(tok.to_str())
    data["pre_tokenizer"][PRE_KEY] = name
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def gguf_vocab_from_tokenizer_json(data: bytes | str, n_vocab: int = 0, prefer: str | None = None) -> dict[str, Any]:
    """tokens, merges, token types and pre-tokenizer name for GGUF export from a tokenizer.json.

    The list is padded with unused ``[PADi]`` entries up to ``n_vocab`` (the embedding rows):
    llama.cpp requires one token per embedding row. The pre-tokenizer name is the table entry
    whose split equals the tokenizer.json's; among names sharing it, ``prefer`` or the name an
    imported file recorded wins (see :func:`cmf.convert.gguf_pretok.pre_name`).
    """
    tj = json.loads(data)
    model = tj.get("model") or {}
    if model.get("type") != "BPE":
        raise GgufError(f"GGUF export supports BPE tokenizers only, this one is {model.get('type')!r}")
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {a["content"]: a for a in tj.get("added_tokens") or []}
    for a in added.values():
        vocab.setdefault(a["content"], a["id"])
    n = max(max(vocab.values()) + 1 if vocab else 0, n_vocab)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [TOKEN_UNUSED] * n  # for holes
    for t, i in vocab.items():
        tokens[i] = t
        a = added.get(t)
        types[i] = TOKEN_NORMAL if a is None else (TOKEN_CONTROL if a.get("special") else TOKEN_USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    pre_tok = tj.get("pre_tokenizer")
    recorded = pre_tok.get(PRE_KEY) if isinstance(pre_tok, dict) else None
    pre = pre_name(tj, prefer=prefer or recorded)
    post = json.dumps(tj.get("post_processor") or {})
    return {"tokens": tokens, "types": types, "merges": merges, "pre": pre, "add_bos": "TemplateProcessing" in post}


def check_tokenizer_vocab(data: str | bytes, meta: dict[str, Any], source: str) -> None:
    """Refuse a tokenizer.json (``--tokenizer``) whose ids do not spell the GGUF's tokens."""
    try:
        tj = json.loads(data)
    except ValueError as exc:
        raise GgufError(f"{source}: not a tokenizer.json ({exc})") from None
    if not isinstance(tj, dict):
        raise GgufError(f"{source}: not a tokenizer.json object")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise GgufError(f"{source}: the GGUF has no tokenizer.ggml.tokens to check it against")
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    vocab = (tj.get("model") or {}).get("vocab")
    ids: dict[int, str] = {}
    if isinstance(vocab, dict):
        ids = {i: t for t, i in vocab.items() if isinstance(i, int)}
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs in id order
        ids = {i: e[0] for i, e in enumerate(vocab) if isinstance(e, list) and e}
    for a in tj.get("added_tokens") or []:
        if isinstance(a, dict) and isinstance(a.get("id"), int):
            ids[a["id"]] = a.get("content")
    bad = []
    for i, t in enumerate(tokens):
        have = ids.get(i)
        if have == t:
            continue
        kind = types[i] if i < len(types) else TOKEN_NORMAL
        if have is None and (kind == TOKEN_UNUSED or t == f"[PAD{i}]"):
            continue  # llama.cpp's converter fills embedding rows without a token with [PADi]
        if have is not None and kind == TOKEN_USER_DEFINED and have.replace("\u2581", " ") == t:
            continue  # the converter writes user-defined tokens with spaces for U+2581 (Gemma)
        bad.append((i, t, have))
    extra = sorted(i for i in ids if i >= len(tokens))
    if bad or extra:
        parts = []
        if bad:
            i, t, have = bad[0]
            parts.append(f"{len(bad)} of the GGUF's {len(tokens)} token ids differ (first: id {i} is {t!r} in the "
                         f"GGUF, {have!r} in the tokenizer.json)")
        if extra:
            parts.append(f"{len(extra)} ids from {extra[0]} on are beyond the GGUF's vocabulary")
        raise GgufError(f"{source}: vocabulary does not match the GGUF: {'; '.join(parts)}")
