"""Steps 3-4 of a round (``decode.step``'s module docstring): pack each slot's anchor and
admitted drafts into R + K rows, run the target once over them (packed verify), accept
(greedy, rejection sampling or coupled), and commit by lengths: the target cache, the
drafter's context and the per-slot state."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.decode.state import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_NONE,
    DecodeState,
    Plan,
    RoundOutput,
)
from dspark_jax.decode.verify import verify_coupled, verify_greedy, verify_sampling
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.ops.branching import same_on_every_device
from dspark_jax.ops.paged_attention import RaggedLayout
from dspark_jax.ops.sampling import process_logits

Array = jax.Array

__all__ = ["cap_total", "commit_step"]


def commit_step(dec, params, state: DecodeState, plan: Plan, budget: int):
    c, g, r = dec.config, dec.gamma, dec.replica_slots  # per replica (its block)
    tp = params[0]
    n_rows = r + budget
    draft_tokens, draft_probs = plan.draft_tokens, plan.draft_probs
    verify_key = plan.verify_keys
    active = state.active
    lengths = jnp.where(active, cap_total(plan.lengths, budget), 0)

    # --- pack anchor + admitted drafts into R + K rows -----------------------------
    j = jnp.arange(g + 1, dtype=jnp.int32)
    counts = jnp.where(active, lengths + 1, 0)
    offsets = jnp.cumsum(counts) - counts
    included = active[:, None] & (j[None, :] <= lengths[:, None])  # [R, G+1]
    row_of = jnp.where(included, offsets[:, None] + j[None, :], n_rows)
    tokens_rj = jnp.concatenate([state.anchor[:, None], draft_tokens], axis=1)
    pos_rj = state.seq_len[:, None] + j[None, :]
    slot_rj = jnp.broadcast_to(jnp.arange(r, dtype=jnp.int32)[:, None], (r, g + 1))

    def pack(values, fill):
        buf = jnp.full((n_rows,), fill, values.dtype)
        return buf.at[row_of].set(values, mode="drop")

    p_tokens = pack(tokens_rj, 0)
    p_pos = pack(pos_rj, 0)
    p_slot = pack(slot_rj, 0)
    p_valid = pack(included, False)
    # Ragged layout of the packed rows: slot r's rows are offsets[r] … + counts[r] - 1,
    # its last positions; sequences listed active slots first (inactive ones have no
    # rows), so the kernel visits only the num_seqs that verify anything.
    order = jnp.argsort(~active, stable=True)
    seq_of_slot = jnp.argsort(order).astype(jnp.int32)  # a slot's place in that list
    kv_lens = jnp.where(active, state.seq_len + lengths + 1, 0)
    layout = RaggedLayout(
        cu_q_lens=jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts[order])]),
        kv_lens=kv_lens[order].astype(jnp.int32),
        page_table=state.page_table[order],
        num_seqs=jnp.sum(active, dtype=jnp.int32)[None],
    )

    hidden, cache, taps = dec.target.apply(
        {"params": tp},
        p_tokens[:, None],
        p_pos[:, None],
        seq_of_slot[p_slot],
        state.cache,
        layout,
        p_valid[:, None],
        taps=dec.taps,
        return_hidden=True,
        attention=dec.attention,
        method=Qwen3.decode,
    )
    logits = dec._lm_head_fn(tp)(hidden[:, 0])  # [R+K, V]: the LM head runs on packed rows
    gather_rows = jnp.minimum(row_of, n_rows - 1)

    # --- verify --------------------------------------------------------------------
    if c.sampling:
        p_temp, p_k, p_p = (x[p_slot] for x in (state.temperature, state.top_k, state.top_p))
        target_probs = process_logits(logits, p_temp, p_k, p_p)[gather_rows]
        verified = verify_sampling(
            verify_key, draft_tokens, draft_probs, target_probs, lengths, active
        )
        coupled = state.coupled & active
        # The Gumbel noise over [R, γ+1, V] is drawn only in rounds with a coupled slot.
        accepted, next_tok, out_tokens = jax.lax.cond(
            same_on_every_device(jnp.any(coupled)),
            lambda: jax.tree.map(
                lambda a, b: jnp.where(coupled.reshape((-1,) + (1,) * (a.ndim - 1)), a, b),
                verify_coupled(
                    dec._position_keys(state), draft_tokens, target_probs, lengths, active
                ),
                verified,
            ),
            lambda: verified,
        )
    else:
        target_argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)[gather_rows]
        accepted, next_tok, out_tokens = verify_greedy(draft_tokens, target_argmax, lengths, active)

    # --- commit by lengths -----------------------------------------------------------
    committed = included & (j[None, :] <= accepted[:, None])  # anchor + accepted drafts
    write = jnp.where(committed, pos_rj, c.max_len)
    ctx_feats, ctx_query = state.ctx_feats, state.ctx_query
    if dec.drafter is not None:  # only the R + K packed rows are projected
        p_next = None
        if dec.next_token_states:
            # The token after each committed row: the next accepted draft, or for the
            # last committed row the new anchor (EAGLE-3/MTP-1 states pair a row with it).
            following = jnp.concatenate([tokens_rj[:, 1:], next_tok[:, None]], axis=1)
            next_rj = jnp.where(j[None, :] == accepted[:, None], next_tok[:, None], following)
            p_next = pack(next_rj, 0)[:, None]
        kv, states = dec._context_rows(params, taps, hidden, p_pos[:, None], p_next)
        ctx_feats = dec._write_context(
            ctx_feats, slot_rj, write, kv[:, 0][gather_rows], state.page_table
        )
        if states is not None:  # the state of the last committed row, per active slot
            last_row = jnp.take_along_axis(gather_rows, accepted[:, None], axis=1)[:, 0]
            last = states[last_row, 0].astype(ctx_query.dtype)
            ctx_query = jnp.where(active[:, None], last, ctx_query)

    emitted = jnp.where(active, accepted + 1, 0)
    emitted = jnp.minimum(emitted, state.remaining)
    is_eos = (out_tokens == c.eos_id) & (j[None, :] < emitted[:, None])
    first_eos = jnp.argmax(is_eos, axis=1)
    hit_eos = jnp.any(is_eos, axis=1)
    emitted = jnp.where(hit_eos, first_eos + 1, emitted)
    new_len = state.seq_len + jnp.where(active, accepted + 1, 0)
    remaining = state.remaining - emitted
    out_of_room = new_len + 1 >= c.max_len
    finish = jnp.where(
        ~active,
        FINISH_NONE,
        jnp.where(
            hit_eos,
            FINISH_EOS,
            jnp.where((remaining <= 0) | out_of_room, FINISH_LENGTH, FINISH_NONE),
        ),
    ).astype(jnp.int32)

    new_state = state._replace(
        cache=cache,
        ctx_feats=ctx_feats,
        ctx_query=ctx_query,
        seq_len=jnp.where(active, new_len, state.seq_len),
        anchor=jnp.where(active, next_tok, state.anchor),
        active=active & (finish == FINISH_NONE),
        remaining=remaining,
        slot_keys=plan.slot_keys,
    )
    # Row j of a slot's output was predicted by its packed row j (anchor, then drafts).
    logprobs, top_ids, top_lps = dec._logprobs(logits, out_tokens, gather_rows)
    out = RoundOutput(
        tokens=out_tokens,
        num_emitted=emitted,
        accepted=accepted,
        verified=lengths,
        finish=finish,
        survival=plan.survival,
        confidence=plan.confidence,
        draft_tokens=draft_tokens,
        logprobs=logprobs,
        top_ids=top_ids,
        top_logprobs=top_lps,
    )
    return new_state, out


def cap_total(lengths: Array, budget: int) -> Array:
    """Trim per-slot prefixes so that their total fits the verify budget K.

    Trimming removes tokens from the end of the *last* slots first; only reached when a
    scheduler that does not know K (fixed, threshold, prefix) overshoots a smaller bucket.
    The choice depends only on lengths, never on the sampled draft tokens themselves.
    """
    before = jnp.cumsum(lengths) - lengths
    return jnp.clip(budget - before, 0, lengths).astype(jnp.int32)
