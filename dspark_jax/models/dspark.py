"""DSpark and DFlash drafters (DESIGN §3.2–3.4).

Conventions (checked against DeepSpec ``deepspec/modeling/dspark`` and its evaluator):

* Target position t's tap features are the target's hidden states after consuming token t.
* A block is anchored at ``anchor_pos``: the anchor token (at ``anchor_pos``) is the block's
  first input, followed by γ-1 MASK tokens, at RoPE positions ``anchor_pos + 0..γ-1``.
  The block sees context features of positions ``< anchor_pos`` only (the target has not
  consumed the anchor yet). Output k (0-based) predicts the token at ``anchor_pos + k + 1``.
* Training: ``block_tokens[n] = tokens[anchor_pos : anchor_pos + γ]`` (true tokens). The
  anchor feeds the backbone; ``block_tokens[:, k]`` is the teacher-forced ``x_{k-1}`` of
  output k (1-based ``k``), so labels are ``tokens[anchor_pos + 1 : anchor_pos + γ + 1]``.
* Drafting: ``context_feats[r, :ctx_len[r]]`` hold the tap features of committed positions
  ``0 .. ctx_len-1``; the anchor (last committed token, not yet run through the target) is
  at position ``ctx_len``. Drafts are tokens at ``ctx_len + 1 .. ctx_len + γ``.

DFlash (DeepSpec's baseline) is the same module with no sequential head and no confidence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.models import heads as H
from dspark_jax.models.backbone import ParallelBackbone, apply_lm_head, embed_tokens
from dspark_jax.models.draft_api import (
    DrafterModule,
    DraftOutput,
    SamplingSettings,
)
from dspark_jax.models.qwen3 import Qwen3Config
from dspark_jax.ops.sampling import split_keys

Array = jax.Array


def draft_qwen3_config(target: Qwen3Config, num_layers: int) -> Qwen3Config:
    """The drafter's layer shapes: the target's width/heads with the drafter's depth."""
    return target.replace(num_hidden_layers=num_layers)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def sample_scan(step_fn, prev0, extra0, per_step, rng, gamma, sampling: SamplingSettings):
    """Left-to-right sampling inside ``lax.scan``; step k draws with ``split(rng, γ)[k]``.

    ``step_fn(prev [R], extra, xs) -> (extra, logits [R, V], conf [R] | None)`` is pure (no
    Linen module calls). ``prev`` starts at ``prev0`` (the anchor) and is then the token
    just sampled. Returns tokens/token_probs ``[R, γ]``, probs ``[R, γ, V]``, conf
    ``[R, γ]`` or ``None``, and each position's ``max_logprob`` ``[R, γ]``.
    """
    keys = split_keys(rng, gamma)

    def body(carry, xs):
        prev, extra = carry
        key, inner = xs
        extra, logits, conf = step_fn(prev, extra, inner)
        tok, p_tok, probs, top = sampling.draw(key, logits)
        return (tok, extra), (tok, p_tok, probs, conf, top)

    _, (toks, p_toks, probs, confs, tops) = jax.lax.scan(body, (prev0, extra0), (keys, per_step))
    confs = None if confs is None else confs.T
    return toks.T, p_toks.T, jnp.swapaxes(probs, 0, 1), confs, tops.T


class DSparkDrafter(DrafterModule):
    """DSpark (and DFlash) drafter. Build with ``drafters.make_drafter``.

    Entry points (``apply(..., method=...)``): ``train_forward`` and ``draft``.
    """

    label = "DSpark"

    def setup(self):
        cfg, tgt = self.config, self.target
        if cfg.kind not in ("dspark", "dflash") or cfg.taps is None or cfg.mask_token_id is None:
            raise ValueError(
                "DSparkDrafter needs a resolved dspark/dflash DrafterConfig "
                "(use drafters.make_drafter)"
            )
        self.qcfg = draft_qwen3_config(tgt, cfg.resolved_num_layers)
        self.backbone = ParallelBackbone(self.qcfg, num_taps=len(cfg.taps))
        self.head_kind = cfg.resolved_head
        if self.head_kind != "none":
            self.markov_head = H.SequentialHead(
                kind=self.head_kind,
                vocab_size=tgt.vocab_size,
                rank=cfg.head_rank,
                hidden_size=tgt.hidden_size,
                init=cfg.head_init,
                param_dtype=tgt.weight_dtype,
            )
        self.use_prev_in_conf = (
            cfg.has_confidence and cfg.confidence_with_prev and self.head_kind != "none"
        )
        if cfg.has_confidence:
            in_dim = tgt.hidden_size + (cfg.head_rank if self.use_prev_in_conf else 0)
            self.confidence_head = H.ConfidenceHead(in_dim, param_dtype=tgt.weight_dtype)

    # -- shared pieces --------------------------------------------------------------------
    def _block_embeds(self, anchor_tokens: Array, embed) -> Array:
        n = anchor_tokens.shape[0]
        gamma = self.config.gamma
        ids = jnp.concatenate(
            [
                anchor_tokens[:, None].astype(jnp.int32),
                jnp.full((n, gamma - 1), self.config.mask_token_id, jnp.int32),
            ],
            axis=1,
        )
        return embed_tokens(embed, ids, self.target.hidden_size, self.qcfg.compute_dtype)

    def _tables(self):
        head = self.markov_head.tables() if self.head_kind != "none" else None
        conf = self.confidence_head.tables() if self.config.has_confidence else None
        return head, conf

    def _confidence(self, conf_tables, head_tables, h: Array, prev: Array) -> Array:
        prev_emb = H.prev_embedding(head_tables, prev) if self.use_prev_in_conf else None
        return H.confidence_logit(conf_tables, h, prev_emb)

    # -- training -------------------------------------------------------------------------
    def train_forward(
        self,
        context_feats: Array,
        ctx_valid: Array,
        block_tokens: Array,
        block_seq: Array,
        anchor_pos: Array,
        embed,
        lm_head,
        return_hidden: bool = False,
    ):
        """Teacher-forced forward over packed blocks (anchor-bounded packing, DESIGN §4).

        Args:
          context_feats: ``[S, T, m·d]`` target tap features of S sequences (position = column).
          ctx_valid: ``[S, T]`` bool, False for padding columns.
          block_tokens: ``[N, γ]`` true tokens at ``anchor_pos .. anchor_pos+γ-1``.
          block_seq: ``[N]`` sequence (row of ``context_feats``) of each block.
          anchor_pos: ``[N]`` anchor position of each block.
          embed, lm_head: the frozen target embedding / LM head (arrays or callables);
            ``lm_head=None`` leaves the LM-head term ``lm_head(h)`` out of the returned
            logits (None when nothing else is left) for the caller to add, e.g. outside a
            vmap whose batch split would otherwise pin the head's rows.

        Block n attends to context rows ``(block_seq[n], t)`` with ``t < anchor_pos[n]`` and
        ``ctx_valid``, and to its own γ tokens; never to other blocks. Cost per layer:
        context K/V once per context token; scores ``N·γ × S·T`` (vmap this method over
        groups of sequences to bound it).

        Returns ``(draft_logits [N, γ, V] float32 (head-corrected), confidence_logits
        [N, γ] or None)``; with ``return_hidden`` also the backbone states ``[N, γ, d]``.
        """
        cfg, tgt = self.config, self.target
        s, t = context_feats.shape[:2]
        n = block_tokens.shape[0]
        _check(
            context_feats.ndim == 3, f"context_feats must be [S, T, m·d], got {context_feats.shape}"
        )
        _check(ctx_valid.shape == (s, t), f"ctx_valid must be {(s, t)}, got {ctx_valid.shape}")
        _check(
            block_tokens.shape == (n, cfg.gamma),
            f"block_tokens must be [N, gamma={cfg.gamma}], got {block_tokens.shape}",
        )
        _check(block_seq.shape == (n,), f"block_seq must be [{n}], got {block_seq.shape}")
        _check(anchor_pos.shape == (n,), f"anchor_pos must be [{n}], got {anchor_pos.shape}")

        h_ctx = self.backbone.context(context_feats)  # [S, T, d]
        ctx_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (s, t))
        ctx_seq = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[:, None], (s, t))
        # Token-level indices -> mask [N, S·T]: own sequence, strictly before the anchor.
        ctx_mask = (
            (ctx_seq.reshape(-1)[None, :] == block_seq[:, None])
            & (ctx_pos.reshape(-1)[None, :] < anchor_pos[:, None])
            & ctx_valid.reshape(-1)[None, :]
        )
        block_pos = anchor_pos[:, None].astype(jnp.int32) + jnp.arange(cfg.gamma, dtype=jnp.int32)
        h = self.backbone(
            self._block_embeds(block_tokens[:, 0], embed),
            block_pos,
            h_ctx,
            ctx_pos,
            ctx_mask,
            shared_context=True,
        )
        logits = None if lm_head is None else apply_lm_head(lm_head, h, tgt.vocab_size)
        head_t, conf_t = self._tables()
        prev = block_tokens.astype(jnp.int32)  # x_{k-1} for outputs k = 1..γ
        if head_t is not None:
            bias = H.teacher_forced_bias(self.head_kind, head_t, prev, h)
            logits = bias if logits is None else logits + bias
        conf = None if conf_t is None else self._confidence(conf_t, head_t, h, prev)
        return (logits, conf, h) if return_hidden else (logits, conf)

    # -- drafting -------------------------------------------------------------------------
    def _draft(self, context, anchor_tokens, rng, sampling, embed, lm_head) -> DraftOutput:
        """Draft γ tokens per slot (the drafting half of the decode step, DESIGN §5.2).

        ``context.rows``: tap features ``[R, M, m·d]`` of committed positions
        ``0..length-1``, or (``cached=True``) the paged K/V ``context_cache`` computed for
        them (``ParallelBackbone.from_paged_cache``); both give the same drafts, the cached
        rows without re-projecting the whole context every round. ``sampling``: scalars
        or ``[R]`` (temperature 0 = greedy argmax). ``embed``, ``lm_head``: the frozen
        target's.
        """
        r, m = context.slots_and_rows
        ctx_len = context.length
        block_pos = ctx_len[:, None].astype(jnp.int32) + jnp.arange(
            self.config.gamma, dtype=jnp.int32
        )
        block = self._block_embeds(anchor_tokens, embed)
        if context.cached:
            writable = context.writable
            if writable is None:
                writable = jnp.ones((r,), bool)
            h, pages = self.backbone.from_paged_cache(
                block, block_pos, context.rows, context.page_table, writable,
                context.attention, context.heads_axis,
            )  # fmt: skip
            return self._sample_block(h, anchor_tokens, rng, sampling, lm_head)._replace(
                context=pages
            )
        ctx_mask = jnp.arange(m, dtype=jnp.int32)[None, :] < ctx_len[:, None]
        h_ctx = self.backbone.context(context.rows)
        ctx_pos = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (r, m))
        h = self.backbone(block, block_pos, h_ctx, ctx_pos, ctx_mask, shared_context=False)
        return self._sample_block(h, anchor_tokens, rng, sampling, lm_head)

    # -- the per-slot context K/V cache (the decode step's path) --------------------------
    def context_cache(self, context_feats, positions, next_ids=None, embed=None):
        """Context K/V of every draft layer for tap features ``[..., T, m·d]`` at absolute
        ``positions [..., T]``: ``([..., T, layers, 2·KV, D], None)`` (see
        ``ParallelBackbone``; a position's K/V need neither the next token nor a last-state
        query, the ``DrafterModule.context_cache`` signature's other parts)."""
        return self.backbone.context_cache(context_feats, positions), None

    def _sample_block(self, h, anchor_tokens, rng, sampling, lm_head):
        """LM head over the block's states, then the sequential head's left-to-right scan."""
        cfg, tgt = self.config, self.target
        r = h.shape[0]
        # The LM head runs once over all γ positions (matrix-matrix); the scan only adds the
        # head's rank-r correction per token.
        base = apply_lm_head(lm_head, h, tgt.vocab_size)  # [R, γ, V]
        head_t, conf_t = self._tables()
        kind, use_prev = self.head_kind, self.use_prev_in_conf

        def step(prev, state, xs):
            u_k, h_k = xs
            logits = u_k
            if head_t is not None:
                state, bias = H.head_step(kind, head_t, state, prev, h_k)
                logits = logits + bias
            conf = None
            if conf_t is not None:
                prev_emb = H.prev_embedding(head_t, prev) if use_prev else None
                conf = H.confidence_logit(conf_t, h_k, prev_emb)
            return state, logits, conf

        state0 = H.init_state(kind, head_t, (r,)) if head_t is not None else jnp.zeros((r, 0))
        toks, p_toks, probs, confs, tops = sample_scan(
            step,
            anchor_tokens.astype(jnp.int32),
            state0,
            (jnp.swapaxes(base, 0, 1), jnp.swapaxes(h, 0, 1)),
            rng,
            cfg.gamma,
            sampling,
        )
        return DraftOutput(toks, p_toks, probs, confs, max_logprobs=tops)
