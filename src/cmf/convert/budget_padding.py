"""The alignment padding a target-size budget must leave room for, and the replan that spends
what the exact layout does not need. A file written to a budget is packed: every payload on the
spec's 64 bytes (§4), not the reference writers' 4 KiB for payloads of 16 KiB or more — on the
shared model's 2.727 MB file that padding was 60 KB, 2.2% of the file."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .budget import BudgetPlan

# room below which a plan is not redone for the padding it did not need (one small payload's alignment)
TENSOR_SLACK = 64
# bisection rounds over the padding the worst case reserved (4 KiB per tensor): 12 halve it to < 1 KiB
SLACK_ROUNDS = 12


def worst_padding(payload_bytes, packed: bool = True) -> int:  # noqa: ANN001 - an iterable of payload sizes
    """The most alignment padding payloads of these sizes can take when written ``packed`` (64
    each) or not (4096 for 16 KiB and more, 64 below: :func:`cmf.format.spool.tensor_alignment`)."""
    from ..format.spool import tensor_alignment

    return sum(tensor_alignment(n, packed) - 1 for n in payload_bytes)


def use_padding_slack(plan: "BudgetPlan", layout: list[tuple[str, int | None]], limit: int,
                      replan: Callable[[int], "BudgetPlan"]) -> "BudgetPlan":
    """Replan with the bytes the worst-case padding reservation did not need. ``limit``: what the
    payloads and their padding may take together. The worst case reserves 63 bytes a payload
    (packed, as budgeted files are written); the exact padding of a planned
    layout is known, so the payload budget is bisected between the reserved one and ``limit``
    for the largest whose plan's exact layout fits (each trial a greedy allocation, no encoding).
    ``replan(budget)``: the plan for a payload budget. A bisection, not a walk up by the room
    left: the floor (:func:`.budget.ladder_floor`) moves with the budget, so plans are not
    monotone in it, and a walk that overshoots and steps back can stop short (a 2.02 MB target
    once came out at 1.955 MB). The plan of the largest budget that fits is kept, not the one of
    least predicted loss: a higher floor raises the predicted loss (it forbids rungs the
    in-sample scores like) and is there because those scores were too optimistic on other text."""
    from ..format.spool import data_span

    def span(p: BudgetPlan) -> int:
        return data_span((p.picked[n].nbytes if s is None else s for n, s in layout), packed=True)

    best = plan
    lo, hi = plan.target_bytes, limit  # lo's plan fits (worst-case padding); the payloads alone cannot exceed limit
    for _ in range(SLACK_ROUNDS):
        if hi - lo < TENSOR_SLACK:
            break
        mid = (lo + hi) // 2
        trial = replan(mid)
        if span(trial) > limit:
            hi = mid
            continue
        lo, best = mid, trial  # the largest budget that fits: its floor may be higher than a smaller one's
    return best
