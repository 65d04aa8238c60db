"""What every drafter's ``draft`` entry point takes and returns (DESIGN §5.2).

All drafters share one signature::

    module.apply({"params": p}, context: DraftContext, anchor_tokens [R], rng,
                 sampling: SamplingSettings, embed, lm_head, method="draft") -> DraftOutput

``DraftContext.rows`` is what the drafter kind reads of the target per committed position
(``DrafterKind.context``): tap features ``[R, M, len(taps)·d]``, the final hidden state
``[R, M, d]`` (MTP-1), or, with ``cached=True``, the per-layer K/V rows DSpark/DFlash
project once per position (``context_cache``). EAGLE-3 and MTP-1 also read the committed
tokens (``DraftContext.tokens``). Token k of a block is drawn with ``split_keys(rng, G)[k]``
(``rng``: one key, per-slot keys ``[R]``, or ``StepKeys`` the decode step derived).
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import flax.linen as nn
import flax.struct
import jax

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
]


@flax.struct.dataclass
class DraftContext:
    """The committed context of R slots.

    rows: ``[R, M, F]`` features; rows ``>= length`` are ignored. With ``cached``: the
      draft layers' context K/V from ``context_cache`` in pages,
      ``[layers, num_pages, page_size, 2·kv_heads, head_dim]`` (``ops.paged_attention``),
      slot ``r``'s position ``t`` at page ``page_table[r, t // page_size]``.
    length: ``[R]`` valid rows = the anchor's position (``>= 1`` for EAGLE-3/MTP-1).
    tokens: ``[R, M]`` committed tokens (EAGLE-3, MTP-1), else ``None``.
    cached: ``rows`` are paged K/V from ``context_cache`` rather than target features.
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
    """

    tokens: Array
    token_probs: Array
    probs: Array
    confidence_logits: Array | None
    context: Array | None = None

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
    needs_tokens: bool,
    accepts_cached: bool,
) -> tuple[int, int]:
    """The checks every ``draft`` shares; returns ``(R, M)``. Errors name the drafter."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ValueError(f"{drafter} draft: {msg}")

    need(isinstance(context, DraftContext), f"context must be a DraftContext, got {type(context)}")
    need(accepts_cached or not context.cached, "has no context K/V cache (cached=True)")
    if context.cached:
        need(
            context.rows.ndim == 5,
            "cached context must be paged, [layers, num_pages, page_size, 2*KV, D], got "
            f"{context.rows.shape}",
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
    if needs_tokens:
        tokens = context.tokens
        need(tokens is not None, f"needs context_tokens [{r}, {m}] (DraftContext.tokens)")
        need(tokens.shape == (r, m), f"context tokens must be {(r, m)}, got {tokens.shape}")
    return r, m


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
        cached = self.config.kv_context
        # Drafters without a context K/V cache re-run their layer over the committed tokens.
        check_draft_inputs(
            self.label, context, anchor_tokens, embed, lm_head,
            needs_tokens=not cached, accepts_cached=cached,
        )  # fmt: skip
        return self._draft(context, anchor_tokens, rng, sampling, embed, lm_head)

    def _draft(self, context, anchor_tokens, rng, sampling, embed, lm_head) -> DraftOutput:
        raise NotImplementedError
