"""The serving engine's settings and its counters (read by ``/metrics``)."""

from __future__ import annotations

import collections
import dataclasses

from dspark_jax.decode.step import StepConfig

__all__ = ["EngineConfig", "EngineStats", "SEEDED_VERIFICATION"]

SEEDED_VERIFICATION = ("coupled", "standard")


@dataclasses.dataclass
class EngineConfig:
    """Engine settings.

    num_slots: decode slots R. max_len: cache positions per slot (prompt + output).
    scheduler: none | fixed | threshold | prefix | topk (DESIGN §5.3).
    max_queue: bound of the admission queue (full -> ``QueueFull``).
    verify_buckets: compiled verify budgets K (default ``policy.default_buckets``): topk
      rounds its budget up to one, prefix its Σ l, fixed/threshold γ per occupied slot;
      SPS is profiled on these for ``prefix``/``topk``.
    sps_cache: JSON file caching the SPS table (``sched.sps.load_or_profile``); None = none.
    sps_repeats: timed calls per bucket when profiling.
    max_logprobs: most alternatives a request may ask for per token (``logprobs`` /
      ``top_logprobs``); the round computes this many (a top-N over the vocabulary of each
      verified row), 0 = only each token's own log-probability.
    seeded_verification: how requests that carry a ``seed`` are verified. ``coupled``
      (default): position-keyed Gumbel-max draws (``decode.verify.verify_coupled``), so a
      seeded output is identical whatever the load and the scheduler; ``standard``:
      rejection sampling like unseeded requests (accepts more drafts; a seed then holds
      under load only with the none/fixed/threshold schedulers).
    page_size / kv_pages: the paged KV cache (``ops.paged_attention``): positions per page
      and pages in the pool, the null page included (None: every slot at ``max_len``, so
      admission never waits for pages). A smaller pool holds more slots of short requests:
      each admitted request reserves the pages of its prompt + ``max_tokens``; a request
      that does not fit yet waits in the queue (``/metrics``: ``dspark_kv_pages_*``,
      ``dspark_requests_waiting_for_pages``).
    attention: the verify attention backend: ``auto`` (``pallas_tpu`` on TPU,
      ``pallas_gpu`` on GPU, else ``xla``), ``xla``, ``pallas_tpu`` or ``pallas_gpu``
      (logged at start and in ``/metrics``).
    plain_rounds: run a plain round (the target alone) when drafting would not pay on the
      newest survivals (``decode.policy``); None: on for ``topk`` and ``prefix``.
    """

    num_slots: int = 8
    max_len: int = 512
    scheduler: str = "topk"
    max_queue: int = 256
    threshold: float = 0.5
    fixed_length: int | None = None
    verify_buckets: tuple[int, ...] | None = None
    seed: int = 0
    sps_cache: str | None = None
    sps_repeats: int = 5
    model_name: str = "dspark"
    # Requests admitted together are prefilled in one call of this many rows (padded with
    # rows that write nothing); 1 prefills one request per call.
    prefill_batch: int = 4
    seeded_verification: str = "coupled"
    max_logprobs: int = 20  # vLLM's default bound; the OpenAI API allows up to 20
    page_size: int = 16
    kv_pages: int | None = None
    attention: str = "auto"
    plain_rounds: bool | None = None

    def __post_init__(self):
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.seeded_verification not in SEEDED_VERIFICATION:
            raise ValueError(
                f"seeded_verification must be one of {list(SEEDED_VERIFICATION)}, got "
                f"{self.seeded_verification!r}"
            )
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.prefill_batch < 1:
            raise ValueError(f"prefill_batch must be >= 1, got {self.prefill_batch}")
        if self.max_len < 4:
            raise ValueError(f"max_len must be >= 4, got {self.max_len}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")

    def step_config(self, scheduler: str, eos_id: int) -> StepConfig:
        """The decode step the engine runs: per-request temperatures (greedy rows exact,
        as a one-hot), ``scheduler`` (``none`` without a drafter)."""
        return StepConfig(
            num_slots=self.num_slots,
            max_len=self.max_len,
            sampling=True,
            scheduler=scheduler,
            threshold=self.threshold,
            fixed_length=self.fixed_length,
            eos_id=eos_id,
            top_logprobs=self.max_logprobs,
            page_size=self.page_size,
            num_pages=self.kv_pages,
            attention=self.attention,
        )


@dataclasses.dataclass
class EngineStats:
    """Counters since start (read by ``/metrics``; written by the engine thread)."""

    rounds: int = 0
    requests_finished: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    slot_rounds: int = 0  # (slot, round) pairs that emitted tokens
    emitted_tokens: int = 0  # tokens emitted by rounds (τ numerator)
    budget_sum: int = 0
    last_round_seconds: float = 0.0
    last_budget: int = 0
    last_tau: float = 0.0
    # The engine thread's time, by what it was doing (the round timeline): dispatching
    # work to the device (prefill and rounds, incl. choosing the budget), waiting for a
    # round's output, host processing of outputs (detokenising, stop strings, delivery),
    # and idle (no request anywhere). Host share = (dispatch + host) / busy time.
    dispatch_seconds: float = 0.0
    device_wait_seconds: float = 0.0
    host_seconds: float = 0.0
    idle_seconds: float = 0.0
    # Admission passes where the next request had a free slot but not enough free KV pages.
    page_waits: int = 0
    # Verify rows run beyond the data replicas' own buckets (decode.replicas).
    padding_rows: int = 0

    def record_round(self, seconds: float, budget: int, taus: list[int], padding: int = 0) -> None:
        """One decode round: its wall time, verify budget, tokens emitted per slot and
        rows padded for other data replicas' budgets."""
        self.rounds += 1
        self.padding_rows += padding
        self.budget_sum += budget
        self.slot_rounds += len(taus)
        self.emitted_tokens += sum(taus)
        self.last_round_seconds = seconds
        self.last_budget = budget
        self.last_tau = sum(taus) / len(taus) if taus else 0.0

    @property
    def host_share(self) -> float:
        """Share of the engine thread's busy time spent on the host (not waiting)."""
        busy = self.dispatch_seconds + self.device_wait_seconds + self.host_seconds
        return (self.dispatch_seconds + self.host_seconds) / busy if busy else 0.0

    def timeline(self) -> dict[str, float]:
        return {
            "dispatch_seconds": self.dispatch_seconds,
            "device_wait_seconds": self.device_wait_seconds,
            "host_seconds": self.host_seconds,
            "idle_seconds": self.idle_seconds,
            "host_share": self.host_share,
        }

    @property
    def mean_tau(self) -> float:
        return self.emitted_tokens / max(self.slot_rounds, 1)

    @property
    def mean_budget(self) -> float:
        return self.budget_sum / max(self.rounds, 1)
