"""Prefill calls in compiled shapes: prompts padded to a power-of-two length bucket, rows
batched up to a compiled row count (1 and the engine's ``prefill_batch``), padding rows
aimed at slot ``num_slots`` (their state writes are dropped by out-of-range scatters and
their K/V go to the null page)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from dspark_jax.decode.autoregressive import length_bucket
from dspark_jax.decode.step import SpeculativeDecoder, request_key_data

__all__ = ["MIN_PROMPT_BUCKET", "PrefillBatcher", "PrefillRow", "prompt_buckets"]

MIN_PROMPT_BUCKET = 16  # smallest prefill length bucket (autoregressive.length_bucket)


class PrefillRow(NamedTuple):
    """One request's row of a prefill call."""

    slot: int
    ids: Sequence[int]
    max_new: int
    temperature: float
    top_k: int
    top_p: float
    keys: np.ndarray  # its random stream, key data (``request_key_data``)
    coupled: bool = False  # position-keyed verification (``decode.verify.verify_coupled``)
    # Its page-table row (``decode.pages.PagePool.allocate``); None: the decoder's static
    # row for the slot (the full-size pool), or the null page (warm-up, profiling).
    pages: np.ndarray | None = None


def prompt_buckets(max_len: int) -> tuple[int, ...]:
    """Powers of two from 16, the last one capped at ``max_len`` (a prompt must leave room
    for one generated token, so lengths up to ``max_len - 2`` are served)."""
    out, b = [], MIN_PROMPT_BUCKET
    while True:
        out.append(min(b, max_len))
        if b >= max_len:
            return tuple(sorted(set(out)))
        b *= 2


class PrefillBatcher:
    """The prefill shapes of one decoder: length buckets and compiled row counts."""

    def __init__(self, decoder: SpeculativeDecoder, prefill_batch: int = 1):
        self.decoder = decoder
        cfg = decoder.config
        self.num_slots, self.max_len = cfg.num_slots, cfg.max_len
        self.prompt_buckets = prompt_buckets(cfg.max_len)
        # Compiled batch sizes: 1, and ``prefill_batch`` (capped at the slots).
        self.rows = tuple(sorted({1, max(1, min(prefill_batch, cfg.num_slots))}))

    @property
    def max_rows(self) -> int:
        return max(self.rows)

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_len - 2

    def bucket_for(self, n: int) -> int:
        return min(length_bucket(n, MIN_PROMPT_BUCKET), self.max_len)

    def run(self, state, rows: Sequence[PrefillRow], bucket: int | None = None):
        """One prefill call for ``rows`` (at most ``max_rows``), prompts padded to the
        longest one's length bucket (or ``bucket``), the batch to a compiled row count."""
        n = len(rows)
        b = next(k for k in self.rows if k >= n)
        t = bucket or max(self.bucket_for(len(r.ids)) for r in rows)
        slots = np.full((b,), self.num_slots, np.int32)
        prompts = np.zeros((b, t), np.int32)
        lengths = np.ones((b,), np.int32)
        max_new = np.ones((b,), np.int32)
        temps = np.zeros((b,), np.float32)
        top_k = np.zeros((b,), np.int32)
        top_p = np.ones((b,), np.float32)
        keys = np.stack([request_key_data(0, i) for i in range(b)])  # padding rows: any
        coupled = np.zeros((b,), bool)
        for i, (slot, ids, mn, temp, k, p, key, cpl, _) in enumerate(rows):
            slots[i], lengths[i], max_new[i] = slot, len(ids), mn
            prompts[i, : len(ids)] = ids
            temps[i], top_k[i], top_p[i], keys[i], coupled[i] = temp, k, p, key, cpl
        pages = self.decoder.static_page_rows(slots)
        for i, row in enumerate(rows):
            if row.pages is not None:
                pages[i] = row.pages
        return self.decoder.prefill(
            state, slots, prompts, lengths, max_new, temps, top_k, top_p, keys, coupled, pages
        )
