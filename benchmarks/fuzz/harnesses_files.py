"""Fuzz harnesses for surfaces that read several files or write one (issue 28): shard sets, GGUF
import with dequantization, ``skill add``. Same contract as :mod:`harnesses`: ``one(data)``
returns on success or on the surface's typed refusal (``CmfError``); anything else is a finding.

- ``shards``: a shard set split from ``data`` at ``SEP``: ``cmf.open`` of its first and last name,
  ``verify``, tensor reads, ``verify_model``;
- ``gguf_import``: ``import_gguf`` of a crafted GGUF (Q8_0/Q4_0/K-quant tensors): scan, metadata,
  tokenizer, dequantize, convert (f32 or q8); no ``.gguf-import-*`` folder may be left, a written
  output must verify;
- ``skill_add``: ``add_skill`` of a crafted donor onto a fixed base, to a new file or in place; a
  refused in-place add must leave the base's bytes, no temp file may be left, a written output
  must verify.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

SEP = b"--cmf-shard--"  # between shard files in a shard-set input (mutations keep the framing)
MAX_SHARDS = 6


def _scratch(name: str) -> Path:
    import harnesses as H

    d = H._tmp / name
    d.mkdir(exist_ok=True)
    return d


def _clear(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink()


def _leftovers(folder: Path, keep: set[str]) -> list[str]:
    """Temporary files or folders a refused operation left behind (dot names, not in ``keep``)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") and p.name not in keep)


# ----------------------------------------------------------------------------------- shard sets


def shards_seeds(folder: Path) -> list[bytes]:
    """Sets written by CmfWriter with ``max_shard_bytes``: 3 shards (masks and vocab in shard 1)
    and 2 shards of quantized tensors, each joined with ``SEP``."""
    import fuzz_reader
    from cmf.format.writer import CmfWriter
    from cmf import quant

    rng = np.random.default_rng(4)
    out = []
    for i, (dtype, limit) in enumerate((("f32", 9_000), ("q8_row", 2_000))):  # small inputs mutate faster
        p = folder / f"set{i}.cmf"
        hdr = {"version": 2, "arch": fuzz_reader._arch(), "quant_type": "F32" if dtype == "f32" else "Q8_ROW"}
        with CmfWriter(p, hdr, max_shard_bytes=limit) as w:
            for li in range(2):
                for n in ("up_proj", "down_proj"):
                    a = rng.standard_normal((16, 64) if n == "up_proj" else (64, 32)).astype(np.float32)
                    payload = a.astype("<f4").tobytes() if dtype == "f32" else quant.encode(a, dtype)
                    w.add(f"model.layers.{li}.mlp.{n}.weight", dtype, a.shape, payload)
            w.add("model.norm.weight", "f16", (64,), np.ones(64, "<f2").tobytes())
            if i == 0:
                w.set_masks(fuzz_reader._masks())
                w.set_vocab(b'{"version":"1.0","model":{"type":"BPE","vocab":{"a":0},"merges":[]}}')
        assert len(w.outputs) > 1, w.outputs
        out.append(SEP.join(q.read_bytes() for q in w.outputs))
    return out


def shards_one(data: bytes) -> None:
    import cmf
    from cmf.format.errors import CmfError
    from cmf.format.reader import shard_name
    from cmf.tools.verify import verify_model

    import harnesses as H

    parts = data.split(SEP)[:MAX_SHARDS]
    folder = _scratch("set")
    _clear(folder)
    paths = [folder / shard_name("m", no, len(parts)) for no in range(1, len(parts) + 1)]
    for p, b in zip(paths, parts):
        p.write_bytes(b)
    for p in (paths[0], paths[-1]):  # opening any shard name opens the whole set
        try:
            with cmf.open(p) as f:
                f.verify()
                _ = (f.masks, f.tokenizer_json, f.size, f.paths)
                for t in f.tensors():
                    bytes(f.raw(t.name)[:64])
                    if t.nbytes <= H.MAX_DECODE_BYTES and t.dtype.label not in ("u8", "mix8_4", "q4_col"):
                        f.array(t.name)
        except CmfError:
            pass
    try:
        r = verify_model(paths[0])
        assert isinstance(r["ok"], bool) and (r["ok"] or r["problems"])
    except CmfError:
        pass


# ----------------------------------------------------------------------------------- GGUF import

# A tiny llama whose matrices take every block size: input width 256 for the K-quants, 32 for the
# output projection and down_proj (Q8_0/Q4_0). 1 layer, 2 heads of 16, 1 KV head, vocab 8.
_TINY = {"hidden": 256, "ffn": 32, "heads": 2, "kv": 1, "head_dim": 16, "vocab": 8}
# the K-quant seed: each matrix of the Q8_0 export retyped (bytes arbitrary, sizes exact)
_KQUANTS = {"blk.0.attn_q.weight": "Q4_K", "blk.0.attn_k.weight": "Q6_K", "blk.0.attn_v.weight": "Q5_K",
            "blk.0.ffn_gate.weight": "Q3_K", "blk.0.ffn_up.weight": "Q2_K", "token_embd.weight": "Q4_K",
            "output.weight": "Q6_K", "blk.0.attn_output.weight": "Q4_0", "blk.0.ffn_down.weight": "Q5_0"}


def _tiny_cmf(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    from cmf.format.writer import CmfWriter

    h, i, nh, nkv, hd, v = (_TINY[k] for k in ("hidden", "ffn", "heads", "kv", "head_dim", "vocab"))
    arch = {"arch_name": "llama", "hidden_size": h, "intermediate_size": i, "num_layers": 1,
            "num_attention_heads": nh, "num_kv_heads": nkv, "head_dim": hd, "vocab_size": v,
            "layer_types": ["FullAttention"], "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
            "rope_theta": 10000.0}
    tok = Tokenizer(models.BPE(vocab={"<s>": 0, "</s>": 1, "a": 2, "b": 3, "ab": 4, "Ġ": 5, "c": 6, "d": 7},
                               merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h),
              "model.layers.0.input_layernorm.weight": (h,), "model.layers.0.post_attention_layernorm.weight": (h,),
              "model.layers.0.self_attn.q_proj.weight": (nh * hd, h),
              "model.layers.0.self_attn.k_proj.weight": (nkv * hd, h),
              "model.layers.0.self_attn.v_proj.weight": (nkv * hd, h),
              "model.layers.0.self_attn.o_proj.weight": (h, nh * hd),
              "model.layers.0.mlp.gate_proj.weight": (i, h), "model.layers.0.mlp.up_proj.weight": (i, h),
              "model.layers.0.mlp.down_proj.weight": (h, i)}
    rng = np.random.default_rng(5)
    p = folder / "tiny-llama.cmf"
    with CmfWriter(p, {"version": 2, "arch": arch, "quant_type": "F32"}) as w:
        for n, s in shapes.items():
            w.add(n, "f32", s, rng.standard_normal(s).astype("<f4").tobytes())
        w.set_vocab(tok.to_str().encode())
    return p


def _retype(src: Path, dst: Path, types: dict[str, str]) -> None:
    """Copy GGUF ``src`` to ``dst`` (same metadata) with the named tensors retyped; their bytes are
    seeded random (the gguf package cannot encode K-quants; arbitrary bytes are what a
    hostile file holds anyway)."""
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, field.contents(), field.types[0], sub)
    rng = np.random.default_rng(6)
    for t in r.tensors:
        shape = [int(d) for d in reversed(t.shape.tolist())]
        if t.name in types:
            qt = gguf.GGMLQuantizationType[types[t.name]]
            block, size = gguf.GGML_QUANT_SIZES[qt]
            raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=qt)  # a byte shape: the element shape follows
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_import_seeds(folder: Path) -> list[bytes]:
    """``cmf export --format gguf`` of a tiny llama at Q8_0 and Q4_0, and the Q8_0 file retyped
    to K-quants (Q2_K..Q6_K) and Q5_0."""
    from cmf.convert.gguf_export import export_gguf

    src = _tiny_cmf(folder)
    out = []
    for q in ("Q8_0", "Q4_0"):
        g = folder / f"tiny-{q}.gguf"
        export_gguf(src, g, q)
        out.append(g.read_bytes())
    k = folder / "tiny-K.gguf"
    _retype(folder / "tiny-Q8_0.gguf", k, _KQUANTS)
    out.append(k.read_bytes())
    return out + [b + b"\0" for b in out]  # odd lengths: the same files imported at q8


def gguf_import_one(data: bytes) -> None:
    """``cmf import-gguf`` end to end; the output dtype (f32 or q8) from the input's length."""
    import cmf
    from cmf.convert.gguf import import_gguf
    from cmf.format.errors import CmfError

    import harnesses as H

    folder = _scratch("gguf")
    src = H._file(data, "import.gguf")
    out = folder / "out.cmf"
    out.unlink(missing_ok=True)
    try:
        with np.errstate(all="ignore"):  # arbitrary scales make inf * 0 in the package's dequantizers
            import_gguf(src, out, "q8" if len(data) & 1 else "f32")
    except CmfError:
        assert not out.exists(), "a refused import left an output"
    else:
        with cmf.open(out) as f:
            assert f.verify() == [], "an imported file does not verify"
    assert not _leftovers(folder, set()), f"temporary files left: {_leftovers(folder, set())}"


# ----------------------------------------------------------------------------------- skill add

_SKILL_BASE: list[tuple[Path, bytes]] = []


def skill_add_seeds(folder: Path) -> list[bytes]:
    """Donors for the fixed base (harnesses._base): layer 1 fine-tuned (f32), both layers (f16),
    layer 0 stored q8_row — written by CmfWriter from the base's own header."""
    import cmf
    from cmf import quant
    from cmf.format.writer import CmfWriter

    import harnesses as H

    base = H._base(folder)
    rng = np.random.default_rng(7)
    out = []
    for i, (layers, dtype) in enumerate((({1}, "f32"), ({0, 1}, "f16"), ({0}, "q8_row"))):
        p = folder / f"donor{i}.cmf"
        with cmf.open(base) as b, CmfWriter(p, b.header.to_dict()) as w:
            for t in b.tensors():
                a = b.array(t.name)
                if any(f"layers.{li}." in t.name for li in layers):
                    a = a + rng.standard_normal(a.shape).astype(np.float32) * 0.1
                payload = a.astype("<f4").tobytes() if dtype == "f32" else quant.encode(a, dtype)
                w.add(t.name, dtype, a.shape, payload)
        out.append(p.read_bytes())
    return out + [b + b"\0" for b in out]  # odd lengths: the same donors added in place


def skill_add_one(data: bytes) -> None:
    """``cmf skill add BASE --from DONOR``: in place when the length is odd (on a fresh copy of the
    base), else to a new file; ``--skill-quant q8`` when bit 1 of the length is set."""
    import cmf
    from cmf.format.errors import CmfError
    from cmf.tools._skill_graft import add_skill

    import harnesses as H

    if not _SKILL_BASE:
        p = H._base(H._tmp)
        _SKILL_BASE.append((p, p.read_bytes()))
    base, base_bytes = _SKILL_BASE[0]
    folder = _scratch("skill-add")
    _clear(folder)
    donor = folder / "donor.cmf"
    donor.write_bytes(data)
    in_place = bool(len(data) & 1)
    target = folder / ("base.cmf" if in_place else "added.cmf")
    if in_place:
        target.write_bytes(base_bytes)
    try:
        add_skill(target if in_place else base, donor, "fz", in_place=in_place,
                  output=None if in_place else target, skill_quant="q8" if len(data) & 2 else None)
    except CmfError:
        if in_place:
            assert target.read_bytes() == base_bytes, "a refused in-place skill add changed the base"
        else:
            assert not target.exists(), "a refused skill add left an output"
    else:
        with cmf.open(target) as f:
            assert f.verify() == [], "the grown file does not verify"
            assert "fz" in [s.id for s in f.skills]
    assert not _leftovers(folder, set()), f"temporary files left: {_leftovers(folder, set())}"


FILE_HARNESSES = {
    "shards": (shards_seeds, shards_one),
    "gguf_import": (gguf_import_seeds, gguf_import_one),
    "skill_add": (skill_add_seeds, skill_add_one),
}
