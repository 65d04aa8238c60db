"""Logit processing and sampling shared by the target and the drafter (DESIGN §5.1).

Lossless speculative sampling needs the draft distribution ``p_d`` and the target
distribution ``p_t`` to be processed by the *same* function: temperature, then top-k, then
top-p (the order Hugging Face uses). Everything here has fixed shapes (sort + cumsum, no
boolean indexing) so it runs inside the jitted decode step.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.ops.branching import same_on_every_device

__all__ = [
    "SamplingSettings",
    "StepKeys",
    "gumbel_max",
    "per_row",
    "position_keys",
    "process_logits",
    "sample",
    "split_keys",
    "uniform",
]


def _leading_param(name: str, value, logits: jax.Array, dtype) -> jax.Array:
    """Broadcast a scalar or per-row parameter over ``logits[..., V]``.

    A per-row parameter has a shape equal to a *prefix* of ``logits.shape[:-1]`` (e.g. ``[R]``
    for logits ``[R, γ+1, V]``), so it is expanded with trailing singleton axes, not aligned
    from the right as plain NumPy broadcasting would.
    """
    value = jnp.asarray(value, dtype=dtype)
    batch_shape = logits.shape[:-1]
    if value.ndim > len(batch_shape) or any(
        s not in (1, b) for s, b in zip(value.shape, batch_shape[: value.ndim])
    ):
        raise ValueError(
            f"{name} has shape {value.shape}; expected a scalar or a prefix of the logits' "
            f"batch shape {batch_shape} (logits shape {logits.shape})"
        )
    return value.reshape(value.shape + (1,) * (logits.ndim - value.ndim))


def _check_concrete(name: str, value, ok, requirement: str) -> None:
    """Validate host-side values; traced values (inside jit) cannot be inspected."""
    if isinstance(value, jax.core.Tracer):
        return
    arr = np.asarray(value)
    if not bool(np.all(ok(arr))):
        raise ValueError(f"{name} must be {requirement}; got {arr.tolist()}")


def process_logits(logits: jax.Array, temperature=1.0, top_k=0, top_p=1.0) -> jax.Array:
    """Turn logits ``[..., V]`` into the sampling distribution ``[..., V]`` (float32).

    Args:
      logits: raw logits, any leading shape.
      temperature: scalar or per-row array (shape = a prefix of ``logits.shape[:-1]``).
        ``T == 0`` yields the greedy point mass on the argmax (first index on ties), so rows of
        a mixed greedy/sampling batch can share ``verify_sampling``; all-greedy batches should
        call ``verify_greedy`` instead, which skips this work.
      top_k: scalar or per-row int; ``0`` disables it. Tokens tied with the k-th largest
        logit are all kept (cut-off by value, as Hugging Face does).
      top_p: scalar or per-row float in ``(0, 1]``; ``1.0`` disables it. Keeps the smallest
        set of highest-probability tokens whose mass is ``>= top_p`` (computed after top-k),
        plus any token tied with the last one kept; the argmax is always kept.

    Returns:
      Probabilities with exact zeros outside the kept set, rows summing to 1.
    """
    logits = jnp.asarray(logits)
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1; got {logits.shape}")
    _check_concrete("temperature", temperature, lambda t: t >= 0, ">= 0")
    _check_concrete("top_k", top_k, lambda k: k >= 0, ">= 0 (0 disables top-k)")
    _check_concrete("top_p", top_p, lambda p: (p > 0) & (p <= 1), "in (0, 1] (1 disables top-p)")
    logits = logits.astype(jnp.float32)
    temp = _leading_param("temperature", temperature, logits, jnp.float32)
    k = _leading_param("top_k", top_k, logits, jnp.int32)
    p = _leading_param("top_p", top_p, logits, jnp.float32)

    greedy = temp <= 0
    scaled = logits / jnp.where(greedy, 1.0, temp)

    def filtered(x: jax.Array) -> jax.Array:
        # Work in sorted order to find how many tokens survive, then cut by value so no
        # scatter back to vocabulary order is needed.
        srt = jnp.sort(x, axis=-1)[..., ::-1]
        rank = jnp.arange(x.shape[-1], dtype=jnp.int32)
        keep_k = (k <= 0) | (rank < k)
        probs_sorted = jax.nn.softmax(jnp.where(keep_k, srt, -jnp.inf), axis=-1)
        mass_before = jnp.cumsum(probs_sorted, axis=-1) - probs_sorted
        keep = keep_k & ((p >= 1.0) | (mass_before < p))
        keep = keep.at[..., 0].set(True)  # always keep the argmax
        n_keep = jnp.sum(keep, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
        return jnp.where(x >= cutoff, x, -jnp.inf)

    # A full-vocabulary sort is the dominant cost; skip it when no row filters.
    needs_filter = same_on_every_device(jnp.any(k > 0) | jnp.any(p < 1.0))
    scaled = jax.lax.cond(needs_filter, filtered, lambda x: x, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    one_hot = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(greedy, one_hot, probs)


@flax.struct.dataclass
class StepKeys:
    """Keys a caller derived per draw: ``keys [n, R]``, draw ``k`` of row ``r`` uses
    ``keys[k, r]``. ``split_keys`` hands them over unchanged, so a drafter that draws token
    ``k`` with ``split_keys(rng, n)[k]`` can be given, e.g., position-keyed keys (the
    coupled verification of ``decode.verify.verify_coupled``)."""

    keys: jax.Array


def position_keys(base: jax.Array, positions: jax.Array) -> jax.Array:
    """``fold_in(base[r], positions[r, j])``: typed keys ``[R, n]``, one per row and
    absolute sequence position, fixed by the row's base key and the position alone."""
    fold = jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)), in_axes=(0, 0))
    return fold(base, jnp.asarray(positions, jnp.uint32))


def gumbel_max(key: jax.Array, logp: jax.Array) -> jax.Array:
    """``argmax(log p + G)`` with ``G`` standard Gumbel noise over ``logp [V]`` drawn from
    ``key``: an exact sample of ``p`` (the Gumbel-max trick; ``-inf`` entries are never
    drawn). Two distributions drawn with the same key share the noise, which is what
    couples a draft token to the target's token at the same position."""
    noise = jax.random.gumbel(key, logp.shape, jnp.float32)
    return jnp.argmax(logp.astype(jnp.float32) + noise, axis=-1)


def per_row(rng) -> bool:
    """``rng`` is a batch of keys, one per row (``[R]``), rather than one key: each row
    then draws from its own stream, whatever the other rows are (per-request seeds)."""
    return jax.dtypes.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key) and rng.ndim >= 1


def split_keys(rng: jax.Array, n: int) -> jax.Array:
    """``n`` keys from one key (``[n]``), or ``n`` per row from per-row keys (``[n, R]``,
    so ``split_keys(rng, n)[k]`` is always what draw ``k`` of every row uses); ``StepKeys``
    are returned as they are."""
    if isinstance(rng, StepKeys):
        if rng.keys.shape[0] != n:
            raise ValueError(f"StepKeys hold {rng.keys.shape[0]} draws per row; {n} requested")
        return rng.keys
    if per_row(rng):
        return jax.vmap(lambda k: jax.random.split(k, n), out_axes=1)(rng)
    return jax.random.split(rng, n)


def uniform(rng: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniforms ``[R, ...]`` from one key, or row r from key r of per-row keys."""
    if per_row(rng):
        return jax.vmap(lambda k: jax.random.uniform(k, shape[1:]))(rng)
    return jax.random.uniform(rng, shape)


def sample(rng: jax.Array, probs: jax.Array) -> jax.Array:
    """Draw one token id per row from ``probs [..., V]``; returns int32 ``[...]``. ``rng``:
    one key, or per-row keys ``[R]`` for ``probs [R, V]``.

    Zero-probability tokens are never drawn (their log-probability is ``-inf``).
    """
    probs = jnp.asarray(probs)
    if probs.ndim < 1:
        raise ValueError(f"probs must have shape [..., V]; got {probs.shape}")
    if per_row(rng):
        # gumbel_max draws exactly what jax.random.categorical draws for one row's key
        # (checked in tests), and is the form the coupled verification relies on.
        return jax.vmap(gumbel_max)(rng, jnp.log(probs)).astype(jnp.int32)
    return jax.random.categorical(rng, jnp.log(probs), axis=-1).astype(jnp.int32)


@flax.struct.dataclass
class SamplingSettings:
    """The ``process_logits`` arguments travelling together: each a scalar or per-row
    array (``[R]``); the defaults are greedy. A pytree, so it passes through ``jit``."""

    temperature: Any = 0.0
    top_k: Any = 0
    top_p: Any = 1.0

    def probs(self, logits: jax.Array) -> jax.Array:
        """``process_logits(logits, temperature, top_k, top_p)``."""
        return process_logits(logits, self.temperature, self.top_k, self.top_p)

    def draw(self, rng: jax.Array, logits: jax.Array):
        """One token per row of ``logits [R, V]``: ``(tokens [R], their probabilities [R],
        the processed distribution [R, V], max_logprob(logits) [R])``."""
        probs = self.probs(logits)
        tok = sample(rng, probs)
        p_tok = jnp.take_along_axis(probs, tok[:, None], axis=-1)[:, 0]
        return tok, p_tok, probs, max_logprob(logits)


def max_logprob(logits: jax.Array) -> jax.Array:
    """``log max_v softmax(logits)_v`` over the last axis, in float32: the largest
    probability of the *untempered* distribution (no temperature, top-k or top-p), known
    before a token is drawn from it. The drafters' survival estimate without a confidence
    head (``decode.plan_step``) reads it; at temperature 0 it is the drafted token's own
    probability, which the processed distribution (a point mass) no longer shows."""
    x = logits.astype(jnp.float32)
    return jnp.max(x, axis=-1) - jax.nn.logsumexp(x, axis=-1)
