"""Per-token mask cost of the grammar libraries on a pycmf tokenizer (docs/SERVER.md, structured output).

For each library: build its tokenizer info from a tokenizer.json, compile a JSON schema, then walk
a valid answer token by token, computing the allowed-token mask before each token. Prints compile
time and the mean / p95 mask time per token, and whether the library's mask allowed every token of
the answer (a coverage check).

    .venv/bin/python benchmarks/grammar_masks.py /work/shared/models/base/tokenizer.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

from cmf.server.tokens import _BYTE_LEVEL_INV

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": ({"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                              "days": {"type": "integer", "minimum": 1}},
              "required": ["city", "unit", "days"], "additionalProperties": False},
             {"city": "Paris in the spring", "unit": "c", "days": 3}),
    "nested": ({"type": "object", "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string",
                                                                                     "format": "email"}},
                  "required": ["id"]},
        "score": {"type": "number"}, "kind": {"anyOf": [{"type": "null"}, {"const": "x"}]}},
        "required": ["name", "tags", "owner", "score", "kind"]},
        {"name": "widget", "tags": ["a", "bb", "ccc"], "owner": {"id": 42, "email": "a@b.co"}, "score": -1.5,
         "kind": None}),
}


def _timeit(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_llguidance(tj: str, vocab: int, eos: int, schema: dict, ids: list[int]) -> dict[str, Any]:
    import llguidance as L
    import llguidance.numpy as LN

    t0 = time.perf_counter()
    tok = L.LLTokenizer(tj, n_vocab=vocab, eos_token=eos)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = L.LLMatcher(tok, L.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
    t_comp = time.perf_counter() - t0
    bm = LN.allocate_token_bitmask(1, vocab)
    times, ok = [], True
    for tid in ids + [eos]:
        times.append(_timeit(lambda: LN.fill_next_token_bitmask(m, bm)))
        allowed = np.unpackbits(bm[0].view(np.uint8), bitorder="little")[:vocab].astype(bool)
        ok &= bool(allowed[tid])
        if tid != eos:
            m.consume_token(tid)
    return dict(tok_s=t_tok, compile_s=t_comp, times=times, ok=ok and not m.is_error())


def bench_xgrammar(tj: str, vocab: int, eos: int, schema: dict, ids: list[int]) -> dict[str, Any]:
    import xgrammar as X
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    hf = Tokenizer.from_str(tj)
    enc = [hf.id_to_token(i) or "" for i in range(vocab)]
    info = X.TokenizerInfo(enc, X.VocabType.BYTE_LEVEL, vocab_size=vocab, stop_token_ids=[eos])
    comp = X.GrammarCompiler(info)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    cg = comp.compile_json_schema(json.dumps(schema))
    t_comp = time.perf_counter() - t0
    m = X.GrammarMatcher(cg)
    bm = X.allocate_token_bitmask(1, vocab)
    times, ok = [], True
    for tid in ids + [eos]:
        times.append(_timeit(lambda: m.fill_next_token_bitmask(bm)))
        allowed = np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)
        ok &= bool(allowed[tid])
        if tid != eos:
            ok &= bool(m.accept_token(tid))
    return dict(tok_s=t_tok, compile_s=t_comp, times=times, ok=ok)


def bench_outlines(tj: str, vocab: int, eos: int, schema: dict, ids: list[int]) -> dict[str, Any]:
    import outlines_core as O
    from tokenizers import Tokenizer

    t0 = time.perf_counter()
    hf = Tokenizer.from_str(tj)
    # outlines-core takes the vocabulary as {piece: ids}; byte-level pieces are read as such.
    table: dict[str, list[int]] = {}
    for i in range(vocab):
        if i == eos:
            continue
        piece = hf.id_to_token(i)
        if piece is None:
            continue
        try:  # a byte-level piece stands for bytes: give outlines those bytes
            key: Any = bytes(_BYTE_LEVEL_INV[c] for c in piece)
        except KeyError:
            key = piece
        table.setdefault(key, []).append(i)
    voc = O.Vocabulary(eos, table)
    t_tok = time.perf_counter() - t0
    t0 = time.perf_counter()
    idx = O.Index(O.json_schema.build_regex_from_schema(json.dumps(schema)), voc)
    t_comp = time.perf_counter() - t0
    g = O.Guide(idx)
    times, ok = [], True
    for tid in ids + [eos]:
        got: list = []
        times.append(_timeit(lambda: got.append(g.get_tokens())))
        ok &= tid in set(got[0])
        if tid != eos:
            g.advance(tid)
    return dict(tok_s=t_tok, compile_s=t_comp, times=times, ok=ok)


def main(path: str) -> None:
    from tokenizers import Tokenizer

    tj = open(path, encoding="utf-8").read()
    hf = Tokenizer.from_str(tj)
    vocab = hf.get_vocab_size()
    eos = hf.token_to_id("<|im_end|>") or 0
    for name, (schema, value) in SCHEMAS.items():
        ids = hf.encode(json.dumps(value), add_special_tokens=False).ids
        for lib, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar),
                        ("outlines-core", bench_outlines)):
            try:
                r = fn(tj, vocab, eos, schema, ids)
            except Exception as exc:  # noqa: BLE001 - a library that cannot take the schema is a result
                print(f"{name:7s} {lib:14s} FAILED: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            us = [t * 1e6 for t in r["times"][1:]]  # the first mask warms caches
            p95 = sorted(us)[int(0.95 * (len(us) - 1))]
            print(f"{name:7s} {lib:14s} vocab {vocab} tokenizer {r['tok_s'] * 1e3:7.1f} ms  compile "
                  f"{r['compile_s'] * 1e3:8.1f} ms  mask mean {statistics.mean(us):7.1f} us  p95 {p95:7.1f} us  "
                  f"({len(ids)} tokens) answer allowed: {r['ok']}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/work/shared/models/base/tokenizer.json")
