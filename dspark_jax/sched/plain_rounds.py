"""Draft-aware rounds: whether the next round drafts at all (our addition to the paper).

Algorithm 1 and top-K decide how many drafts to *verify*; their ``Θ₀ = R·SPS(R)`` is
measured with the drafter running, so every round drafts. Where drafting itself does not
pay (a small target, a busy accelerator), a round of the target alone is faster. Before
each round the rule compares the best expected throughput of a drafting round on the
newest survivals read,

    Θ_draft = max_k τ(k)·SPS(n + k)        (top-K's search, ``sched.topk.best_budget``)

with a plain round's, ``Θ_plain = n·SPS_plain`` (``n`` occupied slots, one token each;
``SPS_plain`` is the plain round's own entry of the SPS profile), summed over data
replicas, and chooses *plain* when ``Θ_draft <= Θ_plain``.

Survivals come only from drafting rounds, so a run of plain rounds is broken by a *probe*
(a drafting round) after ``gap`` plain ones. A probe whose survivals still say plain
doubles the gap, up to ``probe_gap[1]``; a round that pays resets it to ``probe_gap[0]``.
So speculation is never starved for more than ``probe_gap[1]`` rounds, and where it never
pays the probes cost one drafting round in ``probe_gap[1] + 1`` at most.

Lossless: the rule reads survivals of rounds ``<= n − 2`` only (what a pipelined host has
read when it dispatches round ``n``), never the round it decides, so whether a round
drafts is fixed before its drafts exist, as Appendix A's argument needs (DESIGN §5.4).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dspark_jax.sched.topk import best_budget

__all__ = ["DEFAULT_PROBE_GAP", "ROUND_KINDS", "PlainRoundRule"]

# What a round did: drafted (its budget from the scheduler), plain (drafting would not pay
# on the newest survivals), or a probe (a drafting round run to refresh those survivals).
ROUND_KINDS = ("draft", "plain", "probe")
# Plain rounds between probes: first 4, doubled after each probe that confirms plain, at
# most 64 (an idle drafter then costs at most one drafting round in 65).
DEFAULT_PROBE_GAP = (4, 64)


class PlainRoundRule:
    """The decision and its probe state (module docstring). ``reason`` says, in a few
    words, why the last decision was made."""

    def __init__(self, probe_gap: tuple[int, int] = DEFAULT_PROBE_GAP):
        lo, hi = (int(x) for x in probe_gap)
        if not 1 <= lo <= hi:
            raise ValueError(
                f"probe_gap must be (first, most) with 1 <= first <= most; got {probe_gap}"
            )
        self.probe_gap = (lo, hi)
        self.reset()

    def reset(self) -> None:
        self._gap, self._streak = self.probe_gap[0], 0
        self._probe: int | None = None  # index of the newest probe, until its verdict
        self.reason = ""

    def decide(
        self,
        index: int,
        newest,
        sps_table: np.ndarray,
        plain_sps: float,
        buckets: Sequence[int],
        replica_slots: int,
    ) -> str:
        """The kind (``ROUND_KINDS``) of round ``index``. ``newest``: ``(i, survival [R, γ],
        active [R])`` of the newest drafting round read among rounds ``<= index − 2``, or
        None; ``sps_table``: the dense drafting SPS of one replica; ``plain_sps``: plain
        rounds per second."""
        if newest is None:
            self.reason = "no confidences read yet"
            return "draft"
        seen, survival, active = newest
        if seen > index - 2:
            raise ValueError(
                f"round {index} may only be decided on rounds <= {index - 2}; got round {seen}"
            )
        theta_draft = theta_plain = 0.0
        for start in range(0, len(active), replica_slots):  # one server of Algorithm 1 each
            block = slice(start, start + replica_slots)
            if active[block].any():
                theta_draft += best_budget(survival[block], sps_table, buckets, active[block])[1]
                theta_plain += int(active[block].sum()) * plain_sps
        ratio = theta_draft / theta_plain if theta_plain else float("inf")
        if ratio > 1.0:
            self._gap, self._streak, self._probe = self.probe_gap[0], 0, None
            self.reason = f"drafting pays (Θ_draft/Θ_plain = {ratio:.2f})"
            return "draft"
        if self._probe is not None and seen >= self._probe:  # the probe says: still plain
            self._gap, self._probe = min(2 * self._gap, self.probe_gap[1]), None
        if self._streak >= self._gap:
            self._streak, self._probe = 0, index
            self.reason = f"probe after {self._gap} plain rounds"
            return "probe"
        self._streak += 1
        self.reason = f"drafting would not pay (Θ_draft/Θ_plain = {ratio:.2f})"
        return "plain"
