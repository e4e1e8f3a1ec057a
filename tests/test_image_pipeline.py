"""Pipeline containers (spec §12): imagine-pack a tiny Lumina-Image 2.0 folder, run it with imagine.

The oracle is diffusers itself: the same pipeline loaded from its own folder, same seed and
steps. At f32 the decoded image must agree to 1e-5 and the PNG pixels byte for byte; at q8 the
PSNR against the f32 image is reported and held above a floor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("diffusers", reason="the image extra (diffusers) is not installed")
pytest.importorskip("PIL", reason="the image extra (pillow) is not installed")

import image_fixtures  # noqa: E402

import cmf  # noqa: E402
from cmf.cli import main  # noqa: E402
from cmf.format.errors import NotRunnable  # noqa: E402
from cmf.image import ComponentMismatch, MissingComponent, UnsupportedPipeline, packer  # noqa: E402
from cmf.image.loader import load_pipeline  # noqa: E402
from cmf.image.txt2img import generate, to_pixels  # noqa: E402

PROMPT = "a red cat sitting on a blue chair"
STEPS, SIZE, SEED = 3, (64, 64), 7
Q8_PSNR_FLOOR = 35.0  # dB; measured 48 on this fixture (docs/IMAGE.md)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return image_fixtures.build(tmp_path_factory.mktemp("lumina2") / "pipe", seed=0)


@pytest.fixture(scope="module")
def packed(folder: Path) -> dict[str, Path]:
    out = folder.parent
    return {q: packer.pack(folder, out / f"{q}.cmf", q).path for q in ("f32", "q8")}


@pytest.fixture(scope="module")
def reference(folder: Path) -> np.ndarray:
    """diffusers on the original folder: the decoded image before rounding."""
    import torch
    from diffusers import Lumina2Pipeline

    pipe = Lumina2Pipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(PROMPT, num_inference_steps=STEPS, width=SIZE[0], height=SIZE[1], guidance_scale=4.0,
               generator=torch.Generator().manual_seed(SEED), output_type="np")
    return np.asarray(out.images[0], np.float32)


@pytest.fixture(scope="module")
def ours_f32(packed: dict[str, Path]) -> np.ndarray:
    pipe = load_pipeline(packed["f32"]).pipeline
    return generate(pipe, PROMPT, steps=STEPS, size=SIZE, seed=SEED).image


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(1.0 / mse)


# ----------------------------------------------------------------------------------- parity


def test_f32_pack_reproduces_diffusers(reference: np.ndarray, ours_f32: np.ndarray) -> None:
    assert reference.shape == (SIZE[1], SIZE[0], 3)
    assert 0.05 < float(reference.std())  # not a flat image: the comparison means something
    assert float(np.abs(ours_f32 - reference).max()) <= 1e-5


def test_cmf_imagine_png_pixels_equal_diffusers(packed: dict[str, Path], reference: np.ndarray,
                                                tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    png = tmp_path / "out.png"
    rc = main(["imagine", str(packed["f32"]), "-p", PROMPT, "-o", str(png), "--steps", str(STEPS),
               "--size", f"{SIZE[0]}x{SIZE[1]}", "--seed", str(SEED), "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == str(png) and report["steps"] == STEPS and len(report["step_seconds"]) == STEPS - 1
    theirs = VaeImageProcessor.numpy_to_pil(reference[None])[0]
    with Image.open(png) as im:
        assert im.size == SIZE and im.mode == "RGB"
        assert im.tobytes() == theirs.tobytes()  # pixel bytes; the metadata differs by design
        text = dict(im.text)
    with cmf.open(packed["f32"]) as f:
        dir_hash, header_hash = f"{f.envelope.dir_hash:016x}", f"{f.envelope.header_hash:016x}"
    assert text["prompt"] == PROMPT and text["seed"] == str(SEED) and text["steps"] == str(STEPS)
    assert text["size"] == "64x64" and text["cmf_dir_hash"] == dir_hash and text["cmf_header_hash"] == header_hash


def test_q8_psnr_against_f32(packed: dict[str, Path], ours_f32: np.ndarray,
                             record_property: Any) -> None:
    q8 = generate(cmf.image.load(packed["q8"]), PROMPT, steps=STEPS, size=SIZE, seed=SEED).image
    psnr = _psnr(q8, ours_f32)
    record_property("q8_psnr_db", round(float(psnr), 2))
    print(f"q8 vs f32: PSNR {psnr:.2f} dB, max abs {np.abs(q8 - ours_f32).max():.4f}")
    assert psnr >= Q8_PSNR_FLOOR
    assert not np.array_equal(to_pixels(q8), to_pixels(ours_f32))  # q8 really quantized something


def test_load_returns_a_diffusers_pipeline(packed: dict[str, Path]) -> None:
    from diffusers import Lumina2Pipeline

    pipe = cmf.image.load(packed["q8"])
    assert isinstance(pipe, Lumina2Pipeline)
    assert all(p.device.type == "cpu" for p in pipe.transformer.parameters())
    with pytest.raises(cmf.image.ImageError, match="not in this file"):
        pipe.vae.encoder(None)  # only the decoder half is packed


# ----------------------------------------------------------------------------------- layout


def test_layout_follows_spec_12(folder: Path, packed: dict[str, Path]) -> None:
    te_cfg = image_fixtures.read_json(folder / "text_encoder" / "config.json")
    with cmf.open(packed["q8"]) as f:
        names = f.keys()
        for prefix, sub, cfg in (("te", "text_encoder", "config.json"), ("dit", "transformer", "config.json"),
                                 ("vae", "vae", "config.json"), ("scheduler", "scheduler", "scheduler_config.json")):
            t = f.tensor(f"{prefix}.config_json")
            assert t.dtype.label == "u8" and bytes(t.data) == (folder / sub / cfg).read_bytes()
        assert {n.split(".", 1)[0] for n in names} == {"te", "dit", "vae", "scheduler"}
        assert "te.embed_tokens.weight" in names and not any(n.startswith("te.model.") for n in names)
        assert not any("lm_head" in n for n in names)
        assert all(n.startswith(("vae.decoder.", "vae.post_quant_conv.")) or n == "vae.config_json"
                   for n in names if n.startswith("vae."))
        a = f.arch
        assert a.arch_name == "lumina2-image" and a.hidden_size == te_cfg["hidden_size"]
        assert a.num_layers == te_cfg["num_hidden_layers"] and a.vocab_size == te_cfg["vocab_size"]
        prov = f.header.provenance
        assert prov["pipeline"] == "lumina-image-2.0" and set(prov["components"]) == {"te", "dit", "vae"}
        assert prov["diffusers"]["pipeline_class"] == "Lumina2Pipeline"
        assert f.tokenizer_json == (folder / "tokenizer" / "tokenizer.json").read_bytes()
        dtypes = {t.name: t.dtype.label for t in f.tensors()}
    assert dtypes["te.embed_tokens.weight"] == "q8_row"
    assert dtypes["te.layers.0.self_attn.q_proj.weight"] == "q8_row"
    assert dtypes["te.layers.0.input_layernorm.weight"] == "f16"
    assert dtypes["dit.layers.0.norm1.linear.weight"] == "f16"  # adaLN modulation kept high precision
    assert dtypes["dit.layers.0.attn.to_q.weight"] == "q8_row"
    assert {d for n, d in dtypes.items() if n.startswith("vae.") and n != "vae.config_json"} == {"f16"}


def test_policy_overrides_and_q4tp(folder: Path, tmp_path: Path) -> None:
    plan = packer.plan(folder, "q4tp", {"modulation": "q8", "vae": "f32"})
    plan.close()
    by = {t["name"]: t for t in plan.summary()["tensors"]}
    assert by["dit.layers.0.norm1.linear.weight"]["dtype"] == "q8_row"
    assert by["dit.layers.0.attn.to_q.weight"]["dtype"] == "q4tp"
    assert by["te.embed_tokens.weight"]["dtype"] == "q8_row"  # token table stays at q8 under q4tp
    assert by["dit.x_embedder.weight"]["dtype"] == "q8_row"  # 16 input columns: q4tp needs in % 32 == 0
    assert by["vae.decoder.conv_in.weight"]["dtype"] == "f32"


def test_pack_is_deterministic(folder: Path, packed: dict[str, Path], tmp_path: Path) -> None:
    again = packer.pack(folder, tmp_path / "again.cmf", "q8").path
    assert again.read_bytes() == packed["q8"].read_bytes()


def test_packed_file_passes_the_strict_reader_and_verify(packed: dict[str, Path],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    for path in packed.values():
        with cmf.open(path) as f:
            assert f.verify() == []
        assert main(["verify", str(path), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["ok"] and {c["namespace"] for c in report["components"]} == {"te", "dit", "vae", "scheduler"}
    assert main(["verify", str(packed["q8"])]) == 0
    text = capsys.readouterr().out
    assert "dit (Lumina2Transformer2DModel):" in text and "te (Gemma2Model):" in text


def test_info_and_diff_show_components(packed: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(packed["q8"]), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    comps = {c["namespace"]: c for c in d["pipeline"]["components"]}
    assert comps["dit"]["params"] > 0 and "f16" in comps["dit"]["dtypes"] and "q8_row" in comps["te"]["dtypes"]
    assert d["interchange"]["runs_here"] is False
    assert main(["diff", str(packed["f32"]), str(packed["q8"]), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["components"]["tensors"]["dit"]["changed"] > 0
    assert {c["namespace"] for c in d["components"]["b"]} == {"te", "dit", "vae", "scheduler"}


def test_cmf_run_refuses_and_names_imagine(packed: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(packed["q8"]), "-p", "hi"]) == 2
    err = capsys.readouterr().err
    assert "text-to-image pipeline container" in err and "cmf imagine" in err
    with pytest.raises(NotRunnable):
        cmf.load(packed["q8"])


# ----------------------------------------------------------------------------------- errors


def _copy(folder: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "pipe"
    shutil.copytree(folder, dst)
    return dst


@pytest.mark.parametrize("what, remove", [("vae", "vae"), ("tokenizer", "tokenizer/tokenizer.json"),
                                          ("scheduler", "scheduler/scheduler_config.json"),
                                          ("transformer", "transformer/diffusion_pytorch_model.safetensors")])
def test_missing_component_is_named(folder: Path, tmp_path: Path, what: str, remove: str) -> None:
    src = _copy(folder, tmp_path)
    p = src / remove
    shutil.rmtree(p) if p.is_dir() else p.unlink()
    with pytest.raises(MissingComponent, match=what):
        packer.pack(src, tmp_path / "x.cmf", "q8")
    assert not (tmp_path / "x.cmf").exists()


def test_config_that_does_not_match_its_weights(folder: Path, tmp_path: Path) -> None:
    src = _copy(folder, tmp_path)
    cfg_path = src / "transformer" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_layers"] = 3  # the weights have 2 layers
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ComponentMismatch, match=r"transformer.*does not match its weights.*layers\.2\."):
        packer.pack(src, tmp_path / "x.cmf", "q8")
    cfg["num_layers"], cfg["cap_feat_dim"] = 2, 48  # a shape disagreement
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ComponentMismatch, match=r"shape\(s\) differ: dit\.time_caption_embed"):
        packer.pack(src, tmp_path / "x.cmf", "q8")


def test_loader_refuses_a_file_whose_config_does_not_match(folder: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    src = _copy(folder, tmp_path)
    cfg_path = src / "text_encoder" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["intermediate_size"] = 128
    cfg_path.write_text(json.dumps(cfg))
    monkeypatch.setattr(packer, "_validate", lambda *a: False)  # as a pack without diffusers installed
    out = packer.pack(src, tmp_path / "bad.cmf", "f32").path
    assert main(["imagine", str(out), "-p", "x", "-o", str(tmp_path / "x.png"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "te) config does not match its weights" in err and "mlp.gate_proj.weight is [96, 64]" in err
    assert not (tmp_path / "x.png").exists()


def test_truncated_pack_is_refused(packed: dict[str, Path], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    cut = tmp_path / "cut.cmf"
    data = packed["q8"].read_bytes()
    cut.write_bytes(data[: len(data) * 2 // 3])
    assert main(["imagine", str(cut), "-p", "x", "-o", str(tmp_path / "x.png"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("cmf: error:") and "cut.cmf" in err and "internal error" not in err
    with pytest.raises(cmf.CmfError):
        cmf.open(cut)


def test_unsupported_pipeline_class(folder: Path, tmp_path: Path) -> None:
    src = _copy(folder, tmp_path)
    index = json.loads((src / "model_index.json").read_text())
    index["_class_name"] = "FluxPipeline"
    (src / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UnsupportedPipeline, match="FluxPipeline.*two text encoders.*Lumina2Pipeline"):
        packer.plan(src)


def test_bad_imagine_arguments(packed: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = str(tmp_path / "x.png")
    assert main(["imagine", str(packed["q8"]), "-p", "x", "-o", png, "--size", "60x64"]) == 2
    assert "multiples of 16" in capsys.readouterr().err
    assert main(["imagine", str(packed["q8"]), "-p", "x", "-o", png, "--size", "big"]) == 2
    assert "expected WxH" in capsys.readouterr().err
    assert main(["imagine-pack", str(tmp_path), "-o", str(tmp_path / "y.cmf")]) == 2
    assert "model_index.json" in capsys.readouterr().err
    assert main(["imagine-pack", str(tmp_path), "--dry-run", "--policy", "nope=q8"]) == 2
    assert "ROLE=QUANT" in capsys.readouterr().err
