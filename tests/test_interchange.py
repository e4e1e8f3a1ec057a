"""Interchange with the reference implementation (docs/INTERCHANGE.md): keys this runtime does
not model are refused at load, ``cmf info`` says what a file needs and whether it runs here,
verify on load, the default-task rule and ``task="none"``, a skill's ``input_mask_task``, and a
compacted shard set's single file. Fixtures are written with pycmf's own writer."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _builders import write_sample

import cmf
from cmf.cli import main
from cmf.format.errors import HashMismatch, NotRunnable
from cmf.format.masks import MaskSet, TaskMask
from cmf.format.reader import open as cmf_open
from cmf.format.writer import CmfWriter
from cmf.runtime import features
from cmf.tools.info import info, render

IDS = [5, 17, 42, 9, 88, 21, 130, 7, 64, 30, 12, 19]


@pytest.fixture(scope="module")
def base() -> Path:
    """The qwen3 fixture (2 layers, f32): a model that runs."""
    pytest.importorskip("transformers")
    import hf_fixtures as H

    return H.converted("qwen3")


def rewrite(src: Path, dst: Path, *, arch: dict | None = None, top: dict | None = None,
            extra: dict[str, np.ndarray] | None = None, masks: MaskSet | None = None,
            skills: list[dict] | None = None) -> Path:
    """A copy of ``src`` with arch keys set (None deletes), top-level header keys set, extra f32
    tensors, a masks section and a skills registry."""
    with cmf_open(src) as f:
        h = f.header.to_dict()
        for k, v in (arch or {}).items():
            if v is None:
                h["arch"].pop(k, None)
            else:
                h["arch"][k] = v
        h.update(top or {})
        if skills is not None:
            h["skills"] = skills
        with CmfWriter(dst, h) as w:
            for name in f:
                if extra and name in extra:
                    continue
                t = f.tensor(name)
                w.add(name, t.dtype, t.shape, t.numpy())
            for name, a in (extra or {}).items():
                w.add_array(name, np.asarray(a, np.float32), "f32")
            if masks is not None:
                w.set_masks(masks)
            if f.tokenizer_json is not None:
                w.set_vocab(f.tokenizer_json)
    return dst


def _logits(path: Path, **kw: Any) -> np.ndarray:
    with cmf.load(path, **kw) as m:
        return m.logits(IDS)


# ----------------------------------------------------------------------------- 1. refusals

_GDN = {"linear_conv_kernel_dim": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16}
_V = np.ones(64, np.float32)

# How to make a file need each unmodelled feature: (arch changes, extra tensors).
TRIGGERS: dict[str, tuple[dict[str, Any], dict[str, np.ndarray]]] = {
    "layer_types:ShortConv": ({"layer_types": ["ShortConv", "FullAttention"], "linear_conv_kernel_dim": 3}, {}),
    "layer_types:Kda": ({"layer_types": ["FullAttention", "Kda"], **_GDN}, {}),
    "arch.kda_gate_lower_bound": ({"kda_gate_lower_bound": -5.0}, {}),
    "arch.linear_core.kind": ({"layer_types": ["LinearAttention", "FullAttention"], **_GDN,
                               "linear_core": {"kind": "vmf_phase", "num_heads": 2, "value_head_dim": 16,
                                               "nphase": 4}}, {}),
    "arch.mla.nope": ({"mla": {"kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                               "v_head_dim": 16, "nope": True}}, {}),
    "arch.global_head_dim": ({"global_head_dim": 32}, {}),
    "arch.num_global_kv_heads": ({"num_global_kv_heads": 1}, {}),
    "arch.global_partial_rotary_factor": ({"global_partial_rotary_factor": 0.25}, {}),
    "arch.attn_v_norm": ({"attn_v_norm": True}, {}),
    "arch.qk_norm_after_rope": ({"qk_norm_after_rope": True}, {}),
    "arch.hidden_act": ({"hidden_act": "situ", "activation_situ_beta": 1.0}, {}),
    "arch.moe.router_resonance": ({"moe": {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 32,
                                           "router_resonance": True}}, {}),
    "tensor:mlp.per_expert_scale": ({}, {"model.layers.0.mlp.per_expert_scale": np.ones(4, np.float32)}),
    "tensor:mlp.gate_proj+mlp.gate": ({"moe": {"num_experts": 4, "top_k": 2, "moe_intermediate_size": 32}},
                                      {"model.layers.0.mlp.gate.weight": np.zeros((4, 64), np.float32)}),
    "tensor:mlp.tid2eid": ({}, {"model.layers.0.mlp.tid2eid": np.zeros((16, 2), np.float32)}),
    "tensor:hc_*": ({}, {"model.layers.0.hc_attn_fn": np.zeros((24, 256), np.float32)}),
    "tensor:layer_scalar": ({}, {"model.layers.1.layer_scalar": np.ones(1, np.float32)}),
    "tensor:mlp.*_proj.tube": ({}, {"model.layers.0.mlp.gate_proj.tube0.weight": np.zeros((32, 64), np.float32)}),
    "arch.g3n": ({"g3n": {"altup_num_inputs": 4, "laurel_rank": 8, "ple_dim": 16, "ple_vocab": 128,
                          "num_kv_shared_layers": 0, "activation_sparsity": [0.0, 0.0]}}, {}),
    "arch.qwen4_exp": ({"qwen4_exp": {"hc_count": 4}}, {}),
    "arch.deepseek_v41": ({"deepseek_v41": {"text_config": {}}}, {}),
    "arch.prism_hadamard": ({"prism_hadamard": {"version": 1, "block_size": 64}}, {}),
    "arch.head_clusters": ({"head_clusters": 4}, {}),
    "arch.num_loops": ({"num_loops": 2}, {}),
    "arch.loop_final_norm": ({"loop_final_norm": True}, {}),
    "tensor:te.*/dit.*/vae.*": ({}, {"te.config_json_like": np.ones(64, np.float32)}),
}


def test_every_unmodelled_feature_has_a_refusal_case():
    unmodelled = {f.key for f, _ in features.ENTRIES if not f.modelled and f.key != "layer_types"}
    # "layer_types" (an unknown tag) cannot reach the runtime: the header parser refuses the tag.
    assert unmodelled <= set(TRIGGERS), unmodelled - set(TRIGGERS)


@pytest.mark.parametrize("key", sorted(TRIGGERS))
def test_unmodelled_key_opens_as_a_container_but_load_refuses_naming_it(base, tmp_path, key):
    feature = next(f for f, _ in features.ENTRIES if f.key == key)
    if feature.modelled:
        pytest.skip(f"{key} is modelled now ({feature.owner or 'this runtime'})")
    arch, extra = TRIGGERS[key]
    path = rewrite(base, tmp_path / "m.cmf", arch=arch, extra=extra)
    with cmf.open(path) as f:  # a valid container
        assert key in features.report(f.header, f.keys())["not_modelled"]
    with pytest.raises(NotRunnable) as exc:
        cmf.load(path)
    assert key in exc.value.unmet and key.split(":")[-1] in str(exc.value)
    d = info(path)["interchange"]
    assert d["runs_here"] is False and key in d["not_modelled"]


def test_refusal_on_the_command_line(base, tmp_path, capsys):
    path = rewrite(base, tmp_path / "m.cmf", arch={"attn_v_norm": True})
    assert main(["run", str(path), "-p", "hi", "-n", "1"]) == 2
    assert "arch.attn_v_norm" in capsys.readouterr().err
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "runs here: no (arch.attn_v_norm (Gemma-4 scale-less V norm))" in out


def test_flags_that_are_off_are_not_requirements(base, tmp_path):
    path = rewrite(base, tmp_path / "m.cmf", arch={"attn_v_norm": False, "qk_norm_after_rope": False,
                                                     "num_loops": 1, "global_head_dim": None})
    np.testing.assert_array_equal(_logits(path), _logits(base))


# ----------------------------------------------------------------------------- 2. cmf info


def test_info_needs_and_runs_here(base, capsys):
    d = info(base)["interchange"]
    assert d["needs"][0] == "layer_types:FullAttention" and d["runs_here"] is True
    assert d["reference_unknown"] == [] and d["reference_unwritten_dtypes"] == {}
    assert main(["info", str(base)]) == 0
    text = capsys.readouterr().out
    assert f"needs: {', '.join(d['needs'])}\nruns here: yes" in text
    assert "needs a reader" not in text and "never write" not in text
    assert main(["info", str(base), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["interchange"]["runs_here"] is True


@pytest.mark.parametrize("arch,key", [
    ({"rope_attention_factor": 1.19}, "arch.rope_attention_factor"),
    ({"hidden_act": "gelu"}, "arch.hidden_act"),
    ({"yarn": {"factor": 4.0, "original_max_position_embeddings": 64, "truncate": False}}, "arch.yarn.truncate"),
    ({"moe": {"num_experts": 8, "top_k": 2, "moe_intermediate_size": 32, "n_group": 4, "topk_group": 2}},
     "arch.moe.n_group"),
])
def test_info_names_keys_the_reference_does_not_read(arch, key, tmp_path):
    write_sample(tmp_path / "s.cmf", hdr=_sample_header(arch))
    d = info(tmp_path / "s.cmf")
    x = d["interchange"]
    assert x["runs_here"] is True and key in x["reference_unknown"]
    assert f"needs a reader that understands: {key}" in render(d)


def test_keys_with_a_reference_equivalent_are_not_flagged(tmp_path):
    """``rope_freq_factors`` is the reference's own key (loader.rs divides inv_freq by it after
    every build): llama-3 / linear scaling files need no other reader; group limiting off."""
    write_sample(tmp_path / "s.cmf", hdr=_sample_header({
        "rope_freq_factors": [1.0] * 8,
        "moe": {"num_experts": 8, "top_k": 2, "moe_intermediate_size": 32, "n_group": 1, "topk_group": 1}}))
    x = info(tmp_path / "s.cmf")["interchange"]
    assert x["reference_unknown"] == [] and "arch.rope_freq_factors" in x["needs"]


def test_info_says_when_a_dtype_is_one_the_reference_never_writes(tmp_path):
    write_sample(tmp_path / "s.cmf")  # its lm_head is bf16
    d = info(tmp_path / "s.cmf")
    assert d["interchange"]["reference_unwritten_dtypes"] == {"bf16": 1}
    assert "dtypes the reference tools never write: bf16 (1 tensors)" in render(d)


def _sample_header(arch: dict) -> dict:
    from _builders import header

    h = header()
    h["arch"].update(arch)
    return h


# ----------------------------------------------------------------------------- 3. verify on load


def _tampered(base: Path, tmp_path: Path) -> tuple[Path, str]:
    path = rewrite(base, tmp_path / "t.cmf")
    name = "model.layers.1.mlp.down_proj.weight"
    with cmf_open(path) as f:
        off = f.tensor(name).offset + 100
    data = bytearray(path.read_bytes())
    data[off] ^= 0x40
    path.write_bytes(bytes(data))
    return path, name


def test_verify_on_load_refuses_a_tampered_file(base, tmp_path):
    path, name = _tampered(base, tmp_path)
    with cmf.load(path) as m:  # hashes are checked on demand only (spec §1.2)
        m.logits(IDS[:2])
    with pytest.raises(HashMismatch, match=name):
        cmf.load(path, verify=True)
    with cmf.load(base, verify=True) as m:
        assert m.task is None


@pytest.mark.parametrize("verb", [["run", "-p", "hi", "-n", "1"], ["bench", "-p", "4", "-n", "2", "-r", "1"]])
def test_verify_flag_on_the_command_line(base, tmp_path, capsys, verb):
    path, name = _tampered(base, tmp_path)
    assert main([verb[0], str(path), "--verify", *verb[1:]]) == 2
    err = capsys.readouterr().err
    assert "verify on load" in err and name in err


# ----------------------------------------------------------------------------- 4. default task


def _mask(a, name: str, task_id: int, priority: str | None, seed: int) -> TaskMask:
    rng = np.random.default_rng(seed)
    return TaskMask(task_id=task_id, name=name, priority=priority,
                    ffn=rng.random((a.num_layers, a.intermediate_size)) < 0.5,
                    heads=np.ones((a.num_layers, a.num_attention_heads), bool), gates=np.ones(a.num_layers, bool))


@pytest.fixture(scope="module")
def arch_of(base):
    with cmf_open(base) as f:
        return f.arch


@pytest.mark.parametrize("default,priorities,expect", [
    ("b", (None, None), "b"),                   # spec §5.1: default_task names a mask
    ("general", (None, None), "a"),             # no such mask: the Fallback one (task 0)
    ("general", ("Normal", "Fallback"), "b"),   # the Fallback one wherever it is
    ("general", ("Normal", "Primary"), "a"),    # none is Fallback: the first
])
def test_default_task_rule(base, arch_of, tmp_path, default, priorities, expect):
    ms = MaskSet(default_task=default, masks=[_mask(arch_of, "a", 0, priorities[0], 1),
                                             _mask(arch_of, "b", 1, priorities[1], 2)])
    path = rewrite(base, tmp_path / "m.cmf", masks=ms)
    with cmf.load(path) as m:
        assert m.task == expect
        np.testing.assert_array_equal(m.logits(IDS), _logits(path, task=expect))


def test_task_none_runs_unmasked(base, arch_of, tmp_path, capsys):
    ms = MaskSet(default_task="general", masks=[_mask(arch_of, "a", 0, None, 1)])
    path = rewrite(base, tmp_path / "m.cmf", masks=ms)
    plain = _logits(base)
    with cmf.load(path, task="none") as m:
        assert m.task is None
        np.testing.assert_array_equal(m.logits(IDS), plain)
        m.select()  # back to the default rule
        assert m.task == "a" and not np.array_equal(m.logits(IDS), plain)
        m.select(task="none")
        np.testing.assert_array_equal(m.logits(IDS), plain)
    text = tmp_path / "t.txt"
    text.write_text("hello model tensor weight layer expert token hello world rope quant shard\n\n" * 4)
    ppl = {}
    for key, p, task in (("plain", base, []), ("none", path, ["--task", "none"]), ("default", path, [])):
        assert main(["ppl", str(p), "-f", str(text), "--window", "16", "--json", *task]) == 0
        ppl[key] = json.loads(capsys.readouterr().out)["ppl"]
    assert ppl["none"] == ppl["plain"] != ppl["default"]


# ----------------------------------------------------------------------------- 5. input_mask_task


@pytest.fixture(scope="module")
def linked(base, arch_of, tmp_path_factory) -> Path:
    """A skill "s" replacing layer 1's FFN, linked to the task mask "sparse" (as `cortiq skill
    add --sparse` links them); "general" is an all-on Fallback mask, so the default is unmasked."""
    a = arch_of
    rng = np.random.default_rng(7)
    with cmf_open(base) as f:
        extra = {f"skill.s.model.layers.1.mlp.{r}_proj.weight":
                 f.array(f"model.layers.1.mlp.{r}_proj.weight") * (1 + 0.2 * rng.standard_normal(
                     f.tensor(f"model.layers.1.mlp.{r}_proj.weight").shape)).astype(np.float32)
                 for r in ("gate", "up", "down")}
    full = dict(ffn=np.ones((a.num_layers, a.intermediate_size), bool),
                heads=np.ones((a.num_layers, a.num_attention_heads), bool), gates=np.ones(a.num_layers, bool))
    ms = MaskSet(default_task="general", masks=[
        TaskMask(task_id=0, name="general", priority="Fallback",
                 quality={"metric": "heldout_ppl_ratio", "value": 1.0}, **full),
        _mask(a, "sparse", 1, "Normal", 3)])
    skills = [{"id": "s", "layers": [1], "input_mask_task": "sparse"},
              {"id": "dangling", "layers": [1], "input_mask_task": "missing"}]
    extra["skill.dangling.model.layers.1.mlp.gate_proj.weight"] = extra["skill.s.model.layers.1.mlp.gate_proj.weight"]
    return rewrite(base, tmp_path_factory.mktemp("linked") / "m.cmf", masks=ms, skills=skills, extra=extra)


def test_selecting_a_skill_activates_its_input_mask_task(linked):
    explicit = _logits(linked, skill="s", task="sparse")
    with cmf.load(linked, skill="s") as m:
        assert m.task == "sparse"
        np.testing.assert_array_equal(m.logits(IDS), explicit)
        m.select(skill="none")  # the backbone: its default task ("general", all on)
        assert m.task == "general"
        m.select(skill="s")
        assert m.task == "sparse"
        np.testing.assert_array_equal(m.logits(IDS), explicit)
    assert not np.array_equal(explicit, _logits(linked, skill="s", task="none"))


def test_an_explicit_task_wins_over_the_skills_mask(linked):
    with cmf.load(linked, skill="s", task="general") as m:
        assert m.task == "general"
        np.testing.assert_array_equal(m.logits(IDS), _logits(linked, skill="s", task="none"))
    with cmf.load(linked) as m:
        assert m.task == "general" and m.skill is None


def test_a_link_to_a_missing_mask_warns_and_the_default_applies(linked, caplog):
    with caplog.at_level(logging.WARNING, logger="cmf"):
        with cmf.load(linked, skill="dangling") as m:
            assert m.task == "general"
    assert "input_mask_task 'missing'" in caplog.text


def test_run_with_the_skill_uses_its_mask(linked, capsys):
    args = ["run", str(linked), "-p", "hello model", "-n", "4", "--raw", "--json"]
    assert main([*args, "--skill", "s"]) == 0
    a = json.loads(capsys.readouterr().out)
    assert main([*args, "--skill", "s", "--task", "sparse"]) == 0
    b = json.loads(capsys.readouterr().out)
    assert a["text"] == b["text"]


# ----------------------------------------------------------------------------- 6. compacted shard set


def test_a_compacted_shard_set_opens_as_one_file(base, tmp_path):
    """`cortiq compact` of a set writes one file whose header keeps {"shard": {"no": 1, "count": N}}
    (moedefrag.rs cmd_compact writes the input header verbatim): it opens and runs as one file."""
    with cmf_open(base) as f:
        h = f.header.to_dict()
        parts = CmfWriter(tmp_path / "set.cmf", h, max_shard_bytes=200_000)
        with parts as w:
            for name in f:
                t = f.tensor(name)
                w.add(name, t.dtype, t.shape, t.numpy())
            w.set_vocab(f.tokenizer_json)
        count = len(parts.outputs)
        assert count > 1
        h["shard"] = {"no": 1, "count": count}
        out = tmp_path / "compact.cmf"
        with CmfWriter(out, h) as w:
            for name in f:
                t = f.tensor(name)
                w.add(name, t.dtype, t.shape, t.numpy())
            w.set_vocab(f.tokenizer_json)
    with cmf.open(out) as g:
        assert g.paths == [out] and g.header.shard.count == count and g.verify() == []
    np.testing.assert_array_equal(_logits(out), _logits(base))
    np.testing.assert_array_equal(_logits(parts.outputs[0]), _logits(base))
