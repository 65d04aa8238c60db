"""Drafter losses and held-out metrics (DESIGN §4), as pure functions of logits.

Conventions:

* Distributions are taken at temperature 1: ``p_d = softmax(draft logits)``,
  ``p_t = softmax(target logits)``. T = 1 is the distribution that sampled verification
  accepts against, and the distillation data are T = 1 samples of ``p_t``, so the L1 term,
  the confidence target and the acceptance metric all refer to the same ``p_t``.
* Every loss is a weighted mean over valid positions ``Σ w·ℓ / Σ w`` (invalid positions
  have weight 0), in float32 whatever the compute dtype.
* Position weights ``w_k = exp(-(k-1)/decay)``, k = 1..γ, decay 4.0 by default (DeepSpec's
  released configs; the paper writes γ in place of 4.0).

DSpark: ``L = α_ce·L_ce + α_tv·L_tv + α_conf·L_conf`` with ``L_ce = CE(p_d^k, y_k)``,
``L_tv = ‖p_d^k − p_t^k‖₁`` (full L1 over the vocabulary) and ``L_conf = BCE(c_k, c*_k)``,
``c*_k = clamp(1 − ½‖p_d^k − p_t^k‖₁, 0, 1)`` detached (DSpark: 0.1 / 0.9 / 1.0; DFlash:
CE only). ``1 − ½‖p_d − p_t‖₁ = Σ_v min(p_d, p_t)`` is the probability that a token
sampled from ``p_d`` survives lossless verification against ``p_t``, so ``c*`` is the
expected acceptance of position k given an accepted prefix.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

Array = jax.Array

ECE_BINS = 20


def position_weights(gamma: int, decay: float) -> Array:
    """``w_k = exp(-(k-1)/decay)`` for k = 1..γ, float32 ``[γ]``."""
    if decay <= 0:
        raise ValueError(f"loss decay must be > 0, got {decay}")
    return jnp.exp(-jnp.arange(gamma, dtype=jnp.float32) / decay)


def weighted_mean(values: Array, weights: Array) -> Array:
    """``Σ w·ℓ / Σ w`` (0 when every weight is 0)."""
    w = weights.astype(jnp.float32)
    return jnp.sum(values.astype(jnp.float32) * w) / jnp.maximum(jnp.sum(w), 1e-12)


def cross_entropy(logits: Array, labels: Array) -> Array:
    """``-log p(labels)`` per position (float32)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]


def soft_cross_entropy(logits: Array, target_probs: Array) -> Array:
    """``-Σ_v p_t(v) log p_d(v)`` per position."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(target_probs.astype(jnp.float32) * logp, axis=-1)


def l1_distance(p: Array, q: Array) -> Array:
    """``‖p − q‖₁`` over the last axis."""
    return jnp.sum(jnp.abs(p.astype(jnp.float32) - q.astype(jnp.float32)), axis=-1)


def acceptance(draft_logits: Array, target_logits: Array) -> Array:
    """Teacher-forced acceptance ``Σ_v min(p_t, p_d)`` per position (T = 1)."""
    p_d = jax.nn.softmax(draft_logits.astype(jnp.float32), axis=-1)
    p_t = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.minimum(p_d, p_t), axis=-1)


def bce_with_logits(logits: Array, targets: Array) -> Array:
    """``-(c* log σ(z) + (1-c*) log(1-σ(z)))`` = ``softplus(z) − c*·z``, stable for any z."""
    z = logits.astype(jnp.float32)
    return jax.nn.softplus(z) - targets.astype(jnp.float32) * z


def dspark_loss(
    draft_logits: Array,
    conf_logits: Array | None,
    target_logits: Array,
    labels: Array,
    mask: Array,
    *,
    decay: float = 4.0,
    alpha_ce: float = 0.1,
    alpha_tv: float = 0.9,
    alpha_conf: float = 1.0,
) -> tuple[Array, dict[str, Array]]:
    """DSpark / DFlash block loss.

    Args:
      draft_logits, target_logits: ``[N, γ, V]``; output k (0-based) of block n predicts
        ``labels[n, k]`` and ``target_logits[n, k]`` is the target's prediction for it.
      conf_logits: ``[N, γ]`` confidence logits ``z_k`` or ``None`` (no confidence head).
      labels, mask: ``[N, γ]`` true next tokens and their validity.

    Returns ``(loss, terms)`` with ``terms`` = ``l_ce``, ``l_tv``, ``l_conf`` (0 without a
    head) and ``accept`` (weighted mean of ``Σ min(p_t, p_d)``).
    """
    gamma = draft_logits.shape[-2]
    w = position_weights(gamma, decay)[None, :] * mask.astype(jnp.float32)
    logp_d = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    p_d = jnp.exp(logp_d)
    p_t = jax.lax.stop_gradient(jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1))
    ce = -jnp.take_along_axis(logp_d, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    tv = l1_distance(p_d, p_t)
    terms = {"l_ce": weighted_mean(ce, w), "l_tv": weighted_mean(tv, w)}
    terms["accept"] = jax.lax.stop_gradient(1.0 - 0.5 * terms["l_tv"])
    loss = alpha_ce * terms["l_ce"] + alpha_tv * terms["l_tv"]
    if conf_logits is not None:
        c_star = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * tv, 0.0, 1.0))
        terms["l_conf"] = weighted_mean(bce_with_logits(conf_logits, c_star), w)
        loss = loss + alpha_conf * terms["l_conf"]
    elif alpha_conf:
        raise ValueError(
            "alpha_conf > 0 needs confidence logits (a drafter with a confidence head)"
        )
    return loss, terms


def eagle3_loss(
    step_logits: Array, next_logits: Array, mask: Array, *, step_weight: float = 0.8
) -> tuple[Array, dict[str, Array]]:
    """EAGLE-3 training-time-test loss: soft CE against ``p_t``, step weights ``0.8^i``.

    Args:
      step_logits: ``[γ, S, T, V]``; step i at position t predicts the token at ``t+2+i``
        (``Eagle3Drafter.train_forward``).
      next_logits: ``[S, T, V]`` target logits of the LM head at each position u, i.e. the
        target's prediction of the token at ``u+1``; step i at t is scored against
        ``softmax(next_logits[:, t+1+i])``.
      mask: ``[γ, S, T]`` validity of (step, position).

    Returns ``(Σ_{i,t} 0.8^i m ℓ / Σ_{i,t} 0.8^i m, terms)``; terms ``l_soft_ce`` (= loss)
    and ``accept`` (weighted mean teacher-forced acceptance).
    """
    gamma, s, t = step_logits.shape[:3]
    num, den, acc = 0.0, 0.0, 0.0
    for i in range(gamma):
        shift = 1 + i
        tgt = jnp.concatenate(
            [next_logits[:, shift:], jnp.zeros((s, min(shift, t)) + next_logits.shape[2:])],
            axis=1,
        )[:, :t]
        p_t = jax.lax.stop_gradient(jax.nn.softmax(tgt.astype(jnp.float32), axis=-1))
        w = (step_weight**i) * mask[i].astype(jnp.float32)
        num = num + jnp.sum(soft_cross_entropy(step_logits[i], p_t) * w)
        p_d = jax.nn.softmax(step_logits[i].astype(jnp.float32), axis=-1)
        acc = acc + jnp.sum(jax.lax.stop_gradient(jnp.sum(jnp.minimum(p_d, p_t), -1)) * w)
        den = den + jnp.sum(w)
    den = jnp.maximum(den, 1e-12)
    loss = num / den
    return loss, {"l_soft_ce": loss, "accept": acc / den}


def eagle3_block_loss(
    step_logits: Array, target_logits: Array, mask: Array, *, step_weight: float = 0.8
) -> tuple[Array, dict[str, Array]]:
    """EAGLE-3 loss on packed blocks: ``step_logits [N, γ, V]`` (step i of block n predicts
    the token at ``a_n+1+i``), ``target_logits [N, γ, V]`` the target's logits for the same
    tokens, ``mask [N, γ]``. Soft CE with step weights ``0.8^i``, ``Σ w·ℓ / Σ w`` — the
    same formula as :func:`eagle3_loss`, restricted to the states ``a_n - 1``."""
    gamma = step_logits.shape[1]
    w = (step_weight ** jnp.arange(gamma, dtype=jnp.float32))[None, :] * mask.astype(jnp.float32)
    p_t = jax.lax.stop_gradient(jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1))
    loss = weighted_mean(soft_cross_entropy(step_logits, p_t), w)
    acc = jax.lax.stop_gradient(jnp.sum(jnp.minimum(jax.nn.softmax(step_logits, -1), p_t), -1))
    return loss, {"l_soft_ce": loss, "accept": weighted_mean(acc, w)}


def mtp_loss(logits: Array, labels: Array, mask: Array) -> tuple[Array, dict[str, Array]]:
    """MTP-1: CE of ``labels`` (the token at ``t+2`` for position t), mean over ``mask``."""
    ce = weighted_mean(cross_entropy(logits, labels), mask)
    return ce, {"l_ce": ce}


# ----------------------------------------------------------------------------------------
# Calibration (held-out metrics)
# ----------------------------------------------------------------------------------------
def ece_bin_sums(conf: Array, target: Array, mask: Array, num_bins: int = ECE_BINS):
    """Per-bin ``(count, Σ conf, Σ target)`` over valid positions, equal-width bins on
    ``conf ∈ [0, 1]``; summed over batches, :func:`ece_from_sums` gives the ECE."""
    m = mask.astype(jnp.float32).reshape(-1)
    c = conf.astype(jnp.float32).reshape(-1)
    y = target.astype(jnp.float32).reshape(-1)
    bins = jnp.clip(jnp.floor(c * num_bins).astype(jnp.int32), 0, num_bins - 1)
    onehot = jax.nn.one_hot(bins, num_bins, dtype=jnp.float32) * m[:, None]
    return onehot.sum(0), onehot.T @ c, onehot.T @ y


def ece_from_sums(count, sum_conf, sum_target) -> float:
    """``Σ_b (n_b / n) |mean conf_b − mean target_b|`` from per-bin sums (plain floats)."""
    total = float(sum(count))
    if total <= 0:
        return math.nan
    return float(sum(abs(sc - st) for sc, st in zip(sum_conf, sum_target)) / total)
