"""Task masks at run time, mask creation with a measured quality contract, moe-mask, moe-defrag
and defrag (spec §5, §11, §11.1; REFERENCE_NOTES §1.9, §3).

Oracles: transformers with the masked weights zeroed (a dead neuron's down column, a dead head's
o_proj columns, a gated-off layer's o_proj and down_proj), the masked runtime for defrag, the
runtime expert restriction for moe-defrag / moe-mask, and a fresh ``cmf ppl`` for the quality
contract.
"""

from __future__ import annotations

import copy
import json
import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _builders import present_pages  # noqa: E402
import _hf_oracle as O  # noqa: E402
import hf_fixtures as H  # noqa: E402

import cmf  # noqa: E402
from cmf import quant  # noqa: E402
from cmf.cli import main  # noqa: E402
from cmf.format.constants import Feature  # noqa: E402
from cmf.format.masks import MaskSet, TaskMask, mask_layout  # noqa: E402
from cmf.format.reader import open as cmf_open  # noqa: E402
from cmf.format.writer import CmfWriter  # noqa: E402
from cmf.quant.columns import gather_columns, gather_rows, kept_column_fraction  # noqa: E402
from cmf.runtime.ops.moe import Routing, route  # noqa: E402
from cmf.tools.defrag import defrag  # noqa: E402
from cmf.tools.mask_create import create_mask  # noqa: E402
from cmf.tools.moe_defrag import moe_defrag  # noqa: E402
from cmf.tools.moe_mask import moe_mask  # noqa: E402
from cmf.tools.route_stats import route_stats  # noqa: E402

TEXT = "\n\n".join(" ".join(["hello world expert router model layer tensor gate weight shard",
                             "format header vocab attention norm bias quant rope token convert"][i % 2].split()[j:])
                   for i in range(12) for j in range(3))


def full(a, **rows) -> dict:
    """All-on bitfields for arch ``a``, with ``rows`` overriding some."""
    d = dict(ffn=np.ones((a.num_layers, a.intermediate_size), bool),
             heads=np.ones((a.num_layers, a.num_attention_heads), bool), gates=np.ones(a.num_layers, bool))
    d.update(rows)
    return d


def with_masks(src, out, masks: list[TaskMask], arrays: dict | None = None, arch: dict | None = None):
    """A copy of ``src`` with ``masks`` (default task "general", no mask of that name) and some
    tensors replaced by float32 ``arrays`` (stored as f32)."""
    with cmf_open(src) as f:
        header = f.header.to_dict()
        if arch:
            header["arch"] = dict(header["arch"], **arch)
        with CmfWriter(out, header) as w:
            for name in f:
                t = f.tensor(name)
                if arrays and name in arrays:
                    w.add_array(name, arrays[name], "f32")
                else:
                    w.add(name, t.dtype, t.shape, t.numpy())
            w.set_masks(MaskSet(default_task="general", masks=masks))
            if f.tokenizer_json is not None:
                w.set_vocab(f.tokenizer_json)
    return out


def random_mask(a, name: str, seed: int = 0, *, heads: bool = False, gate_off: int | None = None,
                keep: float = 0.5) -> TaskMask:
    rng = np.random.default_rng(seed)
    rows = {"ffn": rng.random((a.num_layers, a.intermediate_size)) < keep}
    if heads:
        h = np.ones((a.num_layers, a.num_attention_heads), bool)
        h[0, 1] = h[1, 3] = False
        rows["heads"] = h
    if gate_off is not None:
        g = np.ones(a.num_layers, bool)
        g[gate_off] = False
        rows["gates"] = g
    return TaskMask(task_id=1, name=name, **full(a, **rows))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """qwen3 (f32) with tasks: half (50% FFN), heads (+ two heads off), gate (+ layer 1 off),
    all (every bit set, quality measured), on a 'general' default without a mask."""
    src = H.converted("qwen3")
    with cmf_open(src) as f:
        a = f.arch
    masks = [random_mask(a, "half"), random_mask(a, "heads", heads=True),
             random_mask(a, "gate", heads=True, gate_off=1),
             TaskMask(task_id=4, name="all", quality={"metric": "heldout_ppl_ratio", "value": 1.0}, **full(a))]
    for i, m in enumerate(masks):
        m.task_id = i
    return with_masks(src, tmp_path_factory.mktemp("masks") / "q3.cmf", masks)


def hf_masked(kind: str, mask: TaskMask):
    """transformers' model with ``mask`` baked in as zeros (dead neurons, heads and layers add 0)."""
    model = copy.deepcopy(O.hf_model(kind))
    cfg = model.config
    hd = getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            dead = torch.from_numpy(~mask.ffn[i][:layer.mlp.down_proj.weight.shape[1]])
            layer.mlp.down_proj.weight[:, dead] = 0
            for h in np.flatnonzero(~mask.heads[i]):
                layer.self_attn.o_proj.weight[:, h * hd:(h + 1) * hd] = 0
            if not mask.gates[i]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    return model


# ----------------------------------------------------------------------------- runtime masks


@pytest.mark.parametrize("task", ["half", "heads", "gate"])
def test_masked_runtime_equals_transformers_with_masked_weights_zeroed(qwen3, task):
    ids = O.prompt(3)
    with cmf.load(qwen3, task=task) as m:
        mask = m.file.masks.get(task)
        got = m.logits(ids)
        cache = m.new_cache()  # one token at a time: the fused (decode) path
        steps = np.stack([m.forward([t], cache)[0] for t in ids[:12]])
    with torch.no_grad():
        ref = hf_masked("qwen3", mask)(torch.tensor(ids)[None]).logits[0].numpy()
    np.testing.assert_allclose(got, ref, atol=O.TOL, rtol=0)
    np.testing.assert_allclose(steps, ref[:12], atol=O.TOL, rtol=0)
    assert not np.allclose(got, O.hf_logits("qwen3", ids), atol=1e-3)


def test_mask_with_every_bit_set_is_exactly_unmasked_and_takes_the_fast_path(qwen3):
    ids = O.prompt(4)
    with cmf.load(qwen3, task="none") as m:  # "none": unmasked (the default would be "half")
        assert m.task is None and m.tasks == ["half", "heads", "gate", "all"]
        ref = m.logits(ids)
        m.select(task="all")
        assert np.array_equal(m.logits(ids), ref)
        for b in m._blocks:
            assert b.alive and b.mixer.head_keep is None and b.ffn._live is None
        m.select(task="half")
        assert all(b.ffn._live is not None for b in m._blocks)


def test_task_switching_is_cheap_and_reversible(qwen3):
    ids = O.prompt(5, 16)
    with cmf.load(qwen3, task="half") as m:
        half = m.logits(ids)
        blocks, file = list(m._blocks), m.file
        gathered = [b.ffn._masked for b in m._blocks]
        m.select(task="heads")
        m.logits(ids)
        m.select(task="half")  # back: the gathers of "half" are reused, nothing is rebuilt
        assert [b.ffn._masked for b in m._blocks] == gathered
        assert m._blocks == blocks and m.file is file
        assert np.array_equal(m.logits(ids), half)
        m.select(task="none")
        assert m.task is None and all(b.ffn._live is None for b in m._blocks)
        m.select()  # the default rule: no "general" mask, so the Fallback one (task 0, "half")
        assert m.task == "half" and [b.ffn._masked for b in m._blocks] == gathered


def test_switching_to_an_unmeasured_mask_warns(qwen3, caplog):
    with caplog.at_level(logging.WARNING, logger="cmf"):
        with cmf.load(qwen3, task="all") as m:
            assert "unmeasured" not in caplog.text
            m.select(task="all")  # measured
            assert "unmeasured" not in caplog.text
            m.select(task="half")
            assert "task 'half': quality unmeasured" in caplog.text


def test_unknown_task_is_refused(qwen3):
    with cmf.load(qwen3) as m:
        with pytest.raises(KeyError, match="no task 'nope'"):
            m.select(task="nope")


def test_masked_out_ffn_rows_are_never_read(qwen3, tmp_path):
    """Dead gate/up rows and down columns overwritten with NaN change nothing under the mask."""
    ids = O.prompt(6)
    with cmf_open(qwen3) as f:
        mask = f.masks.get("half")
        poisoned = {}
        for i in range(f.arch.num_layers):
            p = f"model.layers.{i}.mlp."
            dead = ~mask.ffn[i]
            for role in ("gate_proj", "up_proj", "down_proj"):
                w = f.array(p + role + ".weight").copy()
                if role == "down_proj":
                    w[:, dead] = np.nan
                else:
                    w[dead] = np.nan
                poisoned[p + role + ".weight"] = w
    nan_file = with_masks(qwen3, tmp_path / "nan.cmf", [mask], poisoned)
    with cmf.load(qwen3, task="half") as m:
        ref = m.logits(ids)
    for kernels in (False, True):
        with cmf.load(nan_file, task="half", reference_kernels=kernels) as m:
            got = m.logits(ids)
            cache = m.new_cache()
            step = m.forward(ids[:1], cache)
        assert np.isfinite(got).all()
        if kernels:  # numpy's one sgemm vs the fused path's per-thread sgemm: last-bit differences
            np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)
        else:
            assert np.array_equal(got, ref)
        np.testing.assert_allclose(step[0], ref[0], atol=1e-5, rtol=0)
    with cmf.load(nan_file, task="none") as m:  # the unmasked model does read them
        assert np.isnan(m.logits(ids[:4])).all()


@pytest.mark.parametrize("quant_", ["q8", "q4tp", "vbit"])
def test_masked_quantized_models_match_the_reference_kernels(tmp_path, quant_):
    src = H.converted("qwen3", quant_)
    with cmf_open(src) as f:
        mask = random_mask(f.arch, "half", seed=1)
    path = with_masks(src, tmp_path / "m.cmf", [mask])
    ids = O.prompt(7, 20)
    with cmf.load(path, task="half") as m:
        got = m.logits(ids)
    with cmf.load(path, task="half", reference_kernels=True) as m:
        ref = m.logits(ids)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


def test_loop_masks_are_read_per_visit(qwen3, tmp_path):
    """A LOOP_MASKS file (num_loops 2, one FFN row per visit) loads and visit v reads FFN row v
    (the loop schedule itself: tests/test_interchange_loops.py)."""
    src = H.converted("qwen3")
    with cmf_open(qwen3) as f:
        half = f.masks.get("half")
    a_rows = np.concatenate([half.ffn, np.ones_like(half.ffn)])  # pass 0 = "half", pass 1 = all on
    looped = TaskMask(task_id=0, name="half", ffn=a_rows, heads=half.heads, gates=half.gates)
    path = with_masks(src, tmp_path / "loop.cmf", [looped], arch={"num_loops": 2})
    with cmf_open(path) as f:
        assert f.features & Feature.LOOP_MASKS
        assert f.masks.get("half").ffn.shape == (4, half.ffn.shape[1])
        raw, lay = _raw_masks(path)
        assert json.loads(raw[8:8 + int.from_bytes(raw[4:8], "little")])["masks"][0]["blob_len"] == lay["per_visit"]
    with cmf.load(path, task="half") as m:
        assert len(m._blocks) == 4
        for v, b in enumerate(m._blocks):  # pass 1 is all on: no restriction there
            want = None if a_rows[v].all() else np.flatnonzero(a_rows[v][:b.ffn.width])
            assert (b.ffn._live is None) if want is None else np.array_equal(b.ffn._live, want)


@pytest.mark.parametrize("quant_", ["q8", "q4tp"])
def test_masked_decode_runs_the_gathered_matrices_through_the_grouped_products(tmp_path, quant_):
    """One token at a time under a mask: the step's gate/up/down are the gathered live matrices in
    grouped products on the plain layer path (q4tp: down run whole, its input scattered to the
    live positions), the values those of the reference kernels."""
    src = H.converted("qwen3", quant_)
    with cmf_open(src) as f:
        mask = random_mask(f.arch, "half", seed=2)
    path = with_masks(src, tmp_path / "m.cmf", [mask])
    ids = O.prompt(9, 10)
    with cmf.load(path, task="half", reference_kernels=True) as m:
        ref = m.logits(ids)
    with cmf.load(path, task="half") as m:
        cache = m.new_cache()
        steps = np.stack([m.forward([t], cache)[0] for t in ids])
        for b in m._blocks:
            lf, prod = b._step.ffn._masked
            assert lf is b.ffn.live() and prod is not None
            assert lf.gate.out_features == lf.up.out_features == int(mask.ffn[b.plan.index].sum())
            assert (lf.positions is None) == (quant_ == "q8")
            # q4tp: a random half leaves hardly a 32-column group of down without a live neuron,
            # so down runs whole (no second copy of it) with zeros at the dead positions
            assert (lf.down is b.ffn.down) == (quant_ == "q4tp")
            if quant_ == "q4tp":
                assert np.array_equal(lf.positions, b.ffn._live)
            # the whole layer runs the pre-bound plain path (q4tp: scattering down's input first)
            assert b._step._bound[2] is not None
            assert (b._step._bound[2][4] is None) == (quant_ == "q8")
    np.testing.assert_allclose(steps, ref, atol=1e-4, rtol=0)


def test_masked_gathers_are_prepared_like_the_models_own_ops(tmp_path):
    """Under int8 activations the gathered 4-bit matrices take int8 activations too (one piece),
    and the masked decode matches the unmasked-path kernels' values within int8 rounding."""
    src = H.converted("qwen3", "q4tp")
    with cmf_open(src) as f:
        mask = random_mask(f.arch, "half", seed=5)
    path = with_masks(src, tmp_path / "m.cmf", [mask])
    ids = O.prompt(10, 6)
    with cmf.load(path, task="half", int8_activations=True) as m:
        cache = m.new_cache()
        steps = np.stack([m.forward([t], cache)[0] for t in ids])
        for b in m._blocks:
            lf = b.ffn.live()
            assert lf.gate.pieces == lf.up.pieces == lf.down.pieces == b.ffn.gate.pieces == 1
    with cmf.load(path, task="half", reference_kernels=True) as m:
        ref = m.logits(ids)
    assert np.abs(steps - ref).max() < 0.05 * np.abs(ref).max()


def test_a_masks_dead_ffn_weights_are_not_resident(tmp_path):
    """q8 rows of 512 bytes (eight to a page, so almost every page holds a live row of a random
    half): after a masked prefill and decode, no page of gate/up/down is mapped any more — the
    live rows and columns were gathered and the mapped pages given back — while unmasked they
    all are. Pages within 64 KiB of a tensor's ends are left out: the kernel's fault-around maps
    cached neighbours of another tensor's faulting page."""
    import os

    if not os.access("/proc/self/pagemap", os.R_OK):
        pytest.skip("no /proc/self/pagemap")
    rng = np.random.default_rng(3)
    hidden, inter, layers = 512, 2048, 2
    arch = {"arch_name": "qwen3", "hidden_size": hidden, "intermediate_size": inter, "num_layers": layers,
            "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 64, "vocab_size": 256,
            "layer_types": ["FullAttention"] * layers, "rms_norm_eps": 1e-6, "max_position_embeddings": 128,
            "norm_style": "qwen", "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu"}
    path = tmp_path / "wide.cmf"
    with CmfWriter(path, {"format": "cmf", "version": 2, "arch": arch, "quant_type": "Q8_ROW"}) as w:
        def add(name, r, c):
            w.add_array(name, (rng.standard_normal((r, c)) / np.sqrt(c)).astype(np.float32), "q8_row")
        add("model.embed_tokens.weight", 256, hidden)
        w.add_array("model.norm.weight", 1 + 0.1 * rng.standard_normal(hidden).astype(np.float32), "f32")
        for i in range(layers):
            p = f"model.layers.{i}."
            for n in ("input_layernorm", "post_attention_layernorm"):
                w.add_array(p + n + ".weight", 1 + 0.1 * rng.standard_normal(hidden).astype(np.float32), "f32")
            for n, r, c in (("q", 256, hidden), ("k", 128, hidden), ("v", 128, hidden), ("o", hidden, 256)):
                add(f"{p}self_attn.{n}_proj.weight", r, c)
            for n, r, c in (("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter)):
                add(f"{p}mlp.{n}_proj.weight", r, c)
    with cmf_open(path) as f:
        mask = random_mask(f.arch, "half", seed=4)
    masked = with_masks(path, tmp_path / "masked.cmf", [mask])
    margin = 64 << 10

    def ffn_present(task):
        with cmf.load(masked, task=task) as m:
            cache = m.new_cache()
            logits = m.prefill(list(range(5, 21)), cache)
            for _ in range(6):
                logits = m.forward([int(np.argmax(logits))], cache)
            base = m.file._parts[0].u8.ctypes.data
            return np.concatenate([present_pages(base + t.offset + margin, t.nbytes - 2 * margin)
                                   for t in m.file.tensors() if ".mlp." in t.name])

    unmasked, half = ffn_present("none"), ffn_present("half")
    assert unmasked.size > 1000 and unmasked.mean() > 0.99
    assert not half.any()


# ----------------------------------------------------------------------------- row and column gathers

GATHERED = ["f32", "f16", "bf16", "q8_row", "q8_2f", "q4_block", "q4_tiled", "q1", "q4tp", "q2tp"]


def _stored(w: np.ndarray, dtype: str) -> np.ndarray:
    """The payload bytes of ``w`` stored as ``dtype``."""
    return np.frombuffer(w.tobytes() if dtype == "f32" else quant.encode(w, dtype), np.uint8)


@pytest.mark.parametrize("dtype", GATHERED)
def test_gather_columns_equals_decode_then_slice(dtype):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 128)).astype(np.float32)
    cols = np.sort(rng.choice(128, 50, replace=False))
    buf = _stored(w, dtype)
    sub = gather_columns(buf, quant.resolve_dtype(dtype), w.shape, cols)
    assert sub is not None and sub.positions.size == cols.size
    got = quant.decode(sub.payload, sub.dtype, sub.shape)[:, sub.positions]
    assert np.array_equal(got, quant.decode(buf, dtype, w.shape)[:, cols])
    assert sub.payload.size < buf.size or dtype in ("q4_block", "q4_tiled", "q1", "q4tp", "q2tp")


@pytest.mark.parametrize("dtype", GATHERED)
def test_gather_rows_equals_decode_then_slice(dtype):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((40, 128)).astype(np.float32)
    rows = np.sort(rng.choice(40, 17, replace=False))
    buf = _stored(w, dtype)
    sub = gather_rows(buf, quant.resolve_dtype(dtype), w.shape, rows)
    assert sub is not None and sub.shape == (17, 128) and sub.payload.size < buf.size // 2
    assert np.array_equal(quant.decode(sub.payload, sub.dtype, sub.shape), quant.decode(buf, dtype, w.shape)[rows])


def test_gather_rows_refuses_what_it_cannot_gather_exactly():
    w = np.ones((4, 64), np.float32)
    for dtype in ("vbit", "q1t", "q1s"):
        assert gather_rows(quant.encode(w, dtype), quant.resolve_dtype(dtype), w.shape, [1, 2]) is None
    assert gather_rows(quant.encode(np.ones((4, 40), np.float32), "q4_block"), quant.resolve_dtype("q4_block"),
                       (4, 40), [1]) is None  # groups straddle rows
    with pytest.raises(ValueError, match="sorted"):
        gather_rows(w.tobytes(), 0, w.shape, [3, 1])
    with pytest.raises(ValueError, match="in 0..3"):
        gather_rows(w.tobytes(), 0, w.shape, [4])


def test_kept_column_fraction_is_what_the_gather_keeps():
    rng = np.random.default_rng(2)
    cols = np.sort(rng.choice(256, 40, replace=False))
    assert kept_column_fraction(quant.resolve_dtype("q8_row"), 256, cols) == 40 / 256
    for dtype in ("q4tp", "q4_tiled"):
        w = rng.standard_normal((8, 256)).astype(np.float32)
        sub = gather_columns(quant.encode(w, dtype), quant.resolve_dtype(dtype), w.shape, cols)
        assert kept_column_fraction(quant.resolve_dtype(dtype), 256, cols) == sub.shape[1] / 256
    assert kept_column_fraction(quant.resolve_dtype("vbit"), 256, cols) is None


def test_gather_columns_refuses_what_it_cannot_gather_exactly():
    w = np.ones((4, 64), np.float32)
    assert gather_columns(quant.encode(w, "vbit"), quant.resolve_dtype("vbit"), w.shape, [1, 2]) is None
    with pytest.raises(ValueError, match="sorted"):
        gather_columns(w.tobytes(), 0, w.shape, [3, 1])


# ----------------------------------------------------------------------------- mask create


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    d = tmp_path_factory.mktemp("texts")
    (d / "calib.txt").write_text(TEXT)
    (d / "heldout.txt").write_text(TEXT[::-1].replace("\n\n", " ") + "\n\n" + TEXT[:400])
    return d


def _raw_masks(path) -> tuple[bytes, dict]:
    with cmf_open(path) as f:
        return bytes(f.section_bytes("masks")), mask_layout(f.arch)


def assert_tail_bits_zero(path) -> None:
    """Every bitfield row of every mask of ``path`` has zero bits past its dimension (spec §5)."""
    raw, lay = _raw_masks(path)
    with cmf_open(path) as f:
        a, meta = f.arch, json.loads(raw[8:8 + int.from_bytes(raw[4:8], "little")])
    fields = [(a.num_layers * max(1, a.num_loops), lay["ffn_bytes"], a.intermediate_size),
              (a.num_layers, lay["head_bytes"], a.num_attention_heads), (1, lay["gates_bytes"], a.num_layers)]
    for m in meta["masks"]:
        off = m["blob_off"]
        parts = fields + ([(a.num_layers, lay["expert_bytes"], a.num_experts)] if m.get("has_expert_fields") else [])
        for rows, nbytes, nbits in parts:
            for r in range(rows):
                last = raw[off + (r + 1) * nbytes - 1]
                assert nbits % 8 == 0 or last >> (nbits % 8) == 0, (m["name"], nbits, last)
            off += rows * nbytes
        assert off == m["blob_off"] + m["blob_len"]


def test_mask_create_quality_equals_a_fresh_cmf_ppl_ratio(texts, tmp_path, capsys):
    out = tmp_path / "m.cmf"
    rep = create_mask(H.converted("qwen3"), "calib", texts / "calib.txt", keep=0.5, heldout=texts / "heldout.txt",
                      heads=True, head_keep=0.75, window=48, out=out)
    q = rep["quality"]
    assert q["metric"] == "heldout_ppl_ratio" and q["n_samples"] > 0 and len(q["dataset_sha256"]) == 64
    ppl = {}
    for task in (["--task", "none"], ["--task", "calib"]):
        assert main(["ppl", str(out), "-f", str(texts / "heldout.txt"), "--window", "48", "--json", *task]) == 0
        ppl[task[1] == "calib"] = json.loads(capsys.readouterr().out)
    # The first mask of a file is its Fallback (task 0): with "general" absent it is the default.
    assert main(["ppl", str(out), "-f", str(texts / "heldout.txt"), "--window", "48", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ppl"] == ppl[True]["ppl"]
    assert q["baseline_dense"] == ppl[False]["ppl"] and q["n_samples"] == ppl[False]["tokens"]
    assert q["value"] == ppl[True]["ppl"] / ppl[False]["ppl"]
    import hashlib

    assert q["dataset_sha256"] == hashlib.sha256((texts / "heldout.txt").read_bytes()).hexdigest()
    with cmf_open(out) as f:
        m = f.masks.get("calib")
        assert f.masks.default_task == "general" and m.quality == q
        assert abs(m.sparsity - 0.5) < 0.02 and m.heads.sum(axis=1).tolist() == [3, 3]
    assert_tail_bits_zero(out)


def test_mask_create_per_layer_and_in_place_growth(texts, tmp_path):
    path = tmp_path / "m.cmf"
    path.write_bytes(H.converted("qwen3").read_bytes())
    create_mask(path, "a", texts / "calib.txt", keep=0.25, per_layer=True, window=64, in_place=True)
    create_mask(path, "b", texts / "calib.txt", keep=0.75, window=64, in_place=True)
    with pytest.raises(cmf.CmfError, match="already has a task mask 'a'"):
        create_mask(path, "a", texts / "calib.txt", keep=0.5, window=64, in_place=True)
    with cmf_open(path) as f:
        assert f.verify() == []
        a, b = f.masks.get("a"), f.masks.get("b")
        assert (a.task_id, b.task_id) == (0, 1) and a.quality is None
        assert a.ffn.sum(axis=1).tolist() == [24, 24] and b.ffn.sum() == 144
    assert_tail_bits_zero(path)


def test_mask_create_scores_are_activation_mass(texts):
    from cmf.tools.mask_create import calibrate, select_neurons

    with cmf.load(H.converted("qwen3")) as m:
        ids = m.tokenizer.encode("hello world expert router model layer", add_special_tokens=False)
        sc = calibrate(m, ids, window=64)
        b = m._blocks[0].ffn
        x = m.weights.rows(m.plan.embed, np.asarray(ids))
        from cmf.runtime.ops.norm import rms_norm_prepared

        # layer 0's FFN input, recomputed: the block up to its post-attention norm
        blk = m._blocks[0]
        h = x + blk.mixer(rms_norm_prepared(x, blk.n_in, blk.eps), blk.new_state(), 0)
        hn = rms_norm_prepared(h, blk.n_post_attn, blk.eps)
        a = b.act(b.gate(hn)) * b.up(hn)
        np.testing.assert_allclose(sc.ffn[0], np.abs(a).sum(axis=0), rtol=1e-4)
    sel = select_neurons({0: np.array([1.0, 5, 3, 3]), 1: np.array([10.0, 10, 10, 40])}, 0.5, per_layer=True)
    assert sel[0].tolist() == [False, True, True, False] and sel[1].tolist() == [True, False, False, True]
    glob = select_neurons({0: np.array([1.0, 5, 3, 3]), 1: np.array([10.0, 10, 10, 40])}, 0.25, per_layer=False)
    assert glob[0].tolist() == [False, True, False, False] and glob[1].tolist() == [False, False, False, True]


# ----------------------------------------------------------------------------- defrag


def test_defrag_equals_the_masked_model_at_f32(qwen3, tmp_path):
    out = tmp_path / "d.cmf"
    rep = defrag(qwen3, out, task="half")
    with cmf_open(qwen3) as f:
        mask = f.masks.get("half")
    kept = mask.ffn.sum(axis=1).tolist()
    assert rep["kept_per_layer"] == kept and rep["pre_intermediate"] == 96
    ids = O.prompt(9)
    with cmf.load(qwen3, task="half") as m:
        ref = m.logits(ids)
    with cmf.load(out) as m:
        got = m.logits(ids)
        assert m.tasks == [] and m.file.masks is None
        assert m.file.verify() == []
        prov = m.file.header.to_dict()["provenance"]["defrag"]
        assert prov == {"source_task": "half", "source": qwen3.name, "pre_intermediate": 96,
                        "post_intermediate_max": max(kept), "kept_per_layer": kept,
                        "pruned_ratio": 1 - sum(kept) / 192}
        assert m.arch.intermediate_size == max(kept)
        for i, k in enumerate(kept):
            p = f"model.layers.{i}.mlp."
            assert m.file.tensor(p + "gate_proj.weight").shape == (k, 64)
            assert m.file.tensor(p + "down_proj.weight").shape == (64, k)
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


def test_defragged_width_invariants_are_checked_on_load(qwen3, tmp_path):
    out = tmp_path / "d.cmf"
    defrag(qwen3, out, task="half")
    bad = tmp_path / "bad.cmf"
    with cmf_open(out) as f, CmfWriter(bad, f.header.to_dict()) as w:
        for name in f:
            t = f.tensor(name)
            if name == "model.layers.1.mlp.down_proj.weight":  # one neuron column short of gate/up
                w.add_array(name, f.array(name)[:, 1:], "f32")
            else:
                w.add(name, t.dtype, t.shape, t.numpy())
    with pytest.raises(cmf.CmfError, match="layer 1: FFN shapes disagree"):
        cmf.load(bad)


def test_defrag_requantizes_and_falls_back_to_q8_2f(tmp_path):
    src = H.converted("qwen3", "q4tp")
    with cmf_open(src) as f:
        a = f.arch
    ffn = np.ones((2, 96), bool)
    ffn[0, :40] = False  # 56 live: not a multiple of 32
    ffn[1, 64:] = False  # 64 live
    path = with_masks(src, tmp_path / "m.cmf", [TaskMask(task_id=0, name="t", **full(a, ffn=ffn))])
    out = tmp_path / "d.cmf"
    defrag(path, out, task="t")
    with cmf_open(out) as f:
        assert f.verify() == []
        assert f.tensor("model.layers.0.mlp.down_proj.weight").dtype.label == "q8_2f"
        assert f.tensor("model.layers.1.mlp.down_proj.weight").dtype.label == "q4tp"
        assert f.tensor("model.layers.0.mlp.gate_proj.weight").dtype.label == "q4tp"
        g = quant.decode(f.tensor("model.layers.1.mlp.gate_proj.weight").numpy(), "q4tp", (64, 64))
    with cmf_open(src) as f:
        g_src = quant.decode(f.tensor("model.layers.1.mlp.gate_proj.weight").numpy(), "q4tp", (96, 64))[:64]
    np.testing.assert_allclose(g, g_src, atol=0.05 * np.abs(g_src).max())  # requantized, not truncated
    ids = O.prompt(10, 24)
    with cmf.load(path, task="t") as m, cmf.load(out) as d:
        assert np.abs(m.logits(ids) - d.logits(ids)).max() < 0.05


def test_defrag_refuses_heads_gates_and_unknown_tasks(qwen3, tmp_path):
    with pytest.raises(cmf.CmfError, match="attention heads"):
        defrag(qwen3, tmp_path / "x.cmf", task="heads")
    with pytest.raises(cmf.CmfError, match="gated off"):
        defrag(qwen3, tmp_path / "x.cmf", task="gate")
    with pytest.raises(cmf.CmfError, match="no task mask 'nope'"):
        defrag(qwen3, tmp_path / "x.cmf", task="nope")
    assert not (tmp_path / "x.cmf").exists()


# ----------------------------------------------------------------------------- MoE


def _stats(kind: str, ids) -> dict:
    with cmf.load(H.converted(kind)) as m:
        return route_stats(m, list(ids), window=64)


@pytest.fixture(scope="module")
def moe_setup(tmp_path_factory):
    """Per family: stats over a calibration prompt, a moe-mask file and a moe-defrag file (cover 0.6)."""
    d = tmp_path_factory.mktemp("moe")
    out = {}
    for kind in ("qwen3_moe", "qwen2_moe"):
        stats = _stats(kind, O.prompt(11, 96))
        (d / f"{kind}.json").write_text(json.dumps(stats))
        masked = d / f"{kind}-mask.cmf"
        moe_mask(H.converted(kind), "code", stats=d / f"{kind}.json", cover=0.6, out=masked)
        cut = d / f"{kind}-defrag.cmf"
        moe_defrag(H.converted(kind), cut, stats=d / f"{kind}.json", cover=0.6)
        out[kind] = (d / f"{kind}.json", masked, cut, stats)
    return out


def test_moe_defrag_equals_runtime_restriction_and_moe_mask_when_norm_topk_prob(moe_setup):
    stats_file, masked, cut, stats = moe_setup["qwen3_moe"]
    ids = O.prompt(12, 32)
    with cmf.load(H.converted("qwen3_moe"), moe_mask=stats_file, moe_mask_cover=0.6) as m:
        assert m.plan.layers[0].ffn.routing.norm_topk_prob
        runtime = m.logits(ids)
        g_runtime = O.greedy(m, ids[:8], 12)
    with cmf.load(masked, task="code") as m:
        task = m.logits(ids)
        g_task = O.greedy(m, ids[:8], 12)
    with cmf.load(cut) as m:
        assert all(len(lp.ffn.experts) < 4 for lp in m.plan.layers)
        cut_logits = m.logits(ids)
        g_cut = O.greedy(m, ids[:8], 12)
    assert np.array_equal(task, runtime)
    np.testing.assert_allclose(cut_logits, runtime, atol=1e-5, rtol=0)
    assert g_cut == g_runtime == g_task
    assert not np.allclose(runtime, O.hf_logits("qwen3_moe", ids), atol=1e-3)  # the cover does cut


def test_moe_defrag_differs_from_the_runtime_mask_when_norm_topk_prob_is_false(moe_setup):
    """qwen2_moe (norm_topk_prob false): the runtime mask keeps p normalised over ALL experts, the
    defragged router over the kept ones (REFERENCE_NOTES §3) — the outputs differ, by design."""
    stats_file, masked, cut, _ = moe_setup["qwen2_moe"]
    ids = O.prompt(13, 32)
    with cmf.load(H.converted("qwen2_moe"), moe_mask=stats_file, moe_mask_cover=0.6) as m:
        assert not m.plan.layers[0].ffn.routing.norm_topk_prob
        runtime = m.logits(ids)
    with cmf.load(masked, task="code") as m:
        assert np.array_equal(m.logits(ids), runtime)  # runtime twins agree exactly
    with cmf.load(cut) as m:
        cut_logits = m.logits(ids)
    assert np.abs(cut_logits - runtime).max() > 1e-3
    # The whole difference: the kept experts' weights are rescaled by 1 / Σ_kept p.
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 6)).astype(np.float32)
    keep = np.array([True, False, True, True, False, True])
    r = Routing(top_k=2, norm_topk_prob=False)
    idx_rt, w_rt = route(logits, r, allowed=keep)
    idx_cut, w_cut = route(logits[:, keep], r)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert np.array_equal(np.flatnonzero(keep)[idx_cut], idx_rt)
    np.testing.assert_allclose(w_cut, w_rt / p[:, keep].sum(axis=1, keepdims=True), rtol=1e-5)
    r = Routing(top_k=2, norm_topk_prob=True)
    np.testing.assert_allclose(route(logits[:, keep], r)[1], route(logits, r, allowed=keep)[1], rtol=1e-6)


def test_moe_defrag_copies_experts_verbatim_and_records_provenance(moe_setup, tmp_path):
    _, _, cut, stats = moe_setup["qwen3_moe"]
    from cmf.runtime.ops.moe import cover_mask

    with cmf_open(H.converted("qwen3_moe")) as src, cmf_open(cut) as out:
        assert out.verify() == []
        prov = out.header.to_dict()["provenance"]["moe_defrag"]
        assert out.arch.num_experts == 4 and prov["cover"] == 0.6
        names = out.keys()
        for layer, counts in stats.items():
            kept = np.flatnonzero(cover_mask(np.array(counts), 0.6)).tolist()
            assert prov["kept_per_layer"][layer] == kept
            assert prov["routing_counts"][layer] == [counts[e] for e in kept]
            p = f"model.layers.{layer}.mlp."
            bank = [n for n in names if n.startswith(p + "experts.")]
            roles = [n.split(".")[-2] for n in bank]
            assert roles == sorted(roles, key=["gate_proj", "up_proj", "down_proj"].index)  # role-contiguous
            for j, e in enumerate(kept):
                for role in ("gate_proj", "up_proj", "down_proj"):
                    a, b = src.tensor(f"{p}experts.{e}.{role}.weight"), out.tensor(f"{p}experts.{j}.{role}.weight")
                    assert a.hash == b.hash and bytes(a.numpy()) == bytes(b.numpy())
            assert f"{p}experts.{len(kept)}.gate_proj.weight" not in out
            router = src.array(p + "gate.weight")[kept]
            assert np.array_equal(out.array(p + "gate.weight"), router)
    # a second cut reads the statistics from provenance (renumbered counts)
    again = tmp_path / "again.cmf"
    rep = moe_defrag(cut, again, cover=0.3)
    assert rep["experts_after"] <= rep["experts_before"]
    with cmf.load(again) as m:
        m.logits([5, 6, 7])


def test_moe_mask_rows_quality_and_errors(moe_setup, tmp_path, texts):
    stats_file, masked, _, stats = moe_setup["qwen3_moe"]
    with cmf_open(masked) as f:
        m = f.masks.get("code")
        assert m.experts is not None and m.quality is None and m.ffn.all() and m.heads.all()
        from cmf.runtime.ops.moe import cover_mask

        for layer, counts in stats.items():
            assert m.experts[int(layer)].tolist() == cover_mask(np.array(counts), 0.6).tolist()
    assert_tail_bits_zero(masked)
    rep = moe_mask(H.converted("qwen3_moe"), "measured", stats=stats_file, cover=0.6, heldout=texts / "heldout.txt",
                   window=48, out=tmp_path / "q.cmf")
    assert rep["quality"]["metric"] == "heldout_ppl_ratio"
    with pytest.raises(cmf.CmfError, match="no MoE layers"):
        moe_mask(H.converted("qwen3"), "x", stats=stats_file, out=tmp_path / "x.cmf")
    with pytest.raises(cmf.CmfError, match="no --stats given"):
        moe_defrag(H.converted("qwen3_moe"), tmp_path / "y.cmf")


# ----------------------------------------------------------------------------- CLI


def test_cli_verbs(texts, tmp_path, capsys, moe_setup):
    src = H.converted("qwen3")
    out = tmp_path / "m.cmf"
    code = main(["mask", "create", str(src), "--name", "cli", "--calib", str(texts / "calib.txt"), "--heldout",
                 str(texts / "heldout.txt"), "--keep", "0.5", "--window", "48", "-o", str(out)])
    text = capsys.readouterr().out
    assert code == 0 and "heldout_ppl_ratio=" in text and "--task cli" in text
    assert main(["masks", str(out), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["masks"][0]["name"] == "cli" and listed["masks"][0]["quality"] != "unmeasured"
    assert main(["run", str(out), "--task", "cli", "-p", "hello", "-n", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["generated_tokens"] >= 1
    assert main(["defrag", str(out), "--task", "cli", "-o", str(tmp_path / "d.cmf"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pruned_ratio"] > 0.3
    stats_file = moe_setup["qwen3_moe"][0]
    assert main(["moe-mask", str(H.converted("qwen3_moe")), "--stats", str(stats_file), "--cover", "0.6",
                 "--name", "m", "-o", str(tmp_path / "mm.cmf")]) == 0
    assert "experts kept" in capsys.readouterr().out
    assert main(["moe-defrag", str(H.converted("qwen3_moe")), "--stats", str(stats_file), "--cover", "0.6",
                 "-o", str(tmp_path / "md.cmf")]) == 0
    assert "experts" in capsys.readouterr().out
    assert main(["defrag", str(out), "--task", "nope", "-o", str(tmp_path / "x.cmf")]) == 2
    assert "no task mask 'nope'" in capsys.readouterr().err
    assert main(["mask", "create", str(src), "--name", "x", "--calib", str(texts / "calib.txt"), "--keep", "0.5"]) == 2
    capsys.readouterr()
