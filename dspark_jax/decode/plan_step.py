"""Steps 1-2 of a round (``decode.step``'s module docstring): draft γ tokens per slot with
their confidences, turn them into survivals and let the configured arm choose each slot's
verify length, capped by the cache's room and the tokens still allowed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.decode.keys import select_keys
from dspark_jax.decode.state import (
    DecodeState,
    Plan,
)
from dspark_jax.models.draft_api import DraftContext, SamplingSettings
from dspark_jax.ops.sampling import StepKeys, split_keys
from dspark_jax.sched import policies
from dspark_jax.sched.topk import admit_topk
from dspark_jax.sharding import LOGICAL_RULES

Array = jax.Array

__all__ = ["draft", "no_drafts", "plan_step", "schedule", "survival_logits"]


def plan_step(
    dec, params, state: DecodeState, budget: int, limit=None, drafting: bool = True
) -> tuple[DecodeState, Plan]:
    """Draft and schedule. ``drafting=False`` (static): a *plain* round's plan, no drafter
    call and no draft verified (``decode.policy``'s draft-aware rounds); the slots' streams
    advance as in a drafting round, so a request's draws do not depend on the round kind."""
    c = dec.config
    # Each slot's stream: next key, draft draws, verification draws. Only active slots
    # advance, so a request's draws depend on its own rounds alone; coupled slots keep
    # their key and draw draft k with the key of its position, seq_len + 1 + k.
    active = state.active
    base = jax.random.wrap_key_data(state.slot_keys)
    nxt, draft_keys, verify_keys = split_keys(base, 3)
    slot_keys = jax.random.key_data(select_keys(active & ~state.coupled, nxt, base))
    step_keys = select_keys(
        state.coupled[None, :],
        jnp.swapaxes(dec._position_keys(state), 0, 1)[: dec.gamma],
        split_keys(draft_keys, dec.gamma),
    )
    if drafting:
        draft_tokens, draft_probs, conf, out = dec._draft(params, state, StepKeys(step_keys))
        if out is not None and out.context is not None:
            state = state._replace(ctx_feats=out.context)
    else:
        draft_tokens, draft_probs, _, _ = no_drafts(dec)
        # No draft, no confidence: survival 0 says so to whoever reads the round's output.
        conf = jnp.zeros(draft_tokens.shape, jnp.float32)
    survival = jnp.cumprod(conf, axis=1)
    if drafting:
        limited = () if limit is None else (limit,)  # a data replica's own budget
        lengths = dec._schedule(survival, active, budget, params[2], *limited)
    else:
        lengths = jnp.zeros(active.shape, jnp.int32)
    # Cap by cache room and max_new so no write goes past max_len (lengths only).
    room = jnp.maximum(c.max_len - 2 - state.seq_len, 0)
    lengths = jnp.minimum(lengths, jnp.minimum(room, jnp.maximum(state.remaining - 1, 0)))
    lengths = jnp.where(active, lengths, 0).astype(jnp.int32)
    return state, Plan(
        draft_tokens=draft_tokens,
        draft_probs=draft_probs if c.sampling else None,
        confidence=conf,
        survival=survival,
        lengths=lengths,
        verify_keys=verify_keys,
        slot_keys=slot_keys,
    )


def draft(dec, params, state, key):
    if dec.drafter is None:
        return no_drafts(dec)
    tp, dp = params[0], params[1]
    context = DraftContext(
        state.ctx_feats,  # the draft layers' paged K/V
        state.seq_len,
        cached=True,
        query=state.ctx_query if dec.next_token_states else None,
        page_table=state.page_table,
        writable=state.active,
        attention=dec.attention,
        heads_axis=dict(LOGICAL_RULES)["cache_kv_heads"],
    )
    sampling = SamplingSettings(
        state.temperature if dec.config.sampling else 0.0, state.top_k, state.top_p
    )
    out = dec.drafter.apply(
        {"params": dp},
        context,
        state.anchor,
        key,
        sampling,
        dec._embed_fn(tp),
        dec._lm_head_fn(tp),
        method="draft",
    )
    z = survival_logits(out, dec.survival_estimator)
    conf = jax.nn.sigmoid(calibrated_logits(z, dec.sts_temperatures, dec.sts_biases, dec.sts_knots))
    return out.tokens.astype(jnp.int32), out.probs, conf, out


def calibrated_logits(z, temperatures, biases, knots=None) -> Array:
    """``z / T + b`` per position ``[R, G]``; at positions with an isotonic step map
    (``knots`` ``[G, 2, J]``, host constants; NaN rows: none) the step's logit instead, as
    ``eval.calibration.step_logits`` computes it offline."""
    x = z / temperatures + biases
    if knots is None:
        return x
    knots = np.asarray(knots, np.float32)
    has = ~np.isnan(knots[:, 0, 0])
    edges = np.where(has[:, None], knots[:, 0], 0.0)
    values = np.where(has[:, None], knots[:, 1], 0.0)
    find = jax.vmap(lambda e, col: jnp.searchsorted(e, col, side="right"), (0, 1), 1)
    j = jnp.clip(find(edges, x) - 1, 0, knots.shape[-1] - 1)  # [R, G]: the step each z is on
    stepped = jnp.asarray(values)[jnp.arange(knots.shape[0])[None, :], j]
    return jnp.where(has, stepped, x)


# float32 σ saturates at 1 - 2^-24: a draft probability of 1 maps to the logit σ⁻¹ of that
# (≈ 16.6), the same clip ``eval.calibration`` applies to recorded survivals.
_MAX_LOGPROB = float(np.log1p(-(2.0**-24)))


def survival_logits(out, estimator: str) -> Array:
    """``z_k`` ``[R, G]`` whose calibrated ``σ(z_k / T_k + b_k)`` is the conditional survival
    ``c_k`` of draft k (DESIGN §3.4), for the named estimator:

    * ``confidence_head``: the head's logit (DSpark);
    * ``draft_probability``: ``logit(max_v q_k(v))``, the largest probability of the
      drafter's untempered distribution at position k. Uncalibrated (T = 1, b = 0) it *is*
      ``max q_k``: the chance that a target which agreed with the drafter's ranking keeps
      its top token. It is fixed before ``x_k`` is drawn, so like the head it depends on
      ``x_{<k}`` only; the drafted token's own probability ``q_k(x_k)`` would let ``x_k``
      decide its own admission at T > 0 (DESIGN §5.4; a test shows the difference).
    """
    if estimator == "confidence_head":
        if out.confidence_logits is None:
            raise ValueError("the confidence-head survival estimate needs a confidence head")
        return out.confidence_logits.astype(jnp.float32)
    lp = jnp.minimum(out.max_logprobs.astype(jnp.float32), _MAX_LOGPROB)
    return lp - jnp.log(-jnp.expm1(lp))  # logit(p) = log p - log(1 - p), p = exp(lp)


def no_drafts(dec):
    """Placeholder drafts of a round that verifies none (l = 0): no drafter, or a plain
    round. A uniform p_d keeps the shapes of the sampling verifier, which only draws the
    bonus token from p_t then."""
    g, r, v = dec.gamma, dec.replica_slots, dec.target.config.vocab_size
    probs = jnp.full((r, g, v), 1.0 / v, jnp.float32)
    return jnp.zeros((r, g), jnp.int32), probs, jnp.ones((r, g), jnp.float32), None


def schedule(dec, survival, active, budget, sps_table, limit=None):
    """Per-slot prefix lengths ``[R]`` for the configured arm (DESIGN §5.3).

    Must depend on the survival probabilities only through rules that never let a token
    decide its own admission (DESIGN §5.4); tests override it to show a broken rule is
    detected.
    """
    c, g = dec.config, dec.gamma
    if dec.drafter is None or c.scheduler == "none":
        return jnp.zeros(survival.shape[:1], jnp.int32)
    # The arms' parameters; the rules themselves live in sched/policies.py.
    params = {
        "fixed": {"length": g if c.fixed_length is None else min(c.fixed_length, g)},
        "threshold": {"threshold": c.threshold},
        "prefix": {"sps_table": sps_table},
        "topk": {"budget": budget},
    }[c.scheduler]
    if c.scheduler == "topk" and limit is not None:
        # A data replica's own budget k_d <= the common bucket (decode.replicas).
        return jnp.where(active, admit_topk(survival, budget, active, limit=limit).lengths, 0)
    lengths = policies.get_scheduler(c.scheduler)(survival, active, **params).lengths
    return jnp.where(active, lengths, 0)
