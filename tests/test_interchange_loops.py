"""Looped stacks and tube files from the reference (docs/INTERCHANGE.md, runtime/loops.py).

A looped file is the converted qwen2 fixture with ``arch.num_loops`` set (2 passes over its 2
layers), optionally ``loop_final_norm`` and a LOOP_MASKS task mask with different FFN rows per
visit. The oracle is a small numpy forward of the reference's schedule (visit ``v`` runs layer
``v % L`` over its own keys/values; the final norm between passes; FFN row ``v``), itself checked
against transformers at one pass. Tube files (``mlp.*_proj.tube{k}.weight``) are refused.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cmf  # noqa: E402
import hf_fixtures as H  # noqa: E402
from _interchange import TOL, check_logits, file_parts, hf_logits, hf_tensors, prompt, write_cmf  # noqa: E402
from cmf.format.errors import NotRunnable  # noqa: E402
from cmf.format.masks import MaskSet, TaskMask  # noqa: E402
from cmf.runtime.errors import PlanError  # noqa: E402

KIND = "qwen2"  # qkv biases, tied embeddings, plain RoPE: a short oracle


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, theta: float) -> np.ndarray:
    """Half-split RoPE (HF rotate_half) over x [T, heads, d] at positions 0..T-1."""
    t, _, d = x.shape
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def oracle(sd: dict, cfg, ids: np.ndarray, loops: int, loop_norm: bool, keep: np.ndarray | None = None) -> np.ndarray:
    """Logits of the reference's loop schedule, in float64."""
    g = {k: v.double().numpy() for k, v in sd.items()}
    n, eps, hd = cfg.num_hidden_layers, cfg.rms_norm_eps, cfg.hidden_size // cfg.num_attention_heads
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    theta = cfg.rope_parameters["rope_theta"]
    x = g["model.embed_tokens.weight"][ids]
    t = len(ids)
    causal = np.tril(np.ones((t, t), bool))
    for v in range(n * loops):
        p = f"model.layers.{v % n}."
        h = _rms(x, g[p + "input_layernorm.weight"], eps)
        proj = {c: h @ g[p + f"self_attn.{c}_proj.weight"].T + g[p + f"self_attn.{c}_proj.bias"] for c in "qkv"}
        q = _rope(proj["q"].reshape(t, nh, hd), theta)
        k = np.repeat(_rope(proj["k"].reshape(t, nkv, hd), theta), nh // nkv, axis=1)
        val = np.repeat(proj["v"].reshape(t, nkv, hd), nh // nkv, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd)
        s = np.where(causal[None], s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", pr, val).reshape(t, -1) @ g[p + "self_attn.o_proj.weight"].T
        h = _rms(x, g[p + "post_attention_layernorm.weight"], eps)
        gate = h @ g[p + "mlp.gate_proj.weight"].T
        a = gate / (1 + np.exp(-gate)) * (h @ g[p + "mlp.up_proj.weight"].T)
        if keep is not None:
            a = a * keep[v]
        x = x + a @ g[p + "mlp.down_proj.weight"].T
        if loop_norm and (v + 1) % n == 0 and v + 1 < n * loops:
            x = _rms(x, g["model.norm.weight"], eps)
    x = _rms(x, g["model.norm.weight"], eps)
    return (x @ g["model.embed_tokens.weight"].T).astype(np.float32)  # tied head


@pytest.fixture(scope="module")
def base():
    folder = H.fixture(KIND)
    return hf_tensors(folder), transformers.AutoConfig.from_pretrained(folder), H.converted(KIND)


def looped(src, path, loops: int, loop_norm: bool, masks: MaskSet | None = None):
    head, arrays, vocab = file_parts(src)
    head = copy.deepcopy(head)
    head["arch"].update(num_loops=loops, loop_final_norm=loop_norm)
    head["provenance"] = {"tool": "cortiq convert"}
    return write_cmf(path, head, arrays, vocab, masks)


def test_oracle_is_transformers_at_one_pass(base) -> None:
    sd, cfg, _ = base
    ids = prompt(0)
    np.testing.assert_allclose(oracle(sd, cfg, ids, 1, False), hf_logits(H.fixture(KIND), ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("loop_norm", [False, True])
def test_looped_stack_matches_the_oracle(base, tmp_path, loop_norm: bool) -> None:
    sd, cfg, src = base
    path = looped(src, tmp_path / "loop.cmf", 2, loop_norm)
    ids = prompt(1)
    with cmf.load(path) as m:
        assert len(m.plan.layers) == 4 and [lp.exit_norm is not None for lp in m.plan.layers] == \
            [False, loop_norm, False, False]
    check_logits(path, oracle(sd, cfg, ids, 2, loop_norm), ids)


def test_per_visit_ffn_masks(base, tmp_path) -> None:
    sd, cfg, src = base
    n, inter = cfg.num_hidden_layers, cfg.intermediate_size
    keep = np.random.default_rng(5).random((2 * n, inter)) < 0.6  # different rows per visit
    mask = TaskMask(task_id=1, name="t", ffn=keep, heads=np.ones((n, cfg.num_attention_heads), bool),
                    gates=np.ones(n, bool), quality={"metric": "heldout_ppl_ratio", "value": 1.0})
    path = looped(src, tmp_path / "masked.cmf", 2, True, MaskSet(default_task="t", masks=[mask]))
    with cmf.open(path) as f:
        assert f.masks.get("t").ffn.shape == (2 * n, inter)  # LOOP_MASKS: one row per visit
    ids = prompt(2)
    ref = oracle(sd, cfg, ids, 2, True, keep)
    check_logits(path, ref, ids, task="t")
    assert np.abs(ref - oracle(sd, cfg, ids, 2, True, np.tile(keep[:n], (2, 1)))).max() > 1e-2  # rows matter


@pytest.mark.parametrize("part", ["heads", "gates"])
def test_head_and_gate_restrictions_are_refused_on_looped_models(base, tmp_path, part: str) -> None:
    _, cfg, src = base
    n = cfg.num_hidden_layers
    rows = {"ffn": np.ones((2 * n, cfg.intermediate_size), bool), "heads": np.ones((n, cfg.num_attention_heads), bool),
            "gates": np.ones(n, bool)}
    rows[part][0] = False
    mask = TaskMask(task_id=1, name="t", **rows)
    path = looped(src, tmp_path / "refused.cmf", 2, False, MaskSet(default_task="t", masks=[mask]))
    with pytest.raises(NotRunnable, match="looped model"):
        cmf.load(path, task="t")
    with cmf.load(path, task="none") as m:  # unmasked it runs
        m.logits(prompt(3)[:5])


def test_looped_linear_attention_is_refused(tmp_path) -> None:
    path = looped(H.converted("qwen3_5"), tmp_path / "gdn.cmf", 2, False)
    with pytest.raises(PlanError, match="LinearAttention"):
        cmf.load(path)


def test_tube_files_are_refused_naming_the_tensors(base, tmp_path) -> None:
    _, cfg, src = base
    head, arrays, vocab = file_parts(src)
    rng = np.random.default_rng(0)
    p = "model.layers.0.mlp."
    arrays[p + "gate_proj.tube1.weight"] = rng.standard_normal((32, cfg.hidden_size)).astype(np.float32)
    arrays[p + "up_proj.tube1.weight"] = rng.standard_normal((32, cfg.hidden_size)).astype(np.float32)
    arrays[p + "down_proj.tube1.weight"] = rng.standard_normal((cfg.hidden_size, 32)).astype(np.float32)
    path = write_cmf(tmp_path / "tube.cmf", head, arrays, vocab)
    with pytest.raises(NotRunnable, match=r"mlp\.\*_proj\.tube"):
        cmf.load(path)
    with cmf.open(path) as f:  # still a valid container
        assert f.verify() == []


def test_batched_decode_runs_the_pass_end_norm(base, tmp_path) -> None:
    """The server's batched decode step (runtime/batched.py) runs the same schedule."""
    from cmf.runtime.batched import BatchDecoder

    sd, cfg, src = base
    path = looped(src, tmp_path / "loop.cmf", 2, True)
    ids = prompt(4, 12)
    ref = oracle(sd, cfg, ids, 2, True)
    with cmf.load(path) as m:
        dec = BatchDecoder(m)
        caches = [m.new_cache(), m.new_cache()]
        got = np.stack([dec.step([t, t], caches) for t in ids])
    np.testing.assert_allclose(got[:, 0], ref, atol=TOL, rtol=0)
    np.testing.assert_allclose(got[:, 1], ref, atol=TOL, rtol=0)
