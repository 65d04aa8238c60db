"""Serving simulator: the engine's round loop replayed on a modelled clock (DESIGN §7).

Real drafter behaviour, modelled hardware. Each request replays one prompt's recorded
rounds from an acceptance run (``eval acceptance`` verifies every draft, so a record holds
the round's confidences and how many leading drafts the target accepted, uncensored). A
round's verify lengths come from the project's own schedulers (``sched.policies``, the
budget rule ``sched.budget.next_budget``, ``sched.topk.choose_budget``), and the round takes
``1 / SPS(R + K)`` seconds from a profiled or modelled SPS table (the table times the whole
fused round, drafting included). Verifying the first ``ℓ`` drafts of a round whose
all-drafts outcome was ``a`` accepts ``min(a, ℓ)`` of them plus one target token: exact,
since whether draft ``j`` survives depends only on drafts ``≤ j`` and the target there.

The loop mirrors ``serve.engine.Engine._loop``: admit waiting requests into free slots
(prefill in groups of ``prefill_batch`` rows), dispatch a round for the occupied slots, and
only then process the oldest output still in flight, so the host learns a round's tokens
(and frees finished slots) one round late, and dynamic top-K chooses its budget from the
survivals of the newest processed round (two rounds before the one dispatched). Two-phase
Algorithm 1 waits for the device before each dispatch (it reads Σ ℓ). The device runs its
work in order; the host adds ``host_seconds`` per processed round.

Draft-aware rounds (``Arm.plain_rounds``, ``sched.plain_rounds``): before each round the
same rule as the engine's decides, on the survivals of the newest processed drafting
round, whether to draft; a plain round takes ``SPSTable.plain_seconds`` and gives every
active slot one token without consuming its trace's round (acceptance is treated as
stationary over the few tokens until the next drafting round).

Clients as in ``benchmarks/serving.py``: ``concurrency`` clients each send up to
``requests_per_client`` requests back to back, none started after ``time_limit``.

Data replicas (``replicas`` = D, ``decode.replicas``): the ``slots`` are D blocks of R/D,
a request goes to the least-loaded replica with a free slot, each replica chooses its own
budget from its own slots (one server of Algorithm 1 each), and every round runs the
largest of them: ``1 / SPS(R/D + K)`` with the SPS table of *one replica* (the replicas run
side by side on their own chips). The rows a replica runs beyond its own bucket are
reported as padding. A prefill call takes the clock as one call, as in the engine, where
every replica runs the call's rows (its own, the rest padding) at once.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from dspark_jax.eval.calibration import survival_from_logits
from dspark_jax.sched import budget as budget_lib
from dspark_jax.sched.plain_rounds import PlainRoundRule
from dspark_jax.sched.policies import make_scheduler
from dspark_jax.sched.sps import SPSTable

__all__ = [
    "Arm",
    "Trace",
    "Workload",
    "simulate",
    "traces_from_records",
]


@dataclasses.dataclass(frozen=True)
class Trace:
    """One prompt's recorded rounds (all drafts verified).

    accepted: ``[n]`` leading drafts the target accepted per round (``0 … γ``).
    survival: ``[n, γ]`` survival probabilities ``a = cumprod(confidence)`` the scheduler
      would have seen (ones for drafters without a confidence head).
    """

    accepted: np.ndarray
    survival: np.ndarray

    def __post_init__(self):
        if self.accepted.ndim != 1 or self.survival.ndim != 2:
            raise ValueError("a trace needs accepted [n] and survival [n, γ]")
        if len(self.accepted) != len(self.survival) or len(self.accepted) == 0:
            raise ValueError(
                f"trace lengths differ or are empty: {len(self.accepted)} accepted vs "
                f"{len(self.survival)} survival rows"
            )


def traces_from_records(
    prompt_index: np.ndarray,
    accepted: np.ndarray,
    gamma: int,
    confidence_logits: np.ndarray | None = None,
    sts_temperatures: Sequence[float] | None = None,
    sts_biases: Sequence[float] | None = None,
    sts_knots: np.ndarray | None = None,
) -> list[Trace]:
    """Split an acceptance run's flattened per-round records into per-prompt traces, in
    prompt order. Confidences are calibrated as the decode step does
    (``σ(z / T_k + b_k)``, or an isotonic fit's steps: ``STS.knots``) before the cumulative
    product."""
    prompt_index = np.asarray(prompt_index)
    accepted = np.asarray(accepted, np.int64)
    if prompt_index.shape != accepted.shape:
        raise ValueError("prompt_index and accepted must have the same shape")
    if confidence_logits is None:
        survival = np.ones((len(accepted), gamma), np.float32)
    else:
        z = np.asarray(confidence_logits, np.float32)
        if z.shape != (len(accepted), gamma):
            raise ValueError(f"confidence_logits must be [{len(accepted)}, {gamma}], got {z.shape}")
        survival = survival_from_logits(z, sts_temperatures, sts_biases, sts_knots).astype(
            np.float32
        )
    out = []
    for p in np.unique(prompt_index):
        rows = np.flatnonzero(prompt_index == p)  # records are in round order per prompt
        out.append(Trace(np.minimum(accepted[rows], gamma), survival[rows]))
    return out


@dataclasses.dataclass(frozen=True)
class Arm:
    """One serving arm.

    scheduler: none | fixed | threshold | prefix | topk (as ``EngineConfig.scheduler``).
    gamma: drafts per slot and round (1 for MTP-1, ignored for none).
    sps: the round's SPS table over ``B = R + K`` (seconds per round = 1 / SPS).
    verify_buckets: compiled budgets ``K`` (``(0,)`` for none).
    two_phase: Algorithm 1's plan → Σ ℓ → commit (the host waits for the plan).
    plain_rounds: draft-aware rounds (module docstring); needs ``sps.plain_seconds``.
    """

    name: str
    scheduler: str
    gamma: int
    sps: SPSTable
    verify_buckets: tuple[int, ...]
    threshold: float = 0.5
    two_phase: bool = False
    plain_rounds: bool = False

    def __post_init__(self):
        if self.plain_rounds and self.sps.plain_seconds is None:
            raise ValueError(f"arm {self.name!r}: plain rounds need the SPS table's plain_seconds")
        if self.plain_rounds and self.scheduler not in ("topk", "prefix"):
            raise ValueError(
                f"arm {self.name!r}: plain rounds are decided from survivals (topk, prefix); "
                f"got scheduler {self.scheduler!r}"
            )

    def round_seconds(self, b: int) -> float:
        s = self.sps(b)
        if s <= 0:
            raise ValueError(
                f"arm {self.name!r}: no SPS for B = {b} (table buckets {self.sps.buckets})"
            )
        return 1.0 / s


@dataclasses.dataclass(frozen=True)
class Workload:
    concurrency: int
    requests_per_client: int
    max_tokens: int
    prompt_tokens: tuple[int, ...]  # prompt lengths, cycled like the benchmark's prompts
    time_limit: float = math.inf


class _Request:
    __slots__ = ("client", "index", "trace", "ptr", "emitted", "prompt", "t_submit", "t_done")

    def __init__(self, client, index, trace, prompt, t_submit):
        self.client, self.index, self.trace, self.prompt = client, index, trace, prompt
        self.ptr, self.emitted, self.t_submit, self.t_done = 0, 0, t_submit, None


def _scheduler_fn(arm: Arm, slots: int) -> Callable:
    """``fn(survival [R, γ], active [R], budget) -> lengths [R]`` from ``sched.policies``."""
    if arm.scheduler == "none":
        return lambda a, active, k: np.zeros(slots, np.int64)
    if arm.scheduler == "topk":
        fns = {}

        def topk(a, active, k):
            if k not in fns:
                fns[k] = make_scheduler("topk", budget=int(k))
            return np.asarray(fns[k](a, active).lengths)

        return topk
    if arm.scheduler == "prefix":
        dense = arm.sps.as_array(slots * (arm.gamma + 1) + 1)
        fn = make_scheduler("prefix", sps_table=dense)
    elif arm.scheduler == "threshold":
        fn = make_scheduler("threshold", threshold=arm.threshold)
    elif arm.scheduler == "fixed":
        fn = make_scheduler("fixed")
    else:
        raise ValueError(f"unknown scheduler {arm.scheduler!r}")
    return lambda a, active, k: np.asarray(fn(a, active).lengths)


def simulate(
    arm: Arm,
    traces: Sequence[Trace],
    workload: Workload,
    *,
    slots: int,
    prefill_seconds: Callable[[int, int], float],
    prefill_batch: int = 4,
    host_seconds: float = 0.0,
    replicas: int = 1,
) -> dict:
    """Replay ``workload`` through ``arm`` on ``slots`` decode slots (``replicas`` data
    replicas of ``slots / replicas`` each; the module docstring).

    Args:
      traces: per-prompt recorded rounds; request ``j`` of client ``c`` replays trace
        ``(c · requests_per_client + j) mod len(traces)`` (the benchmark's prompt order).
      prefill_seconds: ``f(rows, prompt_tokens)`` seconds of one prefill call of ``rows``
        prompts padded to the longest one's length.
      host_seconds: host time per processed round (detokenising, delivery).

    Returns aggregate and per-user tokens/s, mean τ and verify budget per request, rounds,
    the modelled wall time and the requests' latencies (same fields as the benchmark).
    """
    if not traces:
        raise ValueError("simulate needs at least one trace")
    if slots < 1 or prefill_batch < 1:
        raise ValueError(f"need slots >= 1 and prefill_batch >= 1, got {slots}, {prefill_batch}")
    if replicas < 1 or slots % replicas:
        raise ValueError(f"replicas must be >= 1 and divide the slots, got {replicas}, {slots}")
    g = max(arm.gamma, 1)
    wl = workload
    rl = slots // replicas  # one replica's slots: the SPS table and schedulers are its
    blocks = [slice(d * rl, (d + 1) * rl) for d in range(replicas)]
    schedule = _scheduler_fn(arm, rl)
    sps_dense = np.asarray(arm.sps.as_array(rl * (g + 1) + 1))
    pending: list[_Request] = []  # submitted, waiting for a slot (in arrival order)
    next_index = collections.Counter()
    finished: list[_Request] = []

    def submit(client: int, t: float) -> None:
        j = next_index[client]
        if j >= wl.requests_per_client or t > wl.time_limit:
            return
        next_index[client] += 1
        k = client * wl.requests_per_client + j
        trace = traces[k % len(traces)]
        prompt = wl.prompt_tokens[k % len(wl.prompt_tokens)]
        pending.append(_Request(client, k, trace, prompt, t))

    for c in range(wl.concurrency):
        submit(c, 0.0)

    host_slots: list[_Request | None] = [None] * slots  # what the host believes occupied
    device_active = np.zeros(slots, bool)
    inflight: collections.deque = collections.deque()
    history: collections.deque = collections.deque(maxlen=2)  # drafting rounds read
    rule = PlainRoundRule() if arm.plain_rounds else None
    kinds = collections.Counter()
    t = dev = 0.0
    rounds = 0
    budgets: list[int] = []
    padding = 0
    per_request_rounds = collections.Counter()
    per_request_tokens = collections.Counter()
    per_request_verified = collections.Counter()

    def finish(req: _Request, when: float) -> None:
        req.t_done = when
        finished.append(req)
        submit(req.client, when)

    def process(item) -> None:
        nonlocal t
        kind, done_at, payload = item
        t = max(t, done_at)
        if kind == "prefill":
            for slot, req in payload:
                if req.emitted >= wl.max_tokens:  # a one-token request ends at prefill
                    host_slots[slot] = None
                    finish(req, t)
            return
        t += host_seconds
        index, survival, active, ended = payload
        if survival is not None:  # a plain round drafted nothing
            history.append((index, survival, active))
        for slot, req in ended:
            host_slots[slot] = None
            finish(req, t)

    while True:
        arrived = [r for r in pending if r.t_submit <= t]
        occupied = any(r is not None for r in host_slots)
        if not arrived and not inflight and not occupied:
            if not pending:
                break
            t = min(r.t_submit for r in pending)  # idle until the next request
            continue
        free = [s for s, r in enumerate(host_slots) if r is None]
        admitted = []
        load = [sum(host_slots[s] is not None for s in range(b.start, b.stop)) for b in blocks]
        for req in arrived:
            if not free:
                break
            pending.remove(req)
            # The least-loaded replica with a free slot (engine.core.EngineCore._place).
            d = min({s // rl for s in free}, key=lambda d: (load[d], d))
            slot = next(s for s in free if s // rl == d)
            free.remove(slot)
            load[d] += 1
            admitted.append((slot, req))
        group = min(prefill_batch, slots)  # the engine's compiled prefill rows: 1 and this
        for i in range(0, len(admitted), group):
            chunk = admitted[i : i + group]
            rows = 1 if len(chunk) == 1 else group
            dev = max(dev, t) + prefill_seconds(rows, max(req.prompt for _, req in chunk))
            for slot, req in chunk:
                host_slots[slot] = req
                req.emitted = 1  # prefill samples the first token
                device_active[slot] = req.emitted < wl.max_tokens
                per_request_tokens[req.index] = 1
            inflight.append(("prefill", dev, chunk))
        if any(r is not None for r in host_slots):
            last = history[-1][1:] if history else (None, None)
            kind = "draft"
            if rule is not None:
                kind = rule.decide(
                    rounds, history[-1] if history else None, sps_dense, arm.sps.plain_sps,
                    arm.verify_buckets, rl,
                )  # fmt: skip
            kinds[kind] += 1
            plain = kind == "plain"  # the target alone: no plan to wait for, no draft
            if arm.two_phase and not plain:
                t = max(t, dev)  # the host reads the plan's Σ ℓ before choosing the shape
            survival = np.ones((slots, g), np.float32)
            accepted = np.zeros(slots, np.int64)
            remaining = np.zeros(slots, np.int64)
            for s in np.flatnonzero(device_active):
                req = host_slots[s]
                survival[s] = req.trace.survival[req.ptr, :g]
                accepted[s] = req.trace.accepted[req.ptr]
                remaining[s] = wl.max_tokens - req.emitted
            lengths = np.zeros(slots, np.int64)
            own = []  # each replica's own budget (one replica: the round's)
            for b in [] if plain else blocks:
                if arm.two_phase:
                    part = schedule(survival[b], device_active[b], None)
                    part = np.where(device_active[b], part, 0)
                    k = budget_lib.smallest_bucket(arm.verify_buckets, int(part.sum()))
                else:
                    k = budget_lib.next_budget(
                        arm.scheduler,
                        arm.verify_buckets,
                        gamma=g,
                        occupied=sum(r is not None for r in host_slots[b]),
                        last_survival=None if last[0] is None else last[0][b],
                        last_active=None if last[1] is None else last[1][b],
                        sps_table=sps_dense,
                    )
                    part = schedule(survival[b], device_active[b], k)
                lengths[b] = part
                own.append(k)
            budget = max(own, default=0)
            padding += sum(budget - k for k in own)
            # The decode step caps each slot by its remaining tokens (one is the target's).
            lengths = np.where(device_active, np.minimum(lengths, np.maximum(remaining - 1, 0)), 0)
            ended = []
            for s in np.flatnonzero(device_active):
                req = host_slots[s]
                n = int(min(accepted[s], lengths[s])) + 1
                req.emitted += n
                req.ptr += 0 if plain else 1  # a plain round keeps the trace's round
                per_request_rounds[req.index] += 1
                per_request_tokens[req.index] = req.emitted
                per_request_verified[req.index] += int(lengths[s])
                if req.emitted >= wl.max_tokens or req.ptr >= len(req.trace.accepted):
                    device_active[s] = False  # the device ends the slot (length / EOS)
                    ended.append((s, req))
            seconds = arm.sps.plain_seconds if plain else arm.round_seconds(rl + budget)
            dev = max(dev, t) + seconds
            budgets.append(int(budget))
            read = None if plain else survival  # a plain round's survivals say nothing
            inflight.append(("round", dev, (rounds, read, device_active.copy(), ended)))
            rounds += 1
            while len(inflight) > 1:
                process(inflight.popleft())
        else:
            while inflight:
                process(inflight.popleft())

    wall = max(r.t_done for r in finished)
    tokens = sum(per_request_tokens[r.index] for r in finished)
    lat = [r.t_done - r.t_submit for r in finished]
    user = [per_request_tokens[r.index] / (r.t_done - r.t_submit) for r in finished]
    taus = [
        (per_request_tokens[r.index] - 1) / per_request_rounds[r.index]
        for r in finished
        if per_request_rounds[r.index]
    ]
    verified = [
        per_request_verified[r.index] / per_request_rounds[r.index]
        for r in finished
        if per_request_rounds[r.index]
    ]
    mean = lambda xs: float(np.mean(xs)) if xs else 0.0
    return {
        "concurrency": wl.concurrency,
        "requests": len(finished),
        "wall_seconds": wall,
        "aggregate_tokens_per_second": tokens / wall,
        "per_user_tokens_per_second": mean(user),
        "mean_tau": mean(taus),
        "mean_verify_budget_per_request": mean(verified),
        "rounds": rounds,
        "mean_round_budget": mean(budgets),
        "budgets": budgets,
        "replicas": replicas,
        "padding_rows": padding,
        "round_kinds": dict(kinds),
        "mean_latency_seconds": mean(lat),
    }
