"""Selecting what a Model runs without reloading: task masks, skills and soft blends (a mixin of
runtime.model.Model; routing an "auto" selection is runtime/router.py).

A switch re-prepares only the layers whose tensors change (``_switch``); after every selection
change the active task mask is resolved again and applied (``_apply_expert_masks``).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from ..format.errors import CmfError
from ..format.masks import TaskMask
from .experts import keep_counts
from .plan import plan_names
from .task_masks import NO_TASK, apply_task_mask, resolve_task

log = logging.getLogger("cmf.runtime.model")  # the messages Model has always logged under


class UnknownTask(CmfError, KeyError):
    """No task mask of that name in the file."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown task"


class UnknownSkill(CmfError, KeyError):
    """No skill of that id in the file."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown skill"


class Selection:
    """Mixin: the task, skill and blend selection of a Model (``file``, ``weights``, ``plan``,
    ``_blocks``, ``_make_block``, ``_norm`` come from the Model)."""

    @property
    def skills(self) -> list[str]:
        """Skill ids of the file's registry."""
        return [s.id for s in self.file.skills]

    @property
    def tasks(self) -> list[str]:
        """Task mask names of the file (empty without a masks section)."""
        return self.file.masks.names() if self.file.masks is not None else []

    @property
    def skill(self) -> str | None:
        return self.weights.skill

    def _check_skill(self, skill: str | None) -> None:
        if skill not in (None, "none", "auto") and skill not in [s.id for s in self.file.skills]:
            known = ", ".join(s.id for s in self.file.skills) or "none"
            raise UnknownSkill(f"{self.file.path}: no skill {skill!r} (skills: {known})")

    @property
    def blend(self) -> dict[str | None, float] | None:
        """The active soft blend {skill id or None (backbone): weight}, or None."""
        return self.weights.blend

    @property
    def auto(self) -> str | None:
        """"skill" or "blend" when every prompt is routed (``skill="auto"`` / ``blend="auto"``)."""
        return self._auto

    def select(self, *, task: str | None = None, skill: str | None = ...,  # type: ignore[assignment]
               blend: "Mapping[str, float] | str | None" = None, route_prompt: Any = None):
        """Switch the active task mask, skill or blend without reloading.

        ``skill``: an id, None or "none" (the backbone), or "auto" (route each prompt by
        recon-argmin; no routable skill → the backbone); left out, the current selection stays.
        ``blend``: {id: weight} (normalized to sum 1; "none" names the backbone) or "auto" (the two
        skills with the smallest E, w ∝ exp(−E/0.4)); it replaces the skill. With an "auto"
        selection the prompt is routed now when ``route_prompt`` (text, messages or token ids) is
        given, else by the next :meth:`stream`/:meth:`generate`. Returns the routing.Route made
        here, or None.

        ``task``: a mask name, ``"none"`` (:data:`NO_TASK`: run unmasked) or None: the default
        rule (:func:`resolve_task`: the selected skill's ``input_mask_task``, else the file's
        ``default_task``, else its Fallback-priority mask, else its first mask).

        Unknown names raise UnknownTask / UnknownSkill. Switching re-prepares only the layers
        whose tensors change (the others keep their prepared operators).
        """
        self._adhoc_mask = None  # back to the file's masks (see use_mask)
        if task is not None and task != NO_TASK and task not in self.tasks:
            raise UnknownTask(f"{self.file.path}: no task {task!r} (tasks: {', '.join(self.tasks) or 'none'}; "
                              f"'{NO_TASK}' runs unmasked)")
        self._task_request = task
        if blend is not None:
            if skill not in (..., None, "none"):
                raise ValueError("give a skill or a blend, not both")
            if isinstance(blend, str):
                if blend != "auto":
                    from .routing import parse_blend

                    blend = parse_blend(blend)
            if blend == "auto":
                self._auto = "blend"
            else:
                from .routing import normalize_blend

                for sid in blend:  # type: ignore[union-attr]
                    if sid not in (None, "none"):
                        self._check_skill(sid)  # UnknownSkill, as for skill=
                self._auto = None
                self._switch(None, normalize_blend(blend, self.skills))  # type: ignore[arg-type]
        elif skill is not ...:
            self._check_skill(skill)
            if skill == "auto":
                self._auto = "skill"
            else:
                self._auto = None
                self._switch(None if skill == "none" else skill, None)
        self._apply_expert_masks()
        if self._auto and route_prompt is not None:
            return self.route_select(route_prompt)
        return None

    def use_mask(self, mask: "TaskMask | None") -> None:
        """Activate an in-memory task mask that is not (yet) in the file, as ``cmf mask create``
        does to measure a candidate; None runs unmasked. The next :meth:`select` returns to the
        file's masks."""
        self._adhoc_mask = mask
        self.task = mask.name if mask is not None else None
        self._mask_applied = self.task  # a candidate being measured: no "unmeasured" warning
        self._apply_expert_masks()

    def _apply_expert_masks(self) -> None:
        """Apply the active task mask (spec §5): FFN neurons, heads and layer gates per layer (see
        runtime/task_masks.py), and the admitted experts per MoE layer: the runtime mask
        (CMF_MOE_MASK) ∧ the task mask's row (runtime/experts.py). Called after every selection
        change."""
        mask = getattr(self, "_adhoc_mask", None)
        if mask is None:
            # The default rule depends on the active skill (its input_mask_task), so it is resolved
            # after every selection change, routed prompts included.
            self.task = resolve_task(self.file, self._task_request, self.weights.skill)
            mask = self.file.masks.get(self.task) if (self.file.masks is not None and self.task) else None
        apply_task_mask(self, mask)
        self._restrict_experts(mask)

    def _switch(self, skill: str | None, blend: "Mapping[str | None, float] | None") -> None:
        """Point the weights at a skill/blend and re-prepare only what reads a changed tensor."""
        changed = self.weights.configure(skill, blend)
        if not changed:
            return
        plan = self.plan
        rebuilt = 0
        for i, lp in enumerate(plan.layers):
            if plan_names(lp) & changed:
                old = self._blocks[i]
                self._replace_block(i, self._make_block(lp))
                keep_counts(old, self._blocks[i])  # statistics survive a switch
                rebuilt += 1
        if plan.final_norm in changed:
            self._final_norm = self._norm(plan.final_norm)
        if plan.lm_head in changed:
            self._lm_head = self.weights.linear(plan.lm_head)
        if plan.mtp is not None:
            self._mtp = None  # rebuilt on first use over the new sources
        log.debug("selection skill=%s blend=%s: %d tensors changed, %d of %d layers re-prepared",
                  self.weights.skill, self.weights.blend, len(changed), rebuilt, len(plan.layers))
