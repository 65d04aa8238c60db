"""Host loop for offline speculative generation: continuous batching over fixed slots.

Prompts wait in a queue; a free slot gets the next prompt (prefill in a length bucket)
once the KV page pool can hold it (``decode.pages``: prompt + max_new_tokens reserved at
admission), every round advances all active slots, finished slots are refilled and their
pages freed. Per sample it records
the generated ids, the finish reason and, per round, the tokens accepted and verified.

Verify budgets (compiled buckets K, draft tokens per round) come from
``decode.policy.RoundPolicy``, shared with the serving engine: none verifies the anchors
only, fixed / threshold the smallest bucket holding γ per occupied slot, dynamic top-K the
bucket chosen from round n − 2's survivals, Algorithm 1 plan → Σ ℓ → commit.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from dspark_jax.decode.autoregressive import length_bucket
from dspark_jax.decode.pages import PagePool
from dspark_jax.decode.policy import RoundPolicy, default_buckets, profile_decoder_sps
from dspark_jax.decode.step import (
    FINISH_NAMES,
    FINISH_NONE,
    SpeculativeDecoder,
    request_key_data,
)

# Re-exported: callers built on the runner keep working.
__all__ = ["Request", "Runner", "SampleResult", "default_buckets", "profile_decoder_sps"]


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
    seed: int | None = None  # the request's random stream (None: from the runner's seed)
    # Position-keyed draws (decode.verify.verify_coupled): the output is a function of the
    # seed and prompt alone, whatever the scheduler and the other requests.
    coupled: bool = False


class Runner:
    """Offline generation over ``decoder``'s slots; shapes per round from a ``RoundPolicy``
    (the one the serving engine uses), so the same scheduler verifies the same shapes."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        buckets: Sequence[int] | None = None,
        record_details: bool = False,
        seed: int = 0,
    ):
        self.decoder = decoder
        self.policy = RoundPolicy(decoder, buckets)
        self.record_details = record_details
        self.seed = seed

    def request_keys(self, index: int, req: Request) -> np.ndarray:
        """Request ``index``'s random stream: from its own ``seed`` if it has one, else
        from the runner's seed and the index (so a run is reproducible as a whole and each
        request's samples do not depend on which others share its rounds)."""
        if req.seed is not None:
            return request_key_data(req.seed)
        return request_key_data(self.seed, index, 1)

    # Read-only views of the round policy.
    buckets = property(lambda self: self.policy.buckets)
    two_phase = property(lambda self: self.policy.two_phase)

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
                page_rows=self.decoder.static_page_rows([0]),  # compiles; any pages do
            )
        state = self.policy.warmup(state)
        jax.block_until_ready(state.seq_len)

    def generate(
        self, requests: Sequence[Request], on_finish: Callable[[int], None] | None = None
    ) -> tuple[list[SampleResult], GenerationStats]:
        """Run every request to its end; ``on_finish(i)`` is called as request ``i`` ends
        (progress bars)."""
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
        pool = PagePool(dec.num_pages, cfg.page_size, cfg.max_len, dec.draft_positions)
        for i, req in enumerate(requests):
            try:
                pool.check_fits(len(req.prompt), req.max_new_tokens)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        slot_pages: list[np.ndarray | None] = [None] * cfg.num_slots
        state = dec.init_state(self.seed)
        queue = collections.deque(enumerate(requests))
        slot_req: list[int | None] = [None] * cfg.num_slots
        results: dict[int, SampleResult] = {}
        self.policy.reset()
        rounds, generated, budget_sum = 0, 0, 0
        start = time.perf_counter()

        def finish(slot, reason):
            results[slot_req[slot]].finish_reason = reason
            if on_finish is not None:
                on_finish(slot_req[slot])
            slot_req[slot] = None
            pool.release(slot_pages[slot])
            slot_pages[slot] = None

        while queue or any(s is not None for s in slot_req):
            for slot in range(cfg.num_slots):
                while slot_req[slot] is None and queue:
                    idx, req = queue[0]
                    pages = pool.allocate(len(req.prompt), req.max_new_tokens)
                    if pages is None:  # first come, first served: wait for freed pages
                        break
                    queue.popleft()
                    slot_pages[slot] = pages
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
                        self.request_keys(idx, req)[None],
                        np.array([req.coupled]),
                        pages[None],
                    )
                    first, code = int(pre.first_token[0]), int(pre.finish[0])
                    results[idx] = SampleResult(idx, req.prompt_index, [first], "", [], [])
                    generated += 1
                    slot_req[slot] = idx
                    if code != FINISH_NONE:
                        finish(slot, FINISH_NAMES[code])
            if not any(s is not None for s in slot_req):
                continue
            occupied = np.array([s is not None for s in slot_req])
            state, out, budget, index = self.policy.dispatch(state, int(occupied.sum()))
            out = jax.device_get(out)
            self.policy.observe(index, out.survival, occupied)
            rounds += 1
            budget_sum += budget
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
