"""Continuous-batching serving engine over fixed decode slots (DESIGN §5.2, §5.3, §6).

One engine thread owns the ``SpeculativeDecoder`` state. Requests enter a bounded admission
queue; the loop moves them into free slots (prefill: requests admitted together share
calls of ``prefill_batch`` rows, prompts padded to a power-of-two length bucket), runs
decode rounds for every occupied slot, streams the
detokenised text to the request's consumer and frees the slot on EOS / stop string /
max tokens / end of cache / cancellation.

Pipelining (why the budget comes from *two* rounds back): rounds are dispatched
asynchronously. Round ``n+1`` is dispatched before the host fetches round ``n``'s output,
so the host work of round ``n`` (detokenising, stop strings, admission) overlaps the device
work of round ``n+1``. For dynamic top-K the verify budget of round ``n+1`` must be known
at dispatch; the newest round whose survival probabilities are on the host then is
``n-1`` — exactly the rule of DESIGN §5.3, and the host never waits on the current round.
Each dispatched round remembers which request owned each slot; outputs for a slot whose
owner has since finished (e.g. a stop string found in round ``n`` while ``n+1`` ran) are
dropped, so a request never receives tokens after its end and a reused slot never receives
its predecessor's tokens.

Compilation: every (prefill rows, prompt length bucket) pair and every verify bucket is
compiled in ``start()``. ``compilations_after_warmup`` is the growth of the jitted functions'
``_cache_size()`` since then; it must stay 0 (tests and ``/metrics`` check it).

Seeds: the decoder has ONE random stream for all slots (``DecodeState.rng``), split once
per prefill and per round, and the per-slot draws of a round depend on the row's slot. A
request's samples therefore depend on what else shares its rounds, and exact per-request
reproducibility under concurrent batching is not possible with this decoder. What the
engine guarantees: when a request carrying ``seed`` is admitted into an idle engine (no
other request running or in flight), the stream is reset to ``jax.random.key(seed)``; if
it also runs alone until it finishes, the same seed gives the same output. Under load the
seed is accepted but only best-effort. Greedy requests (temperature 0) are deterministic
regardless and equal plain autoregressive greedy decoding token for token.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import jax
import numpy as np

from dspark_jax.decode.autoregressive import length_bucket
from dspark_jax.decode.policy import RoundPolicy
from dspark_jax.decode.step import (
    FINISH_EOS,
    FINISH_NONE,
    SpeculativeDecoder,
    StepConfig,
)
from dspark_jax.sched import sps as sps_lib
from dspark_jax.tokenizer import IncrementalDecoder, Tokenizer

log = logging.getLogger(__name__)

MIN_PROMPT_BUCKET = 16  # smallest prefill length bucket (autoregressive.length_bucket)
MAX_STOP_STRINGS = 4  # the OpenAI API's limit


# ------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------
class EngineError(RuntimeError):
    """Base of the engine's request-level errors."""


class QueueFull(EngineError):
    """The admission queue is at its bound (HTTP 429)."""


class EngineClosed(EngineError):
    """The engine is draining or stopped and accepts no new requests (HTTP 503)."""


class InvalidRequest(ValueError):
    """A request parameter is invalid; ``param`` names the offending field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


# ------------------------------------------------------------------------------------------
# requests and results
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings.

    temperature 0 = greedy. top_k 0 = off. top_p 1 = off. ``stop``: up to 4 strings; the
    output is cut before the first occurrence. ``seed``: see the module docstring.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def validate(self, max_len: int) -> None:
        def bad(field, msg):
            raise InvalidRequest(f"{field} {msg}", field)

        mt = self.max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int | np.integer):
            bad("max_tokens", f"must be an integer, got {mt!r}")
        if mt < 1:
            bad("max_tokens", f"must be >= 1, got {mt}")
        if mt > max_len - 1:
            bad(
                "max_tokens",
                f"is {mt} but this server's cache holds {max_len} positions; at most "
                f"{max_len - 1} tokens can be generated",
            )
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
            bad("temperature", f"must be a finite number, got {t!r}")
        if not 0.0 <= t <= 100.0:
            bad("temperature", f"must be in [0, 100], got {t}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
            bad("top_k", f"must be an integer >= 0 (0 disables it), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p <= 1.0:
            bad("top_p", f"must be a number in (0, 1], got {p!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            bad("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(s == "" for s in self.stop):
            bad("stop", "strings must be non-empty")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int | np.integer)):
            bad("seed", f"must be an integer, got {s!r}")
        if s is not None and not 0 <= s < 2**63:
            bad("seed", f"must be in [0, 2**63), got {s}")


@dataclasses.dataclass
class Delta:
    """A streamed piece of a request's output."""

    text: str
    token_ids: list[int]


@dataclasses.dataclass
class Result:
    """The final event of a request."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled" | "abort" | "error"
    prompt_tokens: int
    completion_tokens: int
    rounds: int  # decode rounds that produced tokens for this request
    mean_accepted_length: float  # τ: tokens per round incl. the bonus token
    mean_verified: float  # draft tokens sent to the target per round
    error: str | None = None


_CLOSE = object()


class RequestHandle:
    """A submitted request: iterate its events (``Delta``…, then one ``Result``).

    Sync consumers use ``events()`` / ``result()``; asyncio consumers pass ``loop`` to
    ``Engine.submit`` and use ``aevents()`` / ``aresult()``. The engine thread delivers
    events through ``loop.call_soon_threadsafe`` (asyncio) or a ``queue.Queue`` (sync).
    """

    def __init__(self, request_id, prompt_ids, params, loop=None):
        self.id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self._loop = loop
        self._q: queue.Queue | None = None if loop else queue.Queue()
        self._aq: asyncio.Queue | None = asyncio.Queue() if loop else None
        self._cancelled = threading.Event()
        self.done = threading.Event()
        self.submitted_at = time.perf_counter()

    # -- engine side ---------------------------------------------------------------------
    def _deliver(self, item) -> None:
        if self._loop is None:
            self._q.put(item)
            return
        try:
            self._loop.call_soon_threadsafe(self._aq.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass

    # -- consumer side -------------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the engine to stop this request; its slot is freed at the next round."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def events(self, timeout: float | None = None) -> Iterator[Delta | Result]:
        if self._q is None:
            raise RuntimeError("this handle was submitted with an event loop; use aevents()")
        while True:
            item = self._q.get(timeout=timeout)
            yield item
            if isinstance(item, Result):
                return

    def result(self, timeout: float | None = None) -> Result:
        for item in self.events(timeout):
            if isinstance(item, Result):
                return item
        raise RuntimeError("event stream ended without a result")  # pragma: no cover

    async def aevents(self) -> AsyncIterator[Delta | Result]:
        if self._aq is None:
            raise RuntimeError("this handle was submitted without an event loop; use events()")
        while True:
            item = await self._aq.get()
            yield item
            if isinstance(item, Result):
                return

    async def aresult(self) -> Result:
        async for item in self.aevents():
            if isinstance(item, Result):
                return item
        raise RuntimeError("event stream ended without a result")  # pragma: no cover


class _Active:
    """Host-side progress of a request that owns a slot."""

    def __init__(self, handle: RequestHandle, tokenizer: Tokenizer, stop_ids):
        self.handle = handle
        self.detok = IncrementalDecoder(tokenizer)
        self.stop_ids = stop_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of ``text`` already streamed
        self.done = False
        self.rounds = 0
        self.accepted = 0  # emitted tokens summed over rounds (for τ)
        self.verified = 0


# ------------------------------------------------------------------------------------------
# engine
# ------------------------------------------------------------------------------------------
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

    def __post_init__(self):
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.prefill_batch < 1:
            raise ValueError(f"prefill_batch must be >= 1, got {self.prefill_batch}")
        if self.max_len < 4:
            raise ValueError(f"max_len must be >= 4, got {self.max_len}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")


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


class Engine:
    """Continuous-batching engine. ``start()`` warms up (compiles every bucket, profiles
    SPS when the scheduler needs it) and launches the loop thread; ``submit`` enqueues."""

    def __init__(
        self,
        target,
        target_params,
        tokenizer: Tokenizer,
        drafter=None,
        drafter_params=None,
        config: EngineConfig | None = None,
        sts=None,
        listener=None,
    ):
        self.config = cfg = config or EngineConfig()
        self.tokenizer = tokenizer
        self.listener = listener  # optional: on_round(...), on_finish(result)
        if tokenizer.vocab_size > target.config.vocab_size:
            raise ValueError(
                f"tokenizer has {tokenizer.vocab_size} ids but the target's vocabulary has "
                f"{target.config.vocab_size}: they were not trained together"
            )
        scheduler = cfg.scheduler if drafter is not None else "none"
        if drafter is None and cfg.scheduler not in ("none", "fixed"):
            raise ValueError(f"scheduler {cfg.scheduler!r} needs a drafter; without one use 'none'")
        self.scheduler = scheduler
        step_cfg = dict(
            num_slots=cfg.num_slots,
            max_len=cfg.max_len,
            sampling=True,  # per-request temperatures incl. exact greedy rows (one-hot)
            threshold=cfg.threshold,
            fixed_length=cfg.fixed_length,
            eos_id=tokenizer.eos_id,
        )
        self.decoder = SpeculativeDecoder(
            target,
            target_params,
            drafter,
            drafter_params,
            StepConfig(scheduler=scheduler, **step_cfg),
            sts_temperatures=None if sts is None else sts.temperatures,
            sts_biases=None if sts is None else sts.biases,
        )
        self.gamma = self.decoder.gamma
        # Verify buckets, the budget rule, two-phase Algorithm 1 and warm-up of the rounds:
        # the same policy the offline runner uses (decode/policy.py).
        self.policy = RoundPolicy(self.decoder, cfg.verify_buckets)
        self.verify_buckets = self.policy.buckets
        self.two_phase = self.policy.two_phase
        self.prompt_buckets = self._prompt_buckets(cfg.max_len)
        self.sps_table: sps_lib.SPSTable | None = None

        self.stats = EngineStats()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self._slots: list[_Active | None] = [None] * cfg.num_slots
        self._inflight: collections.deque = collections.deque()
        self._accepting = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._warm_thread: threading.Thread | None = None
        self.warmup_status: dict | None = None  # last warm-up progress (phase, step, of)
        self._baseline: int | None = None
        self.failure: str | None = None
        self._last_ready = 0.0
        self._state = None

    # -- shapes ----------------------------------------------------------------------------
    @staticmethod
    def _prompt_buckets(max_len: int) -> tuple[int, ...]:
        """Powers of two from 16, the last one capped at ``max_len`` (a prompt must leave
        room for one generated token, so lengths up to ``max_len - 2`` are served)."""
        out, b = [], MIN_PROMPT_BUCKET
        while True:
            out.append(min(b, max_len))
            if b >= max_len:
                return tuple(sorted(set(out)))
            b *= 2

    def _bucket_for(self, n: int) -> int:
        return min(length_bucket(n, MIN_PROMPT_BUCKET), self.config.max_len)

    @property
    def max_prompt_tokens(self) -> int:
        return self.config.max_len - 2

    # -- warm-up -------------------------------------------------------------------------
    def _cache_entries(self) -> int:
        return self.decoder.compiled_executables()

    @property
    def compilations_after_warmup(self) -> int:
        """Executables compiled since warm-up (0 means every shape was pre-compiled)."""
        if self._baseline is None:
            return 0
        return self._cache_entries() - self._baseline

    @property
    def prefill_rows(self) -> tuple[int, ...]:
        """Compiled prefill batch sizes: 1, and ``prefill_batch`` (capped at the slots)."""
        return tuple(sorted({1, min(self.config.prefill_batch, self.config.num_slots)}))

    def _prefill(self, state, slot, ids, max_new, temperature, top_k, top_p):
        return self._prefill_many(state, [(slot, ids, max_new, temperature, top_k, top_p)])

    def _prefill_many(self, state, rows):
        """One prefill call for ``rows`` of ``(slot, ids, max_new, temperature, top_k,
        top_p)`` (at most ``max(prefill_rows)``): prompts padded to the longest one's
        length bucket, the batch padded to a compiled size with rows aimed at slot
        ``num_slots``, whose cache and state writes are dropped (out-of-range scatter)."""
        n = len(rows)
        b = next(k for k in self.prefill_rows if k >= n)
        t = max(self._bucket_for(len(r[1])) for r in rows)
        r_slots = self.config.num_slots
        slots = np.full((b,), r_slots, np.int32)
        prompts = np.zeros((b, t), np.int32)
        lengths = np.ones((b,), np.int32)
        max_new = np.ones((b,), np.int32)
        temps = np.zeros((b,), np.float32)
        top_k = np.zeros((b,), np.int32)
        top_p = np.ones((b,), np.float32)
        for i, (slot, ids, mn, temp, k, p) in enumerate(rows):
            slots[i], lengths[i], max_new[i] = slot, len(ids), mn
            prompts[i, : len(ids)] = ids
            temps[i], top_k[i], top_p[i] = temp, k, p
        return self.decoder.prefill(state, slots, prompts, lengths, max_new, temps, top_k, top_p)

    def _fill_all_slots(self, state):
        """Prefill every slot with a short dummy prompt that keeps them active."""
        dummy = [self.tokenizer.eos_id + 1] * 4
        for s in range(self.config.num_slots):
            state, _ = self._prefill(state, s, dummy, self.config.max_len, 0.0, 0, 1.0)
        return state

    def _profile_sps(self) -> None:
        """SPS(B), B = R + K, for every compiled bucket with the decoder's own executables
        (DESIGN §5.3); cached in ``config.sps_cache`` when given. Doubles as compilation."""
        cfg, r = self.config, self.config.num_slots
        key = sps_lib.cache_key(
            cfg.model_name,
            self.scheduler,
            f"R={r}",
            f"gamma={self.gamma}",
            f"max_len={cfg.max_len}",
        )
        self.sps_table = self.policy.profile_sps(
            cache_path=cfg.sps_cache,
            key=key,
            repeats=cfg.sps_repeats,
            progress=lambda b, i, n: self._progress("profiling SPS", i, n, f"B = {b}"),
        )

    def _progress(self, phase: str, done: int, total: int, detail: str = "") -> None:
        """Warm-up progress: logged (serve.py prints it on stderr) and kept for /health."""
        self.warmup_status = {"phase": phase, "step": done, "of": total, "detail": detail}
        log.info("warm-up: %s %d of %d%s", phase, done, total, f" ({detail})" if detail else "")

    def warmup(self) -> None:
        """Compile every prefill bucket and every verify bucket; profile SPS if needed."""
        if self.scheduler in ("topk", "prefix"):
            self._profile_sps()
        state = self.decoder.init_state(self.config.seed)
        r = self.config.num_slots
        n_prefill = len(self.prompt_buckets) * len(self.prefill_rows)
        # Twice: fresh (uncommitted) arrays and round outputs must hit the same executables.
        # The first pass compiles (progress is reported for it); the second only checks.
        for rep in range(2):
            shown = rep == 0
            i = 0
            for t in self.prompt_buckets:
                ids = [1] * min(t, self.max_prompt_tokens)
                for b in self.prefill_rows:
                    i += 1
                    if shown:
                        self._progress("compiling prefill", i, n_prefill, f"{b} x {t} tokens")
                    state, _ = self._prefill_many(state, [(s, ids, 2, 0, 0, 1) for s in range(b)])
            state = self._fill_all_slots(state)

            def on_bucket(k, i, n):
                self._progress("compiling verify round", i, n, f"B = {r + k}")

            state = self.policy.warmup(state, on_bucket if shown else None)
            state = self.decoder.release(state, 0)
            state = state._replace(rng=jax.random.key(self.config.seed))
        jax.block_until_ready(state.seq_len)
        # The serving state starts clean (no slot active).
        self._state = self.decoder.init_state(self.config.seed)
        self._baseline = self._cache_entries()

    def profile_prefill(self, repeats: int = 3) -> dict[tuple[int, int], float]:
        """Median seconds of one prefill call per compiled ``(rows, prompt bucket)``, on a
        fresh decode state (for the serving simulator's cost model). Only on an engine that
        is not running: the loop thread owns the serving state."""
        if self.running or self.starting:
            raise RuntimeError("profile_prefill needs a stopped engine (shutdown() first)")
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        state = self.decoder.init_state(self.config.seed)
        out: dict[tuple[int, int], float] = {}
        for t in self.prompt_buckets:
            ids = [1] * min(t, self.max_prompt_tokens)
            for b in self.prefill_rows:
                rows = [(s, ids, 2, 0, 0, 1) for s in range(b)]
                times = []
                for _ in range(repeats + 1):  # the first call only warms the caches
                    t0 = time.perf_counter()
                    state, pre = self._prefill_many(state, rows)
                    jax.block_until_ready(pre)
                    times.append(time.perf_counter() - t0)
                out[(b, t)] = float(np.median(times[1:]))
        return out

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, background: bool = False) -> Engine:
        """Warm up, then run the loop thread. ``background``: return at once and warm up
        in a thread (``starting`` is True meanwhile; ``submit`` raises ``EngineClosed``;
        a warm-up error sets ``failure``) so a server can answer /health while compiling."""
        if self._thread is not None or self._warm_thread is not None:
            raise RuntimeError("engine already started")
        if not background:
            self._warm_then_run()
            return self
        self._warm_thread = threading.Thread(
            target=self._warm_in_background, name="dspark-warmup", daemon=True
        )
        self._warm_thread.start()
        return self

    def _warm_then_run(self) -> None:
        t0 = time.perf_counter()
        self.warmup()
        log.info(
            "engine warm: %d prompt buckets %s, verify buckets %s, %.1fs",
            len(self.prompt_buckets),
            self.prompt_buckets,
            self.verify_buckets,
            time.perf_counter() - t0,
        )
        with self._lock:
            if self._stop:  # shut down while warming up: never start serving
                return
            self._accepting = True
            self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
            self._thread.start()

    def _warm_in_background(self) -> None:
        try:
            self._warm_then_run()
        except Exception as e:
            log.exception("engine warm-up failed")
            self.failure = f"warm-up failed: {type(e).__name__}: {e}"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until a background warm-up has ended; True if the engine is serving."""
        if self._warm_thread is not None:
            self._warm_thread.join(timeout)
        return self.running

    @property
    def starting(self) -> bool:
        """Warming up in the background (compiling buckets, profiling SPS)."""
        return (
            self._warm_thread is not None
            and self._warm_thread.is_alive()
            and self._thread is None
            and self.failure is None
        )

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    @property
    def accepting(self) -> bool:
        return self._accepting and self.running

    def begin_drain(self) -> None:
        """Stop accepting new requests; in-flight and queued ones still complete."""
        with self._lock:
            self._accepting = False
            self._wake.notify_all()

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop the engine. ``drain``: finish every accepted request first; otherwise
        they end with finish reason ``abort``."""
        with self._lock:
            self._accepting = False
            if not drain:
                self._abort_all = True
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    _abort_all = False

    # -- submission ----------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(
            isinstance(x, int | np.integer) and not isinstance(x, bool) for x in prompt
        ):
            ids = [int(x) for x in prompt]
            vocab = self.decoder.target.config.vocab_size
            if any(not 0 <= x < vocab for x in ids):
                raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
        else:
            raise InvalidRequest("prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise InvalidRequest("prompt is empty (it encodes to no tokens)", "prompt")
        if len(ids) > self.max_prompt_tokens:
            raise InvalidRequest(
                f"prompt has {len(ids)} tokens but this server's cache holds "
                f"{self.config.max_len} positions per request, so prompts may have at most "
                f"{self.max_prompt_tokens} tokens",
                "prompt",
            )
        return ids

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestHandle:
        """Validate and enqueue a request. Raises ``InvalidRequest``, ``QueueFull`` or
        ``EngineClosed``; never blocks on the device."""
        params = params or SamplingParams()
        params.validate(self.config.max_len)
        ids = self.encode_prompt(prompt)
        handle = RequestHandle(f"cmpl-{next(self._ids)}", ids, params, loop)
        with self._lock:
            if self.starting:
                raise EngineClosed(
                    "the engine is still warming up (compiling its shapes); retry when "
                    "/health reports ok"
                )
            if not self._accepting or self.failure is not None:
                raise EngineClosed(
                    "the engine is shutting down" if self.failure is None else self.failure
                )
            if len(self._waiting) >= self.config.max_queue:
                raise QueueFull(
                    f"admission queue is full ({self.config.max_queue} requests waiting)"
                )
            self._waiting.append(handle)
            self._wake.notify_all()
        return handle

    def generate(self, prompt, params: SamplingParams | None = None, timeout=None) -> Result:
        """Blocking convenience: submit and wait for the result."""
        return self.submit(prompt, params).result(timeout)

    # -- introspection -------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    @property
    def active_slots(self) -> int:
        return sum(a is not None for a in self._slots)

    @property
    def idle(self) -> bool:
        """Nothing queued, running or in flight (a seeded request admitted now resets the
        random stream; see the module docstring)."""
        return not self._waiting and not self._inflight and self.active_slots == 0

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until ``idle`` (True) or ``timeout`` seconds pass (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.idle:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    # -- loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # a device/runtime failure: fail every request, loudly
            log.exception("engine loop failed")
            self.failure = f"engine failure: {type(e).__name__}: {e}"
            self._accepting = False
            self._fail_everything("error", self.failure)

    def _fail_everything(self, reason: str, message: str | None = None) -> None:
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        for h in waiting:
            self._finish_unstarted(h, reason, message)
        for s, a in enumerate(self._slots):
            if a is not None:
                self._finish(a, reason, error=message)
                self._slots[s] = None
        self._inflight.clear()

    def _finish_unstarted(self, h: RequestHandle, reason: str, message=None) -> None:
        res = Result(h.id, "", [], reason, len(h.prompt_ids), 0, 0, 0.0, 0.0, message)
        self._record_finish(res)
        h.done.set()
        h._deliver(res)

    def _loop(self) -> None:
        while True:
            admitted = []
            with self._lock:
                t_idle = time.perf_counter()
                while (
                    not self._stop
                    and not self._waiting
                    and not self._inflight
                    and self.active_slots == 0
                ):
                    self._wake.wait()
                self.stats.idle_seconds += time.perf_counter() - t_idle
                if self._abort_all:
                    break
                # Cancelled requests still waiting never touch the device.
                for h in [h for h in self._waiting if h.cancelled]:
                    self._waiting.remove(h)
                    self._finish_unstarted(h, "cancelled")
                free = [s for s, a in enumerate(self._slots) if a is None]
                while free and self._waiting:
                    admitted.append((free.pop(0), self._waiting.popleft()))
                if (
                    self._stop
                    and not self._waiting
                    and not admitted
                    and not self._inflight
                    and self.active_slots == 0
                ):
                    return
            self._step(admitted)
        self._fail_everything("abort", "the server shut down before this request finished")

    def _step(self, admitted) -> None:
        # Host-side ends (cancellation) free their slot before this round.
        for s, a in enumerate(self._slots):
            if a is not None and a.handle.cancelled:
                self._end_on_host(s, a, "cancelled")
        if len(admitted) == 1:
            p = admitted[0][1].params
            if p.seed is not None and not self._inflight and self.active_slots == 0:
                self._state = self._state._replace(rng=jax.random.key(p.seed))
        group = max(self.prefill_rows)
        t0 = time.perf_counter()
        for start in range(0, len(admitted), group):
            chunk = admitted[start : start + group]
            rows = [
                (slot, h.prompt_ids, h.params.max_tokens, h.params.temperature,
                 h.params.top_k, h.params.top_p)
                for slot, h in chunk
            ]  # fmt: skip
            self._state, pre = self._prefill_many(self._state, rows)
            owners: list = [None] * len(self._slots)  # slot -> (request, batch row)
            for i, (slot, h) in enumerate(chunk):
                a = _Active(h, self.tokenizer, set(self.tokenizer.stop_ids))
                self._slots[slot] = a
                owners[slot] = (a, i)
                self.stats.prompt_tokens += len(h.prompt_ids)
            self._inflight.append(("prefill", pre, owners, 0, 0.0, -1))

        owners = list(self._slots)
        if any(a is not None for a in owners):
            t_dispatch = time.perf_counter()
            occupied = sum(a is not None for a in owners)
            self._state, out, budget, index = self.policy.dispatch(self._state, occupied)
            self._inflight.append(("round", out, owners, budget, t_dispatch, index))
            self.stats.dispatch_seconds += time.perf_counter() - t0
            # Process everything older than the round just dispatched (overlaps with it).
            while len(self._inflight) > 1:
                self._process_oldest()
        else:
            self.stats.dispatch_seconds += time.perf_counter() - t0
            while self._inflight:
                self._process_oldest()

    def _process_oldest(self) -> None:
        # Popped only once processed, so ``idle`` never reads True while an output is
        # still being fetched.
        self._process(self._inflight[0])
        self._inflight.popleft()

    def _process(self, item) -> None:
        t_wait = time.perf_counter()
        out = jax.device_get(item[1])  # the only place the engine waits on the device
        t_host = time.perf_counter()
        self.stats.device_wait_seconds += t_host - t_wait
        try:
            self._process_output(item, out)
        finally:
            self.stats.host_seconds += time.perf_counter() - t_host

    def _process_output(self, item, out) -> None:
        kind, _, owners, budget, t_dispatch, index = item
        if kind == "prefill":
            for s, entry in enumerate(owners):
                if entry is None or entry[0].done:
                    continue
                a, i = entry
                self._accept_tokens(s, a, [int(out.first_token[i])], int(out.finish[i]))
            return
        now = time.perf_counter()
        seconds = now - max(t_dispatch, self._last_ready)
        self._last_ready = now
        self.policy.observe(index, out.survival, [a is not None for a in owners])
        taus = []
        for s, a in enumerate(owners):
            if a is None or a.done:
                continue
            n = int(out.num_emitted[s])
            if n == 0 and int(out.finish[s]) == FINISH_NONE:
                continue
            a.rounds += 1
            a.accepted += n
            a.verified += int(out.verified[s])
            taus.append(n)
            self._accept_tokens(s, a, [int(x) for x in out.tokens[s, :n]], int(out.finish[s]))
        st = self.stats
        st.rounds += 1
        st.budget_sum += budget
        st.slot_rounds += len(taus)
        st.emitted_tokens += sum(taus)
        st.last_round_seconds = seconds
        st.last_budget = budget
        st.last_tau = float(np.mean(taus)) if taus else 0.0
        if self.listener is not None:
            self.listener.on_round(seconds, budget, taus, int(np.sum(out.verified)))

    # -- per-request host work -----------------------------------------------------------
    def _accept_tokens(self, slot: int, a: _Active, tokens: list[int], code: int) -> None:
        """Append emitted tokens, detokenise, apply stop ids / stop strings, stream."""
        stops = a.handle.params.stop
        new_ids: list[int] = []
        reason, by_stop_string = None, False
        for tok in tokens:
            new_ids.append(tok)
            a.token_ids.append(tok)
            if tok in a.stop_ids:  # EOS or another end-of-text marker: not part of the text
                reason = "stop"
                break
            a.text += a.detok.add(tok)
            cut = _find_stop(a.text, stops, a.sent) if stops else None
            if cut is not None:
                a.text, reason, by_stop_string = a.text[:cut], "stop", True
                break
        if reason is None and code != FINISH_NONE:
            reason = "stop" if code == FINISH_EOS else "length"
        if reason is not None and not by_stop_string:
            # Generation is over: release text held back for an unfinished UTF-8 char.
            a.text += a.detok.flush()
            cut = _find_stop(a.text, stops, a.sent) if stops else None
            if cut is not None:
                a.text = a.text[:cut]
        # Text that might be the start of a stop string waits for the next tokens.
        safe = len(a.text) if reason is not None else len(a.text) - _holdback(a.text, stops)
        piece = a.text[a.sent : safe] if safe > a.sent else ""
        a.sent = max(a.sent, safe)
        if new_ids:
            a.handle._deliver(Delta(piece, new_ids))
        if reason is None:
            return
        if code == FINISH_NONE:
            self._end_on_host(slot, a, reason)  # the device slot is still running: free it
        else:
            self._slots[slot] = None  # the device already deactivated the slot
            self._finish(a, reason)

    def _end_on_host(self, slot: int, a: _Active, reason: str) -> None:
        """A request ended by the host (stop string, cancellation): free its slot now."""
        self._state = self.decoder.release(self._state, slot)
        self._slots[slot] = None
        self._finish(a, reason)

    def _finish(self, a: _Active, reason: str, error: str | None = None) -> None:
        if a.done:
            return
        a.done = True
        if reason in ("cancelled", "abort", "error") and a.sent < len(a.text):
            a.text = a.text[: a.sent]
        res = Result(
            request_id=a.handle.id,
            text=a.text,
            token_ids=list(a.token_ids),
            finish_reason=reason,
            prompt_tokens=len(a.handle.prompt_ids),
            completion_tokens=len(a.token_ids),
            rounds=a.rounds,
            mean_accepted_length=a.accepted / max(a.rounds, 1),
            mean_verified=a.verified / max(a.rounds, 1),
            error=error,
        )
        self._record_finish(res)
        a.handle.done.set()
        a.handle._deliver(res)

    def _record_finish(self, res: Result) -> None:
        self.stats.requests_finished[res.finish_reason] += 1
        self.stats.completion_tokens += res.completion_tokens
        if self.listener is not None:
            self.listener.on_finish(res)


def _find_stop(text: str, stops: Sequence[str], sent: int) -> int | None:
    """Index of the earliest stop string in ``text`` that is not inside already-streamed
    text (streamed text never contains a whole stop string, so search just before it)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, sent - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _holdback(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of ``text`` that could begin a stop string: they are not
    streamed until the next tokens decide."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    return keep


# ------------------------------------------------------------------------------------------
# model loading
# ------------------------------------------------------------------------------------------
def load_models(target_dir: str, drafter_dir: str | None = None, dtype=None):
    """``(target, target_params, tokenizer, drafter, drafter_params, sts)`` from a Hugging
    Face Qwen3 directory (with ``tokenizer.json``) and an optional drafter directory;
    ``sts`` is the drafter's calibration from its ``sts.json`` (or None)."""
    import os

    from dspark_jax.convert import load_hf
    from dspark_jax.eval.calibration import load_sts
    from dspark_jax.models.qwen3 import Qwen3

    if not os.path.isdir(target_dir):
        raise FileNotFoundError(f"target model directory {target_dir} does not exist")
    config, params = load_hf(target_dir, dtype=dtype)
    tokenizer = Tokenizer(target_dir)
    target = Qwen3(config)
    drafter = drafter_params = sts = None
    if drafter_dir is not None:
        if not os.path.isdir(drafter_dir):
            raise FileNotFoundError(f"drafter directory {drafter_dir} does not exist")
        try:
            from dspark_jax.models.drafter_io import load_drafter
        except ImportError as e:  # pragma: no cover - depends on the package version
            raise RuntimeError(
                "loading a drafter needs dspark_jax.models.drafter_io.load_drafter, which "
                f"this installation lacks ({e})"
            ) from e
        drafter, drafter_params = load_drafter(drafter_dir, config)
        gamma = drafter.config.draft_len
        sts = load_sts(drafter_dir, gamma)
    return target, params, tokenizer, drafter, drafter_params, sts


__all__ = [
    "Delta",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "EngineError",
    "EngineStats",
    "InvalidRequest",
    "QueueFull",
    "RequestHandle",
    "Result",
    "SamplingParams",
    "load_models",
]
