"""The decode step's data: its static settings (``StepConfig``), the state it carries
from round to round (``DecodeState``), what a round, a prefill and a plan return, the
finish codes, and the key data of a request's random stream (``request_key_data``).
``decode/step.py`` computes on them; the engine core and the drivers read them."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import numpy as np

from dspark_jax.ops.paged_attention import ATTENTION_BACKENDS, PagedKVCache

Array = jax.Array

FINISH_NONE, FINISH_EOS, FINISH_LENGTH = 0, 1, 2
FINISH_NAMES = {FINISH_NONE: None, FINISH_EOS: "eos", FINISH_LENGTH: "length"}

SCHEDULER_MODES = ("none", "fixed", "threshold", "prefix", "topk")


@functools.cache
def _key_data_shape() -> tuple[int, ...]:
    """Key data shape of the default PRNG implementation (traced once, not per request)."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape


def request_key_data(*seed: int) -> np.ndarray:
    """Key data of the random stream for ``seed`` (any non-negative integers, e.g. a
    request's seed, or a run seed and a request index), computed on the host: the full
    64-bit seed counts (``jax.random.key`` keeps 32 bits without x64)."""
    shape = _key_data_shape()
    return (
        np.random.SeedSequence([int(x) for x in seed])
        .generate_state(int(np.prod(shape)), np.uint32)
        .reshape(shape)
    )


class DecodeState(NamedTuple):
    cache: PagedKVCache  # the target's page pool (ops.paged_attention)
    page_table: Array  # [R, pages_per_seq] int32: each slot's pages (set at prefill)
    # Drafter context: each draft layer's K/V in pages of the target's page table,
    # [layers, num_pages, page_size, 2·KV, D] (see SpeculativeDecoder.ctx_shape).
    ctx_feats: Array
    ctx_query: Array  # [R, d] the last context state (EAGLE-3, MTP-1); [R, 0] otherwise
    seq_len: Array  # [R] int32
    anchor: Array  # [R] int32
    active: Array  # [R] bool
    remaining: Array  # [R] int32: tokens still allowed (max_new_tokens budget)
    temperature: Array  # [R] float32
    top_k: Array  # [R] int32
    top_p: Array  # [R] float32
    slot_keys: Array  # [R, ...] uint32 key data: each slot's random stream
    coupled: Array  # [R] bool: position-keyed (load-invariant) draws, see module docstring


class RoundOutput(NamedTuple):
    tokens: Array  # [R, G+1] emitted tokens (first ``num_emitted`` valid)
    num_emitted: Array  # [R]
    accepted: Array  # [R] accepted draft tokens
    verified: Array  # [R] draft tokens sent to the target (l[r])
    finish: Array  # [R] FINISH_* code (0 = still running)
    survival: Array  # [R, G] a = cumprod(c) used by the scheduler (ones without confidences)
    confidence: Array  # [R, G] calibrated c_k (ones without confidences)
    draft_tokens: Array  # [R, G]
    # The target's log-probabilities (its own distribution: before temperature, top-k and
    # top-p) of each emitted token, and its ``StepConfig.top_logprobs`` most likely tokens.
    logprobs: Array  # [R, G+1] float32
    top_ids: Array  # [R, G+1, N] int32
    top_logprobs: Array  # [R, G+1, N] float32


class PrefillOutput(NamedTuple):
    first_token: Array  # [B]
    finish: Array  # [B]
    logprob: Array  # [B] the first token's target log-probability (see RoundOutput)
    top_ids: Array  # [B, N]
    top_logprobs: Array  # [B, N]


class Plan(NamedTuple):
    """Drafts and the verification plan of one round (output of ``plan``)."""

    draft_tokens: Array  # [R, G]
    draft_probs: Array | None  # [R, G, V] processed draft distributions (sampling only)
    confidence: Array  # [R, G]
    survival: Array  # [R, G]
    lengths: Array  # [R] draft tokens to verify, already capped by room / max_new
    verify_keys: Array  # [R] typed keys of the verification draws
    slot_keys: Array  # [R, ...] the state's next key data (advanced for active slots)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of a decoder (one compiled round per verify budget K)."""

    num_slots: int
    max_len: int
    scheduler: str = "fixed"
    sampling: bool = False  # False: greedy verification (all requests at temperature 0)
    threshold: float = 0.5  # static-threshold arm
    fixed_length: int | None = None  # fixed arm: verify this many drafts (default: all)
    eos_id: int = -1
    top_logprobs: int = 0  # most likely target tokens reported per emitted token (static)
    # Paged KV cache (ops.paged_attention): positions per page, and pages in the pool
    # including the null page (None: every slot at max_len, ``pages.full_pool_pages``).
    page_size: int = 16
    num_pages: int | None = None
    # Verify attention backend (ops.paged_attention.ATTENTION_BACKENDS): auto (pallas_tpu on
    # TPU, pallas_gpu on GPU, else xla), xla, pallas_tpu or pallas_gpu.
    attention: str = "auto"

    def __post_init__(self):
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(
                f"Unknown attention backend {self.attention!r}; allowed: {list(ATTENTION_BACKENDS)}"
            )
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.num_pages is not None and self.num_pages < 2:
            raise ValueError(
                f"num_pages must be >= 2 (page 0 is the null page), got {self.num_pages}"
            )
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        if self.scheduler not in SCHEDULER_MODES:
            raise ValueError(
                f"Unknown scheduler {self.scheduler!r}; allowed: {list(SCHEDULER_MODES)}"
            )
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
