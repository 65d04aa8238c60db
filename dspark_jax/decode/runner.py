"""Host loop for offline speculative generation: continuous batching over fixed slots.

Prompts wait in a queue; a free slot gets the next prompt (prefill in a length bucket),
every round advances all active slots, finished slots are refilled. Per sample it records
the generated ids, the finish reason and, per round, the tokens accepted and verified.

Verify budgets (compiled buckets K, draft tokens per round):

* ``fixed`` / ``threshold`` / ``none``: one bucket, K = R·γ (one fused round).
* ``topk``: dynamic top-K; K comes from the survivals of two rounds back (the host never
  waits on the round in flight), rounded up to a bucket; one fused round per bucket.
* ``prefix`` (synchronous Algorithm 1): with more than one bucket each round runs as
  ``plan`` (draft + Algorithm 1) -> host reads ``Σ l`` -> ``commit`` in the smallest bucket
  ``K >= Σ l``, so pruned tokens save real compute; with one bucket it is a fused round.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from dspark_jax.decode.autoregressive import length_bucket
from dspark_jax.decode.step import FINISH_NAMES, FINISH_NONE, SpeculativeDecoder
from dspark_jax.sched import sps as sps_lib
from dspark_jax.sched import topk as topk_sched


@dataclasses.dataclass
class SampleResult:
    index: int  # position in the request list
    prompt_index: int
    tokens: list[int]
    finish_reason: str
    accepted_per_round: list[int]  # accepted draft tokens per round (τ = accepted + 1)
    verified_per_round: list[int]
    survival_per_round: list[list[float]] = dataclasses.field(default_factory=list)
    draft_tokens_per_round: list[list[int]] = dataclasses.field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.accepted_per_round)


@dataclasses.dataclass
class GenerationStats:
    rounds: int
    generated_tokens: int
    wall_seconds: float
    mean_budget: float
    compiled_budgets: list[int]

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / max(self.wall_seconds, 1e-9)


@dataclasses.dataclass
class Request:
    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    prompt_index: int = 0


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
) -> sps_lib.SPSTable:
    """Profile ``SPS(B)`` with the decoder's own compiled rounds (``B = R + K`` per bucket),
    through the JSON cache when ``cache_path`` is given, and install it in the decoder.
    ``progress(budget, i, n)``: see ``sps.profile_sps``."""
    fns = decoder.profile_step_fns(budgets)
    kw = dict(repeats=repeats, warmup=warmup, progress=progress)
    if cache_path is None:
        table = sps_lib.profile_sps(fns, **kw)
    else:
        if key is None:
            raise ValueError("profile_decoder_sps: a cache_path needs a cache key")
        table = sps_lib.load_or_profile(cache_path, key, fns, **kw)
    decoder.set_sps_table(table)
    return table


class Runner:
    def __init__(
        self,
        decoder: SpeculativeDecoder,
        buckets: Sequence[int] | None = None,
        record_details: bool = False,
        seed: int = 0,
    ):
        self.decoder = decoder
        cfg = decoder.config
        if cfg.scheduler in ("topk", "prefix") and decoder.drafter is not None:
            self.buckets = tuple(
                sorted({int(b) for b in (buckets or default_buckets(cfg.num_slots, decoder.gamma))})
            )
            if not self.buckets or self.buckets[0] < 0 or self.buckets[-1] > decoder.full_budget:
                raise ValueError(
                    f"buckets must lie in [0, R·γ = {decoder.full_budget}]; got {self.buckets}"
                )
            if self.buckets[-1] != decoder.full_budget:
                # The largest bucket must hold every draft, or a round could be trimmed.
                self.buckets = self.buckets + (decoder.full_budget,)
        else:
            self.buckets = (decoder.full_budget,)
        self.two_phase = cfg.scheduler == "prefix" and len(self.buckets) > 1
        self.record_details = record_details
        self.seed = seed

    def _budget(self, history) -> int:
        """Dynamic top-K: the budget comes from the round two rounds back, so the host
        never waits on the round in flight; the full bucket until two rounds exist."""
        if self.decoder.config.scheduler != "topk" or len(history) < 2:
            return self.buckets[-1]
        survival, active = history[-2]
        table = np.asarray(self.decoder.sps_table)
        return topk_sched.choose_budget(survival, table, self.buckets, active)

    def warmup(self, prompt_buckets: Sequence[int] = ()) -> None:
        """Compile every verify bucket (and the given prompt buckets) before timing."""
        state = self.decoder.init_state(self.seed)
        for t in prompt_buckets:
            state, _ = self.decoder.prefill(
                state,
                np.array([0]),
                np.ones((1, t), np.int32),
                np.array([1]),
                np.array([2]),
                np.array([0.0], np.float32),
                np.array([0]),
                np.array([1.0], np.float32),
            )
        if self.two_phase:
            plan = self.decoder.plan(state)
            for k in self.buckets:
                state, out = self.decoder.commit(state, plan, k)
        else:
            for k in self.buckets:
                state, out = self.decoder.round(state, k)
        jax.block_until_ready(state.seq_len)

    def _step(self, state, history):
        """One round: returns ``(state, output, budget used)``."""
        dec = self.decoder
        if self.two_phase:
            plan = dec.plan(state)
            # Synchronous: the host waits for Algorithm 1's lengths, then runs the smallest
            # compiled bucket that holds them (the largest bucket is R·γ, so one always does).
            need = int(jax.device_get(plan.lengths).sum())
            budget = next(k for k in self.buckets if k >= need)
            state, out = dec.commit(state, plan, budget)
            return state, out, budget
        budget = self._budget(history)
        state, out = dec.round(state, budget)
        return state, out, budget

    def generate(self, requests: Sequence[Request]) -> tuple[list[SampleResult], GenerationStats]:
        dec = self.decoder
        cfg = dec.config
        for i, req in enumerate(requests):
            if len(req.prompt) == 0:
                raise ValueError(f"request {i}: empty prompt")
            if len(req.prompt) + 1 >= cfg.max_len:
                raise ValueError(
                    f"request {i}: prompt has {len(req.prompt)} tokens but the cache holds "
                    f"{cfg.max_len} positions (prompt + 1 generated token must fit)"
                )
            if req.max_new_tokens < 1:
                raise ValueError(f"request {i}: max_new_tokens must be >= 1")
        state = dec.init_state(self.seed)
        queue = collections.deque(enumerate(requests))
        slot_req: list[int | None] = [None] * cfg.num_slots
        results: dict[int, SampleResult] = {}
        history: collections.deque = collections.deque(maxlen=2)
        rounds, generated, budget_sum = 0, 0, 0
        start = time.perf_counter()

        def finish(slot, reason):
            results[slot_req[slot]].finish_reason = reason
            slot_req[slot] = None

        while queue or any(s is not None for s in slot_req):
            for slot in range(cfg.num_slots):
                while slot_req[slot] is None and queue:
                    idx, req = queue.popleft()
                    t = min(length_bucket(len(req.prompt)), cfg.max_len)
                    padded = np.zeros((1, t), np.int32)
                    padded[0, : len(req.prompt)] = req.prompt
                    state, pre = dec.prefill(
                        state,
                        np.array([slot], np.int32),
                        padded,
                        np.array([len(req.prompt)], np.int32),
                        np.array([req.max_new_tokens], np.int32),
                        np.array([req.temperature], np.float32),
                        np.array([req.top_k], np.int32),
                        np.array([req.top_p], np.float32),
                    )
                    first, code = int(pre.first_token[0]), int(pre.finish[0])
                    results[idx] = SampleResult(idx, req.prompt_index, [first], "", [], [])
                    generated += 1
                    slot_req[slot] = idx
                    if code != FINISH_NONE:
                        finish(slot, FINISH_NAMES[code])
            if not any(s is not None for s in slot_req):
                continue
            state, out, budget = self._step(state, history)
            out = jax.device_get(out)
            rounds += 1
            budget_sum += budget
            history.append((out.survival, np.array([s is not None for s in slot_req])))
            for slot, idx in enumerate(slot_req):
                if idx is None:
                    continue
                res = results[idx]
                n = int(out.num_emitted[slot])
                res.tokens.extend(int(x) for x in out.tokens[slot, :n])
                generated += n
                res.accepted_per_round.append(int(out.accepted[slot]))
                res.verified_per_round.append(int(out.verified[slot]))
                if self.record_details:
                    res.survival_per_round.append([float(x) for x in out.survival[slot]])
                    res.draft_tokens_per_round.append([int(x) for x in out.draft_tokens[slot]])
                code = int(out.finish[slot])
                if code != FINISH_NONE:
                    finish(slot, FINISH_NAMES[code])
        wall = time.perf_counter() - start
        stats = GenerationStats(
            rounds=rounds,
            generated_tokens=generated,
            wall_seconds=wall,
            mean_budget=budget_sum / max(rounds, 1),
            compiled_budgets=list(self.buckets),
        )
        return [results[i] for i in range(len(requests))], stats
