"""Applying a task mask (spec §5, REFERENCE_NOTES §3 "Masks") to the executable layers.

Per decoder layer ``i``:

- layer gate 0: the block is skipped, the residual passes through (its cache slot stays empty);
- head bitfield: masked heads of an attention layer contribute zero (their output is zeroed
  before ``o_proj``); linear-attention layers have no heads in this sense and are left alone;
- FFN bitfield (row ``i``; on looped models block ``i`` is visit ``i`` and LOOP_MASKS rows are
  per visit, runtime/loops.py): a dense FFN runs only its live neurons (blocks.DenseFfn). MoE
  layers have no dense neurons: their FFN row is ignored and the expert row restricts routing
  instead (experts.py).

Rows are nominal-width (``arch.intermediate_size``, ``num_attention_heads``); a layer uses the
first ``width`` bits. A row whose bits are all set restricts nothing and keeps the fast path, so a
mask that forbids nothing costs nothing. Re-applying a mask is cheap: arrays are compared, and the
gathered ``down_proj`` columns of the last masks are kept per layer.
"""

from __future__ import annotations

import logging

import numpy as np

from ..format.masks import MaskSet, TaskMask
from .blocks import Attention, DenseFfn, LatentAttention, MoeFfn
from .loops import check_mask as check_loop_mask

log = logging.getLogger(__name__)

NO_TASK = "none"  # the task name that runs unmasked (a mask of that name cannot be selected)
_warned_links: set[tuple[str, str, str]] = set()


def default_task(masks: MaskSet | None) -> str | None:
    """The task a file runs when none is named (docs/MASKS.md, "The default task").

    The mask named by ``default_task`` (spec §5.1) when it exists; otherwise, as the reference's
    runtime starts (runtime.rs ``CortiqRuntime::new`` → mask.rs ``MaskCatalog::fallback``), the
    first mask with priority Fallback, else the first mask. No masks: None (unmasked).
    """
    if masks is None or not masks.masks:
        return None
    if masks.default_task and masks.get(masks.default_task) is not None:
        return masks.default_task
    fallback = next((m for m in masks.masks if m.priority == "Fallback"), masks.masks[0])
    return fallback.name


def resolve_task(file, request: str | None, skill: str | None = None) -> str | None:
    """The task mask to run: ``request`` when it names one, None for :data:`NO_TASK`, and for
    ``request=None`` the default rule: the selected skill's ``input_mask_task`` (spec §9, as
    ``cortiq run --skill`` activates it) when the file has that mask, else :func:`default_task`."""
    masks = file.masks
    if request == NO_TASK or masks is None or not masks.masks:
        return None
    if request is not None:
        return request
    if skill is not None:
        rec = next((s for s in file.skills if s.id == skill), None)
        linked = rec.input_mask_task if rec is not None else None
        if linked and masks.get(linked) is not None:
            return linked
        if linked and (str(file.path), skill, linked) not in _warned_links:
            _warned_links.add((str(file.path), skill, linked))
            log.warning("skill %r names input_mask_task %r, which the file has no mask of; the default "
                        "task applies", skill, linked)
    return default_task(masks)


def _row(bits: np.ndarray | None, i: int, width: int) -> np.ndarray | None:
    """Row ``i`` cut (or padded with set bits) to ``width``; None when it restricts nothing."""
    if bits is None or i >= bits.shape[0]:
        return None
    row = np.asarray(bits[i], dtype=bool)[:width]
    if row.size < width:
        row = np.concatenate([row, np.ones(width - row.size, bool)])
    return None if row.all() else row


def restricts(mask: TaskMask | None) -> bool:
    """Whether ``mask`` forbids anything at all (FFN, heads, gates or experts)."""
    if mask is None:
        return False
    parts = [mask.ffn, mask.heads, mask.gates] + ([mask.experts] if mask.experts is not None else [])
    return not all(np.asarray(p, dtype=bool).all() for p in parts if np.size(p))


def apply_task_mask(model, mask: TaskMask | None) -> None:
    """Set every block's gate, head and FFN restriction from ``mask`` (None: unmasked).

    Logs a warning when a mask whose ``quality`` is null becomes active (once per task and model,
    so a server alternating tasks does not repeat it): its effect was never measured (spec §5.1).
    """
    name = mask.name if mask is not None else None
    if name != getattr(model, "_mask_applied", None):
        warned = model.__dict__.setdefault("_mask_warned", set())
        if mask is not None and mask.quality is None and name not in warned:
            log.warning("task %r: quality unmeasured (the mask carries no held-out metric); "
                        "measure it with 'cmf mask create --heldout' or 'cmf ppl --task'", name)
            warned.add(name)
        model._mask_applied = name
    if not restricts(mask):
        mask = None
    check_loop_mask(model.arch, mask)  # looped models: only FFN rows are read per visit (loops.py)
    # what each layer binds may change: the decode's layer stack checks every layer again
    model.step_epoch += 1
    for i, b in enumerate(model._blocks):
        b.alive = True if mask is None else mask.layer_alive(i)
        mixer = b.mixer
        if isinstance(mixer, (Attention, LatentAttention)):
            mixer.head_keep = None if mask is None else _row(mask.heads, i, mixer.a.heads)
        if isinstance(b.ffn, DenseFfn):
            b.ffn.set_mask(None if mask is None else _row(mask.ffn, i, b.ffn.width))
        elif isinstance(b.ffn, MoeFfn) and mask is not None and _row(mask.ffn, i, mask.ffn.shape[1]) is not None:
            log.debug("task %r: layer %d is MoE; its FFN row is ignored (the expert row applies)", name, i)
