"""What every drafter's ``draft`` entry point takes and returns (DESIGN §5.2).

All drafters share one signature::

    module.apply({"params": p}, context: DraftContext, anchor_tokens [R], rng,
                 sampling: SamplingSettings, embed, lm_head, method="draft") -> DraftOutput

``DraftContext.rows`` is what the drafter kind reads of the target per committed position
(``DrafterKind.context``): tap features ``[R, M, len(taps)·d]`` or the final hidden state
``[R, M, d]`` (MTP-1), which every draft re-projects; or, with ``cached=True``, the draft
layers' K/V rows in pages, computed once per committed position (``context_cache``; the
decode step's layout). Uncached, EAGLE-3 and MTP-1 also read the committed tokens
(``DraftContext.tokens``: their states pair a position with the next token); cached, they
read each slot's last context state (``DraftContext.query``) instead. Token k of a block
is drawn with ``split_keys(rng, G)[k]`` (``rng``: one key, per-slot keys ``[R]``, or
``StepKeys`` the decode step derived).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.qwen3 import Qwen3Config
from dspark_jax.ops.sampling import SamplingSettings

Array = jax.Array

__all__ = [
    "DraftContext",
    "DraftOutput",
    "DrafterModule",
    "SamplingSettings",
    "check_draft_inputs",
    "next_tokens",
]


@flax.struct.dataclass
class DraftContext:
    """The committed context of R slots.

    rows: ``[R, M, F]`` features; rows ``>= length`` are ignored. With ``cached``: the
      draft layers' context K/V from ``context_cache`` in pages,
      ``[layers, num_pages, page_size, 2·kv_heads, head_dim]`` (``ops.paged_attention``),
      slot ``r``'s position ``t`` at page ``page_table[r, t // page_size]``.
    length: ``[R]`` valid rows = the anchor's position (``>= 1`` for EAGLE-3/MTP-1).
    tokens: ``[R, M]`` committed tokens (uncached EAGLE-3, MTP-1), else ``None``.
    cached: ``rows`` are paged K/V from ``context_cache`` rather than target features.
    query: ``[R, d]`` (cached EAGLE-3, MTP-1): each slot's last context state, the one at
      ``length - 1`` that pairs with the anchor (``context_cache``'s second output).
    page_table: ``[R, pages_per_seq]`` (``cached`` only): it must cover ``length + γ``
      positions, where the draft writes its block's K/V.
    writable: ``[R]`` bool (``cached`` only): slots that own their pages and may write
      the block's K/V (a finished slot may not); None: all.
    attention: the paged attention backend (``ops.paged_attention``), and
    heads_axis: the mesh axis its heads are split over (``cached`` only).
    """

    rows: Array
    length: Array
    tokens: Array | None = None
    cached: bool = flax.struct.field(pytree_node=False, default=False)
    query: Array | None = None
    page_table: Array | None = None
    writable: Array | None = None
    attention: str = flax.struct.field(pytree_node=False, default="xla")
    heads_axis: str | None = flax.struct.field(pytree_node=False, default=None)

    @property
    def slots_and_rows(self) -> tuple[int, int]:
        """``(R, M)``: slots and context positions per slot, whichever the layout."""
        if self.cached:
            return self.page_table.shape[0], self.page_table.shape[1] * self.rows.shape[2]
        return self.rows.shape[0], self.rows.shape[1]


class DraftOutput(NamedTuple):
    """One round of drafts for R slots.

    tokens: ``[R, G]`` int32 draft tokens (G = γ, or 1 for MTP-1).
    token_probs: ``[R, G]`` draft probability of each sampled token.
    probs: ``[R, G, V]`` processed draft distribution each token was sampled from (``p_d``
      for rejection sampling; a point mass at temperature 0).
    confidence_logits: ``[R, G]`` raw confidence logits ``z_k`` (apply STS temperatures,
      then σ), or ``None`` without a confidence head.
    context: the paged context K/V after the draft's writes (``DraftContext.cached``; the
      block K/V past each slot's context), which the caller keeps; else ``None``.
    max_logprobs: ``[R, G]`` float32 ``log max_v q_k(v)`` of the *untempered* draft
      distribution at each position (``ops.sampling.max_logprob``), the input of the
      draft-probability survival estimate; it depends on ``x_{<k}`` only, never on the
      drafted ``x_k`` (DESIGN §3.4's non-anticipation).
    """

    tokens: Array
    token_probs: Array
    probs: Array
    confidence_logits: Array | None
    context: Array | None = None
    max_logprobs: Array | None = None

    @property
    def confidence(self) -> Array | None:
        """``c_k = σ(z_k)`` (uncalibrated)."""
        return None if self.confidence_logits is None else jax.nn.sigmoid(self.confidence_logits)


def check_draft_inputs(
    drafter: str,
    context: DraftContext,
    anchor_tokens: Array,
    embed,
    lm_head,
    *,
    kv_shape: tuple[int, int, int, int],
    next_token_states: bool,
    query_width: int = 0,
) -> tuple[int, int]:
    """The checks every ``draft`` shares; returns ``(R, M)``. Errors name the drafter."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"{drafter} draft: {msg}")

    need(isinstance(context, DraftContext), f"context must be a DraftContext, got {type(context)}")
    if context.cached:
        need(
            context.rows.ndim == 5,
            "cached context must be paged, [layers, num_pages, page_size, 2*KV, D], got "
            f"{context.rows.shape}",
        )
        layers, _, kv, d = kv_shape
        shape = context.rows.shape
        need(
            (shape[0], shape[3], shape[4]) == (layers, 2 * kv, d),
            f"context cache has shape {shape}, expected [layers, num_pages, page_size, "
            f"2*kv_heads, head_dim] with layers = {layers}, 2*kv_heads = {2 * kv}, "
            f"head_dim = {d}",
        )
        need(
            context.page_table is not None and context.page_table.ndim == 2,
            "a cached context needs its page table [R, pages_per_seq] (DraftContext.page_table)",
        )
    else:
        need(context.rows.ndim == 3, f"context rows must be [R, M, F], got {context.rows.shape}")
    r, m = context.slots_and_rows
    need(context.length.shape == (r,), f"context length must be [{r}], got {context.length.shape}")
    need(anchor_tokens.shape == (r,), f"anchor_tokens must be [{r}], got {anchor_tokens.shape}")
    need(embed is not None and lm_head is not None, "needs embed and lm_head")
    if next_token_states and context.cached:
        query = context.query
        need(query is not None, f"a cached context needs the last states [{r}, {query_width}] "
             "(DraftContext.query)")  # fmt: skip
        need(query.shape == (r, query_width), f"context query must be {(r, query_width)}, "
             f"got {query.shape}")  # fmt: skip
    elif next_token_states:
        tokens = context.tokens
        need(tokens is not None, f"needs context_tokens [{r}, {m}] (DraftContext.tokens)")
        need(tokens.shape == (r, m), f"context tokens must be {(r, m)}, got {tokens.shape}")
    return r, m


def next_tokens(context_tokens: Array, anchor_tokens: Array, ctx_len: Array) -> Array:
    """``[R, M]``: the token following each context position (x_{t+1}); the anchor at
    ``t = ctx_len-1``; 0 beyond."""
    r, m = context_tokens.shape
    t = jnp.arange(m, dtype=jnp.int32)[None, :]
    shifted = jnp.concatenate(
        [context_tokens[:, 1:], jnp.zeros((r, 1), context_tokens.dtype)], axis=1
    )
    out = jnp.where(t + 1 < ctx_len[:, None], shifted, 0)
    out = jnp.where(t + 1 == ctx_len[:, None], anchor_tokens[:, None], out)
    return out.astype(jnp.int32)


class DrafterModule(nn.Module):
    """Base of every drafter module: the fields they share and the one ``draft`` entry
    point, which checks its inputs and calls the kind's ``_draft``. Subclasses also
    implement ``train_forward`` (its inputs differ by kind: blocks vs. every position)."""

    config: DrafterConfig  # resolved (DrafterConfig.resolve); build with make_drafter
    target: Qwen3Config
    label: ClassVar[str] = "drafter"  # names the drafter in error messages

    def draft(
        self,
        context: DraftContext,
        anchor_tokens: Array,
        rng: Array,
        sampling: SamplingSettings,
        embed,
        lm_head,
    ) -> DraftOutput:
        """One round of drafts for R slots (DESIGN §5.2); see the module docstring."""
        cfg = self.config
        check_draft_inputs(
            self.label, context, anchor_tokens, embed, lm_head,
            kv_shape=cfg.context_kv_shape(self.target), next_token_states=cfg.next_token_states,
            query_width=cfg.query_width(self.target),
        )  # fmt: skip
        return self._draft(context, anchor_tokens, rng, sampling, embed, lm_head)

    def _draft(self, context, anchor_tokens, rng, sampling, embed, lm_head) -> DraftOutput:
        raise NotImplementedError

    def context_cache(self, context_feats, positions, next_ids, embed):
        """What the decode step stores per committed position (``DraftContext.cached``):
        ``(kv, query)``, ``kv [..., T, layers, 2·KV, D]`` every draft layer's K/V of the
        context state at ``positions [..., T]`` from features ``[..., T, F]`` (and, for
        ``next_token_states`` kinds, the next tokens ``next_ids [..., T]``), and ``query
        [..., T, d]`` the states themselves (the slot keeps the last one) or ``None``."""
        raise NotImplementedError
