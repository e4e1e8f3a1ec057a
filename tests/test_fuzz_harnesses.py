"""The coverage-guided fuzz harnesses (benchmarks/fuzz/harnesses.py) run here without atheris:
each on its seed corpus and on deterministic mutations of it, so a harness that breaks (or a
surface that starts raising an untyped error on its seeds) fails the suite, not only a campaign.
Findings of a campaign get their regression test in this file or tests/test_malformed.py.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks" / "fuzz"), str(ROOT / "benchmarks")]

import harnesses as H  # noqa: E402


def mutations(seed: bytes, n: int, rng: random.Random) -> list[bytes]:
    out = []
    for _ in range(n):
        b = bytearray(seed)
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            if op < 0.5 and b:
                b[rng.randrange(len(b))] = rng.randrange(256)
            elif op < 0.7 and b:
                i = rng.randrange(len(b))
                del b[i:i + rng.randint(1, 64)]
            elif op < 0.85:
                b[rng.randrange(len(b) + 1):0] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
            elif b:
                b = b[: rng.randrange(len(b))]
        out.append(bytes(b))
    return out


@pytest.mark.parametrize("name", sorted(H.HARNESSES))
def test_harness_on_seeds_and_mutations(name: str, tmp_path: Path) -> None:
    make, one = H.HARNESSES[name]
    seeds = make(tmp_path)
    assert seeds, f"{name}: no seed"
    rng = random.Random(28)
    for s in seeds:
        one(s)  # a seed is valid input: it must pass without a finding
    for s in seeds[:3]:
        for m in mutations(s, 15, rng):
            one(m)


def test_harness_table_matches_the_campaign() -> None:
    import fuzz_campaign

    assert set(fuzz_campaign.HARNESS_NAMES) == set(H.HARNESSES)


# ----------------------------------------------------------------------------------- findings
# The tokenizer harness's first minutes: the tokenizers library raised a bare Exception on a
# malformed tokenizer.json, and one it accepted could fail at its first encode — a bare
# Exception (a WordLevel vocab without its unk token) or a Rust panic, pyo3's PanicException,
# which is not even an Exception. Each is now a TokenizerError (a CmfError), at load.

_PANIC = (b'{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"pre_tokenizer":{"type":"ByteLevel",'
          b'"add_prefix_space":false,"trim_offsets":true,"use_regex":true},"post_processor":{"type":'
          b'"TemplateProcessing","single":[{"SpecialToken":{"id":"<s{","type_id":0}},{"Sequence":{"id":"A",'
          b'"type_id":0}}],"pair":[{"Sequence":{"id":"A","type_id":0}},{"Sequence":{"id":"B","type_id":1}}],'
          b'"special_tokens":{"<s>":{"id":"<s>","ids":[0],"tokens":["<s>"]}}},"decoder":null,"model":{"type":"BPE",'
          b'"dropout":null,"unk_token":null,"continuing_subword_prefix":null,"end_of_word_suffix":null,'
          b'"fuse_unk":false,"byte_fallback":false,"ignore_merges":false,"vocab":{"<s>":0,"</s>":1,"a":2,"b":3,'
          b'"ab":4,"\xc4\xa0":5},"merges":[["a","b"]]}}')
_NO_UNK = (b'{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,'
           b'"pre_tokenizer":null,"post_processor":null,"decoder":null,"model":{"type":"WordLevel",'
           b'"vocab":{"hi":0,"there":1},"unk_token":"[UNK]"}}')


@pytest.mark.parametrize("data, what", [
    (b"", "not a valid tokenizer"),
    (b"{", "not a valid tokenizer"),
    (b"\xff\xfe{}", "not UTF-8"),
    (_NO_UNK, "cannot encode"),
    (_PANIC, "cannot encode"),
])
def test_tokenizer_findings_are_typed_at_load(data: bytes, what: str) -> None:
    from cmf.format.errors import CmfError
    from cmf.runtime.tokenizer import TokenizerError, tokenizer_from_json

    with pytest.raises(TokenizerError, match=what) as ei:
        tokenizer_from_json(data)
    assert isinstance(ei.value, CmfError)
    H.tokenizer_one(data)  # and the harness passes it


def test_broken_vocab_section_is_a_typed_error(tmp_path: Path) -> None:
    import cmf
    from cmf.runtime.tokenizer import TokenizerError, load_tokenizer

    sys.path.insert(0, str(ROOT / "tests"))
    from _builders import write_sample

    path = tmp_path / "m.cmf"
    write_sample(path, vocab=False)
    from cmf.format.growth import append

    append(path, vocab=_PANIC)
    with cmf.open(path) as f, pytest.raises(TokenizerError, match="embedded tokenizer.json builds but cannot encode"):
        load_tokenizer(f)
