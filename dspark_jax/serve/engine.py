"""Continuous-batching serving engine over fixed decode slots (DESIGN §5.2, §5.3, §6).

One engine thread drives the host core (``engine.core.EngineCore``, which the offline
runner drives too): it owns the ``SpeculativeDecoder`` state, the slots and the KV page
pool. Requests enter a bounded admission queue; each turn the loop hands them to the core,
which moves them into free slots (prefill: requests admitted together share calls of
``prefill_batch`` rows, prompts padded to a power-of-two length bucket) and runs decode
rounds for every occupied slot; the engine streams the detokenised text of the core's
events to the request's consumer, and the slot is freed on EOS / stop string / max tokens /
end of cache / cancellation.

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

Seeds: every request draws from its own random stream (the decoder's per-slot keys, set at
admission from the request's ``seed``, or from the engine's seed and the request's number
when it has none). A request with a ``seed`` is verified *coupled* by default
(``EngineConfig.seeded_verification``): the token at each position is the target's
Gumbel-max draw with that position's noise, so its output is the same whatever else the
engine is serving, under every scheduler. Unseeded requests (and seeded ones with
``seeded_verification="standard"``) use rejection sampling, advanced only by their own
rounds: with the ``none``, ``fixed`` and ``threshold`` schedulers, which decide a slot's
verify length from that slot alone, a seeded output is also load-invariant; with
``prefix`` and ``topk`` the verify lengths depend on the other slots' confidences (a shared
budget), so it is exact in distribution but may differ under load. Greedy requests
(temperature 0) are deterministic regardless and equal plain autoregressive greedy
decoding token for token.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Sequence

from dspark_jax.decode.mesh import check_fits
from dspark_jax.decode.mesh import describe as describe_mesh
from dspark_jax.decode.step import FINISH_NONE, SpeculativeDecoder, request_key_data
from dspark_jax.engine.core import CoreRequest, Emitted, EngineCore, RoundDone
from dspark_jax.sched import sps as sps_lib
from dspark_jax.serve.compilation import ServingShapes
from dspark_jax.serve.config import EngineConfig, EngineStats
from dspark_jax.serve.delivery import (
    ActiveRequest,
    deliver_final,
    encode_prompt,
    unstarted_result,
)
from dspark_jax.serve.handle import RequestHandle
from dspark_jax.serve.loading import load_models
from dspark_jax.serve.requests import (
    ContextLengthExceeded,
    Delta,
    EngineClosed,
    EngineError,
    InvalidRequest,
    QueueFull,
    Result,
    SamplingParams,
    TokenLogprob,
)
from dspark_jax.serve.service import Service
from dspark_jax.tokenizer import Tokenizer

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------
# engine
# ------------------------------------------------------------------------------------------
class Engine(Service):
    """Continuous-batching engine. ``start()`` warms up (compiles every bucket, profiles
    SPS when the scheduler needs it) and launches the loop thread; ``submit`` enqueues."""

    thread_name = "dspark-engine"

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
        mesh=None,
    ):
        super().__init__()
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
        self.decoder = SpeculativeDecoder(
            target,
            target_params,
            drafter,
            drafter_params,
            cfg.step_config(scheduler, tokenizer.eos_id),
            sts=sts,  # the survival estimate's calibration (LoadedDrafter.calibration)
            mesh=mesh,  # tensor parallel (decode/mesh.py); None: one device
        )
        check_fits(self.decoder)  # before compiling: an error that says what to try
        self.mesh = describe_mesh(mesh)
        self.gamma = self.decoder.gamma
        self.stats = EngineStats()
        # The host core the offline runner drives too (engine/core.py): slots, the KV page
        # pool (a request reserves its pages at admission), prefill shapes, the round
        # policy (verify buckets, the budget rule, two-phase Algorithm 1), pipelined here.
        # A mesh over several processes (engine/lockstep.py): process 0's core publishes
        # each turn's operations, the others replay them (``follow``).
        core_class, extra = EngineCore, {}
        self.exchange = None
        if self.decoder.spans_processes:
            from dspark_jax import distributed
            from dspark_jax.engine import lockstep

            self.exchange = lockstep.Exchange()
            if distributed.process_index() == 0:
                core_class, extra = lockstep.LeaderCore, {"exchange": self.exchange}
        self.core = core_class(
            self.decoder,
            cfg.verify_buckets,
            prefill_batch=cfg.prefill_batch,
            pipelined=True,
            seed=cfg.seed,
            times=self.stats,
            plain_rounds=cfg.plain_rounds,
            **extra,
        )
        self.policy = self.core.policy
        self.pages = self.core.pages
        self.shapes = ServingShapes(
            self.decoder, self.policy, cfg, tokenizer.eos_id, self.core.prefill
        )
        if self.exchange is not None:
            self._check_processes_agree(target, target_params, drafter, tokenizer)
        self.sps_table: sps_lib.SPSTable | None = None
        self.attention_backend = self.decoder.attention
        # confidence_head / draft_probability (decode.plan_step.survival_logits), none
        # without a drafter.
        self.survival_estimator = self.decoder.survival_estimator if drafter is not None else "none"

        self._ids = itertools.count()
        # Submitted, not yet handed to the core (the loop moves them each turn).
        self._waiting: collections.deque[RequestHandle] = collections.deque()
        self.warmup_status: dict | None = None  # last warm-up progress (phase, step, of)

    # -- shapes, warm-up, profiling (serve/compilation.py) --------------------------------
    # Read-only views of the round policy and the compiled shapes.
    verify_buckets = property(lambda self: self.policy.buckets)
    two_phase = property(lambda self: self.policy.two_phase)
    prompt_buckets = property(lambda self: self.shapes.prompt_buckets)
    max_prompt_tokens = property(lambda self: self.shapes.max_prompt_tokens)
    prefill_rows = property(lambda self: self.shapes.prefill_rows)

    @property
    def compilations_after_warmup(self) -> int:
        """Executables compiled since warm-up (0 means every shape was pre-compiled)."""
        return self.shapes.compilations_after_warmup

    def _progress(self, phase: str, done: int, total: int, detail: str = "") -> None:
        """Warm-up progress: logged (serve.py prints it on stderr) and kept for /health."""
        self.warmup_status = {"phase": phase, "step": done, "of": total, "detail": detail}
        log.info("warm-up: %s %d of %d%s", phase, done, total, f" ({detail})" if detail else "")

    def warmup(self) -> None:
        """Compile every prefill bucket and every verify bucket; profile SPS if needed."""
        t0 = time.perf_counter()
        if self.scheduler in ("topk", "prefix"):
            self.sps_table = self.shapes.profile_sps(self._progress)
        self.shapes.warmup(self._progress)
        # The serving state starts clean (no slot active).
        self.core.reset()
        log.info(
            "engine warm: prompt buckets %s, verify buckets %s, attention %s, mesh data %d x "
            "tensor %d (%s), KV pool %d pages of %d tokens, %.1fs",
            self.prompt_buckets,
            self.verify_buckets,
            self.attention_backend,
            self.mesh["data"],
            self.mesh["tensor"],
            self.mesh["platform"],
            self.pages.capacity,
            self.pages.page_size,
            time.perf_counter() - t0,
        )

    def _warm(self) -> None:  # the Service hook
        self.warmup()

    # -- several processes (engine/lockstep.py) ------------------------------------------
    @property
    def is_follower(self) -> bool:
        """A process other than the leader of a multi-process mesh: it serves no client
        and runs ``follow()`` instead of ``start()``."""
        from dspark_jax.engine.lockstep import LeaderCore

        return self.exchange is not None and not isinstance(self.core, LeaderCore)

    def follow(self) -> int:
        """A follower's whole life: warm up with the leader (the same compilations and
        SPS profile, the leader's table), then replay its turns until it stops; returns
        the exit code the leader sent."""
        from dspark_jax.engine import lockstep

        if not self.is_follower:
            raise RuntimeError("follow() is for the processes other than process 0")
        self.warmup()
        return lockstep.follow(self.core, self.exchange)

    def _loop_ended(self, failed: bool) -> None:  # the Service hook
        if self.exchange is not None and not self.is_follower:
            self.core.close(1 if failed else 0)  # the followers stop with the leader

    def _check_processes_agree(self, target, target_params, drafter, tokenizer) -> None:
        """Every process must serve the same models on the same mesh with the same
        settings, or the first collective would wait forever: refuse at start, naming
        the difference (``dspark_jax.distributed.check_same``)."""
        from dspark_jax import distributed

        cfg = self.config
        settings = {
            "target config": json.loads(target.config.to_json()),
            # Shapes and dtypes; the values were compared before loading, from each host's
            # checkpoint files (serve.load_for_serving: a gathered sample would be the
            # same mixed sample on every process).
            "target parameters": _tree_signature(target_params),
            "drafter": None if drafter is None else dataclasses.asdict(drafter.config),
            "tokenizer vocabulary": tokenizer.vocab_size,
            "mesh": self.mesh,
            "scheduler": self.scheduler,
            "verify buckets": list(self.policy.buckets),
            **{
                f"engine {k}": v
                for k, v in dataclasses.asdict(cfg).items()
                if k not in ("sps_cache", "model_name", "max_queue", "max_logprobs")
            },
        }
        distributed.check_same("serving settings", settings)

    def profile_prefill(self, repeats: int = 3) -> dict[tuple[int, int], float]:
        """Median seconds of one prefill call per compiled ``(rows, prompt bucket)`` (for
        the serving simulator's cost model). Only on an engine that is not running: the
        loop thread owns the serving state."""
        if self.running or self.starting:
            raise RuntimeError("profile_prefill needs a stopped engine (shutdown() first)")
        return self.shapes.profile_prefill(repeats)

    # -- submission ----------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(
            self.tokenizer,
            prompt,
            self.decoder.target.config.vocab_size,
            self.max_prompt_tokens,
            self.config.max_len,
        )

    def check_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> tuple[list[int], SamplingParams]:
        """A request's prompt ids and settings (``max_tokens`` None resolved to the room
        left after the prompt), or ``InvalidRequest`` naming what is wrong; a prompt plus
        ``max_tokens`` beyond the cache row is ``ContextLengthExceeded``."""
        cfg = self.config
        params = params or SamplingParams()
        params.validate(cfg.max_len, cfg.max_logprobs)
        ids = self.encode_prompt(prompt)
        if params.max_tokens is None:  # as many as the cache row holds after the prompt
            params = dataclasses.replace(params, max_tokens=cfg.max_len - len(ids))
        elif len(ids) + params.max_tokens > cfg.max_len:
            raise ContextLengthExceeded(
                cfg.max_len, len(ids), params.max_tokens, self.max_prompt_tokens
            )
        try:  # a request the page pool could never hold must not wait forever
            self.pages.check_fits(len(ids), params.max_tokens)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        return ids, params

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> RequestHandle:
        """Validate and enqueue a request. Raises ``InvalidRequest``, ``QueueFull`` or
        ``EngineClosed``; never blocks on the device."""
        ids, params = self.check_request(prompt, params)
        number = next(self._ids)
        handle = RequestHandle(f"cmpl-{number}", ids, params, loop)
        # The request's random stream (see the module docstring).
        seed = (params.seed,) if params.seed is not None else (self.config.seed, number, 2)
        handle.keys = request_key_data(*seed)
        handle.coupled = params.seed is not None and (self.config.seeded_verification == "coupled")
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
            if self.queue_depth >= self.config.max_queue:
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
        return len(self._waiting) + len(self.core.waiting)

    @property
    def active_slots(self) -> int:
        return self.core.active_slots

    @property
    def waiting_for_pages(self) -> bool:
        """The queue's head waits for pages, not for a slot."""
        return self.core.waiting_for_pages

    @property
    def _state(self):
        return self.core.state

    @property
    def idle(self) -> bool:
        """Nothing queued, running or in flight."""
        return not self._waiting and not self.core.has_work

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until ``idle`` (True) or ``timeout`` seconds pass (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.idle:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    # -- loop ----------------------------------------------------------------------------
    def _fail_everything(self, reason: str, message: str | None = None) -> None:
        with self._lock:
            waiting = list(self._waiting)
            self._waiting.clear()
        core = self.core
        waiting += [r.tag.handle for r in core.waiting]
        core.waiting.clear()
        for h in waiting:
            self._finish_unstarted(h, reason, message)
        core.inflight.clear()
        for r in list(core.slots):
            if r is not None:
                self._finish(r.tag, reason, error=message)
                core.end(r)

    def _finish_unstarted(self, h: RequestHandle, reason: str, message=None) -> None:
        res = unstarted_result(h, reason, message)
        self._record_finish(res)
        deliver_final(h, res)

    def _loop(self) -> None:
        core = self.core
        while True:
            with self._lock:
                t_idle = time.perf_counter()
                while not self._stop and not self._waiting and not core.has_work:
                    self._wake.wait()
                self.stats.idle_seconds += time.perf_counter() - t_idle
                if self._abort_all:
                    break
                # Into the core, first come first served (it admits as slots and pages
                # allow); cancelled requests still waiting never touch the device.
                while self._waiting:
                    h = self._waiting.popleft()
                    if h.cancelled:
                        self._finish_unstarted(h, "cancelled")
                        continue
                    core.add(CoreRequest(
                        h.prompt_ids, h.params.max_tokens, h.params.temperature,
                        h.params.top_k, h.params.top_p, h.keys, h.coupled,
                        tag=ActiveRequest(h, self.tokenizer),
                    ))  # fmt: skip
                if self._stop and not core.has_work:
                    return
            self._turn()
        self._fail_everything("abort", "the server shut down before this request finished")

    def _turn(self) -> None:
        core = self.core
        for r in list(core.waiting):  # cancelled while queued in the core
            if r.tag.handle.cancelled:
                core.end(r)
                self._finish_unstarted(r.tag.handle, "cancelled")
        # Host-side ends (cancellation) free their slot before this round.
        for r in list(core.slots):
            if r is not None and r.tag.handle.cancelled:
                core.end(r)
                self._finish(r.tag, "cancelled")
        events = core.step()  # admit, prefill, dispatch, read the round before (pipelined)
        t_host = time.perf_counter()
        try:
            for ev in events:
                if isinstance(ev, RoundDone):
                    self.stats.record_round(ev.seconds, ev.budget, ev.taus, ev.padding)
                    if self.listener is not None:
                        self.listener.on_round(ev.seconds, ev.budget, ev.taus, ev.verified)
                else:
                    self._accept(ev)
        finally:
            self.stats.host_seconds += time.perf_counter() - t_host

    # -- per-request host work -----------------------------------------------------------
    def _accept(self, ev: Emitted) -> None:
        """Stream a request's emitted tokens; end it if they end it."""
        a: ActiveRequest = ev.request.tag
        if a.done:
            return
        if ev.round_index is None:
            self.stats.prompt_tokens += len(ev.request.prompt)
        elif ev.tokens or ev.finish != FINISH_NONE:
            a.count_round(len(ev.tokens), ev.verified)
        else:
            return  # a slot that emitted nothing this round
        reason = a.emit(ev.tokens, ev.finish, ev.logprobs)
        if reason is None:
            return
        if ev.finish == FINISH_NONE:
            self.core.end(ev.request)  # a stop string: the device slot is still running
        self._finish(a, reason)

    def _finish(self, a: ActiveRequest, reason: str, error: str | None = None) -> None:
        if a.done:
            return
        res = a.result(reason, error)
        self._record_finish(res)
        deliver_final(a.handle, res)

    def _record_finish(self, res: Result) -> None:
        self.stats.requests_finished[res.finish_reason] += 1
        self.stats.completion_tokens += res.completion_tokens
        if self.listener is not None:
            self.listener.on_finish(res)


def _tree_signature(tree) -> str:
    """Every leaf's path, shape and dtype, hashed (16 hex digits)."""
    import hashlib

    import jax

    text = ";".join(
        f"{jax.tree_util.keystr(p)}:{tuple(x.shape)}:{x.dtype}"
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
    )
    return hashlib.sha1(text.encode()).hexdigest()[:16]


# The serving API in one import (re-exported from the modules that define it).
__all__ = [  # noqa: RUF022
    "ContextLengthExceeded", "Delta", "Engine", "EngineClosed", "EngineConfig", "EngineError",
    "EngineStats", "InvalidRequest", "QueueFull", "RequestHandle", "Result", "SamplingParams",
    "TokenLogprob", "load_models",
]  # fmt: skip
