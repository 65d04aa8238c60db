"""Anchor sampling and anchor-bounded packing for drafter training (DESIGN §4).

An *anchor* at position ``a`` of a sequence starts a block: the drafter sees target context
strictly before ``a`` plus the anchor token, and its output k (1-based) predicts the token
at ``a + k``. Eligible anchors are the positions ``a >= 1`` where tokens ``a`` and ``a+1``
are both supervised (``loss_mask``): the first label is then a generated token, and
``a >= 1`` guarantees at least one context position (EAGLE-3 / MTP-1 read the target
state at ``a - 1``, so all kinds share one anchor definition).

Everything here is a pure, fixed-shape JAX function so it runs inside the jitted step with
the step's RNG: anchors are resampled every step (hence every epoch) and a resumed run
draws exactly the same anchors.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

Array = jax.Array


def eligible_anchors(loss_mask: Array) -> Array:
    """``[B, T]`` bool: ``a >= 1`` and tokens ``a`` and ``a+1`` are supervised."""
    m = loss_mask.astype(bool)
    nxt = jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)
    pos = jnp.arange(m.shape[1])[None, :]
    return m & nxt & (pos >= 1)


def sample_anchors(rng: Array, loss_mask: Array, num_anchors: int) -> tuple[Array, Array]:
    """``num_anchors`` anchors per sequence, uniformly without replacement among eligible ones.

    Top-``N`` of i.i.d. uniform scores over the eligible positions is a uniform random
    ``N``-subset (the Gumbel-top-k argument with equal weights). Sequences with fewer than
    ``N`` eligible positions get all of them plus invalid padding anchors.

    Returns ``anchor_pos [B, N]`` int32 (ascending; invalid anchors sit at position 0,
    which is never eligible) and ``anchor_valid [B, N]`` bool.
    """
    b, t = loss_mask.shape
    if not 1 <= num_anchors <= t:
        raise ValueError(f"num_anchors must be in [1, seq_len={t}], got {num_anchors}")
    elig = eligible_anchors(loss_mask)
    scores = jnp.where(elig, jax.random.uniform(rng, (b, t)), -1.0)
    top, idx = jax.lax.top_k(scores, num_anchors)
    valid = top >= 0.0
    # Ascending positions, invalid ones first at 0 then moved to the end by the sort key.
    key = jnp.where(valid, idx, t + idx)
    order = jnp.argsort(key, axis=1)
    idx = jnp.take_along_axis(idx, order, axis=1)
    valid = jnp.take_along_axis(valid, order, axis=1)
    return jnp.where(valid, idx, 0).astype(jnp.int32), valid


class PackedBlocks(NamedTuple):
    """The γ-token blocks of all anchors of a batch, packed densely (``N_total = B·N``).

    block_tokens: ``[N_total, γ]`` true tokens at ``a .. a+γ-1`` (anchor, then the
      teacher-forced ``x_{k-1}`` of outputs k = 2..γ).
    block_seq: ``[N_total]`` row of the batch each block belongs to.
    anchor_pos: ``[N_total]`` anchor position ``a``.
    labels: ``[N_total, γ]`` tokens at ``a+1 .. a+γ`` (output k predicts ``a+k``).
    label_valid: ``[N_total, γ]`` bool: valid anchor, ``a+k < T`` and token ``a+k``
      supervised (blocks running past the generated region keep only their in-region labels).
    """

    block_tokens: Array
    block_seq: Array
    anchor_pos: Array
    labels: Array
    label_valid: Array

    @property
    def label_pos(self) -> Array:
        """``[N_total, γ]`` position ``a + k`` of each label (k = 1..γ)."""
        g = self.labels.shape[1]
        return self.anchor_pos[:, None] + jnp.arange(1, g + 1, dtype=jnp.int32)[None, :]


def pack_blocks(
    tokens: Array, loss_mask: Array, anchor_pos: Array, anchor_valid: Array, gamma: int
) -> PackedBlocks:
    """Pack the blocks of ``anchor_pos [B, N]`` (sequence-major) into :class:`PackedBlocks`."""
    b, t = tokens.shape
    n = anchor_pos.shape[1]
    if anchor_pos.shape != (b, n) or anchor_valid.shape != (b, n):
        raise ValueError(
            f"anchor_pos/anchor_valid must be [B={b}, N], got {anchor_pos.shape} / "
            f"{anchor_valid.shape}"
        )
    offs = jnp.arange(gamma + 1, dtype=jnp.int32)
    pos = anchor_pos[:, :, None].astype(jnp.int32) + offs  # [B, N, γ+1]
    inside = pos < t
    clipped = jnp.minimum(pos, t - 1)
    rows = jnp.arange(b)[:, None, None]
    toks = tokens[rows, clipped]
    sup = loss_mask.astype(bool)[rows, clipped] & inside
    label_valid = sup[..., 1:] & anchor_valid[..., None]
    flat = lambda x: x.reshape((b * n,) + x.shape[2:])
    return PackedBlocks(
        block_tokens=flat(toks[..., :gamma]).astype(jnp.int32),
        block_seq=jnp.repeat(jnp.arange(b, dtype=jnp.int32), n),
        anchor_pos=flat(anchor_pos).astype(jnp.int32),
        labels=flat(toks[..., 1:]).astype(jnp.int32),
        label_valid=flat(label_valid),
    )


def group_blocks(packed: PackedBlocks, batch_size: int, num_groups: int) -> PackedBlocks:
    """Split sequence-major packed blocks of ``batch_size`` sequences into ``num_groups``
    groups of consecutive sequences: leading axes ``[G, N_total/G, ...]`` with ``block_seq``
    local to its group (``0 .. B/G-1``).

    The drafter's packed forward scores every block against every context token of the
    sequences it is given (masked by the token-level indices), so grouping bounds that cost
    to the group's own sequences and lets the group axis shard over the batch mesh axes.
    """
    total = packed.block_seq.shape[0]
    if batch_size % num_groups or total % batch_size:
        raise ValueError(
            f"cannot split {total} blocks of {batch_size} sequences into {num_groups} groups"
        )
    split = lambda x: x.reshape((num_groups, total // num_groups) + x.shape[1:])
    out = jax.tree.map(split, packed)
    return out._replace(block_seq=out.block_seq % (batch_size // num_groups))
