"""llama.cpp's ``tokenizer.ggml.pre`` names ↔ the Hugging Face split each one stands for.

A GGUF file names its pre-tokenizer (the split of text into words before BPE) instead of storing
it. The names and their regexes come from llama.cpp's ``src/llama-vocab.cpp`` (the name → type
table in ``llama_vocab::impl::load`` and the ``regex_exprs`` of each ``LLAMA_VOCAB_PRE_TYPE_*``,
read at commit 00ad355e); ``convert_hf_to_gguf.py``'s ``get_vocab_base_pre`` says which Hugging
Face repository writes which name. Each entry here is the Hugging Face form of that split:
llama.cpp's regexes as ``Split(isolated)`` steps, except where llama.cpp had to rewrite the
tokenizer.json regex for ``std::regex`` (no ``(?i:)``, no ``\\p{Lu}``): there its comment keeps
the original, and the original is what the model was trained with. Where the Hugging Face
tokenizer is known to use another pre-tokenizer for the same split (``Digits``,
``Punctuation``, ``ByteLevel`` with its GPT-2 regex, an NFC normalizer), that one is used.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from .gguf_scan import GgufError

log = logging.getLogger(__name__)

Step = tuple[str, Any]  # ("split", regex) | ("digits", individual) | ("punct", behavior) | ("bytelevel", use_regex)


@dataclass(frozen=True)
class PreSplit:
    """One split: pre-tokenizer steps, whether text is NFC-normalized first, BPE ``ignore_merges``."""

    steps: tuple[Step, ...]
    nfc: bool = False
    ignore_merges: bool = False  # llama.cpp's flag for the name (whole-word vocabulary hits skip merges)


# tokenizers' ByteLevel(use_regex=True) regex; llama.cpp drops the final \s+, which matches nothing
# the other branches leave (a lone whitespace before a non-space), so the two split alike.
GPT2_HF = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
GPT2_LCPP = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CI = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_CI_SPELLED = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"  # llama.cpp's (?i:) stand-in
LLAMA3 = _CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = _CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN35 = _CI + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
JAIS2 = (_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
         r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
         r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
_UP, _LO = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_W = r"[^\r\n\p{L}\p{N}]?"
TEKKEN = (_W + _UP + "*" + _LO + "+|" + _W + _UP + "+" + _LO + "*"
          + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (_W + _UP + "*" + _LO + "+" + _CI + "?|" + _W + _UP + "+" + _LO + "*" + _CI + "?"
         + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPG, _LOG = r"((?=[\p{L}\p{M}])([^a-z]))", r"((?=[\p{L}\p{M}])([^A-Z]))"  # llama.cpp's own, no original kept
GRANITE_EMB_MULTI = (_W + _UPG + "*" + _LOG + "+" + _CI_SPELLED + "?|" + _W + _UPG + "+" + _LOG + "*"
                     + _CI_SPELLED + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPK, _LOK = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
# Kimi-K2's tiktoken pat_str (llama.cpp implements it by hand and keeps it in a comment)
KIMI_K2 = (r"[\p{Han}]+|" + _W + _UPK + "*" + _LOK + "+" + _CI + "?|" + _W + _UPK + "+" + _LOK + "*" + _CI
           + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
BAILINGMOE = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]"
              r"|\s+(?!\S)|\s+")
SEED_CODER = _CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
EXAONE_MOE = (_CI + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
              r"|\s*[\r\n]|\s+(?!\S)|\s+")
MINICPM5 = _CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
LAGUNA = (_CI_SPELLED + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
YOUTU_CJK = "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a\uff1b\uff0c\u3001-\u303f" \
            "\ufe30-\ufe4f]+|[\u3105-\u312f]+|[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
YOUTU = (_W + _UP + "*" + _LO + "+" + _CI_SPELLED + "?|" + _W + _UP + "+" + _LO + "*" + _CI_SPELLED
         + r"?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_ASCII_PUNCT_WORD = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"""
DEEPSEEK3 = (_ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+")
SPARK2_5 = _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+"
CJK_KANA = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# Character classes copied from llama.cpp as escapes: several of their code points have NFC
# replacements (U+1FD3, U+1F7D, U+2126, U+212A, U+F900...) that an editor or a copy would silently
# substitute, turning ranges inside out. AFMoE's Thai range starts at U+0E40, as llama.cpp has it.
DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+")
DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"
AFMOE_CJK = ("[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f\u2f00-\u2fdf"
             "\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f\ua9e0-\ua9ff\uac00-\ud7af"
             "\u1100-\u11ff]+")
# llama.cpp splits AFMoE digit runs in code (\p{AFMoE_digits}): the first 1-2 digits (length mod 3),
# then groups of three. This regex makes the same cut.
AFMOE_DIGITS = r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
PORO = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"


def _sp(*regexes: str) -> tuple[Step, ...]:
    return tuple(("split", r) for r in regexes)


_BL: Step = ("bytelevel", True)  # ByteLevel with its GPT-2 regex, as GPT-2-style tokenizer.json files have it

# (names, split): the first name of a group is what export writes when nothing says otherwise.
_GROUPS: list[tuple[tuple[str, ...], PreSplit]] = [
    (("default",), PreSplit(_sp(r"[\p{P}\$\+<=>\^~\|]+", GPT2_LCPP, r"\p{N}+", r"[0-9][0-9][0-9]"))),
    (("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
      "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "jais", "trillion",
      "granite-docling"), PreSplit((_BL,))),
    (("mpt", "olmo"), PreSplit((_BL,), nfc=True)),  # GPT-NeoX-20B's tokenizer normalizes NFC
    (("llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
     PreSplit(_sp(LLAMA3), ignore_merges=True)),
    (("dbrx", "smaug-bpe", "glm4", "chatglm-bpe"), PreSplit(_sp(LLAMA3))),
    (("jais-2",), PreSplit(_sp(JAIS2))),
    (("deepseek-llm",), PreSplit(_sp("[\r\n]", DEEPSEEK_LETTERS, DEEPSEEK_PUNCT, r"\s+$", CJK_HANGUL, r"\p{N}+"))),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), PreSplit(_sp(r"\p{N}{1,3}", CJK_KANA, DEEPSEEK3))),
    (("spark2_5",), PreSplit(_sp(r"\p{N}{1,3}", CJK_KANA, SPARK2_5, r"\p{N}"))),
    (("youtu",), PreSplit(_sp(YOUTU_CJK, YOUTU), ignore_merges=True)),
    (("deepseek-coder",), PreSplit(_sp("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", CJK_HANGUL, r"\p{N}"))),
    # tiiuae/falcon-7b: Punctuation, ByteLevel, Digits, Split — Digits and the 3-digit split run on
    # the byte-level text (llama.cpp issue #3502 quotes the file; llama.cpp itself skips Digits)
    (("falcon",), PreSplit((("punct", "contiguous"), _BL, ("digits", False), ("split", r"[0-9][0-9][0-9]")))),
    (("starcoder", "refact", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
     PreSplit((("digits", True), _BL))),
    (("command-r",), PreSplit((("digits", True), _BL), nfc=True)),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), PreSplit(_sp(QWEN2), nfc=True)),
    (("stablelm2", "hunyuan", "solar-open", "grok-2"), PreSplit(_sp(QWEN2))),
    (("qwen35",), PreSplit(_sp(QWEN35), nfc=True)),
    (("poro-chat", "bloom", "gpt3-finnish"), PreSplit(_sp(PORO))),
    (("viking",), PreSplit((("split", PORO), ("digits", True)))),
    (("tekken",), PreSplit(_sp(TEKKEN), ignore_merges=True)),
    (("chameleon",), PreSplit(_sp(r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                                  r"([\t\n]|    |  )", r"\p{N}", r"[\p{P}!-/:-@\[-`{-~]", GPT2_LCPP))),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), PreSplit(_sp(GPT4O))),
    (("granite-embed-multi-97m",), PreSplit(_sp(GRANITE_EMB_MULTI), ignore_merges=True)),
    (("tiny_aya", "cohere2moe"), PreSplit(_sp(r"\d{1,3}(?=(?:\d{3})*\b)", GPT4O))),
    (("kimi-k2",), PreSplit(_sp(KIMI_K2))),
    (("superbpe",), PreSplit(_sp(r"\p{N}+", r"(?=(\d{3})+(?!\d))"))),
    (("bailingmoe", "bailingmoe2", "llada-moe"), PreSplit(_sp(BAILINGMOE))),
    (("seed-coder",), PreSplit(_sp(SEED_CODER))),
    (("ufakzeka",), PreSplit(_sp(UFAKZEKA))),
    (("afmoe",), PreSplit(_sp(AFMOE_DIGITS, AFMOE_CJK, DEEPSEEK3))),
    (("laguna",), PreSplit(_sp(r"[^\n]+|[\n]+", LAGUNA))),
    (("exaone-moe",), PreSplit(_sp(EXAONE_MOE))),
    (("minicpm5",), PreSplit(_sp(r"\p{N}{1,3}", MINICPM5), ignore_merges=True)),
]
PRE_TOKENIZERS: dict[str, PreSplit] = {name: split for names, split in _GROUPS for name in names}
# llama.cpp knows these, but runs BPE on raw UTF-8 (no byte-level alphabet): not a byte-level tokenizer.json
NOT_BYTE_LEVEL = frozenset({"gemma4", "granite-embed-multi-311m", "sarvam-moe", "whitespace"})
MISSING_PRE = "default"  # llama.cpp's pre-tokenizer for a BPE GGUF without the key


def split_for(pre: Any) -> tuple[str, PreSplit]:
    """The name and split for a ``tokenizer.ggml.pre`` value; a typed error for anything else."""
    if pre is None or pre == "":  # llama.cpp treats an empty name as a missing one
        log.warning("GGUF has no tokenizer.ggml.pre: using llama.cpp's 'default' split, as llama.cpp does "
                    "(a file converted before pre-tokenizer names existed; its model may have split otherwise)")
        return MISSING_PRE, PRE_TOKENIZERS[MISSING_PRE]
    if not isinstance(pre, str):
        raise GgufError(f"GGUF tokenizer.ggml.pre is {type(pre).__name__} {pre!r}, not a string")
    if pre in PRE_TOKENIZERS:
        return pre, PRE_TOKENIZERS[pre]
    how = ("pass the model's Hugging Face tokenizer.json with --tokenizer FILE (its vocabulary must match the "
           "GGUF's tokens)")
    if pre in NOT_BYTE_LEVEL:
        raise GgufError(f"GGUF tokenizer.ggml.pre {pre!r} is a llama.cpp pre-tokenizer over raw UTF-8, not "
                        f"byte-level BPE, which is all pycmf synthesizes; {how}")
    raise GgufError(f"GGUF tokenizer.ggml.pre {pre!r} is not one of the {len(PRE_TOKENIZERS)} llama.cpp "
                    f"pre-tokenizer names pycmf knows, and guessing a split would tokenize text differently "
                    f"from the model. To proceed: {how}; or add {pre!r} to PRE_TOKENIZERS in "
                    f"cmf/convert/gguf_pretok.py from llama.cpp's src/llama-vocab.cpp")


def build(split: PreSplit) -> tuple[Any, Any]:
    """(normalizer or None, pre-tokenizer) as ``tokenizers`` objects; ends byte-level in any case."""
    from tokenizers import Regex, normalizers, pre_tokenizers as P

    steps: list[Any] = []
    for kind, arg in split.steps:
        if kind == "split":
            steps.append(P.Split(Regex(arg), behavior="isolated"))
        elif kind == "digits":
            steps.append(P.Digits(individual_digits=arg))
        elif kind == "punct":
            steps.append(P.Punctuation(behavior=arg))
        elif kind == "bytelevel":
            steps.append(P.ByteLevel(add_prefix_space=False, use_regex=arg))
        else:
            raise ValueError(f"unknown pre-tokenizer step {kind!r}")
    if not any(kind == "bytelevel" for kind, _ in split.steps):
        steps.append(P.ByteLevel(add_prefix_space=False, use_regex=False))
    pre = steps[0] if len(steps) == 1 else P.Sequence(steps)
    return (normalizers.NFC() if split.nfc else None), pre


def _steps(node: Any) -> list[tuple[Any, ...]]:
    """A tokenizer.json pre_tokenizer as comparable steps (ByteLevel's own regex spelled out as a Split)."""
    if node is None:
        return []
    if not isinstance(node, dict):
        return [("other", repr(node))]
    kind = node.get("type")
    if kind == "Sequence":
        return [s for child in node.get("pretokenizers") or [] for s in _steps(child)]
    if kind == "Split":
        pattern = node.get("pattern") or {}
        behavior = str(node.get("behavior", "")).lower()
        if "Regex" in pattern:
            return [("split", pattern["Regex"], behavior, bool(node.get("invert", False)))]
        return [("split-string", json.dumps(pattern, sort_keys=True), behavior, bool(node.get("invert", False)))]
    if kind == "Digits":
        return [("digits", bool(node.get("individual_digits", False)))]
    if kind == "Punctuation":
        return [("punct", str(node.get("behavior", "isolated")).lower())]
    if kind == "ByteLevel" and not node.get("add_prefix_space", True):
        mapped: list[tuple[Any, ...]] = [("bytelevel",)]
        return ([("split", GPT2_HF, "isolated", False)] + mapped) if node.get("use_regex", True) else mapped
    return [("other", json.dumps(node, sort_keys=True))]


def _normalizer(node: Any) -> str | None:
    if node is None:
        return None
    if isinstance(node, dict) and node.get("type") == "NFC":
        return "NFC"
    if isinstance(node, dict) and node.get("type") == "Sequence":
        parts = [_normalizer(n) for n in node.get("normalizers") or []]
        parts = [p for p in parts if p is not None]
        return parts[0] if len(parts) == 1 else (None if not parts else json.dumps(parts))
    return json.dumps(node, sort_keys=True)


def split_key(tokenizer_json: dict[str, Any]) -> tuple[Any, ...]:
    """What decides how a tokenizer.json splits text: its normalizer and pre-tokenizer steps."""
    return _normalizer(tokenizer_json.get("normalizer")), tuple(_steps(tokenizer_json.get("pre_tokenizer")))


def _key_of(split: PreSplit) -> tuple[Any, ...]:
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.BPE())
    norm, pre = build(split)
    if norm is not None:
        tok.normalizer = norm
    tok.pre_tokenizer = pre
    return split_key(json.loads(tok.to_str()))


_KEYS: dict[str, tuple[Any, ...]] = {}


def pre_name(tokenizer_json: dict[str, Any], prefer: str | None = None) -> str:
    """The llama.cpp name whose split equals this tokenizer.json's (structurally, by the table).

    Several names share a split; ``prefer`` (the name a file was imported with) wins among them,
    then a name whose ``ignore_merges`` matches the BPE model's, then the group's first name.
    """
    if not _KEYS:
        _KEYS.update({name: _key_of(split) for name, split in PRE_TOKENIZERS.items()})
    key = split_key(tokenizer_json)
    names = [n for n, k in _KEYS.items() if k == key]
    if not names:
        raise GgufError("the tokenizer.json's normalizer/pre-tokenizer is none of the llama.cpp pre-tokenizers "
                        f"pycmf knows ({key[0] or 'no normalizer'}, {len(key[1])} steps); llama.cpp would split "
                        "text differently from the model, so no tokenizer.ggml.pre is written for it")
    if prefer in names:
        return prefer  # type: ignore[return-value]
    ignore = bool((tokenizer_json.get("model") or {}).get("ignore_merges", False))
    return next((n for n in names if PRE_TOKENIZERS[n].ignore_merges == ignore), names[0])
