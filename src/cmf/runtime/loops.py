"""Looped layer stacks (``arch.num_loops`` > 1): the visit schedule the reference runs.

A looped model applies its ``num_layers`` physical layers ``num_loops`` times (Nanbeige 4.2:
22 layers × 2). Facts from the reference (infosave2007/cmf, docs/INTERCHANGE.md "Looped
models"):

- ``loader.rs`` ``Pipeline::from_model_with_overlay``: the stack has ``num_layers · num_loops``
  virtual layers; ``pipeline.rs`` ``phys_layer``: virtual layer ``v`` runs the weights of
  physical layer ``v % num_layers``.
- ``pipeline.rs``: the KV cache is indexed by the virtual layer (``kv_cache.layers[li]``), so
  every visit attends over its own keys and values.
- ``pipeline.rs`` ``is_loop_end`` and the token graph's ``loop_norm_at``: with
  ``loop_final_norm`` the final norm (``model.norm.weight``) is applied to the residual stream
  after the last layer of every pass but the last; the last pass ends in the ordinary final norm.
- ``cortiq-core/tests/loop_masks.rs``: task masks carry one FFN row per visit (pass-major), and
  the runtime reads FFN row ``v`` for visit ``v``.

The plan therefore lists one LayerPlan per visit (same tensor names, ``index`` = the visit,
``exit_norm`` at pass ends), and everything downstream (blocks, caches, FFN masks) follows it.

Refused, because the reference does not pin down what they mean on a second pass: linear
attention layers (the reference's graph keys their recurrent state by the *physical* layer),
and task masks that restrict heads, layer gates or experts (stored per physical layer; which
row a later visit reads is not established).
"""

from __future__ import annotations

import dataclasses

from .errors import PlanError

# Real looped models use 2-4 passes; a header asking for more would multiply the stack unchecked.
MAX_LOOPS = 64


def visit_plans(arch, layers: list, final_norm: str | None) -> list:  # noqa: ANN001 - Arch, [LayerPlan]
    """The LayerPlan of every visit of a looped stack (``layers`` itself when not looped)."""
    loops = int(arch.num_loops or 1)
    if loops <= 1:
        return layers
    if loops > MAX_LOOPS:
        raise PlanError(f"arch.num_loops = {loops}: more than {MAX_LOOPS} passes is not a model this runtime runs")
    linear = [lp.index for lp in layers if lp.kind == "LinearAttention"]
    if linear:
        raise PlanError(f"arch.num_loops = {loops} with LinearAttention layers {linear}: the reference keeps "
                        "their recurrent state per physical layer across passes, which is not a schedule this "
                        "runtime reproduces; refusing to run it")
    norm = None
    if arch.loop_final_norm:
        if final_norm is None:
            raise PlanError("arch.loop_final_norm is set but the file has no model.norm.weight")
        norm = final_norm
    n = len(layers)
    total = n * loops
    return [dataclasses.replace(layers[v % n], index=v,
                                exit_norm=norm if (v + 1) % n == 0 and v + 1 < total else None)
            for v in range(total)]


def check_mask(arch, mask) -> None:  # noqa: ANN001 - Arch, TaskMask | None
    """Refuse a task mask on a looped model that restricts heads, gates or experts (see above);
    FFN rows are read per visit."""
    if mask is None or int(arch.num_loops or 1) <= 1:
        return
    import numpy as np

    parts = {"heads": mask.heads, "layer gates": mask.gates}
    if mask.experts is not None:
        parts["experts"] = mask.experts
    bad = [k for k, v in parts.items() if np.size(v) and not np.asarray(v, dtype=bool).all()]
    if bad:
        from ..format.errors import NotRunnable

        raise NotRunnable(f"task {mask.name!r} restricts {' and '.join(bad)} of a looped model "
                          f"(num_loops = {arch.num_loops}): those rows are stored per physical layer and which "
                          "row a later pass reads is not established by the reference; only FFN rows (one per "
                          "visit) are run on looped models")
