"""Resident memory (runtime/memory.py): what the runtime gives back once it no longer needs it —
the compiler's code pages, looked-up embedding rows — and that nothing read afterwards changes."""

from __future__ import annotations

import os

import numba
import numpy as np
import pytest
from _builders import present_pages

import cmf
from cmf.format.writer import CmfWriter
from cmf.runtime import memory
from cmf.runtime.memory import idle_code_ranges
from cmf.runtime.model import EMBED_RELEASE_EVERY

needs_pagemap = pytest.mark.skipif(not os.access("/proc/self/pagemap", os.R_OK) or
                                   not os.access("/proc/self/smaps", os.R_OK), reason="no /proc/self/pagemap")

SMAPS = """\
7f0000000000-7f0000100000 r--p 00000000 fd:01 123 /venv/llvmlite/binding/libllvmlite.so
Size:               1024 kB
Rss:                 512 kB
Anonymous:             0 kB
VmFlags: rd mr mw me sd
7f0000100000-7f0004000000 r-xp 00100000 fd:01 123 /venv/llvmlite/binding/libllvmlite.so
Size:              64512 kB
Anonymous:             0 kB
7f0004000000-7f0004200000 r--p 04000000 fd:01 123 /venv/llvmlite/binding/libllvmlite.so
Anonymous:          1792 kB
7f0004200000-7f0004210000 rw-p 04200000 fd:01 123 /venv/llvmlite/binding/libllvmlite.so
Anonymous:             0 kB
7f0005000000-7f0005100000 r-xp 00000000 fd:01 456 /usr/lib/libc.so.6
Anonymous:             0 kB
7f0006000000-7f0006100000 r-xp 00000000 00:00 0
Anonymous:             0 kB
7f0007000000-7f0007100000 r-xp 00000000 fd:01 789 /a dir/with spaces/libllvmlite.so.1 (deleted)
Anonymous:             0 kB
"""


def test_idle_code_ranges_keeps_only_unwritten_read_only_mappings_of_the_compiler() -> None:
    # text and read-only data qualify; relocated RELRO data (private pages), writable data, other
    # libraries and anonymous mappings do not; a path with spaces or "(deleted)" still matches
    assert idle_code_ranges(SMAPS) == [(0x7f0000000000, 0x7f0000100000), (0x7f0000100000, 0x7f0004000000),
                                       (0x7f0007000000, 0x7f0007100000)]
    assert idle_code_ranges(SMAPS, ("libc.",)) == [(0x7f0005000000, 0x7f0005100000)]
    assert idle_code_ranges("") == []


def _model(path, *, tied: bool, vocab: int = 4096, hidden: int = 256):
    rng = np.random.default_rng(11)
    arch = {"arch_name": "qwen3", "hidden_size": hidden, "intermediate_size": 512, "num_layers": 2,
            "num_attention_heads": 4, "num_kv_heads": 2, "head_dim": 64, "vocab_size": vocab,
            "layer_types": ["FullAttention"] * 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 512,
            "norm_style": "qwen", "rope_theta": 10000.0, "tie_word_embeddings": tied, "hidden_act": "silu"}
    with CmfWriter(path, {"format": "cmf", "version": 2, "arch": arch, "quant_type": "Q8_ROW"}) as w:
        def add(name, r, c):
            w.add_array(name, (rng.standard_normal((r, c)) / np.sqrt(c)).astype(np.float32), "q8_row")

        def norm(name):
            w.add_array(name, 1 + 0.1 * rng.standard_normal(hidden).astype(np.float32), "f32")

        add("model.embed_tokens.weight", vocab, hidden)
        if not tied:
            add("lm_head.weight", vocab, hidden)
        norm("model.norm.weight")
        for i in range(2):
            p = f"model.layers.{i}."
            norm(p + "input_layernorm.weight")
            norm(p + "post_attention_layernorm.weight")
            w.add_array(p + "self_attn.q_norm.weight", 1 + 0.1 * rng.standard_normal(64).astype(np.float32), "f32")
            w.add_array(p + "self_attn.k_norm.weight", 1 + 0.1 * rng.standard_normal(64).astype(np.float32), "f32")
            for n, r, c in (("q", 256, hidden), ("k", 128, hidden), ("v", 128, hidden), ("o", hidden, 256)):
                add(f"{p}self_attn.{n}_proj.weight", r, c)
            for n, r, c in (("gate", 512, hidden), ("up", 512, hidden), ("down", hidden, 512)):
                add(f"{p}mlp.{n}_proj.weight", r, c)
    return path


def _embedding_present(m) -> np.ndarray:
    t = m.file.tensor(m.plan.embed)
    margin = 64 << 10  # fault-around from the neighbouring tensors' pages
    return present_pages(m.file._parts[0].u8.ctypes.data + t.offset + margin, t.nbytes - 2 * margin)


@needs_pagemap
def test_looked_up_embedding_rows_are_given_back_and_decode_is_unchanged(tmp_path) -> None:
    path = _model(tmp_path / "untied.cmf", tied=False)
    ids = list(np.random.default_rng(2).permutation(4096)[:200])  # rows all over the table
    with cmf.load(path) as m:
        cache = m.new_cache()
        logits = m.prefill(ids, cache)
        assert not _embedding_present(m).any()  # 200 lookups, each faulting 64 KiB, all given back
        steps = [logits]
        for i in range(70):  # past EMBED_RELEASE_EVERY: decode lookups are given back too
            steps.append(m.forward([int(ids[i])], cache)[0])
            if m._forwards % EMBED_RELEASE_EVERY == 0:
                assert not _embedding_present(m).any()
    with cmf.load(path) as m:  # the same lookups on fresh mappings, nothing released in between
        m._embed_pages = None
        cache = m.new_cache()
        want = [m.prefill(ids, cache)] + [m.forward([int(ids[i])], cache)[0] for i in range(70)]
        assert _embedding_present(m).mean() > 0.9  # what the lookups leave mapped otherwise
    assert all(np.array_equal(a.reshape(-1), b.reshape(-1)) for a, b in zip(steps, want))


@needs_pagemap
def test_a_tied_embedding_stays_mapped(tmp_path) -> None:
    """The lm_head reads the whole tied matrix every token: giving its pages back would only make
    the next token fault them all in again."""
    with cmf.load(_model(tmp_path / "tied.cmf", tied=True)) as m:
        assert m._embed_pages is None
        m.prefill(list(range(3, 40)), m.new_cache())
        assert _embedding_present(m).mean() > 0.99


@needs_pagemap
def test_the_compilers_code_pages_are_given_back_after_a_forward(tmp_path) -> None:
    with open("/proc/self/smaps") as fh:
        ranges = idle_code_ranges(fh.read())
    if not ranges:
        pytest.skip("llvmlite's library is not mapped from a file here")
    with cmf.load(_model(tmp_path / "m.cmf", tied=False)) as m:
        first = m.prefill(list(range(3, 40)), m.new_cache())
        again = m.prefill(list(range(3, 40)), m.new_cache())  # its first layer gives back the head's loads
        resident = sum(int(present_pages(lo, hi - lo).sum()) for lo, hi in ranges)
        assert resident == 0
        assert np.array_equal(first, again)

    # numba still compiles after: the pages LLVM needs fault back in, unchanged
    @numba.njit(cache=False)
    def affine(a):
        return a * 3 + 1

    assert np.array_equal(affine(np.arange(5)), np.arange(5) * 3 + 1)
    memory.release_compiler_pages()
    assert affine(7) == 22


def test_layer_names_are_kept_per_plan_object(tmp_path) -> None:
    """The names a layer's pages are given back by: its plan's, recomputed once the layer's plan
    object is replaced (a skill's rebuilt layer)."""
    import dataclasses

    from cmf.runtime.plan import plan_names

    with cmf.load(_model(tmp_path / "m.cmf", tied=False)) as m:
        lp = m.plan.layers[0]
        first = m._layer_names(0)
        assert first == frozenset(plan_names(lp)) and m._layer_names(0) is first
        m.plan.layers[0] = dataclasses.replace(lp)
        try:
            again = m._layer_names(0)
            assert again == first and again is not first
        finally:
            m.plan.layers[0] = lp


def test_which_forwards_give_pages_back(tmp_path) -> None:
    """Layer pages are given back after decode forwards 1, 2, 4, ..., after prefills 1, 2, 4, ...
    or longer than any before, and after the first forward once a layer was rebuilt (a skill or
    task switch) — the batched decode step included, after its head's product."""
    from cmf.runtime.batched import decoder

    with cmf.load(_model(tmp_path / "m.cmf", tied=False)) as m:
        assert [m._count_forward(t) for t in (5, 5, 5, 5, 7, 5)] == [True, True, False, True, True, False]
        assert [m._count_forward(1) for _ in range(5)] == [True, True, False, True, False]
        m._make_block(m.plan.layers[0])  # a rebuilt layer: the next forward of either kind is watched
        assert [m._count_forward(5) for _ in range(3)] == [True, True, False]  # prefill 7 (rebuilt), 8, 9
        heads: list[int] = []
        m._give_back_head = lambda: heads.append(1)  # noqa: E731 - the instance's, recorded
        caches = [m.new_cache(), m.new_cache()]
        for c in caches:
            m.forward([3, 4, 5], c)  # prefills 10 and 11: not watched
        assert heads == []
        m._make_block(m.plan.layers[0])
        decoder(m).step([6, 7], caches)
        assert heads == [1]
        decoder(m).step([8, 9], caches)  # decode count 7: not watched (6 was, for the rebuilt layer)
        assert heads == [1]
