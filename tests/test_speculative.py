"""MTP speculative decoding: the draft head against transformers' MtpModel, and output that equals
plain greedy decoding token for token — with the fixtures' own (untrained, rarely right) heads and
with an oracle head whose drafts are right except where a test breaks them on purpose, which
exercises partial acceptance and the rollback of KV, latent (MLA) and linear-attention state.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import _hf_oracle as O  # noqa: E402
import hf_fixtures as H  # noqa: E402

import cmf  # noqa: E402
from cmf.runtime.generate import generate_step  # noqa: E402
from cmf.runtime.sampling import make_logits_processors, make_sampler  # noqa: E402
from cmf.runtime.speculative import MtpHead, NoMtpHead, SpecStats  # noqa: E402

MTP_KINDS = ["deepseek_v3", "glm4_moe", "qwen3_next"]
_MODELS: dict[str, cmf.Model] = {}


def mtp_model(kind: str) -> cmf.Model:
    if kind not in _MODELS:
        _MODELS[kind] = cmf.load(H.converted(kind, mtp=True))
    return _MODELS[kind]


def prompts(n: int = 20) -> list[list[int]]:
    return [O.prompt(100 + i, 6 + (i * 5) % 23).tolist() for i in range(n)]


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe"])
def test_draft_logits_equal_transformers_mtp_model(kind):
    from transformers.modeling_layers import MtpModel

    hf = O.hf_model(kind, mtp=True)
    # transformers finds MTP weights through patterns naming the real models' layer (61 / 46 / 92).
    hf._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{hf.config.num_hidden_layers}\..*"]
    mtp = MtpModel.from_pretrained(hf).eval()
    ids = O.prompt(11, 14)
    with torch.no_grad():
        h = hf(torch.tensor(ids)[None], output_hidden_states=True).hidden_states[-1]
        nxt = torch.tensor(ids[1:])[None]
        out = mtp.forward_layer(0, h[:, :-1], torch.arange(1, len(ids))[None], None, input_ids=nxt)
        ref = mtp._project_to_logits(out)[0].numpy()
    m = mtp_model(kind)
    ours_h = m.hidden(ids, m.new_cache())
    np.testing.assert_allclose(ours_h, h[0].numpy(), atol=O.TOL, rtol=0)
    head = m.mtp_head()
    _, logits = head.step(ids[1:].tolist(), ours_h[:-1], head.new_cache())
    np.testing.assert_allclose(logits, ref, atol=O.TOL, rtol=0)


@pytest.mark.parametrize("kind", MTP_KINDS)
def test_speculative_equals_plain_greedy_with_the_files_head(kind):
    m = mtp_model(kind)
    for ids in prompts():
        plain = O.greedy(m, ids, 16)
        for k in (1, 2, 4):
            assert O.greedy(m, ids, 16, spec="on", spec_k=k) == plain, (kind, ids, k)


class Oracle:
    """Replaces the head's drafts by the true greedy continuation, breaking draft ``j`` of round
    ``r`` for j = r mod (k+1) (j = k: the round is fully right). The head itself still runs, so
    its cache bookkeeping is exercised as in real use."""

    def __init__(self, truth: list[int], prompt_len: int, vocab: int) -> None:
        self.truth, self.p, self.vocab, self.round = truth, prompt_len, vocab, 0
        self.expected_accepted = 0
        self._draft = MtpHead.draft

    def __call__(self, head, tokens, hidden, cache, k):
        self._draft(head, tokens, hidden, cache, k)
        done = cache.pos - (self.p - 1)  # tokens emitted so far: the head holds P-1 + done pairs
        drafts = list(self.truth[done:done + k])
        j = self.round % (k + 1)
        if j < len(drafts):
            drafts[j] = (drafts[j] + 1) % self.vocab
        self.expected_accepted += min(j, len(drafts))
        self.round += 1
        return drafts


@pytest.mark.parametrize("kind", MTP_KINDS)
def test_rejected_drafts_roll_back_every_kind_of_state(kind, monkeypatch):
    m = mtp_model(kind)
    for ids, k in zip(prompts(4), (1, 2, 3, 4)):
        truth = O.greedy(m, ids, 40)
        oracle = Oracle(truth, len(ids), m.plan.vocab)
        monkeypatch.setattr(MtpHead, "draft", lambda head, *a, o=oracle: o(head, *a))
        stats = SpecStats()
        got = O.greedy(m, ids, 40, spec="on", spec_k=k, spec_stats=stats)
        monkeypatch.undo()
        assert got == truth, (kind, k)
        assert stats.accepted == oracle.expected_accepted and stats.accepted > 0
        assert stats.emitted == stats.accepted + stats.rounds
        assert stats.tokens_per_round > 1.0


def test_auto_pauses_drafting_when_drafts_lose():
    m = mtp_model("deepseek_v3")
    ids = prompts(1)[0]
    on, auto = SpecStats(), SpecStats()
    a = O.greedy(m, ids, 40, spec="on", spec_k=2, spec_stats=on)
    b = O.greedy(m, ids, 40, spec="auto", spec_k=2, spec_stats=auto)
    assert a == b == O.greedy(m, ids, 40)
    assert on.accepted == 0 and on.rounds >= 30  # the untrained head never wins here
    assert auto.rounds <= 8  # 4 losing rounds, a pause, a retry near the end


def test_penalties_apply_identically():
    m = mtp_model("qwen3_next")
    ids = prompts(2)[1]
    procs = make_logits_processors(repetition_penalty=1.3, presence_penalty=0.2)
    kw = dict(sampler=make_sampler(0.0), processors=procs, max_tokens=24)
    plain = [t for t, _ in generate_step(m, ids, **kw)]
    spec = [t for t, _ in generate_step(m, ids, spec="on", spec_k=3, **kw)]
    assert spec == plain


def test_stopping_early_leaves_the_cache_at_the_accepted_length():
    m = mtp_model("qwen3_next")
    ids = prompts(3)[2]
    cache = m.new_cache()
    gen = generate_step(m, ids, sampler=make_sampler(0.0), max_tokens=30, spec="on", spec_k=4, cache=cache)
    got = [next(gen)[0] for _ in range(7)]
    gen.close()
    assert cache.pos == len(ids) + 6  # everything emitted but the last token has been fed
    ref_cache = m.new_cache()
    m.prefill(ids + got[:-1], ref_cache)
    np.testing.assert_allclose(m.forward(got[-1:], cache), m.forward(got[-1:], ref_cache), atol=O.TOL, rtol=0)


def test_refusals_and_auto_fallback():
    with cmf.load(H.converted("qwen3_moe")) as plain_model:
        with pytest.raises(NoMtpHead):
            O.greedy(plain_model, [3, 4, 5], 4, spec="on")
        assert O.greedy(plain_model, [3, 4, 5], 4, spec="auto") == O.greedy(plain_model, [3, 4, 5], 4)
    with pytest.raises(ValueError, match="temperature 0"):
        list(generate_step(mtp_model("glm4_moe"), [3, 4], sampler=make_sampler(0.8, seed=1), max_tokens=3,
                           spec="on"))


def test_generate_text_and_cli_report_acceptance(capsys):
    from cmf.cli import main

    m = mtp_model("glm4_moe")
    kw = dict(max_tokens=12, raw=True, ignore_eos=True)
    last = list(m.stream("hello world", spec="on", spec_k=2, **kw))[-1]
    assert m.generate("hello world", spec="on", spec_k=2, **kw) == m.generate("hello world", **kw)
    assert last.spec_drafted > 0 and 0.0 <= last.acceptance_rate <= 1.0
    assert main(["run", str(H.converted("glm4_moe", mtp=True)), "-p", "hello world", "--raw", "-n", "8",
                 "--speculative", "--draft", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "spec_acceptance" in out and out["generated_tokens"] >= 1


def test_linear_attention_mtp_block(tmp_path, monkeypatch):
    """An MTP block that is a Gated DeltaNet layer: its state survives drafting intact."""
    from safetensors.torch import load_file, save_file

    from cmf.convert import convert

    folder = H.build("qwen3_next", tmp_path / "src", mtp=True)
    sd = load_file(str(folder / "model.safetensors"))
    sd = {k: v for k, v in sd.items() if not k.startswith("mtp.layers.0.")}
    sd.update({"mtp.layers.0." + k[len("model.layers.0."):]: v.clone() for k, v in list(sd.items())
               if k.startswith("model.layers.0.")})
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "m.cmf"
    convert(folder, out, quant="f32")
    with cmf.load(out) as m:
        assert type(m.plan.mtp.layers[0].attn).__name__ == "GdnPlan"
        ids = prompts(1)[0]
        head = m.mtp_head()
        h = m.hidden(ids, m.new_cache())
        drafted, fed = head.new_cache(), head.new_cache()
        head.draft(ids[1:], h[:-1], drafted, 4)
        head.step(ids[1:], h[:-1], fed)
        a, b = drafted.layers[0], fed.layers[0]
        assert drafted.pos == fed.pos == a.pos == len(ids) - 1
        assert np.array_equal(a.S, b.S) and np.array_equal(a.conv, b.conv)
        truth = O.greedy(m, ids, 20)
        for k in (1, 3):
            assert O.greedy(m, ids, 20, spec="on", spec_k=k) == truth
        oracle = Oracle(truth, len(ids), m.plan.vocab)
        monkeypatch.setattr(MtpHead, "draft", lambda head, *a, o=oracle: o(head, *a))
        stats = SpecStats()
        assert O.greedy(m, ids, 20, spec="on", spec_k=3, spec_stats=stats) == truth
        assert stats.accepted == oracle.expected_accepted > 0
