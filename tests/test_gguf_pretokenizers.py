"""GGUF ``tokenizer.ggml.pre``: every llama.cpp name splits text as llama.cpp's regexes say.

The reference splitter below applies llama.cpp's ``regex_exprs`` for each pre-tokenizer type
(``src/llama-vocab.cpp`` at commit 00ad355e, copied here independently of the module under test)
with Python's ``regex`` module, one regex after the other, each match and each gap between
matches a piece of its own — what llama.cpp's ``unicode_regex_split`` and a Sequence of
``Split(isolated)`` both do. Where llama.cpp rewrote a tokenizer.json regex for ``std::regex``
and kept the original in a comment, the reference uses the original (the model's own split), and
three types follow their Hugging Face file rather than llama.cpp's code (see ``HF_OVERRIDES``).
Pieces are compared as UTF-8 byte strings, after the byte-level mapping.
"""

from __future__ import annotations

import json
import logging
import struct
import unicodedata
from typing import Any, Callable

import numpy as np
import pytest

regex = pytest.importorskip("regex")
pytest.importorskip("tokenizers")

from cmf.convert import gguf_pretok as G  # noqa: E402
from cmf.convert.gguf_scan import GgufError  # noqa: E402
from cmf.convert.gguf_tokenizer import (  # noqa: E402
    PRE_KEY, check_tokenizer_vocab, gguf_vocab_from_tokenizer_json, tokenizer_json_from_gguf)

# --------------------------------------------------------------------------- llama.cpp's tables

# llama_vocab::impl::load: tokenizer.ggml.pre → LLAMA_VOCAB_PRE_TYPE_*
LLAMA_CPP_NAMES: dict[str, list[str]] = {
    "DEFAULT": ["default"],
    "LLAMA3": ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
               "jina-v5-nano"],
    "MINICPM5": ["minicpm5"],
    "DEEPSEEK_LLM": ["deepseek-llm"], "DEEPSEEK_CODER": ["deepseek-coder"], "DEEPSEEK3_LLM": ["deepseek-v3"],
    "SPARK2_5": ["spark2_5"], "YOUTU": ["youtu"], "FALCON": ["falcon"], "MPT": ["mpt"],
    "STARCODER": ["starcoder"],
    "GPT2": ["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
             "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4"],
    "JAIS2": ["jais-2"], "REFACT": ["refact"], "COMMAND_R": ["command-r"],
    "QWEN2": ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], "QWEN35": ["qwen35"],
    "STABLELM2": ["stablelm2"], "OLMO": ["olmo"], "DBRX": ["dbrx"], "SMAUG": ["smaug-bpe"],
    "PORO": ["poro-chat"], "CHATGLM4": ["glm4", "chatglm-bpe"], "VIKING": ["viking"], "JAIS": ["jais"],
    "TEKKEN": ["tekken"], "SMOLLM": ["smollm"], "CODESHELL": ["codeshell"], "BLOOM": ["bloom"],
    "GPT3_FINNISH": ["gpt3-finnish"], "EXAONE": ["exaone"], "EXAONE_MOE": ["exaone-moe"],
    "CHAMELEON": ["chameleon"], "MINERVA": ["minerva-7b"],
    "GPT4O": ["gpt-4o", "llama4", "kanana2", "talkie"], "GRANITE_EMB_MULTI": ["granite-embed-multi-97m"],
    "TINY_AYA": ["tiny_aya", "cohere2moe"], "SUPERBPE": ["superbpe"], "TRILLION": ["trillion"],
    "GRANITE_DOCLING": ["granite-docling"], "BAILINGMOE": ["bailingmoe", "bailingmoe2", "llada-moe"],
    "SEED_CODER": ["seed-coder"], "HUNYUAN": ["hunyuan"], "HUNYUAN_DENSE": ["hunyuan-dense"],
    "HY_V4": ["hy_v4"], "JOYAI_LLM": ["joyai-llm"], "KIMI_K2": ["kimi-k2"], "UFAKZEKA": ["ufakzeka"],
    "GROK_2": ["grok-2"], "AFMOE": ["afmoe"], "LAGUNA": ["laguna"], "MINIMAX_M2": ["minimax-m2"],
    "SOLAR_OPEN": ["solar-open"], "MELLUM2": ["mellum2"],
    # raw-UTF-8 BPE (byte_encode = false): refused, not tabled
    "GEMMA4": ["gemma4", "granite-embed-multi-311m"], "SARVAM_MOE": ["sarvam-moe"], "WHITESPACE": ["whitespace"],
}
NOT_BYTE_LEVEL_TYPES = {"GEMMA4", "SARVAM_MOE", "WHITESPACE"}

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
CI = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
SPELLED = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LLAMA3_SPELLED = LLAMA3.replace(CI, SPELLED, 1)
QWEN2 = CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
UP, LO = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
W = r"[^\r\n\p{L}\p{N}]?"
O200K = (f"{W}{UP}*{LO}+{CI}?|{W}{UP}+{LO}*{CI}?"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PORO = " ?[^(\\s|.,!?…。，、।۔،)]+"
KANA = "[一-龥぀-ゟ゠-ヿ]+"
HANGUL = "[一-龥ࠀ-一가-퟿]+"
DS3 = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
       r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
STARCODER = [r"\p{N}", GPT2]
SAME_AS_QWEN2 = [QWEN2]  # llama.cpp's comment: the original regex from tokenizer.json

BYTELEVEL = object()  # reference step: map pieces to the byte-level alphabet, later regexes see that


def _afmoe_digits(piece: str) -> list[str]:
    """llama.cpp's unicode_regex_split_custom_afmoe: digit runs cut length-mod-3 first, then threes."""
    out, pos = [], 0
    for m in regex.finditer(r"\p{N}+", piece):
        if m.start() > pos:
            out.append(piece[pos:m.start()])
        run, head = m.group(), len(m.group()) % 3
        if head:
            out.append(run[:head])
        out += [run[i:i + 3] for i in range(head, len(run), 3)]
        pos = m.end()
    return out + ([piece[pos:]] if pos < len(piece) else [])


# LLAMA_VOCAB_PRE_TYPE_* → regex_exprs (or the commented original)
LLAMA_CPP_REGEX: dict[str, list[Any]] = {
    "DEFAULT": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "LLAMA3": [LLAMA3],
    "JAIS2": [CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)"
              r"|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)"
              r"|\s{1,2}(?!\S)|\s{1}"],
    "DBRX": [LLAMA3_SPELLED], "SMAUG": [LLAMA3_SPELLED], "CHATGLM4": [LLAMA3_SPELLED],
    "DEEPSEEK_LLM": ["[\r\n]", G.DEEPSEEK_LETTERS, "\\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", HANGUL, r"\p{N}+"],
    "DEEPSEEK3_LLM": [r"\p{N}{1,3}", KANA, DS3],
    "SPARK2_5": [r"\p{N}{1,3}", KANA,
                 r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                 r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}"],
    "YOUTU": ["[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
              f"{W}{UP}*{LO}+{SPELLED}?|{W}{UP}+{LO}*{SPELLED}?"
              r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "DEEPSEEK_CODER": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", HANGUL, r"\p{N}"],
    "FALCON": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"],
    "STARCODER": STARCODER, "REFACT": STARCODER, "COMMAND_R": STARCODER, "SMOLLM": STARCODER,
    "CODESHELL": STARCODER, "EXAONE": STARCODER, "MINERVA": STARCODER, "MELLUM2": STARCODER,
    "GPT2": [GPT2], "MPT": [GPT2], "OLMO": [GPT2], "JAIS": [GPT2], "TRILLION": [GPT2], "GRANITE_DOCLING": [GPT2],
    "STABLELM2": SAME_AS_QWEN2, "QWEN2": SAME_AS_QWEN2, "HUNYUAN": SAME_AS_QWEN2, "SOLAR_OPEN": SAME_AS_QWEN2,
    "QWEN35": [CI + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+"],
    "PORO": [PORO], "BLOOM": [PORO], "GPT3_FINNISH": [PORO],
    "VIKING": [PORO, r"\p{N}"],
    "TEKKEN": [f"{W}{UP}*{LO}+|{W}{UP}+{LO}*" r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "CHAMELEON": [r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
                  r"[\p{P}!-/:-@\[-`{-~]", GPT2],
    "GPT4O": [O200K], "MINIMAX_M2": [O200K],
    "GRANITE_EMB_MULTI": [r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + SPELLED
                          + r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*"
                          + SPELLED + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "TINY_AYA": [r"\d{1,3}(?=(?:\d{3})*\b)", O200K],
    "SUPERBPE": [r"\p{N}+", r"(?=(\d{3})+(?!\d))"],
    "BAILINGMOE": [r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]"
                   r"|\s+(?!\S)|\s+"],
    "SEED_CODER": [CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "UFAKZEKA": [r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "GROK_2": SAME_AS_QWEN2,
    "HUNYUAN_DENSE": [r"\p{N}{1,3}", KANA, DS3], "JOYAI_LLM": [r"\p{N}{1,3}", KANA, DS3],
    "HY_V4": [r"\p{N}{1,3}", KANA, DS3],
    "AFMOE": [_afmoe_digits, G.AFMOE_CJK, DS3],
    "LAGUNA": [r"[^\n]+|[\n]+", QWEN2.replace(CI, SPELLED, 1)],
    "EXAONE_MOE": [CI + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
                   r"|\s*[\r\n]|\s+(?!\S)|\s+"],
    "MINICPM5": [r"\p{N}{1,3}",
                 CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    # Kimi-K2: llama.cpp splits in code; its comment keeps tokenization_kimi.py's pat_str (V1: &&)
    "KIMI_K2": ["(?V1)[\\p{Han}]+|" + W + r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}"
                r"&&[^\p{Han}]]+" + CI + "?|" + W + r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}"
                r"\p{Lo}\p{M}&&[^\p{Han}]]*" + CI + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}
# The Hugging Face file, not llama.cpp's code: tiiuae/falcon-7b runs Digits(individual_digits=false)
# after ByteLevel, on the byte-level text (its tokenizer.json, quoted in llama.cpp issue #3502);
# llama.cpp leaves Digits out, which only its vocabulary (no "Ġ3"-style merges) makes harmless.
HF_OVERRIDES: dict[str, list[Any]] = {
    "FALCON": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, BYTELEVEL, r"\p{N}+", r"[0-9][0-9][0-9]"],
}

TEXT = "\n".join([
    " ".join("".join(str((n + k) % 10) for k in range(n)) for n in range(1, 13)) + " 3.14159 1,000,000 x=42;",
    "v2 2024-01-01 ½ ² ١٢٣ ٣٤٥ १२३ १२३४ １２３４ 33333 333333 3333333",
    "def f(x):\n    if x > 0:\n\treturn x ** 2  # square\n    return -x\r\n",
    "!!! ??? ... --- === ((())) {}[] <<>> ''' \"\"\" ``` ~~~ $$$ %% ^^ && || ;; @#$%^&*() ---======= ......",
    "a  b   c\t\td\n\ne\r\nf \n g\u3000h\u00a0i  \n\n   \t \t\t \t\n  \n   \n    \n     ",
    "I'm you're he's she'd we'll they've don't I'M YOU'RE HE'S We'Ve a'lL It'S 'told 'RE 'M 'D",
    "camelCase HTTPServer ÉCOLE Éric naïve café Ǆemal ǅemal",
    "我想在apple工作1314151天～，你好世界。「引用」『二重』【括弧】",
    "こんにちは、世界！カタカナとひらがな漢字 ｶﾀｶﾅ 안녕하세요 세계 ㄱㄴ ㄅㄆ",
    "مرحبا بالعالم، كيف حالك؟ ۔ हिन्दी नमस्ते दुनिया। ভাষা",
    "Привет, мир! нещо на Български Ελληνικά ΐ สวัสดีครับ ກາ កាន់តែពិសេសអាច မြန်မာ",
    "👨‍👩‍👧‍👦 👍🏽 👩🏿‍💻 🏳️‍🌈 🚀 (normal) 😶‍🌫️ ✅ 🦙🦙 🇩🇪",
    "<sentinel:12> IMGIMGABZ <|im_start|>user hi<|im_end|> http://example.com/a/b?c=d",
    "",
])


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character mapping (the byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


ENC = _byte_alphabet()
DEC = {c: b for b, c in ENC.items()}


def reference_split(text: str, steps: list[Any]) -> list[bytes]:
    """Apply the regexes in turn; every match and every gap between matches becomes a piece."""
    pieces, byte_level = [text], False
    for step in steps:
        if step is BYTELEVEL:
            pieces, byte_level = ["".join(ENC[b] for b in p.encode()) for p in pieces], True
            continue
        out: list[str] = []
        for p in pieces:
            if callable(step):
                out += step(p)
                continue
            pos = 0
            for m in regex.finditer(step, p):
                if m.start() > pos:
                    out.append(p[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(p):
                out.append(p[pos:])
        pieces = out
    return [bytes(DEC[c] for c in p) if byte_level else p.encode() for p in pieces]


def our_split(split: G.PreSplit, text: str) -> list[bytes]:
    norm, pre = G.build(split)
    if norm is not None:
        text = norm.normalize_str(text)
    return [bytes(DEC[c] for c in piece) for piece, _ in pre.pre_tokenize_str(text)]


NAME_TYPE = {name: t for t, names in LLAMA_CPP_NAMES.items() for name in names}


# --------------------------------------------------------------------------- the table


def test_table_holds_every_byte_level_llama_cpp_name():
    expected = {n for t, names in LLAMA_CPP_NAMES.items() if t not in NOT_BYTE_LEVEL_TYPES for n in names}
    assert set(G.PRE_TOKENIZERS) == expected
    assert G.NOT_BYTE_LEVEL == {n for t in NOT_BYTE_LEVEL_TYPES for n in LLAMA_CPP_NAMES[t]}
    for t, names in LLAMA_CPP_NAMES.items():  # one llama.cpp type, one split
        if t not in NOT_BYTE_LEVEL_TYPES:
            assert len({G.PRE_TOKENIZERS[n] for n in names}) == 1, t


def test_text_is_nfc():
    # NFC entries normalize first; llama.cpp does not: on NFC text both see the same characters
    assert unicodedata.is_normalized("NFC", TEXT)


@pytest.mark.parametrize("name", sorted(G.PRE_TOKENIZERS))
def test_split_matches_llama_cpp(name):
    t = NAME_TYPE[name]
    want = reference_split(TEXT, HF_OVERRIDES.get(t) or LLAMA_CPP_REGEX[t])
    got = our_split(G.PRE_TOKENIZERS[name], TEXT)
    assert b"".join(got) == TEXT.encode()
    if got != want:
        i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        pytest.fail(f"{name} ({t}): piece {i}: ours {got[max(i - 2, 0):i + 3]} vs llama.cpp "
                    f"{want[max(i - 2, 0):i + 3]}")


def test_adapted_llama_cpp_regexes_agree_on_ascii():
    # the std::regex rewrites llama.cpp uses, next to the originals the table keeps: same on ASCII
    ascii_text = "".join(c for c in TEXT if ord(c) < 128)
    tekken = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])"
              r"([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    pairs = [(LLAMA3_SPELLED, LLAMA3), (tekken, LLAMA_CPP_REGEX["TEKKEN"][0])]
    for adapted, original in pairs:
        assert reference_split(ascii_text, [adapted]) == reference_split(ascii_text, [original])


def test_digit_splits():
    s = G.PRE_TOKENIZERS
    assert our_split(s["smollm"], "12345") == [b"1", b"2", b"3", b"4", b"5"]
    assert our_split(s["llama-bpe"], "1234567") == [b"123", b"456", b"7"]
    assert our_split(s["qwen2"], "12345") == [b"1", b"2", b"3", b"4", b"5"]
    assert our_split(s["gpt-2"], " 12345") == [b" 12345"]
    assert our_split(s["afmoe"], "1234567") == [b"1", b"234", b"567"]
    assert our_split(s["superbpe"], "1234567") == [b"1", b"234", b"567"]
    assert our_split(s["falcon"], " 12345") == [b" ", b"123", b"45"]


def test_nfc_entries_normalize():
    decomposed = "cafe\u0301"
    for name in ("qwen2", "qwen35", "command-r", "mpt"):
        assert our_split(G.PRE_TOKENIZERS[name], decomposed) == ["café".encode()], name
    assert b"".join(our_split(G.PRE_TOKENIZERS["llama-bpe"], decomposed)) == decomposed.encode()


def test_shared_splits_export_their_first_name():
    # the report of which names share a split, and the name export writes without a hint
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, split in G.PRE_TOKENIZERS.items():
        groups.setdefault(G._key_of(split), []).append(name)
    assert len(groups) == 32
    for names in groups.values():
        tj = json.loads(_synth(names[-1]))
        del tj["pre_tokenizer"][PRE_KEY]
        want = next(n for n in names if G.PRE_TOKENIZERS[n].ignore_merges == tj["model"]["ignore_merges"])
        assert G.pre_name(tj) == want


# --------------------------------------------------------------------------- import and export

ALPHABET = [ENC[b] for b in range(256)]


def _meta(pre: Any, extra: tuple[str, ...] | list[str] = (), merges: tuple[str, ...] | list[str] = ()
          ) -> dict[str, Any]:
    tokens = ALPHABET + list(extra) + ["<|endoftext|>"]
    meta: dict[str, Any] = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
                            "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3],
                            "tokenizer.ggml.merges": list(merges)}
    if pre is not None:
        meta["tokenizer.ggml.pre"] = pre
    return meta


def _synth(pre: Any, **kw: Any) -> str:
    return tokenizer_json_from_gguf(_meta(pre, **kw))


def test_unknown_pre_is_an_error_naming_it():
    with pytest.raises(GgufError, match=r"'smollm-9000'.*--tokenizer"):
        _synth("smollm-9000")
    with pytest.raises(GgufError, match=r"'gemma4'.*raw UTF-8"):
        _synth("gemma4")
    with pytest.raises(GgufError, match="not a string"):
        _synth(7)  # type: ignore[arg-type]


def test_missing_pre_is_llama_cpp_default_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="cmf.convert.gguf_pretok"):
        tj = json.loads(_synth(None))
    assert "no tokenizer.ggml.pre" in caplog.text
    assert tj["pre_tokenizer"][PRE_KEY] == "default"
    assert gguf_vocab_from_tokenizer_json(json.dumps(tj))["pre"] == "default"
    assert json.loads(_synth(""))["pre_tokenizer"][PRE_KEY] == "default"


def test_synthesized_tokenizer_splits_digits_for_smollm():
    from tokenizers import Tokenizer

    merges = ["1 2", "12 3", "Ġ 1"]
    for pre, want in (("smollm", ["1", "2", "3", "4", "5"]), ("gpt-2", ["123", "4", "5"])):
        tok = Tokenizer.from_str(_synth(pre, extra=["12", "123", "Ġ1"], merges=merges))
        assert tok.encode("12345").tokens == want, pre


@pytest.mark.parametrize("name", ["smollm", "qwen2", "llama-bpe", "dbrx", "gpt-2", "mpt", "falcon", "kimi-k2",
                                  "megrez", "grok-2", "tekken"])
def test_export_writes_the_imported_name(name):
    data = _synth(name)
    assert gguf_vocab_from_tokenizer_json(data)["pre"] == name
    # without the recorded name, export still finds the split (the group's first name)
    tj = json.loads(data)
    del tj["pre_tokenizer"][PRE_KEY]
    back = gguf_vocab_from_tokenizer_json(json.dumps(tj))["pre"]
    assert G._key_of(G.PRE_TOKENIZERS[back]) == G._key_of(G.PRE_TOKENIZERS[name])


def test_export_matches_hugging_face_files():
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers as P

    def tj(norm: Any, pre: Any, **bpe: Any) -> dict[str, Any]:
        t = Tokenizer(models.BPE(**bpe))
        if norm is not None:
            t.normalizer = norm
        t.pre_tokenizer = pre
        return json.loads(t.to_str())

    smollm2 = tj(None, P.Sequence([P.Digits(individual_digits=True), P.ByteLevel(add_prefix_space=False)]))
    assert gguf_vocab_from_tokenizer_json(json.dumps(smollm2), prefer="smollm")["pre"] == "smollm"
    assert G.pre_name(smollm2) == "starcoder"
    qwen = tj(normalizers.NFC(), P.Sequence([P.Split(Regex(QWEN2), "isolated"),
                                             P.ByteLevel(add_prefix_space=False, use_regex=False)]))
    assert G.pre_name(qwen) == "qwen2"
    llama3 = tj(None, P.Sequence([P.Split(Regex(LLAMA3), "isolated"),
                                  P.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)]),
                ignore_merges=True)
    assert G.pre_name(llama3) == "llama-bpe"
    assert G.pre_name(tj(None, P.ByteLevel(add_prefix_space=False))) == "gpt-2"
    with pytest.raises(GgufError, match="none of the llama.cpp pre-tokenizers"):
        G.pre_name(tj(None, P.ByteLevel(add_prefix_space=True)))


def test_explicit_tokenizer_vocab_is_checked():
    meta = _meta("no-such-pre")
    good = _synth("gpt-2")
    check_tokenizer_vocab(good, meta, "t.json")  # matching ids pass, whatever the pre name
    bad = json.loads(good)
    bad["model"]["vocab"]["Ā"], bad["model"]["vocab"]["ā"] = 1, 0
    with pytest.raises(GgufError, match=r"t\.json: vocabulary does not match.*2 of the GGUF's 257"):
        check_tokenizer_vocab(json.dumps(bad), meta, "t.json")
    with pytest.raises(GgufError, match="not a tokenizer.json"):
        check_tokenizer_vocab("{", meta, "t.json")


# --------------------------------------------------------------------------- a real (tiny) GGUF file


def _write_gguf(path, pre: str | None) -> None:
    gguf = pytest.importorskip("gguf")
    meta = _meta(pre, extra=["12", "123"], merges=["1 2", "12 3"])
    tokens = meta["tokenizer.ggml.tokens"]
    w = gguf.GGUFWriter(str(path), "llama")
    h, ff = 8, 16
    w.add_context_length(32)
    w.add_embedding_length(h)
    w.add_block_count(1)
    w.add_feed_forward_length(ff)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_eos_token_id(len(tokens) - 1)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), h), "output_norm.weight": (h,), "blk.0.attn_norm.weight": (h,),
              "blk.0.attn_q.weight": (h, h), "blk.0.attn_k.weight": (h, h), "blk.0.attn_v.weight": (h, h),
              "blk.0.attn_output.weight": (h, h), "blk.0.ffn_norm.weight": (h,),
              "blk.0.ffn_gate.weight": (ff, h), "blk.0.ffn_up.weight": (ff, h), "blk.0.ffn_down.weight": (h, ff)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_import_refuses_unknown_pre_unless_a_tokenizer_is_given(tmp_path):
    from cmf.convert.gguf import gguf_to_hf

    g = tmp_path / "m.gguf"
    _write_gguf(g, "no-such-pre")
    with pytest.raises(GgufError, match="'no-such-pre'"):
        gguf_to_hf(g, tmp_path / "a")
    explicit = tmp_path / "tokenizer.json"
    explicit.write_text(json.dumps(json.loads(tokenizer_json_from_gguf(
        _meta("gpt-2", extra=["12", "123"], merges=["1 2", "12 3"])))))
    folder = gguf_to_hf(g, tmp_path / "b", tokenizer=explicit)
    assert (folder / "tokenizer.json").read_text() == explicit.read_text()
    other = tmp_path / "other.json"
    other.write_text(_synth("gpt-2"))  # lacks "12", "123": ids shift
    with pytest.raises(GgufError, match="vocabulary does not match"):
        gguf_to_hf(g, tmp_path / "c", tokenizer=other)


def test_import_export_round_trip_of_the_name(tmp_path):
    from tokenizers import Tokenizer

    from cmf.convert.gguf import gguf_to_hf

    for pre in ("smollm", "qwen2"):
        g = tmp_path / f"{pre}.gguf"
        _write_gguf(g, pre)
        folder = gguf_to_hf(g, tmp_path / pre)
        data = (folder / "tokenizer.json").read_text()
        assert gguf_vocab_from_tokenizer_json(data)["pre"] == pre
        assert Tokenizer.from_str(data).encode("12345").tokens == ["1", "2", "3", "4", "5"]
