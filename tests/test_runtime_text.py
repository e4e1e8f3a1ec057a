"""Tokenizer, chat templates, streaming detokenization and samplers against Hugging Face."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cmf.runtime.chat import NO_THINK, chat_ids, chatml_ids, render_chat
from cmf.runtime.sampling import make_logits_processors, make_sampler
from cmf.runtime.tokenizer import tokenizer_from_json

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "conformance"

ADVERSARIAL = [
    "", " ", "hello world", "Hello,  world!\n\nNew paragraph.", "line one\r\nline two\r\n",
    "数据格式与模型 テンソル 한국어", "family: 👨‍👩‍👧‍👦 and flags 🇺🇦🏳️‍🌈", "def f(x):\n\treturn x ** 2  # square\n",
    "<|im_start|>user\nhi<|im_end|>", "Ünïcödé NFC vs NFD: e\u0301", "tabs\t\tand   spaces   ", "1234567890 3.14159",
    "weird\u200bzero\u200dwidth", "emoji🙂in🙃words", "\x00control\x07chars",
]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "description": "city name"}},
                                               "required": ["city"]}}}]

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "What's the weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
     {"role": "tool", "content": "{\"temp\": 21}"}],
    [{"role": "user", "content": "Think first."},
     {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nDone."}, {"role": "user", "content": "Again"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_fixtures import train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    train_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def hf_tok(hf_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_tokenizer_dir))


@pytest.fixture(scope="module")
def ours(hf_tokenizer_dir):
    return tokenizer_from_json((hf_tokenizer_dir / "tokenizer.json").read_bytes())


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_tokenizer_ids_equal_hf(hf_tok, ours, text):
    assert ours.encode(text) == hf_tok(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == hf_tok(text, add_special_tokens=False)["input_ids"]
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_stream_decoder_never_breaks_utf8(ours, text):
    ids = ours.encode(text, add_special_tokens=False)
    dec = ours.stream_decoder(skip_special_tokens=False)
    pieces = [dec.step(i) for i in ids]
    assert "".join(pieces) == ours.decode(ids, skip_special_tokens=False)
    assert all("\ufffd" not in p for p in pieces)


def _templates():
    out = []
    for name in ("qwen3_chat_template.jinja", "nanbeige42_chat_template.jinja"):
        p = SHARED / name
        if p.is_file():
            out.append(p.read_text())
    return out


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("thinking", [None, False])
def test_chat_render_equals_hf_conformance_templates(hf_tok, conv, with_tools, thinking):
    templates = _templates()
    if not templates:
        pytest.skip("../shared/conformance is absent")
    messages = CONVERSATIONS[conv]
    for template in templates:
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        expected = hf_tok.apply_chat_template(messages, tools=TOOLS if with_tools else None, tokenize=False,
                                              add_generation_prompt=True, chat_template=template, **kwargs)
        got = render_chat(template, messages, tools=TOOLS if with_tools else None, add_generation_prompt=True,
                          enable_thinking=thinking, bos_token=hf_tok.bos_token, eos_token=hf_tok.eos_token)
        assert got == expected


def test_chat_render_fixture_template_and_ids(hf_tok, ours, hf_tokenizer_dir):
    template = (hf_tokenizer_dir / "chat_template.jinja").read_text()
    for messages in CONVERSATIONS[:2] + CONVERSATIONS[3:]:
        expected = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                              chat_template=template, return_dict=False)
        assert chat_ids(ours, template, messages) == list(expected)


def test_chatml_fallback_ids(ours):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    start, end = ours.token_to_id("<|im_start|>"), ours.token_to_id("<|im_end|>")
    nl = ours.encode("\n", add_special_tokens=False)
    expect = ([start] + ours.encode("system\nS", add_special_tokens=False) + [end] + nl
              + [start] + ours.encode("user\nhi", add_special_tokens=False) + [end] + nl
              + [start] + ours.encode("assistant\n", add_special_tokens=False))
    assert chatml_ids(ours, msgs) == expect
    assert chat_ids(ours, None, msgs) == expect
    assert chatml_ids(ours, msgs, thinking=False) == expect + ours.encode(NO_THINK, add_special_tokens=False)
    # a template that raises falls back to ChatML
    assert chat_ids(ours, "{{ raise_exception('nope') }}", msgs) == expect


def test_eos_ids_include_bundle_and_im_end(hf_tokenizer_dir):
    from cmf.format.header import TokenizerConfig, _build

    bundle = _build(TokenizerConfig, {"eos_token_ids": [5], "chat_template": None}, "tokenizer_config")
    tok = tokenizer_from_json((hf_tokenizer_dir / "tokenizer.json").read_bytes(), bundle=bundle)
    assert tok.token_to_id("<|im_end|>") in tok.eos_ids
    assert 5 in tok.eos_ids


def test_sampler_seeded_reproducible_and_greedy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(100).astype(np.float32)
    greedy = make_sampler(0.0)
    assert greedy(logits) == int(np.argmax(logits))
    a = make_sampler(0.9, top_k=20, top_p=0.9, min_p=0.01, seed=42)
    b = make_sampler(0.9, top_k=20, top_p=0.9, min_p=0.01, seed=42)
    sa = [a(logits) for _ in range(50)]
    assert sa == [b(logits) for _ in range(50)]
    assert len(set(sa)) > 1
    top1 = make_sampler(1.0, top_k=1, seed=1)
    assert all(top1(logits) == greedy(logits) for _ in range(10))
    topk = make_sampler(5.0, top_k=3, seed=2)
    allowed = set(np.argsort(-logits)[:3].tolist())
    assert {topk(logits) for _ in range(200)} <= allowed


def test_logits_processors_math():
    logits = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    (rep,) = make_logits_processors(repetition_penalty=2.0)
    np.testing.assert_allclose(rep(logits, [0, 1, 1]), [1.0, -4.0, 1.0, 0.5])
    (pf,) = make_logits_processors(presence_penalty=0.5, frequency_penalty=0.25)
    np.testing.assert_allclose(pf(logits, [2, 2, 3]), [2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25])
    (bias,) = make_logits_processors(logit_bias={1: 10.0, 99: 5.0})
    np.testing.assert_allclose(bias(logits, []), [2.0, 8.0, 1.0, 0.5])


def test_tokenizer_sources_embedded_sidecar_bytes(tmp_path, hf_tokenizer_dir):
    """Embedded vocab section first, then a sidecar tokenizer.json, then raw bytes."""
    from _builders import header

    from cmf.format.reader import open as cmf_open
    from cmf.format.writer import CmfWriter
    from cmf.runtime.tokenizer import load_tokenizer

    tj = (hf_tokenizer_dir / "tokenizer.json").read_bytes()
    emb = tmp_path / "emb" / "m.cmf"
    emb.parent.mkdir()
    with CmfWriter(emb, header()) as w:
        w.set_vocab(tj)
    with cmf_open(emb) as f:
        assert load_tokenizer(f).source == "embedded"
    side = tmp_path / "side" / "m.cmf"
    side.parent.mkdir()
    CmfWriter(side, header()).finish()
    with cmf_open(side) as f:
        assert load_tokenizer(f).source == "bytes"
        (side.parent / "tokenizer.json").write_bytes(tj)
        tok = load_tokenizer(f)
        assert tok.source.endswith("tokenizer.json") and tok.encode("hello") == tokenizer_from_json(tj).encode("hello")
    raw = tmp_path / "raw" / "m.cmf"
    raw.parent.mkdir()
    CmfWriter(raw, header()).finish()
    with cmf_open(raw) as f:
        tok = load_tokenizer(f)
        assert tok.encode("hé") == list("hé".encode())
        dec = tok.stream_decoder()
        assert [dec.step(b) for b in "é!".encode()] == ["", "é", "!"]


def test_bos_from_post_processor(tmp_path):
    """A llama-style tokenizer that declares a BOS prepends it on encode (as transformers does)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    ours = tokenizer_from_json(tok.to_str())
    assert ours.bos_id == 0
    assert ours.encode("a b") == [0, 2, 3]
    assert ours.encode("a b", add_special_tokens=False) == [2, 3]
    assert 1 in ours.eos_ids
