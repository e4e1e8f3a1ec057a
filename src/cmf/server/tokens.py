"""Token text for log-probabilities: each token's exact bytes, and the logprob entries themselves."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from .responses import TokenLogprob

MAX_CACHED = 1 << 18  # token texts kept (a vocabulary's worth for most models)


def _byte_level_table() -> dict[str, int]:
    """The inverse of the byte → printable-character map of byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, NBSP,
    soft hyphen) are shifted, in byte order, to U+0100 onwards.
    """
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    inv: dict[str, int] = {}
    shift = 0
    for b in range(256):
        if b in keep:
            inv[chr(b)] = b
        else:
            inv[chr(0x100 + shift)] = b
            shift += 1
    return inv


_BYTE_LEVEL_INV = _byte_level_table()


def _vocab_kind(tok: Any) -> tuple[bool, set[int]]:
    """(whether the tokenizer's decoder is byte-level, the ids of its added tokens)."""
    if tok.backend is None:
        return False, set()
    try:
        spec = json.loads(tok.backend.to_str())
    except (ValueError, AttributeError):
        return False, set()
    dec = spec.get("decoder") or {}
    kinds = [d.get("type") for d in dec.get("decoders", [])] if dec.get("type") == "Sequence" else [dec.get("type")]
    added = {int(a["id"]) for a in spec.get("added_tokens") or () if isinstance(a, dict) and "id" in a}
    return "ByteLevel" in kinds, added


class TokenText:
    """A token's text and bytes (cached), and logprob entries built from processed logits."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        self._byte_level, self._added = _vocab_kind(tokenizer)

    def token(self, tid: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token."""
        hit = self._cache.get(tid)
        if hit is None:
            raw = self._bytes_of(tid)
            hit = (raw.decode("utf-8", errors="replace"), list(raw))
            if len(self._cache) < MAX_CACHED:
                self._cache[tid] = hit
        return hit

    def _bytes_of(self, tid: int) -> bytes:
        # A token may hold part of a UTF-8 character, which decode() turns into U+FFFD; logprobs
        # promise the real bytes, so read them off the vocabulary where its encoding is known.
        tok = self.tokenizer
        if tok.backend is None:
            return bytes([tid]) if tid < 256 else b""
        piece = tok.id_to_token(tid)
        if piece is not None:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # byte fallback
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            if self._byte_level and tid not in self._added:
                try:
                    return bytes(_BYTE_LEVEL_INV[c] for c in piece)
                except KeyError:
                    pass
        return tok.decode([tid], skip_special_tokens=False).encode("utf-8")

    def logprob(self, token: int, logits: np.ndarray, top: int) -> TokenLogprob:
        """The entry of ``token`` drawn from ``logits`` (after bias and penalties, before
        temperature, as OpenAI reports them), with the ``top`` most likely alternatives."""
        x = logits.astype(np.float64, copy=False)
        m = float(x.max())
        lse = m + float(np.log(np.exp(x - m).sum()))
        text, raw = self.token(token)
        alts: list[tuple[str, float, list[int]]] = []
        if top:
            k = min(top, x.size)
            idx = np.argpartition(-x, k - 1)[:k]
            idx = idx[np.lexsort((idx, -x[idx]))]  # highest first, lower id on ties
            for i in idx:
                t, b = self.token(int(i))
                alts.append((t, float(x[i]) - lse, b))
        return TokenLogprob(text, float(x[token]) - lse, raw, alts)
