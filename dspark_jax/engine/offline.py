"""The offline driver of the engine core: run a list of requests to their ends and keep,
per request, the generated ids, the finish reason and each round's record (tokens
accepted and verified; with ``record_details``, the survivals and drafts), for
evaluation, calibration and ``generate``.

Rounds are read as they finish (``EngineCore(pipelined=False)``): nothing here streams,
and the records need every round. Verify budgets come from the round policy the server
uses (``decode.policy.RoundPolicy``), so the same scheduler verifies the same shapes.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from dspark_jax.decode.policy import default_buckets, profile_decoder_sps
from dspark_jax.decode.step import FINISH_NAMES, FINISH_NONE, SpeculativeDecoder, request_key_data
from dspark_jax.engine.core import CoreRequest, Emitted, EngineCore, RoundDone

__all__ = [
    "GenerationStats",
    "Request",
    "Runner",
    "SampleResult",
    "default_buckets",
    "profile_decoder_sps",
]


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
    # Verify rows run beyond the data replicas' own buckets (0 with one replica).
    padding_rows: int = 0
    # Rounds by kind (decode.policy.ROUND_KINDS): drafting, plain (target alone), probes.
    round_kinds: dict[str, int] = dataclasses.field(default_factory=dict)

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
    """Offline generation over ``decoder``'s slots through one ``EngineCore``
    (``plain_rounds``: ``decode.policy.RoundPolicy``'s draft-aware rounds)."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        buckets: Sequence[int] | None = None,
        record_details: bool = False,
        seed: int = 0,
        plain_rounds: bool | None = None,
    ):
        self.decoder = decoder
        self.core = EngineCore(decoder, buckets, seed=seed, plain_rounds=plain_rounds)
        self.policy = self.core.policy
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
        self.core.warmup(prompt_buckets)

    def generate(
        self, requests: Sequence[Request], on_finish: Callable[[int], None] | None = None
    ) -> tuple[list[SampleResult], GenerationStats]:
        """Run every request to its end; ``on_finish(i)`` is called as request ``i`` ends
        (progress bars)."""
        core = self.core
        for i, req in enumerate(requests):  # every request checked before any runs
            try:
                core.check(len(req.prompt), req.max_new_tokens)
            except ValueError as e:
                raise ValueError(f"request {i}: {e}") from None
        core.reset()
        for i, req in enumerate(requests):
            core.add(CoreRequest(
                req.prompt, req.max_new_tokens, req.temperature, req.top_k, req.top_p,
                self.request_keys(i, req), req.coupled, tag=i,
            ))  # fmt: skip
        results: dict[int, SampleResult] = {}
        rounds = generated = budget_sum = padding = 0
        kinds: dict[str, int] = {}
        start = time.perf_counter()
        while core.has_work:
            for ev in core.step():
                if isinstance(ev, RoundDone):
                    rounds += 1
                    kinds[ev.kind] = kinds.get(ev.kind, 0) + 1
                    budget_sum += ev.budget
                    padding += ev.padding
                    continue
                generated += self._record(ev, results, requests)
                if ev.finish != FINISH_NONE:
                    results[ev.request.tag].finish_reason = FINISH_NAMES[ev.finish]
                    if on_finish is not None:
                        on_finish(ev.request.tag)
        stats = GenerationStats(
            rounds=rounds,
            generated_tokens=generated,
            wall_seconds=time.perf_counter() - start,
            mean_budget=budget_sum / max(rounds, 1),
            compiled_budgets=list(self.buckets),
            padding_rows=padding,
            round_kinds=kinds,
        )
        return [results[i] for i in range(len(requests))], stats

    def _record(self, ev: Emitted, results: dict, requests) -> int:
        i = ev.request.tag
        if ev.round_index is None:  # the prefill's first token
            results[i] = SampleResult(i, requests[i].prompt_index, list(ev.tokens), "", [], [])
            return len(ev.tokens)
        res = results[i]
        res.tokens.extend(ev.tokens)
        res.accepted_per_round.append(ev.accepted)
        res.verified_per_round.append(ev.verified)
        if self.record_details:
            res.survival_per_round.append([float(x) for x in ev.survival])
            res.draft_tokens_per_round.append([int(x) for x in ev.draft_tokens])
        return len(ev.tokens)
