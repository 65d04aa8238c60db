"""Drafter building blocks: multi-source attention, the drafter decoder layer, and the
parallel block backbone shared by DSpark and DFlash (DESIGN §3.2).

Backbone (DeepSpec ``Qwen3DSparkModel._forward_backbone``):

* ``H_ctx = RMSNorm(W_c [h_l1; …; h_lm])`` (``fc`` then ``hidden_norm``).
* Every draft layer applies its own k/v projections (and the per-head k-norm) to ``H_ctx``
  directly (no input layernorm on the context, as in DeepSpec) and to the block, and
  attends over ``[context ; block]``. Only block tokens are queries; attention inside a
  block is bidirectional; a block sees context positions strictly before its anchor.
* RoPE: context keys at their absolute positions, block tokens at ``anchor_pos + 0..γ-1``.
* A final RMSNorm (``norm``) produces ``h_k``; the *target's* LM head maps it to logits.

The context K/V of a layer depend only on ``H_ctx``, so they are computed once per context
token (not per block): the packed training forward and the draft step differ only in how
blocks index the context (a mask built from token-level indices).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.models.qwen3 import (
    ACT_AXES,
    MLP,
    REMAT_POLICIES,
    Projection,
    Qwen3Config,
    RMSNorm,
    SelfAttention,
    apply_rope,
    rope_tables,
)
from dspark_jax.ops.paged_attention import (
    RaggedLayout,
    block_attention,
    ragged_attention,
)

Array = jax.Array
# (keys, values, mask). keys/values: [C,KV,D] shared by all rows, [B,C,KV,D] per row, or
# [B,Q,C,KV,D] per query; mask broadcastable to [B,Q,C] (True = may attend).
Source = tuple[Array, Array, Array]


# Keys per step of the blocked (online-softmax) path: a source longer than this is read in
# chunks, so the float32 scores alive at once are [.., Q, KEY_CHUNK], not [.., Q, C]
# (training: 32 blocks x 7 queries x 32 heads x the whole 4096-token context per layer).
KEY_CHUNK = 512
_SPECS = {3: "ckd", 4: "bckd", 5: "bqckd"}  # einsum letters of a source's keys/values


def multi_source_attention(q: Array, sources: Sequence[Source]) -> Array:
    """One softmax over the concatenation of several key/value sources.

    ``q``: ``[B, Q, H, D]``. Each source is ``(k, v, mask)`` with k/v shaped ``[C, KV, D]``
    (one set shared by every row, e.g. the flattened context of a packed batch),
    ``[B, C, KV, D]`` (per row) or ``[B, Q, C, KV, D]`` (per query, e.g. an EAGLE-3 chain).
    Splitting the keys this way avoids materialising a dense ``[Q, all keys]`` mask over
    other rows' tokens. Scores and softmax in float32. Returns ``[B, Q, H, D]``.

    When a source has more than ``KEY_CHUNK`` keys, every source is read in chunks with an
    online softmax (running max and sum, the flash-attention recurrence) and each chunk is
    rematerialised in the backward pass, so no ``[Q, C]`` score matrix is stored; the
    result equals the dense softmax up to float rounding (tested).
    """
    for k, _, _ in sources:
        if k.ndim not in _SPECS:
            raise ValueError(f"attention keys must be 3-, 4- or 5-D, got shape {k.shape}")
    if any(k.shape[k.ndim - 3] > KEY_CHUNK for k, _, _ in sources):
        return _blocked_attention(q, sources, KEY_CHUNK)
    b, nq, h, d = q.shape
    kvh = sources[0][0].shape[-2]
    qg = q.reshape(b, nq, kvh, h // kvh, d)
    scores, sizes = [], []
    for k, _, mask in sources:
        s = _masked_scores(qg, k, mask)
        scores.append(s)
        sizes.append(s.shape[-1])
    probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out = 0.0
    start = 0
    for (_, v, _), c in zip(sources, sizes):
        p = probs[..., start : start + c].astype(v.dtype)
        start += c
        out = out + jnp.einsum(
            f"bkgqc,{_SPECS[v.ndim]}->bqkgd", p, v, preferred_element_type=jnp.float32
        )
    return out.reshape(b, nq, h, d).astype(q.dtype)


def _masked_scores(qg: Array, k: Array, mask: Array) -> Array:
    """Scaled float32 scores ``[B, KV, G, Q, C]`` of grouped queries ``qg [B, Q, KV, G, D]``
    against one source's keys, ``finfo.min`` where ``mask`` (``[B, Q, C]``-broadcastable)
    is False."""
    b, nq, _, _, d = qg.shape
    s = jnp.einsum(
        f"bqkgd,{_SPECS[k.ndim]}->bkgqc", qg, k.astype(qg.dtype),
        preferred_element_type=jnp.float32,
    )  # fmt: skip
    m = jnp.broadcast_to(mask, (b, nq, s.shape[-1]))
    return jnp.where(m[:, None, None], s * (d**-0.5), jnp.finfo(jnp.float32).min)


def _blocked_attention(q: Array, sources: Sequence[Source], chunk: int) -> Array:
    """``multi_source_attention`` by key chunks with an online softmax.

    The running maximum starts at ``finfo.min`` (the masked score), so a query whose keys
    are all masked gets the same uniform average as the dense softmax, and masked keys
    stop counting (their weight is rescaled by ``exp(min - max) = 0``) as soon as a
    visible key appears.
    """
    b, nq, h, d = q.shape
    kvh = sources[0][0].shape[-2]
    g = h // kvh
    qg = q.reshape(b, nq, kvh, g, d)
    neg = jnp.finfo(jnp.float32).min
    state = (
        jnp.full((b, kvh, g, nq), neg, jnp.float32),  # running max
        jnp.zeros((b, kvh, g, nq), jnp.float32),  # running sum of exp
        jnp.zeros((b, kvh, g, nq, d), jnp.float32),  # running weighted values
    )

    @jax.checkpoint
    def step(state, kvm):
        k, v, mask = kvm
        m, total, acc = state
        s = _masked_scores(qg, k, mask)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        scale = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        pv = jnp.einsum(
            f"bkgqc,{_SPECS[v.ndim]}->bkgqd", p.astype(v.dtype), v,
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        return (m_new, total * scale + jnp.sum(p, axis=-1), acc * scale[..., None] + pv)

    for k, v, mask in sources:
        axis = k.ndim - 3  # the key axis: C of [C,KV,D], [B,C,KV,D], [B,Q,C,KV,D]
        c = k.shape[axis]
        mask = jnp.broadcast_to(mask, (b, nq, c))
        if c <= chunk:
            state = step(state, (k, v, mask))
            continue
        n = -(-c // chunk)
        pad = n * chunk - c
        if pad:  # padded keys are masked out
            widths = [(0, 0)] * k.ndim
            widths[axis] = (0, pad)
            k, v = jnp.pad(k, widths), jnp.pad(v, widths)
            mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad)))

        def chunks(x, ax, n=n):  # [.., n·chunk, ..] -> [n, .., chunk, ..]
            x = x.reshape(x.shape[:ax] + (n, chunk) + x.shape[ax + 1 :])
            return jnp.moveaxis(x, ax, 0)

        state, _ = jax.lax.scan(
            lambda st, kvm: (step(st, kvm), None),
            state,
            (chunks(k, axis), chunks(v, axis), chunks(mask, 2)),
        )
    _, total, acc = state
    out = acc / total[..., None]  # [B, KV, G, Q, D]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, nq, h, d).astype(q.dtype)


def kv_rows(k: Array, v: Array) -> Array:
    """Keys and values ``[..., KV, D]`` as one row ``[..., 2·KV, D]`` of the paged cache's
    layout (keys at the even, values at the odd entries; ``ops.paged_attention``)."""
    kv = jnp.stack([k, v], axis=-2)  # [..., KV, 2, D]
    return kv.reshape(kv.shape[:-3] + (-1, kv.shape[-1]))


class DraftDecoderLayer(nn.Module):
    """A Qwen3 decoder layer whose attention takes extra key/value sources.

    Parameter names follow Hugging Face / DeepSpec (``input_layernorm``, ``self_attn``,
    ``post_attention_layernorm``, ``mlp``; plus ``hidden_norm`` when ``fused_input``, the
    EAGLE-3 layer whose attention input is ``[norm(embed(x)); norm(h)]`` of width 2d).
    """

    config: Qwen3Config
    fused_input: bool = False

    def setup(self):
        cfg = self.config
        kw = dict(eps=cfg.rms_norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype)
        self.input_layernorm = RMSNorm(**kw)
        if self.fused_input:
            self.hidden_norm = RMSNorm(**kw)
        self.post_attention_layernorm = RMSNorm(**kw)
        self.self_attn = SelfAttention(cfg)
        self.mlp = MLP(cfg)

    def attn_input(self, h: Array, embeds: Array | None = None) -> Array:
        """The attention input: ``norm(h)``, or ``[norm(embeds); hidden_norm(h)]`` (EAGLE-3)."""
        if self.fused_input:
            return jnp.concatenate([self.input_layernorm(embeds), self.hidden_norm(h)], axis=-1)
        return self.input_layernorm(h)

    def context_kv(self, x: Array, positions: Array) -> tuple[Array, Array]:
        """Keys (k-normed, RoPE at ``positions``) and values of ``x [..., T, in]``."""
        k, v = self.self_attn.kv(x)
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        return apply_rope(k, cos, sin), v

    def __call__(
        self,
        x: Array,
        resid: Array,
        positions: Array,
        sources: Sequence[Source] = (),
        own: str = "block",
        own_mask: Array | None = None,
    ) -> tuple[Array, tuple[Array, Array]]:
        """Attention + MLP for query tokens ``x [B, Q, in]`` with residual ``resid [B, Q, d]``.

        ``own`` says how the queries see each other's keys: ``"block"`` (every query of a row
        sees every key of the row, restricted by ``own_mask [.., Q, Q]`` if given),
        ``"self"`` (each query sees only its own key), or ``"none"``. Returns the layer
        output ``[B, Q, d]`` and the queries' own ``(k, v)`` (RoPE applied).
        """
        q, k, v = self._roped_qkv(x, positions)
        b, nq = x.shape[:2]
        srcs = list(sources)
        if own == "block":
            mask = jnp.ones((1, nq, nq), bool) if own_mask is None else own_mask
            srcs.append((k, v, mask))
        elif own == "self":
            srcs.append((k[:, :, None], v[:, :, None], jnp.ones((1, nq, 1), bool)))
        elif own != "none":
            raise ValueError(f"own must be 'block', 'self' or 'none', got {own!r}")
        if not srcs:
            raise ValueError("attention needs at least one key/value source")
        return self._residual_mlp(resid, multi_source_attention(q, srcs)), (k, v)

    def _roped_qkv(self, x: Array, positions: Array) -> tuple[Array, Array, Array]:
        """The queries' ``q, k, v``, RoPE on ``q`` and ``k`` at ``positions``."""
        cfg = self.config
        q, k, v = self.self_attn.project(x)
        cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _residual_mlp(self, resid: Array, attn: Array) -> Array:
        """Output projection of ``attn`` onto the residual, then the MLP block."""
        h = resid + self.self_attn.output(attn)
        return h + self.mlp(self.post_attention_layernorm(h))

    def block_step(
        self,
        h: Array,
        h_ctx: Array,
        ctx_positions: Array,
        block_positions: Array,
        ctx_mask: Array,
        shared_context: bool,
    ) -> Array:
        """One parallel-backbone layer (``ParallelBackbone``): context K/V of ``h_ctx``,
        then attention of the block ``h`` over ``[context ; block]`` and the MLP.

        The unit that ``nn.remat`` wraps (``Qwen3Config.remat``): it covers the context
        K/V too, the largest per-layer activation of packed training."""
        kc, vc = self.context_kv(h_ctx, ctx_positions)
        if shared_context:
            kc = kc.reshape((-1,) + kc.shape[-2:])
            vc = vc.reshape((-1,) + vc.shape[-2:])
        out, _ = self(self.attn_input(h), h, block_positions, [(kc, vc, ctx_mask)], own="block")
        return out

    def block_step_paged(
        self,
        h: Array,
        ctx_pages: Array,
        layer_offset: int,
        page_table: Array,
        block_positions: Array,
        writable: Array,
        attention: str,
        heads_axis: str | None,
    ) -> tuple[Array, Array]:
        """``block_step`` over the paged context K/V (``ops.paged_attention.block_attention``):
        the block's own K/V are written into the pages after the context, then each slot's
        pages are read once for its whole block. Returns ``(h, ctx_pages)``."""
        return self.paged_step(
            self.attn_input(h), h, ctx_pages, layer_offset, page_table, block_positions,
            writable, attention, heads_axis,
        )  # fmt: skip

    def paged_step(
        self,
        x: Array,
        resid: Array,
        ctx_pages: Array,
        layer_offset: int,
        page_table: Array,
        positions: Array,
        writable: Array | None,
        attention: str,
        heads_axis: str | None,
    ) -> tuple[Array, Array]:
        """Attention + MLP of the queries ``x [S, G, in]`` (residual ``resid``) of slot
        ``s`` at ``positions[s] = p_s … p_s + G - 1`` over the slot's paged K/V.

        ``writable`` given: the queries' own K/V are written at their positions first (only
        for slots it marks) and the queries see ``[pages before p_s ; the G written]``
        (``block_attention``). ``None``: their K/V are already in the pages (a committed
        context state re-used as a query, G = 1), nothing is written and each query sees
        the positions up to itself. Returns ``(out [S, G, d], ctx_pages)``."""
        q, k, v = self._roped_qkv(x, positions)
        if writable is None:
            s, g, h, d = q.shape
            if g != 1:
                raise ValueError(f"a read-only paged step takes one query per slot, got {g}")
            # An empty slot (length 0, position -1) reads position 0 (its drafts are never
            # used) rather than nothing: a kernel dividing by an empty softmax sum gives NaN.
            layout = RaggedLayout(
                cu_q_lens=jnp.arange(s + 1, dtype=jnp.int32),
                kv_lens=jnp.maximum(positions[:, 0] + 1, 1).astype(jnp.int32),
                page_table=page_table.astype(jnp.int32),
            )
            attn = ragged_attention(
                q[:, 0], ctx_pages, layout, layer_offset, attention, heads_axis=heads_axis,
                max_rows_per_sequence=1,
            )[:, None]  # fmt: skip
        else:
            attn, ctx_pages = block_attention(
                q, k, v, ctx_pages, page_table, positions[:, 0], writable, layer_offset,
                attention, heads_axis=heads_axis,
            )  # fmt: skip
        return self._residual_mlp(resid, attn), ctx_pages


class ParallelBackbone(nn.Module):
    """DFlash/DSpark parallel block backbone over target tap features (DESIGN §3.2)."""

    config: Qwen3Config  # the target's width/heads; num_hidden_layers = drafter layers
    num_taps: int

    def setup(self):
        cfg = self.config
        kw = dict(eps=cfg.rms_norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype)
        # W_c: m·d -> d, no bias (DeepSpec ``fc``).
        self.fc = Projection(
            features=(cfg.hidden_size,),
            in_axes=("taps",),
            out_axes=("embed",),
            dtype=cfg.compute_dtype,
            param_dtype=cfg.weight_dtype,
        )
        self.hidden_norm = RMSNorm(**kw)
        layer_cls = DraftDecoderLayer
        if cfg.remat != "none":
            # Gradient checkpointing per draft layer (same policies as the target's layers;
            # forward values unchanged). Argument 6 of block_step (self = 0) is the static
            # ``shared_context`` flag. Parameter paths stay ``layers_{i}/...``.
            layer_cls = nn.remat(
                DraftDecoderLayer,
                policy=REMAT_POLICIES[cfg.remat],
                static_argnums=(6,),
                methods=["block_step"],
            )
        self.layers = [layer_cls(cfg, name=f"layers_{i}") for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(**kw)

    def context(self, feats: Array) -> Array:
        """``H_ctx = RMSNorm(W_c feats)`` for tap features ``[..., m·d]``."""
        want = self.num_taps * self.config.hidden_size
        if feats.shape[-1] != want:
            raise ValueError(
                f"context features have last dim {feats.shape[-1]}, expected "
                f"{self.num_taps} taps x hidden_size {self.config.hidden_size} = {want}"
            )
        # Activation constraints (as after every target layer): without them the weights'
        # fsdp-split ``embed`` axis propagates into the activations' last axis and pushes
        # the batch axis off the mesh (global-batch activations on every device).
        return nn.with_logical_constraint(self.hidden_norm(self.fc(feats)), ACT_AXES)

    def context_cache(self, feats: Array, positions: Array) -> Array:
        """Every layer's context keys (k-normed, RoPE at ``positions``) and values of tap
        features ``feats [..., T, m·d]``: ``[..., T, layers, 2·kv_heads, head_dim]``, keys
        at the even and values at the odd entries of the combined-heads axis (the paged
        cache's layout, ``ops.paged_attention``).

        A position's K/V depend on its own features and position only, so the decode step
        computes them once, when the position is committed, and every later draft reuses
        them (``from_paged_cache``) instead of re-projecting the whole context each round."""
        h_ctx = self.context(feats)
        parts = [kv_rows(*layer.context_kv(h_ctx, positions)) for layer in self.layers]
        return jnp.stack(parts, axis=-3)  # [..., T, L, 2KV, D]

    def from_paged_cache(
        self,
        block_embeds: Array,
        block_positions: Array,
        ctx_pages: Array,
        page_table: Array,
        writable: Array,
        attention: str = "xla",
        heads_axis: str | None = None,
    ) -> tuple[Array, Array]:
        """Final-normed block states ``[N, γ, d]`` over a paged context K/V cache
        ``ctx_pages [layers, num_pages, page_size, 2·kv_heads, head_dim]`` (the target KV
        cache's layout, ``ops.paged_attention``; slot ``n``'s position ``t`` at offset
        ``t % page_size`` of page ``page_table[n, t // page_size]``). The block of slot
        ``n`` sits at ``block_positions[n] = ctx_len[n] + 0..γ-1`` and sees the context
        positions before it. Each layer writes its block K/V into the pages after the
        context (slots with ``writable`` only) and reads each slot's pages once; returns
        ``(h, ctx_pages)`` with those writes, which the caller keeps (they lie past the
        committed context and are overwritten when those positions are committed)."""
        # The layout is checked by the drafters' ``draft`` entry point (check_draft_inputs).
        shape = ctx_pages.shape
        layers, num_pages = shape[:2]
        flat = ctx_pages.reshape((layers * num_pages,) + shape[2:])
        h = block_embeds
        for i, layer in enumerate(self.layers):
            h, flat = layer.block_step_paged(
                h, flat, i * num_pages, page_table, block_positions, writable, attention,
                heads_axis,
            )  # fmt: skip
            h = nn.with_logical_constraint(h, ACT_AXES)
        return self.norm(h), flat.reshape(shape)

    def __call__(
        self,
        block_embeds: Array,
        block_positions: Array,
        h_ctx: Array,
        ctx_positions: Array,
        ctx_mask: Array,
        shared_context: bool,
    ) -> Array:
        """Final-normed block hidden states ``[N, γ, d]``.

        ``block_embeds [N, γ, d]`` at ``block_positions [N, γ]``. Context ``h_ctx`` at
        ``ctx_positions``: with ``shared_context`` it is ``[S, T, d]`` and all N blocks
        index its flattened ``S·T`` rows through ``ctx_mask [N, S·T]`` (packed training);
        otherwise it is ``[N, M, d]``, one context per row, masked by ``ctx_mask [N, M]``.
        """
        h = block_embeds
        mask = ctx_mask[:, None, :]  # same context visibility for every token of a block
        for layer in self.layers:
            h = layer.block_step(h, h_ctx, ctx_positions, block_positions, mask, shared_context)
            h = nn.with_logical_constraint(h, ACT_AXES)
        return self.norm(h)


# ----------------------------------------------------------------------------------------
# Frozen target embedding / LM head, passed in as arrays or callables (never drafter params)
# ----------------------------------------------------------------------------------------

EmbedLike = Array | Callable[[Array], Array]


def embed_tokens(embed: EmbedLike, tokens: Array, hidden_size: int, dtype: Any) -> Array:
    """Look up ``tokens`` in the target embedding (array ``[V, d]`` or callable)."""
    if callable(embed):
        out = embed(tokens)
    else:
        if embed.ndim != 2 or embed.shape[1] != hidden_size:
            raise ValueError(
                f"target embedding must be [vocab, hidden_size={hidden_size}], got {embed.shape}"
            )
        out = jnp.take(embed, tokens, axis=0)
    if out.shape != tokens.shape + (hidden_size,):
        raise ValueError(
            f"embedding of tokens {tokens.shape} gave shape {out.shape}, expected "
            f"{tokens.shape + (hidden_size,)}"
        )
    return out.astype(dtype)


def apply_lm_head(lm_head: EmbedLike, h: Array, vocab_size: int) -> Array:
    """Target LM head over final-normed ``h [..., d]``; float32 logits ``[..., V]``.

    ``lm_head`` is a callable, a kernel ``[d, V]`` (``Projection`` layout), or a tied
    embedding table ``[V, d]`` (accepted when ``V != d``).
    """
    d = h.shape[-1]
    if callable(lm_head):
        out = lm_head(h)
    else:
        if lm_head.shape == (d, vocab_size):
            kernel = lm_head
        elif lm_head.shape == (vocab_size, d) and vocab_size != d:
            kernel = lm_head.T
        else:
            raise ValueError(
                f"lm_head must be a callable, a [hidden_size={d}, vocab={vocab_size}] kernel or "
                f"a [vocab, hidden_size] tied embedding; got shape {lm_head.shape}"
            )
        out = jnp.einsum("...d,dv->...v", h, kernel.astype(h.dtype))
    if out.shape != h.shape[:-1] + (vocab_size,):
        raise ValueError(f"lm_head gave shape {out.shape}, expected {h.shape[:-1] + (vocab_size,)}")
    return out.astype(jnp.float32)
