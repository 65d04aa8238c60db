"""Every shape the serving engine runs, compiled before the first request (DESIGN §5.2):
prompt length buckets × prefill row counts, and the round policy's verify buckets; the SPS
profile of those buckets; and the count of executables compiled since (which must stay 0).
The one place that knows the engine's shapes.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import jax
import numpy as np

from dspark_jax.decode.policy import RoundPolicy
from dspark_jax.decode.step import SpeculativeDecoder, request_key_data
from dspark_jax.engine.prefill import MIN_PROMPT_BUCKET, PrefillBatcher, PrefillRow
from dspark_jax.sched import sps as sps_lib

__all__ = ["MIN_PROMPT_BUCKET", "PrefillRow", "ServingShapes"]


Progress = Callable[[str, int, int, str], None]  # (phase, step, of, detail)


class ServingShapes:
    """Prompt buckets, prefill batching, warm-up and profiling of one engine's decoder.

    ``config`` is the engine's ``EngineConfig`` (slots, max_len, prefill_batch, seed,
    model_name, sps_cache, sps_repeats); warm-up prompts use the id after ``eos_id``.
    """

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        policy: RoundPolicy,
        config,
        eos_id: int,
        prefill: PrefillBatcher | None = None,
    ):
        self.decoder = decoder
        self.policy = policy
        self.config = config
        self.dummy_id = eos_id + 1
        # The engine core's prefill shapes (engine/prefill.py), or the same built here.
        self.prefill = prefill or PrefillBatcher(decoder, config.prefill_batch)
        self.prompt_buckets = self.prefill.prompt_buckets
        self._baseline: int | None = None

    # -- shapes --------------------------------------------------------------------------
    def bucket_for(self, n: int) -> int:
        return self.prefill.bucket_for(n)

    @property
    def max_prompt_tokens(self) -> int:
        return self.prefill.max_prompt_tokens

    @property
    def prefill_rows(self) -> tuple[int, ...]:
        """Compiled prefill batch sizes: 1, and ``prefill_batch`` (capped at the slots)."""
        return self.prefill.rows

    def prefill_many(self, state, rows):
        """One prefill call for ``rows`` (``PrefillRow``s) in a compiled shape."""
        return self.prefill.run(state, rows)

    def _fill_all_slots(self, state):
        """Prefill every slot with a short dummy prompt that keeps them active."""
        dummy = [self.dummy_id] * 4
        for s in range(self.config.num_slots):
            row = PrefillRow(s, dummy, self.config.max_len, 0.0, 0, 1.0, request_key_data(0, s))
            state, _ = self.prefill_many(state, [row])
        return state

    # -- compilation ---------------------------------------------------------------------
    @property
    def compilations_after_warmup(self) -> int:
        """Executables compiled since warm-up (0 means every shape was pre-compiled)."""
        if self._baseline is None:
            return 0
        return self.decoder.compiled_executables() - self._baseline

    def sps_cache_key(self) -> str:
        """The SPS cache key: everything that changes a round's time. Readable parts
        (model name, scheduler, R, gamma, max_len) and a digest of the decode step's
        config (pages, attention backend, logprobs, sampling), the resolved attention
        backend and pool, and both models' configs (shapes and dtypes; the weights' values
        do not change the time); ``sps.cache_key`` adds the device and the JAX version."""
        cfg, dec = self.config, self.decoder
        drafter = None if dec.drafter is None else getattr(dec.drafter, "config", None)
        shapes = repr((dec.config, dec.attention, dec.num_pages, dec.target.config, drafter))
        return sps_lib.cache_key(
            cfg.model_name,
            self.policy.scheduler,
            f"R={cfg.num_slots}",
            f"gamma={dec.gamma}",
            f"max_len={cfg.max_len}",
            f"shapes={hashlib.sha256(shapes.encode()).hexdigest()[:16]}",
        )

    def profile_sps(self, progress: Progress) -> sps_lib.SPSTable:
        """SPS(B), B = R + K, for every verify bucket with the decoder's own executables
        (DESIGN §5.3); cached in ``config.sps_cache`` when given, under
        ``sps_cache_key``. Doubles as compilation of the verify rounds."""
        cfg = self.config
        return self.policy.profile_sps(
            cache_path=cfg.sps_cache,
            key=self.sps_cache_key(),
            repeats=cfg.sps_repeats,
            # Each point compiles its verify round, then times it (the timing is the short
            # part); a cached profile skips this and warm-up compiles the rounds.
            progress=lambda b, i, n: progress(
                "profiling SPS", i, n, f"B = {b}: compiling its verify round, then timing it"
            ),
        )

    def warmup(self, progress: Progress) -> None:
        """Compile every (prefill rows, prompt bucket) and every verify bucket."""
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
                        progress("compiling prefill", i, n_prefill, f"{b} x {t} tokens")
                    rows = [
                        PrefillRow(s, ids, 2, 0, 0, 1, request_key_data(0, s)) for s in range(b)
                    ]
                    state, _ = self.prefill_many(state, rows)
            state = self._fill_all_slots(state)

            def on_bucket(k, i, n):
                progress("compiling verify round", i, n, f"B = {r + k}")

            try:
                state = self.policy.warmup(state, on_bucket if shown else None)
            except Exception as e:
                backend = self.decoder.attention
                if backend == "xla":
                    raise
                # A kernel backend that does not trace or compile on this jax/flax (seen:
                # pallas_gpu under flax 0.12.10's layer scan on jax 0.11.2): say which, and
                # what to run instead, above the library's own error.
                import flax

                raise RuntimeError(
                    f"the verify round did not compile with attention backend {backend!r} "
                    f"(jax {jax.__version__}, flax {flax.__version__}): "
                    f"{type(e).__name__}: {e}. Start with --attention xla (StepConfig."
                    "attention='xla') to serve with the XLA reference attention."
                ) from e
            state = self.decoder.release(state, 0)
        jax.block_until_ready(state.seq_len)
        self._baseline = self.decoder.compiled_executables()

    def profile_prefill(self, repeats: int = 3) -> dict[tuple[int, int], float]:
        """Median seconds of one prefill call per ``(rows, prompt bucket)`` on a fresh
        decode state (the caller makes sure nothing else uses the decoder)."""
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        state = self.decoder.init_state(self.config.seed)
        out: dict[tuple[int, int], float] = {}
        for t in self.prompt_buckets:
            ids = [1] * min(t, self.max_prompt_tokens)
            for b in self.prefill_rows:
                rows = [PrefillRow(s, ids, 2, 0, 0, 1, request_key_data(0, s)) for s in range(b)]
                times = []
                for _ in range(repeats + 1):  # the first call only warms the caches
                    t0 = time.perf_counter()
                    state, pre = self.prefill_many(state, rows)
                    jax.block_until_ready(pre)
                    times.append(time.perf_counter() - t0)
                out[(b, t)] = float(np.median(times[1:]))
        return out
