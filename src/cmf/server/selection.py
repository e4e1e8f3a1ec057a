"""What a request runs under — task mask, skill or blend — as a hashable key, and switching to it.

The model has one active selection, so a decode batch holds sequences of one key only; the key
also scopes the prefix cache (KV computed under one skill is wrong under another). ``auto``
skills and blends are routed here, on the request's own text, before the key is known.
"""

from __future__ import annotations

import logging
from typing import Any, Hashable

from ..runtime.routing import BLEND_ROUTE_TOKENS, auto_blend, normalize_blend
from ..runtime.task_masks import NO_TASK, resolve_task

log = logging.getLogger(__name__)

Key = tuple  # (task, skill, blend as sorted (id or "none", weight) pairs, or None)


def needs_routing(job: Any) -> bool:
    return job.skill == "auto" or job.blend == "auto"


def task_of(model: Any, job: Any, skill: str | None = None) -> str:
    """The task mask ``job`` runs under ``skill``: its own, or the file's default rule (the skill's
    ``input_mask_task``, the default task, ...); :data:`NO_TASK` when it runs unmasked. Resolved
    here so that requests asking the same thing in other words share a key."""
    task = resolve_task(model.file, job.task, skill)
    return task if task is not None else NO_TASK


def resolve(model: Any, job: Any) -> tuple[Key, Any]:
    """(key, routing.Route or None) of ``job``. An ``auto`` job is routed now, under the task mask
    it has without a skill, which the caller must have active (see :func:`select_task`)."""
    route = None
    if job.blend == "auto":
        route = model.route(job.route_prompt, max_tokens=BLEND_ROUTE_TOKENS)
        route.blend = auto_blend(route.scores)
        blend = route.blend or None
        skill = None
    elif job.blend is not None:
        blend, skill = normalize_blend(job.blend, model.skills), None
    else:
        blend = None
        skill = job.skill
        if skill == "auto":
            route = model.route(job.route_prompt)
            skill = route.winner
        elif skill == "none":
            skill = None
    task = task_of(model, job, skill)
    if blend is not None:
        pairs = tuple(sorted(("none" if k is None else k, float(w)) for k, w in blend.items()))
        return (task, None, pairs), route
    return (task, skill, None), route


def select(model: Any, key: Key) -> dict[str, Any]:
    """Make ``key`` the model's active selection (only the layers that change are re-prepared);
    returns what runs: ``task``, ``skill``, ``blend``."""
    task, skill, pairs = key
    if pairs is not None:
        model.select(task=task, blend=dict(pairs))
    else:
        model.select(task=task, skill=skill)
    return current(model)


def select_task(model: Any, task: str) -> None:
    """Activate ``task`` (a name or NO_TASK) on the backbone: routing runs under the request's mask."""
    model.select(task=task, skill=None)


def current(model: Any) -> dict[str, Any]:
    blend = model.blend
    return {"task": model.task, "skill": model.skill,
            "blend": {k or "none": w for k, w in blend.items()} if blend else None}


def describe(key: Hashable) -> str:
    task, skill, pairs = key  # type: ignore[misc]
    what = ",".join(f"{k}:{w:g}" for k, w in pairs) if pairs else (skill or "backbone")
    return f"task={task} {what}"
