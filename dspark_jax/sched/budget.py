"""The verify budget ``K`` of the next round: which compiled bucket runs (DESIGN §5.3).

Chosen on the host before the round is dispatched, from what the host already knows (the
occupied slots, and for dynamic top-K the newest *processed* round's survivals, which is
two rounds before the one being dispatched), so choosing never waits on the device. The
serving engine and the serving simulator (``perf/serving_sim.py``) both call
``next_budget``; two-phase Algorithm 1 reads its Σ l first and calls ``smallest_bucket``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dspark_jax.sched.topk import choose_budget

__all__ = ["next_budget", "smallest_bucket"]


def smallest_bucket(buckets: Sequence[int], need: int) -> int:
    """The smallest compiled budget holding ``need`` drafts (the largest if none does)."""
    return next((k for k in buckets if k >= need), buckets[-1])


def next_budget(
    scheduler: str,
    buckets: Sequence[int],
    *,
    gamma: int,
    occupied: int,
    last_survival: np.ndarray | None = None,
    last_active: np.ndarray | None = None,
    sps_table: np.ndarray | None = None,
) -> int:
    """Budget for the round about to be dispatched.

    fixed / threshold: at most γ drafts per occupied slot, so the smallest bucket holding
    γ·occupied (occupied slots include any finishing in the round still in flight: an upper
    bound). topk: ``choose_budget`` on ``last_survival [R, γ]`` / ``last_active [R]`` (the
    largest bucket before any round was processed; the smallest when none was active).
    Anything else (none, one-phase prefix): the largest bucket.
    """
    if scheduler in ("fixed", "threshold"):
        return smallest_bucket(buckets, gamma * occupied)
    if scheduler != "topk" or last_survival is None:
        return buckets[-1]
    if not np.asarray(last_active).any():
        return buckets[0]
    if sps_table is None:
        raise ValueError("the 'topk' budget needs the dense SPS table")
    return choose_budget(last_survival, sps_table, buckets, last_active)
