"""GGUF vocabulary ↔ Hugging Face tokenizer.json (byte-level BPE, the `gpt2` GGUF tokenizer model)."""

from __future__ import annotations

import json
import logging
from typing import Any

from .gguf_scan import GgufError

log = logging.getLogger(__name__)

# tokenizer.ggml.pre → the split regex of the matching Hugging Face pre-tokenizer.
PRE_REGEX = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt-2": r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
}
NFC_PRE = {"qwen2"}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4


def tokenizer_json_from_gguf(meta: dict[str, Any]) -> str:
    """Synthesize tokenizer.json from ``tokenizer.ggml.*`` metadata (byte-level BPE only)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GgufError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE 'gpt2'); "
                        f"pass a tokenizer.json with --tokenizer")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    merges: list[str] = list(meta.get("tokenizer.ggml.merges") or [])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
    if not tokens or len(types) != len(tokens):
        raise GgufError("GGUF vocabulary is empty or its token_type list has the wrong length")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise GgufError(f"GGUF merge {m[:40]!r} is not 'left right'")
        pairs.append((a, b))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False))
    pre = meta.get("tokenizer.ggml.pre") or "gpt-2"
    regex = PRE_REGEX.get(pre)
    if regex is None:
        log.warning("unknown tokenizer.ggml.pre %r: using the GPT-2 split regex", pre)
        regex = PRE_REGEX["gpt-2"]
    if pre in NFC_PRE:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=(ty == TOKEN_CONTROL), normalized=False)
                for t, ty in zip(tokens, types) if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED)]
    if specials:
        tok.add_tokens(specials)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None and 0 <= bos < len(tokens):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str()


def gguf_vocab_from_tokenizer_json(data: bytes | str, n_vocab: int = 0) -> dict[str, Any]:
    """tokens, merges, token types and pre-tokenizer name for GGUF export from a tokenizer.json.

    The list is padded with unused ``[PADi]`` entries up to ``n_vocab`` (the embedding rows):
    llama.cpp requires one token per embedding row.
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
    types = [5] * n  # UNUSED for holes
    for t, i in vocab.items():
        tokens[i] = t
        a = added.get(t)
        types[i] = TOKEN_NORMAL if a is None else (TOKEN_CONTROL if a.get("special") else TOKEN_USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    pre = "gpt-2"
    text = json.dumps(tj.get("pre_tokenizer") or {})
    for name, regex in PRE_REGEX.items():
        if json.dumps(regex)[1:-1] in text:
            pre = name
    post = json.dumps(tj.get("post_processor") or {})
    return {"tokens": tokens, "types": types, "merges": merges, "pre": pre, "add_bos": "TemplateProcessing" in post}
