"""Coverage-guided fuzz harnesses (atheris) for every surface that reads untrusted bytes (issue 28).

Each harness is ``one(data: bytes) -> None``: it feeds ``data`` to one surface and returns
normally on success *or on the surface's own typed refusal*; anything else escaping it (another
exception type, a hang, a crash) is a finding. ``seeds(folder)`` writes a seed corpus made by the
project's own writers. ``benchmarks/fuzz_campaign.py`` runs them; ``run_one.py`` runs one.

| harness | surface | typed refusals |
|---|---|---|
| reader | ``cmf.open`` + ``verify`` + every tensor's bytes and small decodes | ``CmfError`` |
| codecs | each codec's decoder and fused kernel on payloads of valid length | ``CmfError`` |
| skill | a standalone skill file: ``cmf.open`` and ``skill apply`` onto a fixed base | ``CmfError`` |
| gguf | the GGUF scan of ``cmf import-gguf`` (header, metadata, array lengths, tensor infos) | ``CmfError`` |
| tokenizer | the tokenizer bundle (the vocab section's tokenizer.json): build, encode, decode, stream-decode | ``CmfError`` |
| template | the tokenizer bundle's chat template in the sandbox (bounded time and output) | ``ChatTemplateError`` |
| pipeline | §12 pipeline containers: components, recipe, component and scheduler configs | ``CmfError`` |
| http | the OpenAI request validators (chat, completions, tokenize, tools, response_format) | ``RequestError`` |
| shards, gguf_import, skill_add | shard sets, ``import-gguf`` with dequantization, ``skill add`` (harnesses_files.py) | ``CmfError`` |
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

SCRATCH = Path(os.environ.get("CMF_FUZZ_SCRATCH") or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))
_tmp = Path(tempfile.mkdtemp(prefix="cmf-fuzz-", dir=SCRATCH))
atexit.register(shutil.rmtree, _tmp, True)
MAX_DECODE_BYTES = 1 << 20  # decode a tensor only below this: the harness measures parsing, not decode speed


def _file(data: bytes, name: str = "in.cmf") -> Path:
    p = _tmp / name
    p.write_bytes(data)
    return p


def _arch() -> dict:
    import fuzz_reader

    return fuzz_reader._arch()


# ----------------------------------------------------------------------------------- reader


def reader_seeds(folder: Path) -> list[bytes]:
    import fuzz_reader

    return [p.read_bytes() for p in fuzz_reader.build_seeds(folder)]


def reader_one(data: bytes) -> None:
    import cmf
    from cmf.format.errors import CmfError

    try:
        with cmf.open(_file(data), shards=False) as f:
            f.verify()
            _ = (f.header.to_dict(), f.masks, f.skills, f.tokenizer_json, f.chat_config)
            for t in f.tensors():
                bytes(f.raw(t.name)[:64])
                if t.nbytes <= MAX_DECODE_BYTES and t.dtype.label not in ("u8", "mix8_4", "q4_col"):
                    f.array(t.name)
    except CmfError:
        pass


# ----------------------------------------------------------------------------------- codecs

_CODEC_DTYPES = ("f32", "f16", "bf16", "q8_row", "q8_2f", "q4_block", "q4_tiled", "q4tp", "q2tp", "q1", "vbit",
                 "vbit_ro", "q1s", "q1t")


def codecs_seeds(folder: Path) -> list[bytes]:
    from cmf import quant

    rng = np.random.default_rng(0)
    out = []
    for i, dt in enumerate(_CODEC_DTYPES):
        rows, k = 4, 2
        w = rng.standard_normal((rows, 32 * k)).astype(np.float32)
        opts = {"mean_bits": 4.25} if dt in ("vbit", "vbit_ro") else {}
        try:
            payload = quant.encode(w, dt, **opts)
        except Exception:  # noqa: BLE001 - a codec without an encoder: raw bytes seed it
            payload = rng.integers(0, 256, 512, dtype=np.uint8).tobytes()
        out.append(bytes([i, rows, k]) + payload)
    return out


def codecs_one(data: bytes) -> None:
    from cmf import kernels, quant
    from cmf.format.constants import Dtype
    from cmf.format.dtypes import expected_nbytes, validate_payload
    from cmf.format.errors import CmfError
    from cmf.format.reader import QTensor

    if len(data) < 3:
        return
    dt = Dtype[_CODEC_DTYPES[data[0] % len(_CODEC_DTYPES)].upper()]
    rows, cols = 1 + data[1] % 16, 32 * (1 + data[2] % 8)
    shape = (rows, cols)
    payload = data[3:]
    need = expected_nbytes(dt, shape)
    if need is not None:  # fixed-size dtype: exactly the valid length (cut or zero-padded)
        payload = payload[:need] + bytes(max(0, need - len(payload)))
    try:
        validate_payload(dt, shape, payload, "fuzz")
        w = quant.decode(payload, dt, shape)
        assert w.shape == shape and w.dtype == np.float32
        u8 = np.frombuffer(payload, dtype=np.uint8) if payload else np.zeros(0, np.uint8)
        qt = QTensor("fuzz", dt, shape, len(payload), 0, 0, 0, u8)
        op = kernels.prepare(qt)
        with np.errstate(invalid="ignore", over="ignore"):  # random float bytes hold NaN and inf
            y = op(np.ones(cols, np.float32))
        assert y.shape == (rows,)
    except CmfError:
        pass


# ----------------------------------------------------------------------------------- skill files


def _base(folder: Path) -> Path:
    from cmf.format.writer import CmfWriter

    p = folder / "skill-base.cmf"
    if not p.exists():
        rng = np.random.default_rng(1)
        with CmfWriter(p, {"version": 2, "arch": _arch(), "quant_type": "F32"}) as w:
            for n in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight"):
                w.add(n, "f32", (64, 96), rng.standard_normal((64, 96)).astype("<f4").tobytes())
    return p


_BASE: list[Path] = []


def skill_seeds(folder: Path) -> list[bytes]:
    from cmf.format.writer import CmfWriter
    from cmf.tools._skill_file import export_skill

    base = _base(folder)
    spec = folder / "skill-spec.cmf"
    rng = np.random.default_rng(2)
    import cmf

    with cmf.open(base) as b, CmfWriter(spec, b.header.to_dict()) as w:
        for t in b.tensors():
            a = b.array(t.name)
            if "layers.1" in t.name:
                a = a + rng.standard_normal(a.shape).astype(np.float32) * 0.1
            w.add(t.name, "f32", a.shape, a.astype("<f4").tobytes())
    out = folder / "skill.cmf"
    export_skill(spec, base, "fuzzskill", out)
    return [out.read_bytes()]


def skill_one(data: bytes) -> None:
    import cmf
    from cmf.format.errors import CmfError
    from cmf.tools._skill_file import apply_skill

    if not _BASE:
        _BASE.append(_base(_tmp))
    try:
        p = _file(data, "skill.cmf")
        with cmf.open(p, shards=False) as f:
            _ = (f.skills, f.is_skill_file)
        apply_skill(_BASE[0], p, _tmp / "applied.cmf", force=True)
    except CmfError:
        pass


# ----------------------------------------------------------------------------------- GGUF


def gguf_seeds(folder: Path) -> list[bytes]:
    import gguf

    p = folder / "seed.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_string("general.name", "fuzz")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    w.add_array("tokenizer.ggml.scores", [0.0, 0.5, 1.0])
    w.add_tensor("token_embd.weight", np.ones((3, 64), np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return [p.read_bytes()]


def gguf_one(data: bytes) -> None:
    from cmf.convert.gguf_scan import scan
    from cmf.format.errors import CmfError

    try:
        scan(_file(data, "in.gguf"))
    except CmfError:
        pass


# ----------------------------------------------------------------------------------- tokenizer bundle


def tokenizer_seeds(folder: Path) -> list[bytes]:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4, "Ġ": 5}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    wl = Tokenizer(models.WordLevel(vocab={"hi": 0, "there": 1, "[UNK]": 2}, unk_token="[UNK]"))
    return [tok.to_str().encode(), wl.to_str().encode()]


def tokenizer_one(data: bytes) -> None:
    """The vocab section as ``cmf.load`` reads it: build, encode, decode, stream-decode."""
    from cmf.format.errors import CmfError
    from cmf.runtime.tokenizer import tokenizer_from_json

    try:
        tok = tokenizer_from_json(data)
        ids = tok.encode("ab hi there ab\n", add_special_tokens=True)
        tok.decode(ids)
        sd = tok.stream_decoder()
        for i in ids[:16] + [0, 1, max(tok.vocab_size - 1, 0)]:
            sd.step(i)
        tok.id_to_token(0)
    except CmfError:
        pass


# ----------------------------------------------------------------------------------- chat templates

_TEMPLATE_SECONDS = 2.0


def template_seeds(folder: Path) -> list[bytes]:
    shared = Path(__file__).resolve().parents[2].parent / "shared" / "conformance"  # real models' templates
    out = [p.read_bytes() for p in sorted(shared.glob("*chat_template*.jinja"))]
    out.append(b"{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               b"{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    out.append(b"{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}{{ m.content|length }}{% endfor %}")
    return out


def template_one(data: bytes) -> None:
    from cmf.runtime import chat_sandbox
    from cmf.runtime.chat import ChatTemplateError, render_chat

    template = data.decode("utf-8", "replace")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}]
    t0 = time.monotonic()
    try:
        out = render_chat(template, msgs, tools=[{"type": "function", "function": {"name": "f"}}],
                          enable_thinking=bool(len(data) & 1), bos_token="<s>", eos_token="</s>")
        assert isinstance(out, str) and len(out) <= 8 * 100 + (1 << 20) + 8 * 64
    except ChatTemplateError:
        pass
    # the sandbox's own deadline is 5 s; a render past it plus slack is a finding
    assert time.monotonic() - t0 < chat_sandbox.RENDER_SECONDS + 2.0, "template render over its deadline"


# ----------------------------------------------------------------------------------- §12 pipeline files


def pipeline_seeds(folder: Path) -> list[bytes]:
    """A pipeline container's layout (spec §12: ``te``/``dit``/``vae`` weights, u8 JSON configs)
    written by CmfWriter; the full packer needs a diffusers checkpoint and torch."""
    from cmf.format.writer import CmfWriter

    arch = dict(_arch(), arch_name="lumina2-image")
    p = folder / "pipeline.cmf"
    cfgs = {"te": {"architectures": ["Gemma2Model"], "hidden_size": 8},
            "dit": {"_class_name": "Lumina2Transformer2DModel", "num_layers": 1},
            "vae": {"_class_name": "AutoencoderKL", "latent_channels": 4},
            "scheduler": {"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 3.0}}
    with CmfWriter(p, {"version": 2, "arch": arch, "quant_type": "F16",
                       "provenance": {"hf_tokenizer_config": {"tokenizer_class": "GemmaTokenizerFast"}}}) as w:
        for ns, cfg in cfgs.items():
            blob = json.dumps(cfg).encode()
            w.add(f"{ns}.config_json", "u8", (len(blob),), blob)
            if ns != "scheduler":
                w.add(f"{ns}.w", "f16", (4, 8), np.ones((4, 8), "<f2").tobytes())
        w.set_vocab(tokenizer_seeds(folder)[0])
    return [p.read_bytes()]


def pipeline_one(data: bytes) -> None:
    """What ``cmf info`` and ``cmf imagine`` read from a container before torch is involved."""
    import cmf
    from cmf.format.errors import CmfError
    from cmf.image.components import components
    from cmf.image.loader import config_of, recipe_of
    from cmf.image.recipes import CONFIG_SUFFIX

    try:
        with cmf.open(_file(data), shards=False) as f:
            components(f)
            recipe = recipe_of(f)
            for c in recipe.components:
                config_of(f, f"{c.prefix}.{CONFIG_SUFFIX}")
            config_of(f, f"{recipe.scheduler_prefix}.{CONFIG_SUFFIX}")
    except CmfError:
        pass


# ----------------------------------------------------------------------------------- HTTP schemas


def http_seeds(folder: Path) -> list[bytes]:
    bodies = [
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stop": ["\n"], "logit_bias": {"3": -5},
         "temperature": 0.5, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "hello", "max_tokens": 4, "logprobs": 2, "echo": True},
        {"prompt": [1, 2, 3], "suffix": None, "seed": -5},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
         "tools": [{"type": "function", "function": {"name": "get", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}],
         "tool_choice": "required"},
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": {
            "name": "o", "schema": {"type": "object", "properties": {"k": {"type": "string"}}}}}},
        {"messages": [{"role": "user", "content": "x"}], "cmf": {"task": "none", "blend": {"a": 1}}},
    ]
    return [json.dumps(b).encode() for b in bodies]


def http_one(data: bytes) -> None:
    from cmf.server import schemas as S
    from cmf.server import structured, tools_calls

    try:
        body = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError):
        return  # the HTTP layer answers these with 400 invalid_json before any validator
    for parse in (S.parse_chat, S.parse_completion, S.parse_tokenize):
        try:
            req = parse(body, vocab=1000)
        except S.RequestError as err:
            assert 400 <= err.status < 500 and set(err.body()["error"]) == {"message", "type", "param", "code"}
            continue
        if isinstance(req, S.ChatRequest):
            try:
                tools_calls.parse_tools(req.raw.get("tools"), req.raw.get("tool_choice"))
                structured.response_format(req.raw.get("response_format"))
            except S.RequestError as err:
                assert 400 <= err.status < 500


HARNESSES: dict[str, tuple[Callable[[Path], list[bytes]], Callable[[bytes], None]]] = {
    "reader": (reader_seeds, reader_one),
    "codecs": (codecs_seeds, codecs_one),
    "skill": (skill_seeds, skill_one),
    "gguf": (gguf_seeds, gguf_one),
    "tokenizer": (tokenizer_seeds, tokenizer_one),
    "template": (template_seeds, template_one),
    "http": (http_seeds, http_one),
    "pipeline": (pipeline_seeds, pipeline_one),
}

from harnesses_files import FILE_HARNESSES  # noqa: E402 - its harnesses use this module's scratch folder

HARNESSES.update(FILE_HARNESSES)
