"""The round policy: which compiled shape each decode round runs (DESIGN §5.3).

One object, in the one host core (``engine.core.EngineCore``) that the offline runner and
the serving engine both drive, so offline evaluation and serving verify the same shapes
for the same scheduler:

* verify buckets: compiled budgets ``K`` (draft tokens per round). ``none`` verifies only
  the anchors (``K = 0``); every other arm gets ``default_buckets`` (or the caller's) plus
  ``R·γ``, so the largest bucket always holds every draft;
* the budget of the next round (``sched.budget.next_budget``): fixed / threshold take the
  smallest bucket holding γ drafts per occupied slot, dynamic top-K the bucket
  ``choose_budget`` picks from the survivals of round ``n − 2`` (the newest a pipelined
  host has processed when it dispatches round ``n``: the host never waits on the round in
  flight), one-phase prefix the largest;
* two-phase Algorithm 1 (``prefix`` with several buckets): ``plan`` → read Σ ℓ → ``commit``
  in the smallest bucket holding it, so pruned drafts save real compute;
* warm-up (every verify bucket compiled), SPS profiling on the decoder's own rounds, and
  the count of compiled executables (``SpeculativeDecoder.compiled_executables``).

With data replicas (``decode.replicas``) every rule above runs per replica, on that
replica's own slots (each replica is one server of Algorithm 1); the round runs in the
largest of their buckets, each replica admitting only its own budget, and the rows a
replica computes beyond its own bucket are the round's *padding*.

Draft-aware rounds (``topk`` and ``prefix``, on by default): a *plain* round
(``SpeculativeDecoder.plain_round``: the target alone, the drafter's context still
written) when drafting would not pay on the newest survivals read, with probes that keep
speculation from starving (the rule and why it stays lossless: ``sched.plain_rounds``).

A host loop calls ``dispatch(state, occupied)`` for each round (``occupied``: which slots
hold a request) and ``observe(index, survival, active)`` when it has read that round's
output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from dspark_jax.decode.step import SpeculativeDecoder
from dspark_jax.sched import budget as budget_lib
from dspark_jax.sched import sps as sps_lib
from dspark_jax.sched.plain_rounds import DEFAULT_PROBE_GAP, ROUND_KINDS, PlainRoundRule

__all__ = ["ROUND_KINDS", "RoundPolicy", "default_buckets", "profile_decoder_sps"]


def default_buckets(num_slots: int, gamma: int, count: int = 8) -> tuple[int, ...]:
    """Evenly spaced verify budgets up to K = R·γ (dynamic top-K rounds up to these)."""
    full = num_slots * gamma
    return tuple(sorted({max(1, (full * i) // count) for i in range(1, count + 1)}))


def profile_decoder_sps(
    decoder: SpeculativeDecoder,
    budgets: Sequence[int],
    cache_path: str | None = None,
    key: str | None = None,
    repeats: int = 5,
    warmup: int = 1,
    progress=None,
    plain: bool | None = None,
) -> sps_lib.SPSTable:
    """Profile ``SPS(B)`` with the decoder's own compiled rounds (``B = R + K`` per bucket),
    through the JSON cache when ``cache_path`` is given, and install it in the decoder.
    ``progress(budget, i, n)``: see ``sps.profile_sps``. ``plain``: also time the plain
    round (``SPSTable.plain_seconds``; None: when the decoder has a drafter)."""
    fns = decoder.profile_step_fns(budgets)
    # A decoder with a drafter also times its plain round (the draft-aware policy's arm).
    timed_plain = decoder.drafter is not None and plain is not False
    plain_fn = decoder.plain_step_fn() if timed_plain else None
    kw = dict(repeats=repeats, warmup=warmup, progress=progress, plain_fn=plain_fn)
    if decoder.spans_processes:
        table = _profile_on_every_process(fns, cache_path, key, kw)
    elif cache_path is None:
        table = sps_lib.profile_sps(fns, **kw)
    else:
        if key is None:
            raise ValueError("profile_decoder_sps: a cache_path needs a cache key")
        table = sps_lib.load_or_profile(cache_path, key, fns, **kw)
    decoder.set_sps_table(table)
    return table


def _profile_on_every_process(fns, cache_path, key, kw) -> sps_lib.SPSTable:
    """SPS on a mesh over several processes: every process must run the same rounds and
    then schedule from the same table, so process 0 decides (its cache hit, else the
    profile every process runs together, timed by process 0) and the others take its
    table. A follower's own cache file is never read: it may be stale or absent."""
    from dspark_jax import distributed as dist

    leader = dist.process_index() == 0
    cached = None
    if leader and cache_path is not None:
        cached = sps_lib.cached_table(cache_path, key, fns, plain=kw["plain_fn"] is not None)
    hit = dist.broadcast_json("sps-cache-hit", None if cached is None else cached.to_json())
    if hit is not None:
        return sps_lib.SPSTable.from_json(hit)
    table = sps_lib.profile_sps(fns, **kw)
    if leader and cache_path is not None:
        sps_lib.store_table(cache_path, key, table)
    return sps_lib.SPSTable.from_json(dist.broadcast_json("sps-profile", table.to_json()))


class RoundPolicy:
    """Verify buckets, the budget rule, draft-aware rounds, two-phase mode and warm-up of
    one decoder. ``plain_rounds``: run plain rounds when drafting cannot pay (default: for
    ``topk`` and ``prefix``, the arms with survivals to decide on; it needs an SPS table
    with the plain round's time, else every round drafts); ``probe_gap``: (first, most)
    plain rounds between probes (module docstring)."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        buckets: Sequence[int] | None = None,
        plain_rounds: bool | None = None,
        probe_gap: tuple[int, int] = DEFAULT_PROBE_GAP,
    ):
        self.decoder = decoder
        cfg = decoder.config
        self.scheduler = cfg.scheduler if decoder.drafter is not None else "none"
        full = decoder.full_budget
        if self.scheduler == "none":
            self.buckets: tuple[int, ...] = (0,)
        else:
            slots = decoder.replica_slots  # per replica: its own block of R/D slots
            given = {int(b) for b in (buckets or default_buckets(slots, decoder.gamma))}
            if any(not 0 <= b <= full for b in given):
                per = f" per data replica (R/D = {slots})" if decoder.replicas > 1 else ""
                raise ValueError(
                    f"verify buckets must lie in [0, R·γ = {full}]{per}; got {sorted(given)}"
                )
            self.buckets = tuple(sorted(given | {full}))
        self.two_phase = self.scheduler == "prefix" and len(self.buckets) > 1
        survivals = self.scheduler in ("topk", "prefix")
        if plain_rounds and not survivals:
            raise ValueError(
                f"plain rounds are decided from survivals: they need scheduler 'topk' or "
                f"'prefix' with a DSpark drafter; this decoder's is {self.scheduler!r}"
            )
        self.plain_rounds = survivals if plain_rounds is None else bool(plain_rounds)
        self.plain_rule = PlainRoundRule(probe_gap)
        self._plain_indices: set[int] = set()  # dispatched plain rounds not yet observed
        self.last_kind = "draft"  # what the last dispatched round did (ROUND_KINDS)
        self.last_reason = ""  # why, in a few words
        self.kind_counts = dict.fromkeys(ROUND_KINDS, 0)
        # Survivals [R, γ] and occupancy of read drafting rounds, by index (plain rounds
        # draft nothing, so they are never recorded here).
        self._observed: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._next_index = 0
        self.last_wait_seconds = 0.0  # the last dispatch's wait for its plan (two-phase)
        self.last_padding = 0  # rows the last round ran beyond the replicas' own buckets
        self._sps_src = None  # the decoder table _sps_dense was copied from
        self._sps_dense: np.ndarray | None = None

    # -- the budget ----------------------------------------------------------------------
    def next_budget(self, occupied) -> int:
        """Budget of the round about to be dispatched (one-phase arms); ``occupied``: which
        slots hold a request (``[R]`` bool), or their count (one replica)."""
        return max(self.replica_budgets(occupied))

    def replica_budgets(self, occupied) -> list[int]:
        """Each data replica's own budget for the round about to be dispatched, from its
        own slots (one entry without replicas)."""
        dec = self.decoder
        d, rl = dec.replicas, dec.replica_slots
        if np.ndim(occupied) == 0:
            if d > 1:
                raise ValueError("with data replicas, pass which slots are occupied ([R] bool)")
            counts = [int(occupied)]
        else:
            counts = [int(n) for n in np.asarray(occupied, bool).reshape(d, rl).sum(axis=1)]
        newest = self._newest_observed()
        old = None if newest is None else newest[1:]
        sps = self._host_sps() if old is not None else None
        out = []
        for i in range(d):
            block = slice(i * rl, (i + 1) * rl)
            out.append(budget_lib.next_budget(
                self.scheduler, self.buckets, gamma=dec.gamma, occupied=counts[i],
                last_survival=None if old is None else old[0][block],
                last_active=None if old is None else old[1][block], sps_table=sps,
            ))  # fmt: skip
        return out

    def _newest_observed(self):
        """``(index, survival, active)`` of the newest drafting round read among rounds
        ``<= n − 2`` (``n``: the round about to be dispatched; a pipelined host has read
        exactly those, so offline and serving decide alike), or None."""
        ready = [i for i in self._observed if i <= self._next_index - 2]
        return None if not ready else (max(ready), *self._observed[max(ready)])

    def _round_kind(self) -> str:
        """Draft, plain or probe for the round about to be dispatched
        (``sched.plain_rounds``): reads only survivals of rounds ``<= n − 2`` and the
        profiled SPS, never anything of the round it decides."""
        dec = self.decoder
        if not self.plain_rounds or dec.plain_sps is None:
            self.last_reason = "always drafts" if not self.plain_rounds else "no plain SPS"
            return "draft"
        kind = self.plain_rule.decide(
            self._next_index, self._newest_observed(), self._host_sps(), dec.plain_sps, self.buckets,
            dec.replica_slots,
        )  # fmt: skip
        self.last_reason = self.plain_rule.reason
        return kind

    def _host_sps(self) -> np.ndarray | None:
        """The decoder's SPS table on the host, fetched once per installed table (never
        per round: the host must not queue a transfer behind the round in flight)."""
        table = self.decoder.sps_table
        if table is None:
            return None
        if self._sps_src is not table:
            self._sps_src, self._sps_dense = table, np.asarray(table)
        return self._sps_dense

    def dispatch(self, state, occupied):
        """Run round ``n`` without waiting for it (two-phase prefix reads its plan's Σ ℓ
        first). ``occupied``: which slots hold a request (``[R]`` bool; a count is enough
        for one replica). Returns ``(state, output, budget, n)``; ``last_padding`` is the
        round's padding (module docstring)."""
        dec = self.decoder
        index = self._next_index
        self.last_wait_seconds = 0.0
        kind = self._round_kind()
        self.last_kind = kind
        self.kind_counts[kind] += 1
        if kind == "plain":
            state, out = dec.plain_round(state)
            self._plain_indices.add(index)
            self.last_padding = 0
            self._next_index += 1
            return state, out, 0, index
        if self.two_phase:
            state, plan = dec.plan(state)
            t0 = time.perf_counter()
            lengths = np.asarray(jax.device_get(plan.lengths))
            # Time blocked on the device (the plan, and every round still queued before it).
            self.last_wait_seconds = time.perf_counter() - t0
            needs = lengths.reshape(dec.replicas, -1).sum(axis=1)
            own = [budget_lib.smallest_bucket(self.buckets, int(n)) for n in needs]
            budget = max(own)
            state, out = dec.commit(state, plan, budget)
        else:
            own = self.replica_budgets(occupied)
            budget = max(own)
            if dec.replicas > 1:
                state, out = dec.round(state, budget, replica_budgets=own)
            else:
                state, out = dec.round(state, budget)
        self.last_padding = sum(budget - k for k in own)
        self._next_index += 1
        return state, out, budget, index

    def observe(self, index: int, survival, active) -> None:
        """Record round ``index``'s survivals ``[R, γ]`` and which slots were occupied
        (host arrays, read from its output). A plain round's are not recorded: it drafted
        nothing."""
        if index in self._plain_indices:
            self._plain_indices.discard(index)
            return
        self._observed[index] = (np.asarray(survival), np.asarray(active, bool))
        for i in sorted(self._observed)[:-2]:  # the newest two are all a decision reads
            del self._observed[i]

    # -- compilation and profiling -------------------------------------------------------
    def warmup(self, state, on_bucket: Callable[[int, int, int], None] | None = None):
        """Compile every verify bucket (``on_bucket(K, i, n)`` before the i-th of n);
        returns the state (the rounds ran on it)."""
        dec = self.decoder
        plan = None
        if self.two_phase:
            state, plan = dec.plan(state)
        for i, k in enumerate(self.buckets, 1):
            if on_bucket is not None:
                on_bucket(k, i, len(self.buckets))
            if self.two_phase:
                state, _ = dec.commit(state, plan, k)
            else:
                state, _ = dec.round(state, k)
        if self.plain_rounds:
            state, _ = dec.plain_round(state)
        return state

    def profile_sps(self, **kw) -> sps_lib.SPSTable:
        """``profile_decoder_sps`` over this policy's buckets (installs the table)."""
        table = profile_decoder_sps(self.decoder, self.buckets, plain=self.plain_rounds, **kw)
        self._host_sps()
        return table

    def reset(self) -> None:
        """Forget observed rounds and probes (a new generation run starts)."""
        self._observed.clear()
        self._plain_indices.clear()
        self._next_index = 0
        self.plain_rule.reset()
        self.kind_counts = dict.fromkeys(ROUND_KINDS, 0)
