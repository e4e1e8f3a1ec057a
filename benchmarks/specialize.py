"""Specialization: task masks, defrag and moe-defrag, measured.

    python benchmarks/specialize.py [--models ../shared/models] [--windows 12] [--calib-tokens 8192]

1. Dense (../shared/models/base, q8): masks created from each domain's calibration text at keep
   0.75 / 0.5 / 0.25 (``cmf mask create``'s selection: activation mass, one model-wide budget),
   held-out perplexity of each domain under each mask (257-token windows, the quality protocol).
2. Defrag: the rust 50% mask baked with ``cmf defrag``: file size, decode speed (unmasked,
   masked at run time, defragged), held-out perplexity masked vs defragged (requantization).
3. Resident memory: a fresh process per configuration, the file's pages evicted from the page
   cache first (posix_fadvise DONTNEED), then load + 8-token prefill + 24 decode steps. "read"
   = file pages in the page cache afterwards (mincore: what was ever read, MADV_RANDOM disables
   read-ahead), "mapped" = RSS of the file mapping (smaps), "gathered" = the live gate/up rows
   and down_proj columns copied per mask. On the base model and on a synthetic wide layer (hidden 4096, q8:
   one 4 KiB page per gate/up row) with a random 50% mask.
4. MoE: a seeded random Qwen3-MoE (4 layers, 16 experts, top-2, the base tokenizer), q8. Masks
   from each domain keep the top 0.75 / 0.5 / 0.25 of experts by routing counts; moe-defrag at
   cover 0.95 / 0.8 from the rust statistics: experts kept, size, decode speed, perplexity of
   the defragged file vs the runtime restriction (norm_topk_prob true: equal).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, table  # noqa: E402

import cmf  # noqa: E402
from cmf.convert import convert  # noqa: E402
from cmf.format.masks import MaskSet, TaskMask  # noqa: E402
from cmf.tools._maskio import write_masks  # noqa: E402
from cmf.tools.defrag import defrag  # noqa: E402
from cmf.tools.mask_create import build_mask, calibrate  # noqa: E402
from cmf.tools.moe_defrag import moe_defrag  # noqa: E402
from cmf.tools.perplexity import encode_text, perplexity  # noqa: E402

WINDOW = 257
DOMAINS = ("rust", "man", "py")
KEEPS = (0.75, 0.5, 0.25)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def decode_speeds(configs: list[tuple[Path, str | None]], n: int, prompt: list[int], rounds: int = 9) -> list[float]:
    """Best tokens/s per (path, task) of ``n`` single-token forwards after ``prompt`` over
    ``rounds`` rounds. The configurations take turns round by round and the best round counts
    (as timeit does): on a shared 2-core machine, medians mostly measure the neighbours."""
    models = [cmf.load(p, task=t) for p, t in configs]
    rates: list[list[float]] = [[] for _ in configs]
    try:
        for _ in range(rounds):
            for m, r in zip(models, rates):
                cache = m.new_cache()
                logits = m.prefill(prompt, cache)
                t0 = time.perf_counter()
                for _ in range(n):
                    logits = m.forward([int(np.argmax(logits))], cache)
                r.append(n / (time.perf_counter() - t0))
    finally:
        for m in models:
            m.close()
    return [float(np.max(r)) for r in rates]


def ppl_of(m, ids: list[int], windows: int) -> float:
    return perplexity(m, ids, WINDOW, min(windows, len(ids) // WINDOW))["ppl"]


# ----------------------------------------------------------------------------- resident memory


def _resident_child(path: str, task: str | None) -> None:
    """In a fresh process: evict the file, run, report pages read / mapped / gathered (JSON)."""
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    m = cmf.load(path, task=task or None)
    cache = m.new_cache()
    ids = list(range(5, 13))
    logits = m.prefill(ids, cache)
    for _ in range(24):
        logits = m.forward([int(np.argmax(logits))], cache)
    u8 = m.file._parts[0].u8
    base, size = u8.ctypes.data, u8.size
    page = mmap.PAGESIZE
    start = base // page * page
    npages = -(-(base + size - start) // page)
    vec = (ctypes.c_ubyte * npages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(npages * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    res = np.frombuffer(vec, np.uint8) & 1
    read = {"ffn": 0, "other": 0}
    total = {"ffn": 0, "other": 0}
    for t in m.file.tensors():
        a = (base + t.offset - start) // page
        b = (base + t.offset + max(t.nbytes, 1) - 1 - start) // page
        kind = "ffn" if ".mlp." in t.name and "_proj" in t.name else "other"
        read[kind] += int(res[a:b + 1].sum()) * page
        total[kind] += t.nbytes
    rss = 0
    with open("/proc/self/smaps") as fh:
        inside = False
        for line in fh:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= base < hi
            elif inside and head == "Rss:":
                rss += int(line.split()[1]) * 1024
    gathered = sum(b.ffn._masked.nbytes for b in m._blocks if getattr(b.ffn, "_masked", None) is not None)
    print(json.dumps({"read_ffn": read["ffn"], "read_other": read["other"], "ffn_bytes": total["ffn"],
                      "mapped": rss, "gathered": gathered}))


def resident(path: Path, task: str | None) -> dict:
    out = subprocess.run([sys.executable, __file__, "--_resident", str(path), task or ""], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def wide_model(path: Path, hidden: int = 4096, inter: int = 2048, layers: int = 2) -> None:
    """A synthetic qwen3-shaped model whose q8 gate/up rows are one 4 KiB page each."""
    rng = np.random.default_rng(0)
    heads, hd, kv, vocab = 8, 64, 2, 256
    arch = {"arch_name": "qwen3", "hidden_size": hidden, "intermediate_size": inter, "num_layers": layers,
            "num_attention_heads": heads, "num_kv_heads": kv, "head_dim": hd, "vocab_size": vocab,
            "layer_types": ["FullAttention"] * layers, "rms_norm_eps": 1e-6, "max_position_embeddings": 256,
            "norm_style": "qwen", "rope_theta": 10000.0, "tie_word_embeddings": True, "hidden_act": "silu"}
    header = {"format": "cmf", "version": 2, "arch": arch, "quant_type": "Q8_ROW",
              "provenance": {"tool": "benchmarks/specialize.py (synthetic)"}}

    def mat(r, c):
        return (rng.standard_normal((r, c), dtype=np.float32) / np.sqrt(c)).astype(np.float32)

    with cmf.CmfWriter(path, header) as w:
        w.add_array("model.embed_tokens.weight", mat(vocab, hidden), "q8_row")
        w.add_array("model.norm.weight", np.ones(hidden, np.float32), "f16")
        for i in range(layers):
            p = f"model.layers.{i}."
            w.add_array(p + "input_layernorm.weight", np.ones(hidden, np.float32), "f16")
            w.add_array(p + "post_attention_layernorm.weight", np.ones(hidden, np.float32), "f16")
            for n, r, c in (("q", heads * hd, hidden), ("k", kv * hd, hidden), ("v", kv * hd, hidden),
                            ("o", hidden, heads * hd)):
                w.add_array(f"{p}self_attn.{n}_proj.weight", mat(r, c), "q8_row")
            for n, r, c in (("gate", inter, hidden), ("up", inter, hidden), ("down", hidden, inter)):
                w.add_array(f"{p}mlp.{n}_proj.weight", mat(r, c), "q8_row")


def random_half(path: Path, out: Path) -> None:
    with cmf.open(path) as f:
        a = f.arch
    rng = np.random.default_rng(1)
    mask = TaskMask(task_id=0, name="half", ffn=rng.random((a.num_layers, a.intermediate_size)) < 0.5,
                    heads=np.ones((a.num_layers, a.num_attention_heads), bool), gates=np.ones(a.num_layers, bool))
    write_masks(path, MaskSet(default_task="general", masks=[mask]), out)


# ----------------------------------------------------------------------------- MoE fixture


def moe_fixture(folder: Path, base: Path) -> None:
    """A seeded random Qwen3-MoE with the base model's tokenizer (routing made decisive)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=2048, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                         num_experts=16, num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, norm_topk_prob=True, max_position_embeddings=1024,
                         tie_word_embeddings=True, eos_token_id=0, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # router logits O(1): selection depends on the input
            layer.mlp.gate.weight.normal_(0, 1 / np.sqrt(cfg.hidden_size) * 4)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (base / name).exists():
            shutil.copy(base / name, folder / name)


# ----------------------------------------------------------------------------- parts


def ppl_table(path: Path, texts: Path, args, header: str) -> tuple[str, dict]:
    """Per calibration domain and keep: held-out ppl on each domain (ratio to unmasked)."""
    masks: dict[tuple[str, float], TaskMask] = {}
    with cmf.load(path) as m:
        held = {d: encode_text(m.tokenizer, (texts / f"{d}-heldout.txt").read_text(encoding="utf-8"))
                for d in DOMAINS}
        for d in DOMAINS:
            calib = encode_text(m.tokenizer, (texts / f"{d}-calib.txt").read_text(encoding="utf-8"))
            scores = calibrate(m, calib[:args.calib_tokens], WINDOW)
            for k in KEEPS:
                masks[(d, k)] = build_mask(m, scores, f"{d}-{k}", k)
            log(f"{header}: calibrated on {d} ({min(len(calib), args.calib_tokens)} tokens)")
        m.use_mask(None)
        base = {e: ppl_of(m, held[e], args.windows) for e in DOMAINS}
        rows = [["— (unmasked)", "1.00", "0.000"] + [f"{base[e]:.3f}" for e in DOMAINS]]
        for (d, k), mask in masks.items():
            m.use_mask(mask)
            vals = {e: ppl_of(m, held[e], args.windows) for e in DOMAINS}
            rows.append([d, f"{k:.2f}", f"{mask.sparsity:.3f}"]
                        + [f"{vals[e]:.3f} ({vals[e] / base[e]:.3f}×)" for e in DOMAINS])
            log(f"{header}: {d} keep {k}: " + ", ".join(f"{e} {v:.3f}" for e, v in vals.items()))
    head = ["mask from", "keep", "sparsity"] + [f"{e} held-out ppl" for e in DOMAINS]
    return table(head, rows), {"masks": masks, "held": held, "base": base}


def dense_defrag(path: Path, masks: dict, held: dict, d: Path, args) -> str:
    masked = d / "base-masked.cmf"
    rust = masks[("rust", 0.5)]
    rust.name = "rust"
    write_masks(path, MaskSet(default_task="general", masks=[rust]), masked)
    out = d / "base-defrag.cmf"
    rep = defrag(masked, out, task="rust")
    prompt = held["rust"][:16]
    configs = [("unmasked", path, None), ("mask rust 50% (run time)", masked, "rust"), ("defrag rust 50%", out, None)]
    speeds = decode_speeds([(p, t) for _, p, t in configs], args.decode, prompt)
    rows = []
    for (label, p, task), tps in zip(configs, speeds):
        with cmf.load(p, task=task) as m:
            pp = ppl_of(m, held["rust"], args.windows)
        rows.append([label, f"{p.stat().st_size / 2**20:.2f}", f"{tps:.1f}", f"{pp:.3f}"])
    kept = rep["kept_per_layer"]
    return (table(["model", "file MiB", "decode t/s", "rust held-out ppl"], rows)
            + f"\n\nkept per layer {kept} of {rep['pre_intermediate']} (pruned {100 * rep['pruned_ratio']:.1f}%)")


def memory_rows(label: str, path: Path, masked: Path, mask_label: str, task: str) -> list[list[str]]:
    rows = []
    for name, p, t in (("none", path, None), (mask_label, masked, task)):
        r = resident(p, t)
        mib = lambda x: f"{x / 2**20:.2f}"  # noqa: E731
        rows.append([label, name, mib(r["ffn_bytes"]), mib(r["read_ffn"]), mib(r["read_other"]), mib(r["mapped"]),
                     mib(r["gathered"]), mib(r["mapped"] + r["gathered"])])
    return rows


def moe_part(d: Path, base: Path, texts: Path, args) -> str:
    folder = d / "moe-hf"
    moe_fixture(folder, base)
    path = d / "moe-q8.cmf"
    convert(folder, path, quant="q8")
    tab, info = ppl_table(path, texts, args, "moe")
    held = info["held"]
    with cmf.load(path) as m:
        from cmf.tools.route_stats import route_stats

        calib = encode_text(m.tokenizer, (texts / "rust-calib.txt").read_text(encoding="utf-8"))
        stats = route_stats(m, calib[:args.calib_tokens], WINDOW)
    sfile = d / "rust-stats.json"
    sfile.write_text(json.dumps(stats))
    prompt = held["rust"][:16]
    covers = (0.95, 0.8)
    reps, cuts, rts = [], [], []
    for cover in covers:
        out = d / f"moe-defrag-{cover}.cmf"
        reps.append((out, moe_defrag(path, out, stats=sfile, cover=cover)))
        with cmf.load(out) as m:
            cuts.append(ppl_of(m, held["rust"], args.windows))
        with cmf.load(path, moe_mask=sfile, moe_mask_cover=cover) as m:
            rts.append(ppl_of(m, held["rust"], args.windows))
    speeds = decode_speeds([(path, None)] + [(o, None) for o, _ in reps], args.decode, prompt)
    rows = [["full", "+".join(["16"] * 4), f"{path.stat().st_size / 2**20:.2f}", f"{speeds[0]:.1f}", "—",
             f"{info['base']['rust']:.3f}"]]
    for cover, (out, rep), cut, rt, tps in zip(covers, reps, cuts, rts, speeds[1:]):
        rows.append([f"moe-defrag cover {cover}", "+".join(str(v) for v in rep["kept_per_layer"].values()),
                     f"{out.stat().st_size / 2**20:.2f}", f"{tps:.1f}", f"{rt:.3f}", f"{cut:.3f}"])
    return (tab + "\n\n" + table(["model", "experts kept (per layer)", "file MiB", "decode t/s",
                                  "rust ppl, CMF_MOE_MASK", "rust ppl, file"], rows))


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--_resident":
        _resident_child(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=str(Path(__file__).resolve().parents[2] / "shared" / "models"))
    ap.add_argument("--windows", type=int, default=12, help="held-out windows per domain")
    ap.add_argument("--calib-tokens", type=int, default=8192, help="calibration tokens per domain")
    ap.add_argument("--decode", type=int, default=48, help="decode steps per speed sample")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: dense,memory,moe")
    args = ap.parse_args()
    root = Path(args.models)
    base, texts = root / "base", root / "texts"
    if not base.is_dir():
        sys.exit(f"{base} not found: this benchmark needs ../shared/models")
    skip = set(args.skip.split(","))
    t0 = time.time()
    out = [f"# specialize — {datetime.date.today()} — {machine()}\n"]
    with tempfile.TemporaryDirectory() as td:
        d = Path(td)
        path = d / "base-q8.cmf"
        convert(base, path, quant="q8")
        if "dense" not in skip:
            tab, info = ppl_table(path, texts, args, "dense")
            out += [f"Dense: ../shared/models/base at q8, held-out perplexity ({WINDOW}-token windows, at most "
                    f"{args.windows} per domain) under masks made from each domain's calibration text "
                    f"(first {args.calib_tokens} tokens); ratio to unmasked in parentheses.\n", tab, ""]
            out += ["Defrag of the rust 50% mask (decode: best of 9 interleaved rounds of "
                    f"{args.decode} single-token steps after a 16-token prompt):\n",
                    dense_defrag(path, info["masks"], info["held"], d, args), ""]
            log(f"dense done at {time.time() - t0:.0f} s")
        if "memory" not in skip:
            masked = d / "base-masked.cmf"
            if not masked.exists():
                sys.exit("the memory part needs the dense part (its rust mask)")
            wide = d / "wide.cmf"
            wide_model(wide)
            wide_masked = d / "wide-masked.cmf"
            random_half(wide, wide_masked)
            rows = (memory_rows("base q8", path, masked, "rust 50%", "rust")
                    + memory_rows("wide q8 (hidden 4096)", wide, wide_masked, "random 50%", "half"))
            out += ["Resident memory after load + 8-token prefill + 24 decode steps, cold page cache (MiB):\n",
                    table(["model", "mask", "FFN tensors", "FFN read", "other read", "mapped RSS", "gathered",
                           "mapped + gathered"], rows), ""]
            wide_cut = d / "wide-defrag.cmf"
            defrag(wide_masked, wide_cut, task="half")
            speeds = decode_speeds([(wide, None), (wide_masked, "half"), (wide_cut, None)], args.decode // 2,
                                   list(range(5, 21)))
            out += ["Decode speed of the wide model (t/s, best of 9 interleaved rounds of "
                    f"{args.decode // 2} steps):\n",
                    table(["unmasked", "random 50% mask (run time)", "defrag of that mask", "file MiB before / after"],
                          [[f"{speeds[0]:.1f}", f"{speeds[1]:.1f}", f"{speeds[2]:.1f}",
                            f"{wide.stat().st_size / 2**20:.1f} / {wide_cut.stat().st_size / 2**20:.1f}"]]), ""]
            log(f"memory done at {time.time() - t0:.0f} s")
        if "moe" not in skip:
            out += ["MoE: seeded random Qwen3-MoE (4 layers × 16 experts of 128, top-2, norm_topk_prob, hidden 128, "
                    "the base tokenizer), q8. Masks keep the top fraction of experts per layer by routing counts "
                    "on each domain's calibration text.\n", moe_part(d, base, texts, args), ""]
    out.append(f"(total {time.time() - t0:.0f} s)")
    print("\n".join(out))


if __name__ == "__main__":
    main()
