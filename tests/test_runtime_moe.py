"""MoE and MLA runtime against transformers, plus routing semantics, statistics and expert masks.

Families: qwen2_moe (shared expert with sigmoid gate, q/k/v biases, norm_topk_prob false, a dense
layer), qwen3_moe, mixtral, deepseek_v3 (MLA, sigmoid routing with correction bias, group-limited
top-k, routed scaling, a first dense layer) and glm4_moe (the same routing, partial rotary, q/k
norms and biases).
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
from cmf.format.header import as_arch  # noqa: E402
from cmf.runtime.ops.moe import Routing, cover_mask, route  # noqa: E402
from cmf.runtime.plan import PlanError, build_plan  # noqa: E402
from cmf.tools.route_stats import route_stats  # noqa: E402

FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe"]


@pytest.mark.parametrize("kind", FAMILIES)
def test_logits_decode_and_chunked_prefill_match_hf(kind):
    O.check_logits(kind)


@pytest.mark.parametrize("kind", FAMILIES)
def test_sixteen_greedy_tokens_equal_hf(kind):
    O.check_greedy(kind)


def test_plans_follow_tensor_presence():
    with cmf.load(H.converted("qwen2_moe")) as m:
        kinds = [type(lp.ffn).__name__ for lp in m.plan.layers]
        assert kinds == ["MoePlan", "FfnPlan"]  # mlp_only_layers=[1]: dense and MoE mixed
        moe = m.plan.layers[0].ffn
        assert moe.shared is not None and moe.shared_gate is not None and not moe.routing.norm_topk_prob
    with cmf.load(H.converted("deepseek_v3")) as m:
        lp0, lp1 = m.plan.layers
        assert type(lp0.ffn).__name__ == "FfnPlan" and type(lp0.attn).__name__ == "MlaPlan"
        r = lp1.ffn.routing
        assert (r.sigmoid, r.n_group, r.topk_group, r.scaling) == (True, 2, 1, 2.5)
        assert lp1.ffn.expert_bias is not None and lp1.ffn.shared_gate is None
        # the latent cache: kv_rank + rope_dim floats per position, not heads × (k + v)
        cache = m.new_cache()
        m.forward([5, 6, 7], cache)
        kv = cache.layers[1]
        assert kv.k.shape[1:] == (1, 32) and kv.v.shape[1:] == (1, 8) and kv.n == 3


def test_fused_expert_storage_gives_identical_logits():
    ids = O.prompt(4)
    with cmf.load(H.converted("qwen3_moe")) as a, cmf.load(H.converted("qwen3_moe", fused=True)) as b:
        assert np.array_equal(a.logits(ids), b.logits(ids))


def test_decode_reads_only_selected_experts():
    with cmf.load(H.converted("mixtral")) as m:
        cache = m.new_cache()
        m.forward([11], cache)
        prepared = [n for n in m.weights._linears if ".experts." in n]
        layers = len(m.plan.layers)
        assert len(prepared) == 3 * 2 * layers  # top-2 experts × gate/up/down per layer, nothing else


# ----------------------------------------------------------------------------------- routing


def test_route_ties_go_to_the_lower_index_and_k_clamps():
    logits = np.zeros((1, 4), np.float32)
    idx, w = route(logits, Routing(top_k=2))
    assert idx.tolist() == [[0, 1]] and np.allclose(w, 0.25)
    idx, _ = route(logits, Routing(top_k=8), allowed=np.array([False, True, False, True]))
    assert idx.tolist() == [[1, 3]]


def test_expert_bias_selects_but_does_not_weigh():
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    bias = np.array([0, 0, 0, 5], np.float32)
    idx, w = route(logits, Routing(top_k=2, sigmoid=True, norm_topk_prob=True, scaling=2.5), bias=bias)
    p = 1 / (1 + np.exp(-logits[0].astype(np.float64)))
    assert idx.tolist() == [[3, 0]]
    expect = p[[3, 0]] * 2.5 / (p[[3, 0]].sum() + 1e-6)  # REFERENCE_NOTES §3 weight formula
    np.testing.assert_allclose(w[0], expect, rtol=1e-6)


def test_group_limited_top_k():
    # Groups {0,1} and {2,3}: group 1 holds the single best expert, group 0 the best pair sum.
    s = np.array([[0.8, 0.7, 0.9, 0.1]], np.float32)
    logits = np.log(s / (1 - s))  # sigmoid(logits) == s
    idx, _ = route(logits, Routing(top_k=2, sigmoid=True, n_group=2, topk_group=1))
    assert idx.tolist() == [[0, 1]]
    idx, _ = route(logits, Routing(top_k=2, sigmoid=True))
    assert idx.tolist() == [[2, 0]]


def test_softmax_weights_without_renormalization():
    logits = np.array([[1.0, 2.0, 3.0]], np.float32)
    idx, w = route(logits, Routing(top_k=2))
    p = np.exp(logits[0] - 3) / np.exp(logits[0] - 3).sum()
    assert idx.tolist() == [[2, 1]]
    np.testing.assert_allclose(w[0], p[[2, 1]], rtol=1e-6)


def test_cover_mask():
    assert cover_mask(np.array([5, 0, 3, 2]), 1.0).tolist() == [True, False, True, True]
    assert cover_mask(np.array([5, 0, 3, 2]), 0.5).tolist() == [True, False, False, False]
    assert cover_mask(np.array([5, 0, 3, 2]), 0.8).tolist() == [True, False, True, False]
    assert cover_mask(np.array([2, 2, 1]), 0.4).tolist() == [True, False, False]  # ties: lower index
    assert cover_mask(np.zeros(3), 0.5).all()


def test_experts_by_presence_and_router_rows_must_match():
    with cmf.load(H.converted("qwen3_moe")) as m:
        arch, shape = m.arch, m.weights.shape

        def hide(pred, router_rows=None):
            def shape_of(name):
                if pred(name):
                    return None
                if router_rows is not None and name == "model.layers.0.mlp.gate.weight":
                    return (router_rows, arch.hidden_size)
                return shape(name)
            return shape_of

        with pytest.raises(PlanError, match="3 experts are present"):
            build_plan(arch, hide(lambda n: n.startswith("model.layers.0.mlp.experts.3.")))
        # enumeration stops at the first gap: expert 3 exists but is not reached
        with pytest.raises(PlanError, match="2 experts are present"):
            build_plan(arch, hide(lambda n: n.startswith("model.layers.0.mlp.experts.2.")))
        # a defragged layer: 2 experts, 2 router rows; top_k clamps to the layer's count
        plan = build_plan(arch, hide(lambda n: n.startswith(("model.layers.0.mlp.experts.2.",
                                                             "model.layers.0.mlp.experts.3.")), router_rows=2))
        assert plan.layers[0].ffn.n_experts == 2 and plan.layers[1].ffn.n_experts == 4
        with pytest.raises(PlanError, match="no arch.moe block"):
            build_plan(as_arch({k: v for k, v in arch.raw.items() if k != "moe"}), shape)


# ----------------------------------------------------------------------------------- statistics and masks


def _hf_router_counts(kind: str, ids: np.ndarray) -> dict[str, list[int]]:
    """Selections per expert recorded from transformers' own routers (hooks on mlp.gate)."""
    model = O.hf_model(kind)
    counts: dict[str, list[int]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "top_k"):
            continue
        n = gate.weight.shape[0]

        def hook(mod, inp, out, i=i, n=n):
            counts[str(i)] = np.bincount(out[2].reshape(-1).numpy(), minlength=n).tolist()

        hooks.append(gate.register_forward_hook(hook))
    try:
        O.hf_logits(kind, ids)
    finally:
        for h in hooks:
            h.remove()
    return counts


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_route_stats_equal_hf_routing(kind):
    ids = O.prompt(6)
    with cmf.load(H.converted(kind)) as m:
        stats = route_stats(m, ids.tolist(), window=64)
        top_k = m.plan.layers[m.moe_layers[0]].ffn.routing.top_k
    assert stats == _hf_router_counts(kind, ids)
    assert all(sum(v) == len(ids) * top_k for v in stats.values())


def test_route_stats_windows_count_every_token_once():
    ids = O.prompt(7, 50).tolist()
    with cmf.load(H.converted("qwen2_moe")) as m:
        stats = route_stats(m, ids, window=16)
        assert list(stats) == ["0"] and sum(stats["0"]) == 50 * 2
        assert m.route_stats() == {}  # counting is off again afterwards


def test_moe_mask_cover_one_changes_nothing_and_lower_cover_restricts(tmp_path):
    ids = O.prompt(8).tolist()
    path = H.converted("qwen3_moe")
    with cmf.load(path) as m:
        ref = m.logits(ids)
        stats = route_stats(m, ids, window=64)
    stats_file = tmp_path / "stats.json"
    stats_file.write_text(json.dumps(stats))
    with cmf.load(path, moe_mask=stats_file, moe_mask_cover=1.0) as m:
        assert np.array_equal(m.logits(ids), ref)
    with cmf.load(path, moe_mask=stats_file, moe_mask_cover=0.5) as m:
        m.collect_route_stats(True)
        restricted = m.logits(ids)
        for layer, counts in m.route_stats().items():
            keep = cover_mask(np.array(stats[layer]), 0.5)
            assert not np.array(counts)[~keep].any()
    assert not np.allclose(restricted, ref)


def test_moe_mask_from_environment(tmp_path, monkeypatch):
    path = H.converted("qwen3_moe")
    counts = {"0": [1, 0, 0, 0], "1": [0, 0, 0, 1]}
    f = tmp_path / "s.json"
    f.write_text(json.dumps(counts))
    monkeypatch.setenv("CMF_MOE_MASK", str(f))
    monkeypatch.setenv("CMF_MOE_MASK_COVER", "0.9")
    with cmf.load(path) as m:
        m.collect_route_stats(True)
        m.logits([4, 5, 6])
        assert m.route_stats() == {"0": [3, 0, 0, 0], "1": [0, 0, 0, 3]}  # top_k clamps to the one admitted
    f.write_text(json.dumps({"0": [1, 2]}))
    with pytest.raises(cmf.CmfError, match="layer 0 has 2 counts"):
        cmf.load(path).close()


def test_route_stats_cli_and_moe_stats_env(tmp_path, monkeypatch):
    import atexit

    from cmf.cli import main

    text = tmp_path / "t.txt"
    text.write_text("hello world expert router\n\nthe model layer tensor gate\n")
    out = tmp_path / "stats.json"
    assert main(["route-stats", str(H.converted("qwen2_moe")), "-f", str(text), "-o", str(out)]) == 0
    stats = json.loads(out.read_text())
    assert list(stats) == ["0"] and sum(stats["0"]) % 2 == 0 and sum(stats["0"]) > 0
    registered = []
    monkeypatch.setattr(atexit, "register", lambda fn, *a: registered.append((fn, a)))
    env_out = tmp_path / "env.json"
    monkeypatch.setenv("CMF_MOE_STATS", str(env_out))
    assert main(["ppl", str(H.converted("qwen2_moe")), "-f", str(text), "--window", "8", "--json"]) == 0
    for fn, a in registered:
        fn(*a)
    env_stats = json.loads(env_out.read_text())
    assert sum(env_stats["0"]) == (sum(stats["0"]) // 2 // 8) * 8 * 2  # whole windows of 8, top-2


def test_task_mask_expert_row_restricts_routing(tmp_path):
    from cmf.format.masks import MaskSet, TaskMask
    from cmf.format.reader import open as open_cmf
    from cmf.format.writer import CmfWriter

    out = tmp_path / "masked.cmf"
    with open_cmf(H.converted("qwen3_moe")) as src:
        a = src.arch
        with CmfWriter(out, dict(src.header.raw)) as w:
            for name in src:
                t = src.tensor(name)
                w.add(name, t.dtype, t.shape, t.numpy())
            full = dict(ffn=np.ones((a.num_layers, a.intermediate_size), bool),
                        heads=np.ones((a.num_layers, a.num_attention_heads), bool), gates=np.ones(a.num_layers, bool))
            experts = np.zeros((a.num_layers, 4), bool)
            experts[0, [1, 2]] = True  # layer 1's empty row means unrestricted
            w.set_masks(MaskSet(default_task="general", masks=[
                TaskMask(task_id=0, name="general", priority="Fallback", **full),
                TaskMask(task_id=1, name="two", experts=experts, **full)]))
    ids = O.prompt(10, 24).tolist()
    with cmf.load(out) as m:
        m.collect_route_stats(True)
        m.logits(ids)
        assert all(c > 0 for c in m.route_stats()["0"])  # general: every expert routable
        m.select(task="two")
        m.reset_route_stats()
        m.logits(ids)
        stats = m.route_stats()
        assert stats["0"][0] == stats["0"][3] == 0 and sum(stats["0"]) == 2 * len(ids)
        assert sum(stats["1"]) == 2 * len(ids) and sum(c > 0 for c in stats["1"]) > 2
