"""EAGLE-3 drafter baseline (DESIGN §3.5; layout checked against DeepSpec ``eagle3``).

One decoder layer whose attention input is ``[input_layernorm(embed(x)); hidden_norm(g)]``
(width 2d), residual ``g``; logits = target LM head over ``norm(h)``. ``g`` is
``fc([h_l1; …; h_lm])`` for context states and the layer's own previous output when it
drafts further (it feeds back its hidden state).

State layout. State ``t`` pairs the feature of position t with the *next* token x_{t+1},
sits at RoPE position t and predicts x_{t+2}. With ``c = ctx_len`` (the anchor's position):

* context states ``t = 0..c-1`` (step 0): ``g_t = fc(feats_t)``, token ``x_{t+1}`` (the
  anchor for ``t = c-1``); attention is causal over context states.
* draft step ``i = 1..γ-1``: input ``(h^{(i-1)}, d_i)`` at RoPE position ``c-1+i``; it
  attends to every context state (``t <= c-1``) plus the chain states of steps ``1..i``.
  Step ``i`` proposes ``d_{i+1}`` (the token at position ``c+1+i``).

Training (training-time test, DeepSpec ``compute_eagle3_loss``): the same computation for
every position t of a sequence at once, unrolled over γ steps; step i at t attends to the
step-0 states ``<= t`` and to its own chain (steps ``1..i`` at t).

Drafting reads the context one of two ways (``DraftContext.cached``): target features and
tokens, whose states' K/V it recomputes every round (tests, offline use), or the decode
step's paged K/V of the context states (``context_cache``: state ``t``'s K/V are written
once, when ``x_{t+1}`` is committed) and each slot's last state ``g_{c-1}``. Cached, chain
step ``i`` writes its K/V at position ``c-1+i`` of the slot's pages (past the context,
overwritten when those positions are committed) and reads the pages up to itself, which
is exactly ``[context states ; chain 1..i]``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.models.backbone import DraftDecoderLayer, apply_lm_head, embed_tokens, kv_rows
from dspark_jax.models.draft_api import (
    DrafterModule,
    DraftOutput,
    next_tokens,
)
from dspark_jax.models.dspark import _check, draft_qwen3_config
from dspark_jax.models.qwen3 import Projection, Qwen3Config, RMSNorm
from dspark_jax.ops.sampling import split_keys

Array = jax.Array


def shift_left(tokens: Array, n: int) -> Array:
    """``tokens[:, t+n]`` with zeros past the end."""
    if n == 0:
        return tokens
    pad = jnp.zeros((tokens.shape[0], n), tokens.dtype)
    return jnp.concatenate([tokens[:, n:], pad], axis=1)[:, : tokens.shape[1]]


def causal_mask(valid: Array) -> Array:
    """``[S, T, T]``: query t sees valid keys ``<= t``."""
    t = valid.shape[1]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    return causal[None] & valid[:, None, :]


def _gather_rows(x: Array, idx: Array) -> Array:
    """``x[r, idx[r]]`` keeping a length-1 axis: ``[R, 1, ...]``."""
    return jnp.take_along_axis(x, idx.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)


class _Eagle3Core(nn.Module):
    """The fused-input layer and final norm (a unit so ``nn.scan`` can carry it)."""

    config: Qwen3Config

    def setup(self):
        cfg = self.config
        self.layers_0 = DraftDecoderLayer(cfg, fused_input=True)
        self.norm = RMSNorm(
            eps=cfg.rms_norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype
        )

    def context_kv(self, g: Array, emb: Array, positions: Array):
        return self.layers_0.context_kv(self.layers_0.attn_input(g, emb), positions)

    def paged(self, g, emb, positions, pages, page_table, writable, attention, heads_axis):
        """The layer for one query per slot over the slot's paged states (``paged_step``):
        returns ``(h, pages, norm(h))``."""
        layer = self.layers_0
        h, pages = layer.paged_step(
            layer.attn_input(g, emb), g, pages, 0, page_table, positions, writable,
            attention, heads_axis,
        )  # fmt: skip
        return h, pages, self.norm(h)

    def __call__(self, g, emb, positions, sources, own, own_mask=None):
        layer = self.layers_0
        h, kv = layer(layer.attn_input(g, emb), g, positions, sources, own, own_mask)
        return h, kv, self.norm(h)


class Eagle3Drafter(DrafterModule):
    """EAGLE-3 drafter. Entry points: ``train_forward`` and ``draft``."""

    label = "EAGLE-3"

    def setup(self):
        cfg, tgt = self.config, self.target
        if cfg.kind != "eagle3" or cfg.taps is None:
            raise ValueError("Eagle3Drafter needs a resolved eagle3 DrafterConfig")
        if cfg.resolved_num_layers != 1:
            raise ValueError(
                f"EAGLE-3 uses exactly one decoder layer; got num_layers={cfg.num_layers}"
            )
        self.qcfg = draft_qwen3_config(tgt, 1)
        self.fc = Projection(
            features=(tgt.hidden_size,),
            in_axes=("taps",),
            out_axes=("embed",),
            dtype=tgt.compute_dtype,
            param_dtype=tgt.weight_dtype,
        )
        self.core = _Eagle3Core(self.qcfg)

    def _project(self, feats: Array) -> Array:
        want = len(self.config.taps) * self.target.hidden_size
        _check(
            feats.shape[-1] == want,
            f"context features have last dim {feats.shape[-1]}, expected {len(self.config.taps)} "
            f"taps x hidden_size {self.target.hidden_size} = {want}",
        )
        return self.fc(feats)

    def _embed(self, embed, ids):
        return embed_tokens(embed, ids, self.target.hidden_size, self.qcfg.compute_dtype)

    def train_forward(self, context_feats, tokens, valid, embed, lm_head):
        """Training-time test unrolled over γ steps.

        Args:
          context_feats: ``[S, T, m·d]`` target tap features; tokens: ``[S, T]``;
          valid: ``[S, T]`` bool (False = padding); embed, lm_head: frozen target pieces.

        Returns logits ``[γ, S, T, V]`` (float32): step i at position t predicts the token
        at ``t + 2 + i`` given true tokens up to ``t + 1`` and the drafter's own states for
        the rest (the trainer applies weights ``0.8^i`` and masks targets past the end).
        """
        cfg, tgt = self.config, self.target
        s, t = tokens.shape
        _check(
            context_feats.shape[:2] == (s, t),
            f"context_feats {context_feats.shape} vs tokens {tokens.shape}",
        )
        _check(valid.shape == (s, t), f"valid must be {(s, t)}, got {valid.shape}")
        tokens = tokens.astype(jnp.int32)
        g = self._project(context_feats)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
        mask = causal_mask(valid)
        h, (k0, v0), hn = self.core(
            g, self._embed(embed, shift_left(tokens, 1)), pos, [], "block", mask
        )
        all_logits = [apply_lm_head(lm_head, hn, tgt.vocab_size)]
        chain_k, chain_v = [], []
        for i in range(1, cfg.gamma):
            sources = [(k0, v0, mask)]
            if chain_k:
                ck = jnp.stack(chain_k, axis=2)  # [S, T, i-1, KV, D]
                cv = jnp.stack(chain_v, axis=2)
                sources.append((ck, cv, jnp.ones((1, t, i - 1), bool)))
            h, (k, v), hn = self.core(
                h, self._embed(embed, shift_left(tokens, 1 + i)), pos + i, sources, "self"
            )
            chain_k.append(k)
            chain_v.append(v)
            all_logits.append(apply_lm_head(lm_head, hn, tgt.vocab_size))
        return jnp.stack(all_logits, axis=0)

    def context_cache(self, context_feats, positions, next_ids, embed):
        """The context states' K/V ``[..., T, 1, 2·KV, D]`` and the states' ``g = fc(feats)``
        ``[..., T, d]`` (the decode step keeps the last as the first draft query) for tap
        features ``[..., T, m·d]`` at ``positions``, paired with ``next_ids`` (x_{t+1})."""
        g = self._project(context_feats)
        k, v = self.core.context_kv(g, self._embed(embed, next_ids), positions)
        return kv_rows(k, v)[..., None, :, :], g

    def _draft(self, context, anchor_tokens, rng, sampling, embed, lm_head) -> DraftOutput:
        """Draft γ tokens autoregressively (``lax.scan`` over steps 1..γ-1; cached: steps
        unrolled over the paged states, see the module docstring).

        ``context.rows [R, M, m·d]`` and ``context.tokens [R, M]`` hold the tap features and
        tokens of committed positions ``0..length-1`` (``length >= 1``); the anchor is at
        ``length``. ``confidence_logits`` is ``None``.
        """
        if context.cached:
            return self._draft_cached(context, anchor_tokens, rng, sampling, embed, lm_head)
        cfg, tgt = self.config, self.target
        r, m = context.rows.shape[:2]
        context_feats, context_tokens = context.rows, context.tokens
        ctx_len = context.length.astype(jnp.int32)
        gamma = cfg.gamma
        keys = split_keys(rng, gamma)

        g = self._project(context_feats)
        emb = self._embed(embed, next_tokens(context_tokens, anchor_tokens, ctx_len))
        pos = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (r, m))
        k_all, v_all = self.core.context_kv(g, emb, pos)
        ctx_mask = (pos < ctx_len[:, None])[:, None, :]
        last = ctx_len - 1
        h, _, hn = self.core(
            _gather_rows(g, last),
            _gather_rows(emb, last),
            last[:, None],
            [(k_all, v_all, ctx_mask)],
            "none",
        )

        def pick(hn_q, key):
            return sampling.draw(key, apply_lm_head(lm_head, hn_q[:, 0], tgt.vocab_size))

        tok0, p0, probs0, top0 = pick(hn, keys[0])
        if gamma == 1:
            return DraftOutput(
                tok0[:, None], p0[:, None], probs0[:, None], None, max_logprobs=top0[:, None]
            )

        kvh, hd = tgt.num_key_value_heads, tgt.head_dim
        chain0 = jnp.zeros((r, 1, gamma - 1, kvh, hd), k_all.dtype)
        d, dt = tgt.hidden_size, self.qcfg.compute_dtype
        embed_fn = lambda ids: embed_tokens(embed, ids, d, dt)  # pure: usable inside nn.scan

        def body(core, carry, key):
            prev, hid, ck, cv, i = carry
            chain_mask = (jnp.arange(gamma - 1) < i - 1)[None, None, :]
            h_new, (k, v), hn_new = core(
                hid,
                embed_fn(prev[:, None]),
                (last + i)[:, None],
                [(k_all, v_all, ctx_mask), (ck, cv, chain_mask)],
                "self",
            )
            ck = jax.lax.dynamic_update_slice_in_dim(ck, k[:, :, None].astype(ck.dtype), i - 1, 2)
            cv = jax.lax.dynamic_update_slice_in_dim(cv, v[:, :, None].astype(cv.dtype), i - 1, 2)
            tok, p_tok, probs, top = pick(hn_new, key)
            return (tok, h_new, ck, cv, i + 1), (tok, p_tok, probs, top)

        scan = nn.scan(
            body,
            variable_broadcast="params",
            split_rngs={"params": False},
            length=gamma - 1,
        )
        carry0 = (tok0, h, chain0, chain0, jnp.int32(1))
        _, (toks, p_toks, probs, tops) = scan(self.core, carry0, keys[1:])
        tokens = jnp.concatenate([tok0[:, None], toks.T], axis=1)
        token_probs = jnp.concatenate([p0[:, None], p_toks.T], axis=1)
        all_probs = jnp.concatenate([probs0[:, None], jnp.swapaxes(probs, 0, 1)], axis=1)
        tops = jnp.concatenate([top0[:, None], tops.T], axis=1)
        return DraftOutput(tokens, token_probs, all_probs, None, max_logprobs=tops)

    def _draft_cached(self, context, anchor_tokens, rng, sampling, embed, lm_head):
        """``_draft`` over the paged states: the first query is the slot's last context state
        (``context.query``, at ``length - 1``, its K/V already in the pages); chain step i
        writes its K/V at ``length - 1 + i`` and reads the pages up to there. Returns the
        drafts and the pages with the chain's writes (``DraftOutput.context``)."""
        tgt, gamma = self.target, self.config.gamma
        r = context.page_table.shape[0]
        keys = split_keys(rng, gamma)
        shape = context.rows.shape  # [1, num_pages, page_size, 2·KV, D]
        pages = context.rows.reshape(shape[1:])
        table, attn, axis = context.page_table, context.attention, context.heads_axis
        writable = jnp.ones((r,), bool) if context.writable is None else context.writable
        last = context.length.astype(jnp.int32) - 1
        g_last = context.query[:, None].astype(self.qcfg.compute_dtype)
        h, _, hn = self.core.paged(
            g_last, self._embed(embed, anchor_tokens[:, None]), last[:, None], pages, table,
            None, attn, axis,
        )  # fmt: skip
        outs = []
        for i in range(gamma):
            if i:  # chain step i: the previous state and the token it proposed
                h, pages, hn = self.core.paged(
                    h, self._embed(embed, outs[-1][0][:, None]), (last + i)[:, None], pages,
                    table, writable, attn, axis,
                )  # fmt: skip
            outs.append(sampling.draw(keys[i], apply_lm_head(lm_head, hn[:, 0], tgt.vocab_size)))
        tokens, token_probs, probs, tops = (jnp.stack(x, axis=1) for x in zip(*outs))
        return DraftOutput(tokens, token_probs, probs, None, pages.reshape(shape), tops)
