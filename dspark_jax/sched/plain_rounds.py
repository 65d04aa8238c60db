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
doubles the gap, up to its most; a round that pays resets it to its least. Both ends are
``probe_gap`` scaled by what a probe costs beyond a plain round, ``c = SPS_plain /
SPS_draft(smallest bucket) − 1``, when that is more than one plain round (``× max(1, c)``):
where drafting never pays, probes then cost at most ``1 / probe_gap[1]`` of the time
(1/128 by default) whatever the hardware, and speculation is never starved for more than
``probe_gap[1]·max(1, c)`` rounds, about 128 drafting rounds' time. Before any survival has
been read, the first round drafts (the first probe) and the rounds dispatched until its
survivals are read run plain.

Lossless: the rule reads survivals of rounds ``<= n − 2`` only (what a pipelined host has
read when it dispatches round ``n``), never the round it decides, so whether a round
drafts is fixed before its drafts exist, as Appendix A's argument needs (DESIGN §5.4).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from dspark_jax.sched.topk import best_budget

__all__ = ["DEFAULT_PROBE_GAP", "ROUND_KINDS", "PlainRoundRule"]

# What a round did: drafted (its budget from the scheduler), plain (drafting would not pay
# on the newest survivals), or a probe (a drafting round run to refresh those survivals).
ROUND_KINDS = ("draft", "plain", "probe")
# Plain rounds between probes: first 8, doubled after each probe that confirms plain, at
# most 128, both times max(1, c) (module docstring): where drafting never pays, probes
# then cost under 1 % of the time. (4, 64) measured 0.90x of plain decoding on the CPU
# demo, where a probe costs ~2 plain rounds more and a request lasts ~100 rounds.
DEFAULT_PROBE_GAP = (8, 128)


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
        self._level, self._streak = 0, 0  # gap = least · 2**level, at most the most
        self._probe: int | None = None  # index of the newest probe, until its verdict
        self._drafted: int | None = None  # the newest drafting round decided here
        self.reason = ""

    def _gap(self, sps_table, plain_sps: float, buckets, replica_slots: int) -> int:
        """Plain rounds before the next probe (module docstring)."""
        cost = plain_sps / max(float(sps_table[replica_slots + min(buckets)]), 1e-30) - 1.0
        scale = max(1.0, cost)
        lo, hi = (math.ceil(x * scale) for x in self.probe_gap)
        return min(lo * 2**self._level, hi)

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
            if self._drafted is None:  # the first round: it drafts (the first probe)
                self._drafted = index
                self.reason = "no confidences read yet: a first probe"
                return "draft"
            self.reason = "waiting for the first probe's confidences"
            return "plain"
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
            self._level, self._streak, self._probe, self._drafted = 0, 0, None, index
            self.reason = f"drafting pays (Θ_draft/Θ_plain = {ratio:.2f})"
            return "draft"
        if self._probe is not None and seen >= self._probe:  # the probe says: still plain
            self._probe, self._level = None, min(self._level + 1, 30)  # the gap doubles
        gap = self._gap(sps_table, plain_sps, buckets, replica_slots)
        if self._streak >= gap:
            self._streak, self._probe, self._drafted = 0, index, index
            self.reason = f"probe after {gap} plain rounds"
            return "probe"
        self._streak += 1
        self.reason = f"drafting would not pay (Θ_draft/Θ_plain = {ratio:.2f})"
        return "plain"
