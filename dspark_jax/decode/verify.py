"""Lossless verification of a drafted block (DESIGN §5.1), batched over R slots.

Shapes are fixed: drafts ``[R, γ]``, target distributions ``[R, γ+1, ...]``. The scheduler
admits a per-slot prefix of ``n_verify[r]`` draft tokens (DESIGN §5.3); positions
``>= n_verify[r]`` were pruned from the verify pass, are never accepted, and their target
rows are never read (they may hold garbage, even NaN).

Outputs (all int32), per slot ``r``:
  * ``accepted_len[r]``: draft tokens accepted, ``0 <= accepted_len <= n_verify``.
  * ``next_token[r]``: the token after the accepted prefix — the target's correction at the
    first rejection, or the bonus token if every verified draft was accepted.
  * ``out_tokens[r]``: ``accepted drafts ++ [next_token]`` padded with ``PAD_TOKEN``;
    ``accepted_len + 1`` tokens are valid, so τ for the round is ``accepted_len + 1``.
Inactive slots (``active[r] == False``) report ``accepted_len = 0``,
``next_token = PAD_TOKEN`` and an all-``PAD_TOKEN`` row; callers must not commit them.

Two lossless rules for sampled drafts: ``verify_sampling`` (speculative sampling, Leviathan
et al. / Chen et al.: accept with ``min(1, p_t/p_d)``, resample from the residual) and
``verify_coupled`` (Gumbel-max with noise keyed by sequence position: the emitted token at
every position is the target's own Gumbel-max draw, so the output does not depend on the
drafts, the scheduler or the other slots; it accepts less often, see its docstring).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.ops.sampling import gumbel_max, sample, split_keys, uniform

__all__ = [
    "PAD_TOKEN",
    "acceptance_probability",
    "residual_distribution",
    "verify_coupled",
    "verify_greedy",
    "verify_sampling",
]

PAD_TOKEN = -1
# Below this residual mass the rejection branch is (numerically) unreachable: its
# probability equals the residual mass. Falling back to p_t keeps the draw well defined.
_RESIDUAL_EPS = 1e-6


def acceptance_probability(p_t: jax.Array, p_d: jax.Array) -> jax.Array:
    """``min(1, p_t(x) / p_d(x))`` elementwise, for the probabilities of drafted tokens.

    ``p_d(x) = 0`` cannot happen for a token sampled from ``p_d``; it maps to 1 when
    ``p_t(x) > 0`` so the rule stays total.
    """
    return jnp.minimum(1.0, p_t / jnp.maximum(p_d, jnp.finfo(jnp.float32).tiny))


def residual_distribution(p_t: jax.Array, p_d: jax.Array) -> jax.Array:
    """``norm(max(0, p_t − p_d))`` over the last axis; ``p_t`` where that mass is ~0."""
    resid = jnp.maximum(p_t - p_d, 0.0)
    mass = jnp.sum(resid, axis=-1, keepdims=True)
    ok = mass > _RESIDUAL_EPS
    return jnp.where(ok, resid / jnp.where(ok, mass, 1.0), p_t)


def _check_shapes(draft_tokens, target, n_verify, active, target_name, target_rank):
    if draft_tokens.ndim != 2:
        raise ValueError(f"draft_tokens must be [R, γ]; got shape {draft_tokens.shape}")
    r, gamma = draft_tokens.shape
    if target.ndim != target_rank or target.shape[:2] != (r, gamma + 1):
        want = "[R, γ+1, V]" if target_rank == 3 else "[R, γ+1]"
        raise ValueError(
            f"{target_name} must be {want} = [{r}, {gamma + 1}{', V' if target_rank == 3 else ''}]"
            f" for draft_tokens {draft_tokens.shape}; got {target.shape}"
        )
    if n_verify.shape != (r,):
        raise ValueError(f"n_verify must be [R] = [{r}]; got shape {n_verify.shape}")
    if active is not None and active.shape != (r,):
        raise ValueError(f"active must be [R] = [{r}]; got shape {active.shape}")


def _assemble(draft_tokens, accept, n_verify, active, next_from_len):
    """Shared tail: accepted prefix length, next token, padded output row."""
    r, gamma = draft_tokens.shape
    n = jnp.clip(n_verify.astype(jnp.int32), 0, gamma)
    pos = jnp.arange(gamma, dtype=jnp.int32)
    accept = accept & (pos[None, :] < n[:, None])  # pruned positions are never accepted
    if active is not None:
        accept = accept & active[:, None]
    accepted_len = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    next_token = next_from_len(accepted_len)
    pos1 = jnp.arange(gamma + 1, dtype=jnp.int32)[None, :]
    drafts = jnp.concatenate([draft_tokens, jnp.zeros((r, 1), draft_tokens.dtype)], axis=1)
    out = jnp.where(pos1 < accepted_len[:, None], drafts, PAD_TOKEN)
    out = jnp.where(pos1 == accepted_len[:, None], next_token[:, None], out)
    if active is not None:
        next_token = jnp.where(active, next_token, PAD_TOKEN)
        out = jnp.where(active[:, None], out, PAD_TOKEN)
    return accepted_len, next_token.astype(jnp.int32), out.astype(jnp.int32)


@jax.jit
def verify_greedy(draft_tokens, target_logits, n_verify, active=None):
    """Greedy (T = 0) verification: accept while the draft equals the target argmax.

    Args:
      draft_tokens: int ``[R, γ]``.
      target_logits: float ``[R, γ+1, V]`` target logits (row ``k`` predicts the token after
        draft ``k-1``; row 0 follows the anchor), or int ``[R, γ+1]`` already-argmaxed target
        tokens (saves materialising ``V``-wide rows when the verify pass is packed).
      n_verify: int ``[R]``, draft tokens admitted per slot (clipped to ``[0, γ]``).
      active: optional bool ``[R]``; inactive slots report nothing (see module docstring).

    Returns:
      ``(accepted_len [R], next_token [R], out_tokens [R, γ+1])``, int32.
    """
    draft_tokens = jnp.asarray(draft_tokens).astype(jnp.int32)
    target_logits = jnp.asarray(target_logits)
    n_verify = jnp.asarray(n_verify)
    active = None if active is None else jnp.asarray(active, bool)
    if target_logits.ndim == 2 and jnp.issubdtype(target_logits.dtype, jnp.integer):
        target_tok = target_logits.astype(jnp.int32)
        _check_shapes(draft_tokens, target_tok, n_verify, active, "target tokens", 2)
    else:
        _check_shapes(draft_tokens, target_logits, n_verify, active, "target_logits", 3)
        target_tok = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
    accept = draft_tokens == target_tok[:, :-1]
    return _assemble(
        draft_tokens,
        accept,
        n_verify,
        active,
        lambda length: jnp.take_along_axis(target_tok, length[:, None], axis=1)[:, 0],
    )


@jax.jit
def verify_sampling(rng, draft_tokens, draft_probs, target_probs, n_verify, active=None):
    """Speculative-sampling verification (lossless for any ``n_verify`` chosen without
    looking at the tokens it admits; DESIGN §5.4).

    Token ``x_k`` (``k < n_verify``) is accepted with probability
    ``min(1, p_t(x_k) / p_d(x_k))``; at the first rejection the next token is drawn from
    ``norm(max(0, p_t − p_d))`` at that position (``p_t`` if the residual mass is ~0); if all
    ``n_verify`` drafts are accepted the bonus token is drawn from ``p_t`` at position
    ``n_verify``.

    Args:
      rng: PRNG key, or per-slot keys ``[R]`` (each slot's draws from its own stream).
      draft_tokens: int ``[R, γ]`` drafts, ``x_k ~ draft_probs[:, k]``.
      draft_probs: float ``[R, γ, V]`` processed draft distributions (``process_logits``).
      target_probs: float ``[R, γ+1, V]`` processed target distributions, same processing.
      n_verify: int ``[R]`` admitted draft tokens per slot (clipped to ``[0, γ]``).
      active: optional bool ``[R]``; inactive slots report nothing (see module docstring).

    Returns:
      ``(accepted_len [R], next_token [R], out_tokens [R, γ+1])``, int32.
    """
    draft_tokens = jnp.asarray(draft_tokens).astype(jnp.int32)
    draft_probs = jnp.asarray(draft_probs, jnp.float32)
    target_probs = jnp.asarray(target_probs, jnp.float32)
    n_verify = jnp.asarray(n_verify)
    active = None if active is None else jnp.asarray(active, bool)
    _check_shapes(draft_tokens, target_probs, n_verify, active, "target_probs", 3)
    if draft_probs.shape != draft_tokens.shape + target_probs.shape[-1:]:
        raise ValueError(
            f"draft_probs must be [R, γ, V] = {draft_tokens.shape + target_probs.shape[-1:]}; "
            f"got {draft_probs.shape}"
        )
    r, gamma = draft_tokens.shape
    k_accept, k_sample = split_keys(rng, 2)
    p_d = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    p_t = jnp.take_along_axis(target_probs[:, :gamma], draft_tokens[..., None], axis=-1)[..., 0]
    u = uniform(k_accept, (r, gamma))
    accept = u < acceptance_probability(p_t, p_d)
    n = jnp.clip(n_verify.astype(jnp.int32), 0, gamma)

    def next_from_len(length):
        # One draw per slot from the distribution at the stopping position: the residual
        # after a rejection (length < n), the plain target for the bonus (length == n).
        t_row = jnp.take_along_axis(target_probs, length[:, None, None], axis=1)[:, 0]
        d_idx = jnp.minimum(length, gamma - 1)[:, None, None]
        d_row = jnp.take_along_axis(draft_probs, d_idx, axis=1)[:, 0]
        rejected = (length < n)[:, None]
        dist = jnp.where(rejected, residual_distribution(t_row, d_row), t_row)
        return sample(k_sample, dist)

    return _assemble(draft_tokens, accept, n, active, next_from_len)


@jax.jit
def verify_coupled(position_keys, draft_tokens, target_probs, n_verify, active=None):
    """Position-keyed Gumbel-max verification: lossless, and load-invariant for a seed.

    The target's token at each position is drawn as ``argmax(log p_t + G)`` with Gumbel
    noise ``G`` from that position's key; drafts are accepted while they equal those
    tokens, and the token after the accepted prefix is the target's draw there. The
    emitted token at position ``t`` is therefore ``argmax(log p_t(· | prefix) + G_t)`` in
    every case: an exact sample of the target (Gumbel-max trick; ``G_t`` is independent of
    everything before ``t``), and the same token whatever was drafted, how many drafts
    were verified or what other slots did. A drafter that drew draft ``k`` with the same
    key (``ops.sampling.StepKeys`` from ``position_keys``) shares the noise, so it is
    accepted whenever both distributions' perturbed argmaxes agree: often when ``p_d`` is
    close to ``p_t``, but less often than ``min(1, p_t/p_d)`` acceptance (the cost is
    measured by ``benchmarks/acceptance.py --verification coupled``).

    Args:
      position_keys: typed keys ``[R, γ+1]``; key ``j`` belongs to the position target row
        ``j`` predicts (draft ``j``'s position; ``γ`` is the bonus position).
      draft_tokens: int ``[R, γ]``.
      target_probs: float ``[R, γ+1, V]`` processed target distributions.
      n_verify: int ``[R]`` admitted draft tokens per slot (clipped to ``[0, γ]``).
      active: optional bool ``[R]``; inactive slots report nothing (see module docstring).

    Returns:
      ``(accepted_len [R], next_token [R], out_tokens [R, γ+1])``, int32.
    """
    target_probs = jnp.asarray(target_probs, jnp.float32)
    draft_tokens = jnp.asarray(draft_tokens).astype(jnp.int32)
    r, g1 = draft_tokens.shape[0], draft_tokens.shape[1] + 1
    if position_keys.shape != (r, g1) or target_probs.shape[:2] != (r, g1):
        raise ValueError(
            f"position_keys {position_keys.shape} and target_probs {target_probs.shape} must "
            f"be [R, γ+1] = [{r}, {g1}] (and [R, γ+1, V]) for draft_tokens {draft_tokens.shape}"
        )
    v = target_probs.shape[-1]
    target_tok = jax.vmap(gumbel_max)(
        position_keys.reshape(-1), jnp.log(target_probs).reshape(r * g1, v)
    ).reshape(r, g1)
    return verify_greedy(draft_tokens, target_tok.astype(jnp.int32), n_verify, active)
