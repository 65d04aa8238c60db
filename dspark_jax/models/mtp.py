"""MTP-1 drafter baseline (DeepSeek-V3 style, DESIGN §3.5).

State t: ``s_t = W_p [hnorm(h_t); enorm(embed(x_{t+1}))]`` where ``h_t`` is the target's
final (normed) hidden state at position t — the context feature of MTP-1 is that hidden
state, not a tap — and ``x_{t+1}`` the next token. One Qwen3 decoder layer runs causally
over the states, then a final RMSNorm and the shared (frozen) target LM head; the output
at t predicts ``x_{t+2}``. Embedding and head are the target's.

Drafting: with the anchor at position ``c = ctx_len``, the state at ``t = c-1`` pairs
``h_{c-1}`` with the anchor and proposes the single token at ``c+1``, attending to the
states ``t <= c-1``: recomputed from features and tokens every round (uncached), or read
from the decode step's paged K/V of the states (``DraftContext.cached``: state t's K/V
written once, when x_{t+1} is committed, ``context_cache``) with the slot's last state
``s_{c-1}`` as the query.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.models.backbone import DraftDecoderLayer, apply_lm_head, embed_tokens, kv_rows
from dspark_jax.models.draft_api import (
    DrafterModule,
    DraftOutput,
    next_tokens,
)
from dspark_jax.models.dspark import _check, draft_qwen3_config
from dspark_jax.models.eagle3 import _gather_rows, causal_mask, shift_left
from dspark_jax.models.qwen3 import Projection, RMSNorm
from dspark_jax.ops.sampling import split_keys

Array = jax.Array


class MTPDrafter(DrafterModule):
    """MTP-1 drafter. Entry points: ``train_forward`` and ``draft`` (one token)."""

    label = "MTP-1"

    def setup(self):
        cfg, tgt = self.config, self.target
        if cfg.kind != "mtp1":
            raise ValueError("MTPDrafter needs an mtp1 DrafterConfig")
        if cfg.resolved_num_layers != 1:
            raise ValueError(f"MTP-1 uses one block; got num_layers={cfg.num_layers}")
        self.qcfg = draft_qwen3_config(tgt, 1)
        kw = dict(eps=tgt.rms_norm_eps, dtype=tgt.compute_dtype, param_dtype=tgt.weight_dtype)
        self.hnorm = RMSNorm(**kw)
        self.enorm = RMSNorm(**kw)
        # W_p: 2d -> d (DeepSeek-V3 ``eh_proj``); the "taps" axis names the 2 concatenated inputs.
        self.eh_proj = Projection(
            features=(tgt.hidden_size,),
            in_axes=("taps",),
            out_axes=("embed",),
            dtype=tgt.compute_dtype,
            param_dtype=tgt.weight_dtype,
        )
        self.layers_0 = DraftDecoderLayer(self.qcfg)
        self.norm = RMSNorm(**kw)

    def _states(self, hidden: Array, next_ids: Array, embed) -> Array:
        d = self.target.hidden_size
        _check(
            hidden.shape[-1] == d,
            f"MTP-1 context features are the target's final hidden states (last dim {d}); "
            f"got last dim {hidden.shape[-1]}",
        )
        e = embed_tokens(embed, next_ids, d, self.qcfg.compute_dtype)
        return self.eh_proj(jnp.concatenate([self.hnorm(hidden), self.enorm(e)], axis=-1))

    def train_forward(self, context_feats, tokens, valid, embed, lm_head):
        """``context_feats [S, T, d]`` (target final hidden), ``tokens [S, T]``, ``valid [S, T]``
        -> logits ``[S, T, V]``; position t predicts the token at ``t + 2``."""
        s, t = tokens.shape
        _check(
            context_feats.shape[:2] == (s, t),
            f"context_feats {context_feats.shape} vs tokens {tokens.shape}",
        )
        _check(valid.shape == (s, t), f"valid must be {(s, t)}, got {valid.shape}")
        states = self._states(context_feats, shift_left(tokens.astype(jnp.int32), 1), embed)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
        layer = self.layers_0
        h, _ = layer(layer.attn_input(states), states, pos, [], "block", causal_mask(valid))
        return apply_lm_head(lm_head, self.norm(h), self.target.vocab_size)

    def context_cache(self, context_feats, positions, next_ids, embed):
        """The states' K/V ``[..., T, 1, 2·KV, D]`` and the states ``s_t`` ``[..., T, d]``
        (the decode step keeps the last as the draft query) for final hidden states
        ``[..., T, d]`` at ``positions``, paired with ``next_ids`` (x_{t+1})."""
        states = self._states(context_feats, next_ids, embed)
        layer = self.layers_0
        k, v = layer.context_kv(layer.attn_input(states), positions)
        return kv_rows(k, v)[..., None, :, :], states

    def _draft(self, context, anchor_tokens, rng, sampling, embed, lm_head) -> DraftOutput:
        """One draft token per slot: ``DraftOutput`` with ``tokens [R, 1]``, ``probs [R, 1, V]``.

        ``context.rows [R, M, d]`` / ``context.tokens [R, M]``: final hidden states and
        tokens of committed positions ``0..length-1`` (``length >= 1``); anchor at
        ``length``; or (cached) the states' paged K/V and ``context.query``. The token uses
        ``split(rng, 1)[0]`` (same convention as DSpark).
        """
        layer = self.layers_0
        last = context.length.astype(jnp.int32) - 1
        if context.cached:  # the last state's K/V are in the pages: nothing is written
            q_state = context.query[:, None].astype(self.qcfg.compute_dtype)
            shape = context.rows.shape
            h, _ = layer.paged_step(
                layer.attn_input(q_state), q_state, context.rows.reshape(shape[1:]), 0,
                context.page_table, last[:, None], None, context.attention,
                context.heads_axis,
            )  # fmt: skip
            return self._sample(h, rng, sampling, lm_head)
        r, m = context.rows.shape[:2]
        context_feats, context_tokens = context.rows, context.tokens
        ctx_len = context.length.astype(jnp.int32)
        states = self._states(
            context_feats, next_tokens(context_tokens, anchor_tokens, ctx_len), embed
        )
        pos = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (r, m))
        k_all, v_all = layer.context_kv(layer.attn_input(states), pos)
        q_state = _gather_rows(states, last)
        h, _ = layer(
            layer.attn_input(q_state),
            q_state,
            last[:, None],
            [(k_all, v_all, (pos < ctx_len[:, None])[:, None, :])],
            "none",
        )
        return self._sample(h, rng, sampling, lm_head)

    def _sample(self, h, rng, sampling, lm_head) -> DraftOutput:
        logits = apply_lm_head(lm_head, self.norm(h), self.target.vocab_size)  # [R, 1, V]
        tok, p_tok, probs, top = sampling.draw(split_keys(rng, 1)[0], logits[:, 0])
        return DraftOutput(
            tok[:, None], p_tok[:, None], probs[:, None], None, max_logprobs=top[:, None]
        )
