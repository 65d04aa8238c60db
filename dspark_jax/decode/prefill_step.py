"""Prefill (DESIGN §5.2): prompts into their slots' pages, the first token sampled, the
drafter's context written, each row's random stream set. ``SpeculativeDecoder.prefill``
builds the rows; this is the computation it compiles (per data replica with
``decode.replicas``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.decode.keys import select_keys
from dspark_jax.decode.state import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_NONE,
    PrefillOutput,
)
from dspark_jax.models.draft_api import next_tokens
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.ops.sampling import position_keys, process_logits, sample, split_keys

Array = jax.Array

__all__ = ["prefill_step"]


def prefill_step(dec, params, state, rows):
    slots, prompts, lengths, max_new, temperature, top_k, top_p, keys, coupled = rows[:9]
    page_rows = rows[9]
    c = dec.config
    tp = params[0]
    b, t = prompts.shape
    hidden, cache, taps = dec.target.apply(
        {"params": tp},
        prompts,
        lengths,
        page_rows,
        state.cache,
        taps=dec.taps,
        return_hidden=True,
        method=Qwen3.prefill,
    )
    last_h = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    logits = dec._lm_head_fn(tp)(last_h)
    # The row's stream: one split for the first token, the rest is the slot's key. A
    # coupled row keeps its key and draws the token at position ``length`` from it.
    base = jax.random.wrap_key_data(keys.astype(jnp.uint32))
    split = split_keys(base, 2)
    coupled = coupled.astype(bool)
    if c.sampling:
        probs = process_logits(logits, temperature, top_k, top_p)
        first_key = select_keys(coupled, position_keys(base, lengths[:, None])[:, 0], split[1])
        first = sample(first_key, probs)
    else:
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    next_keys = select_keys(coupled, base, split[0])

    # Drafter context: the K/V of prompt positions 0..len-1 (the state at len-1 pairs
    # with the first sampled token) and the last context state.
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    ctx_feats, ctx_query = state.ctx_feats, state.ctx_query
    if dec.drafter is not None:
        write = jnp.where(pos < lengths[:, None], pos, c.max_len)
        next_ids = next_tokens(prompts, first, lengths) if dec.next_token_states else None
        kv, states = dec._context_rows(params, taps, hidden, pos, next_ids)
        # Row b's pages are page_rows[b] (the state's table is updated below).
        table_rows = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, t))
        ctx_feats = dec._write_context(ctx_feats, table_rows, write, kv, page_rows)
        if states is not None:
            last = jnp.take_along_axis(states, (lengths - 1)[:, None, None], axis=1)[:, 0]
            ctx_query = ctx_query.at[slots].set(last.astype(ctx_query.dtype), mode="drop")

    finish = jnp.where(
        first == c.eos_id,
        FINISH_EOS,
        jnp.where((max_new <= 1) | (lengths + 1 >= c.max_len), FINISH_LENGTH, FINISH_NONE),
    ).astype(jnp.int32)

    # Rows aimed at slot >= num_slots (batch padding) write nothing: every scatter here
    # and in the caches drops out-of-range indices.
    def put(x, v):
        return x.at[slots].set(v, mode="drop")

    state = state._replace(
        cache=cache,
        page_table=put(state.page_table, page_rows),
        ctx_feats=ctx_feats,
        ctx_query=ctx_query,
        seq_len=put(state.seq_len, lengths),
        anchor=put(state.anchor, first),
        active=put(state.active, finish == FINISH_NONE),
        remaining=put(state.remaining, max_new - 1),
        temperature=put(state.temperature, temperature),
        top_k=put(state.top_k, top_k),
        top_p=put(state.top_p, top_p),
        slot_keys=put(state.slot_keys, jax.random.key_data(next_keys)),
        coupled=put(state.coupled, coupled),
    )
    return state, PrefillOutput(first, finish, *dec._logprobs(logits, first))
