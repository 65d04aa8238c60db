"""The target's log-probabilities of emitted tokens and its most likely tokens, as the
decode step reports them (``RoundOutput.logprobs`` / ``top_ids`` / ``top_logprobs``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["target_logprobs"]


def target_logprobs(logits: Array, tokens: Array, rows: Array | None, top_n: int):
    """Target log-probabilities for logits ``[P, V]``: of ``tokens`` (``[...]``, each
    scored by logits row ``rows[...]``, default row i for token i; PAD entries give
    values the caller never reads) and the ``top_n`` largest entries of those
    rows. A log-sum-exp and a top-N per row: nothing ``V`` wide is gathered."""
    logits = logits.astype(jnp.float32)
    rows = jnp.arange(logits.shape[0]) if rows is None else rows
    lse = jax.nn.logsumexp(logits, axis=-1)[rows]
    picked = logits[rows, jnp.maximum(tokens, 0)] - lse
    if top_n:
        top_vals, top_ids = jax.lax.top_k(logits, top_n)
    else:
        top_vals = jnp.zeros(logits.shape[:-1] + (0,), jnp.float32)
        top_ids = jnp.zeros(logits.shape[:-1] + (0,), jnp.int32)
    return picked, top_ids[rows].astype(jnp.int32), top_vals[rows] - lse[..., None]
