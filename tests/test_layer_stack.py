"""Every layer of a decoded token in one compiled call (runtime/layer_stack.py): the same logits
as one call a layer, the KV cache grown and advanced alike, and the per-layer loop wherever the
stack does not apply."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cmf  # noqa: E402
from cmf.convert.hf import convert  # noqa: E402
from cmf.runtime import layer_stack  # noqa: E402
from cmf.runtime.layer_stack import LayerStack  # noqa: E402

pytest.importorskip("transformers")
import hf_fixtures as H  # noqa: E402

_FILES: dict[tuple[str, str], Path] = {}


def _converted(kind: str, quant: str) -> Path:
    if (kind, quant) not in _FILES:
        folder = H.fixture(kind)
        out = folder.parent / f"{kind}-{quant}-stack.cmf"
        if not out.exists():
            convert(folder, out, quant=quant)
        _FILES[kind, quant] = out
    return _FILES[kind, quant]


def _count_stacked(monkeypatch, stacked: bool) -> list[int]:
    """A one-item list that counts the stacked tokens from now on; with ``stacked`` False the
    stack is turned off (every token one call a layer)."""
    calls = [0]
    real = layer_stack.stack_step

    def counted(*args):  # noqa: ANN002, ANN202
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(layer_stack, "stack_step", counted)
    if not stacked:
        monkeypatch.setattr(LayerStack, "run", lambda self, *a, **k: False)
    return calls


def _decode(path: Path, tokens: int, stacked: bool, monkeypatch, kv_cache: str = "f32",
            prompt: int = 9) -> tuple[np.ndarray, int, list[int]]:
    """Logits of a ``prompt``-token prompt and ``tokens`` greedy steps, how many steps ran as
    one stacked call, and each layer's cache length at the end."""
    calls = _count_stacked(monkeypatch, stacked)
    ids = np.random.default_rng(3).integers(0, 200, prompt).tolist()
    with cmf.load(path, kv_cache=kv_cache) as m:
        c = m.new_cache()
        out = [m.prefill(ids, c)[-1:]]
        for _ in range(tokens):
            out.append(m.forward([int(np.argmax(out[-1][-1]))], c))
        lengths = [kv.n for kv in c.layers]
    monkeypatch.undo()
    return np.concatenate(out), calls[0], lengths


@pytest.mark.parametrize("quant,kv_cache", [("f32", "f32"), ("q4tp", "f32"), ("q8", "f32"), ("q4tp", "f16")])
def test_stacked_decode_equals_one_call_a_layer(quant, kv_cache, monkeypatch):
    """12 tokens after a 58-token prompt: the caches grow past their first 64 entries on the way
    (an f16 cache too: its entries are stored as f16 bits)."""
    path = _converted("qwen3", quant)
    stacked, n_stacked, len_a = _decode(path, 12, True, monkeypatch, kv_cache, prompt=58)
    single, n_single, len_b = _decode(path, 12, False, monkeypatch, kv_cache, prompt=58)
    # every token but the watched ones (decodes 1, 2, 4 and 8: memory.py gives pages back layer
    # by layer there, so they run one call a layer)
    assert n_single == 0 and n_stacked == 8
    assert len_a == len_b == [70] * len(len_a)
    assert np.array_equal(stacked, single)


def test_layers_with_attention_biases_keep_one_call_a_layer(monkeypatch):
    """qwen2's q/k/v biases keep its layers off the one-call form, so off the stack too."""
    _, n_stacked, _ = _decode(_converted("qwen2", "q8"), 4, True, monkeypatch)
    assert n_stacked == 0


def test_a_stack_that_does_not_apply_changes_nothing(monkeypatch):
    """A cache whose layers disagree in length is refused before anything is written."""
    with cmf.load(_converted("qwen3", "q4tp")) as m:
        c = m.new_cache()
        m.prefill([1, 2, 3], c)
        m.forward([4], c)  # binds every layer
        c.layers[1].n -= 1
        before = [(kv.n, kv.k.copy()) for kv in c.layers]
        x = np.ones((1, m.plan.hidden), np.float32)
        assert not m._stack.run(x, c, c.pos, 1)
        assert np.all(x == 1)
        for kv, (n, k) in zip(c.layers, before):
            assert kv.n == n and kv.k.tobytes() == k.tobytes()  # (bytes: unwritten entries may hold NaN)


def test_layers_of_different_types_are_not_stacked():
    """A typed list needs one numba type: layer arguments of two types give no stack."""
    stack = LayerStack([])
    assert stack._typed_args([np.zeros(2, np.float32), np.zeros(2, np.int64)]) is None
    assert stack._typed_args([np.zeros(2, np.float32), np.ones(2, np.float32)]) is not None


def test_two_caches_in_turn_equal_each_alone(monkeypatch):
    """Two sequences decoded in turn on one model (a server's sessions) give each one's logits."""
    path = _converted("qwen3", "q4tp")
    alone, _, _ = _decode(path, 6, True, monkeypatch)
    ids = np.random.default_rng(3).integers(0, 200, 9).tolist()
    with cmf.load(path) as m:
        caches = [m.new_cache(), m.new_cache()]
        outs = [[m.prefill(ids, c)[-1:]] for c in caches]
        for _ in range(6):
            for c, out in zip(caches, outs):
                out.append(m.forward([int(np.argmax(out[-1][-1]))], c))
    for out in outs:
        assert np.array_equal(np.concatenate(out), alone)


def _masked_run(path: Path, stacked: bool, monkeypatch) -> tuple[np.ndarray, int]:
    """Three tokens unmasked, then an FFN task mask applied between tokens, three more, then
    the mask removed, three more: the logits and how many tokens ran stacked."""
    from cmf.format.masks import TaskMask
    from cmf.runtime.task_masks import apply_task_mask

    calls = _count_stacked(monkeypatch, stacked)
    ids = np.random.default_rng(5).integers(0, 200, 9).tolist()
    with cmf.load(path) as m:
        layers, width = len(m._blocks), m._blocks[0].ffn.width
        heads = m._blocks[0].mixer.a.heads
        keep = np.random.default_rng(6).random((layers, width)) < 0.6
        mask = TaskMask(task_id=1, name="half", ffn=keep, heads=np.ones((layers, heads), bool),
                        gates=np.ones(layers, bool), sparsity=0.4)
        c = m.new_cache()
        out = [m.prefill(ids, c)[-1:]]
        for stage in (None, mask, None):
            apply_task_mask(m, stage)
            for _ in range(3):
                out.append(m.forward([int(np.argmax(out[-1][-1]))], c))
    monkeypatch.undo()
    return np.concatenate(out), calls[0]


def test_a_task_mask_switched_between_tokens_is_followed(monkeypatch):
    """Switching a task mask rebinds the layers' FFN products; the stack follows it (its short
    way is keyed on the mask epoch): off while the masked layers cannot be one call, on again
    after, with the per-layer logits throughout."""
    path = _converted("qwen3", "q4tp")
    stacked, n = _masked_run(path, True, monkeypatch)
    single, n_single = _masked_run(path, False, monkeypatch)
    # decodes 1, 2, 4 and 8 are watched (one call a layer); under the mask the down projections
    # take a scatter, which keeps the layers off the one-call form: 3, 7 and 9 are stacked
    assert n_single == 0 and n == 3
    assert np.array_equal(stacked, single)


def test_a_cache_shrunk_between_tokens_is_followed(monkeypatch):
    """The server's ``reserve`` and ``shrink`` reallocate a sequence's arrays between tokens; the
    tokens decoded on that cache afterwards write the new arrays (the short way sees
    LayerKV.moves change) and read what was copied into them."""
    from cmf.runtime.batched import reserve, shrink

    path = _converted("qwen3", "q4tp")
    ids = np.random.default_rng(3).integers(0, 200, 9).tolist()
    outs = []
    for shrunk in (False, True):
        with cmf.load(path) as m:
            c = m.new_cache()
            out = [m.prefill(ids, c)[-1:]]
            for t in range(8):
                if shrunk and t == 2:
                    reserve(c, 200)
                    assert c.layers[-1].k.shape[0] >= 200
                if shrunk and t == 5:
                    shrink(c)
                    assert [kv.k.shape[0] for kv in c.layers] == [kv.n for kv in c.layers]
                out.append(m.forward([int(np.argmax(out[-1][-1]))], c))
            outs.append(np.concatenate(out))
    assert np.array_equal(outs[0], outs[1])


def test_typed_list_holds_the_items_in_order_without_copies():
    """The stack's typed lists are built by the module's cached compiled functions (not by
    ``numba.typed.List`` from Python, which compiles the list's methods in every process): the
    same arrays, in order, in a numba typed List."""
    from numba.typed import List

    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3) + 10 * i for i in range(5)]
    out = layer_stack.typed_list(arrays)
    assert isinstance(out, List) and len(out) == 5
    for got, want in zip(out, arrays):
        assert np.shares_memory(got, want) and np.array_equal(got, want)
    one = layer_stack.typed_list(arrays[:1])
    assert len(one) == 1 and np.shares_memory(one[0], arrays[0])


_COMPILES = r"""
import sys
import numpy as np
from numba.core import event

compiled = []


class Listener(event.Listener):
    def on_start(self, ev):
        compiled.append(str(ev.data.get("dispatcher")))

    def on_end(self, ev):
        pass


event.register("numba:compile", Listener())
import cmf

with cmf.load(sys.argv[1]) as m:
    c = m.new_cache()
    logits = m.prefill([5, 6, 7], c)
    for _ in range(10):  # decodes 3, 5, 6, 7, 9 and 10 run stacked
        logits = m.forward([int(np.argmax(logits[-1]))], c)
print(repr(compiled))
"""


def test_a_warm_process_compiles_nothing_to_decode():
    """Everything a decode runs comes from numba's cache once it is warm: a second process
    compiles nothing (the stack's typed lists, built by ``numba.typed.List`` from Python,
    compiled the list's methods in every process: 0.4 s and ~50 MB of peak RSS)."""
    import ast
    import subprocess

    path = _converted("qwen3", "q4tp")
    runs = []
    for _ in range(2):  # the first may fill the cache for anything this worker did not compile yet
        r = subprocess.run([sys.executable, "-c", _COMPILES, str(path)], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        runs.append(ast.literal_eval(r.stdout.strip().splitlines()[-1]))
    assert runs[1] == []
