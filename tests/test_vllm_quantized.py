"""``quantized: keep`` (cmf.integrations.vllm.quantized): the compressed-tensors tensors handed to vLLM.

No vLLM engine is started: the packed int8/int4 tensors, unpacked by the methods' documented
layout (and, in the vLLM venv, by vLLM's own helpers), must equal pycmf's decode bit for bit.
The engine runs are in test_vllm_plugin.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import cmf  # noqa: E402
import hf_fixtures as H  # noqa: E402
from cmf.integrations.vllm import iter_hf_weights, prepare, read_source  # noqa: E402
from cmf.integrations.vllm.quantized import dequantize_kept, pack_int32, quantization_config  # noqa: E402
from cmf.integrations.vllm.weights import iter_hf_tensors, kept_plan  # noqa: E402

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not importable in this venv (run with .venv-vllm/bin/python -m pytest)")


@pytest.mark.parametrize("quant", ["q8", "q4", "q4t", "q4tp"])
def test_kept_weights_dequantize_to_pycmf_values(quant: str, tmp_path: Path) -> None:
    """quantized=keep: the compressed-tensors tensors, unpacked by the methods' documented layout,
    equal pycmf's decode bit for bit; the other tensors are the dequantized stream as before."""
    src = H.converted("qwen3", quant)
    with cmf.open(src) as f:
        want = dict(iter_hf_weights(f))
        plan = kept_plan(f)
        got = {n: a for n, a, _ in iter_hf_tensors(f, quantized="keep")}
    assert plan, "nothing kept"
    for name, (scheme, _) in plan.items():
        mod = name[:-len(".weight")]
        assert got[name].dtype == np.int8 if scheme == "w8a8" else name not in got  # w8a8 keeps the name
        deq = dequantize_kept(got, mod, scheme)
        assert deq.dtype == np.float32 and np.array_equal(deq, want[name]), name
    for name in set(want) - set(plan):
        assert got[name].dtype == np.float32 and np.array_equal(got[name], want[name]), name
    qc = quantization_config(plan)
    targets = {t for g in qc["config_groups"].values() for t in g["targets"]}
    assert targets == {n[:-len(".weight")] for n in plan}
    folder = prepare(src, cache_dir=tmp_path, quantized="keep")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["quantization_config"] == json.loads(json.dumps(qc))
    assert read_source(folder)["quantized"] == "keep"
    assert "quantization_config" not in json.loads((prepare(src, cache_dir=tmp_path) / "config.json").read_text())


def test_kept_groups_share_one_scheme() -> None:
    """q/k/v and gate/up are one layer in vLLM: a group is kept only when all members are."""
    with cmf.open(H.converted("qwen3", "q4tp")) as f:
        plan = kept_plan(f)
    for layer in {n.rsplit(".", 3)[0] for n in plan}:
        qkv = [f"{layer}.self_attn.{p}_proj.weight" in plan for p in "qkv"]
        gu = [f"{layer}.mlp.{p}_proj.weight" in plan for p in ("gate", "up")]
        assert len(set(qkv)) == 1 and len(set(gu)) == 1


def test_pack_int32_layout() -> None:
    nib = np.arange(16, dtype=np.uint8).reshape(1, 16)
    words = pack_int32(nib).view(np.uint32)
    assert words.tolist() == [[0x76543210, 0xFEDCBA98]]  # input 8j+i in bits 4i..4i+3 of word j


@needs_vllm
def test_kept_int4_tensors_unpack_with_vllms_own_helpers() -> None:
    """vLLM's unpacking (quant_utils, no engine) of the kept W4A16 tensors gives pycmf's nibbles."""
    import torch
    from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32
    from vllm.scalar_type import scalar_types

    with cmf.open(H.converted("qwen3", "q4tp")) as f:
        want = dict(iter_hf_weights(f))
        plan = kept_plan(f)
        got = {n: a for n, a, _ in iter_hf_tensors(f, quantized="keep")}
    assert plan
    for name in plan:
        mod = name[:-len(".weight")]
        q = unpack_quantized_values_into_int32(torch.from_numpy(got[f"{mod}.weight_packed"]), scalar_types.uint4b8, 1)
        vals = (q.float() - scalar_types.uint4b8.bias) * torch.from_numpy(got[f"{mod}.weight_scale"]).repeat_interleave(32, 1)
        assert torch.equal(vals, torch.from_numpy(want[name])), name


def test_prepare_cli_quantized_keep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cmf.integrations.vllm.__main__ import main

    src = H.converted("qwen3", "q8")
    assert main(["prepare", str(src), "--quantized", "keep", "--cache-dir", str(tmp_path)]) == 0
    folder = Path(capsys.readouterr().out.strip())
    assert folder.name.endswith("-keep") and read_source(folder)["quantized"] == "keep"


def test_kept_config_must_match_the_file(tmp_path: Path) -> None:
    """A keep folder made for one file (or skill) is refused for another whose kept layers differ."""
    from cmf.integrations.vllm import UnsupportedSelection
    from cmf.integrations.vllm.weights import check_kept_config

    q8, q4 = H.converted("qwen3", "q8"), H.converted("qwen3", "q4tp")
    cfg = json.loads((prepare(q8, cache_dir=tmp_path, quantized="keep") / "config.json").read_text())
    with cmf.open(q8) as f:
        check_kept_config(f, None, cfg["quantization_config"], "folder")  # its own file: fine
    with cmf.open(q4) as f, pytest.raises(UnsupportedSelection, match="does not match"):
        check_kept_config(f, None, cfg["quantization_config"], "folder")



def test_keep_folder_per_skill(tmp_path: Path) -> None:
    """A skill's tensors may be stored in other dtypes than the backbone's: keep folders are per skill."""
    import skill_fixtures as SF

    m, _ = SF.cmf_with_skill(tmp_path, "q8")
    plain = prepare(m, cache_dir=tmp_path / "c", quantized="keep")
    skilled = prepare(m, cache_dir=tmp_path / "c", quantized="keep", skill="d1")
    assert skilled.name.startswith(plain.name + "-d1-") and read_source(skilled)["skill"] == "d1"
    from cmf.integrations.vllm.weights import check_kept_config

    cfg = json.loads((skilled / "config.json").read_text())
    with cmf.open(m) as f:
        check_kept_config(f, "d1", cfg.get("quantization_config"), "folder")
