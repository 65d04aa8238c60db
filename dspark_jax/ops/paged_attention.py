"""The paged KV cache and ragged attention over it.

Layout (``PagedKVCache.kv``): ``[layers, num_pages, page_size, 2 * kv_heads, head_dim]``,
keys at the even and values at the odd entries of the combined-heads axis. It is the
layout jax's TPU ``ragged_paged_attention`` kernel reads, so that kernel streams a
sequence's pages straight from the cache. Each sequence (decode slot) owns a row of a page
table ``[S, pages_per_seq]``: position ``t`` lives at offset ``t % page_size`` of page
``page_table[s, t // page_size]``. Memory is the page pool, sized by the tokens a server
holds at once, not ``slots × max_len``.

Page 0 is the *null page*: never handed out (``decode.pages.PagePool``). Page-table
entries a sequence does not own point at it, padding rows write into it, and every read of
it lies beyond a sequence's length (masked), so it never leaks into a result.

Inside the layer scan the cache is one flat buffer ``[layers · num_pages, ...]`` carried
from layer to layer; layer ``l``'s page ``p`` is entry ``l · num_pages + p``. Writes are
scatters into that carried buffer (in place: no layer slice is ever copied out) and the
attention kernels receive the whole buffer with page indices offset by ``l · num_pages``.

Ragged attention (``ragged_attention``): query rows are grouped by sequence, the rows of
sequence ``s`` being ``cu_q_lens[s] : cu_q_lens[s + 1]``; its ``q_len`` queries are its
*last* positions, ``kv_lens[s] - q_len … kv_lens[s] - 1``, and each attends causally to
the cache up to itself (the kernel's convention; the verify buffer packs every slot's
anchor and admitted drafts this way). Rows after ``cu_q_lens[S]`` are padding: their
output is zero. Backends:

* ``xla``: a blocked reference in plain XLA for any device (CPU tests, and the fallback
  elsewhere). It walks the cache in blocks of pages only up to the longest sequence in the
  batch (a while loop, online softmax in float32), so its cost follows the tokens in use,
  not ``max_len``; each query row gathers its own sequence's pages.
* ``pallas_tpu``: ``jax.experimental.pallas.ops.tpu.ragged_paged_attention``, which reads
  each sequence's pages once for all its query rows, only up to its length.
* ``pallas_gpu``: our Pallas GPU (Triton) kernel (``ops.ragged_attention_gpu``): one
  program per sequence and KV head reads the sequence's pages once for its query rows (a
  block of rows × GQA group ≈ 64 queries: 16 rows for Qwen3's group of 4, more than a
  verify row group), only up to its length. Off GPU it runs in Pallas interpret mode
  (tests).

Under tensor parallelism the kernels run per device on their own KV heads (``shard_map``).
``auto`` picks ``pallas_tpu`` on TPU, ``pallas_gpu`` on GPU and ``xla`` elsewhere, each
where it supports the head dimension (``resolve_backend``).

Drafting (``block_attention``): the DSpark/DFlash drafter's context K/V live in pages of
the same table and layout. A drafted block (bidirectional inside, seeing the context
before it) is written into the pages after the context and run as one query row per slot,
the block's positions folded into the heads, so the same backends read each slot's pages
once per draft layer.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

Array = jax.Array

NULL_PAGE = 0
ATTENTION_BACKENDS = ("auto", "xla", "pallas_tpu", "pallas_gpu")
# The reference walks the cache in blocks of about this many positions per loop step.
XLA_BLOCK_TOKENS = 256
_MASKED = -1e30  # finite: a fully masked block must not produce NaNs in the online softmax


class PagedKVCache(NamedTuple):
    """Paged K/V of every layer: ``kv [layers, num_pages, page_size, 2·KV, head_dim]``."""

    kv: Array

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def num_pages(self) -> int:
        return self.kv.shape[1]

    @property
    def page_size(self) -> int:
        return self.kv.shape[2]


class RaggedLayout(NamedTuple):
    """Which query rows belong to which sequence, and how far each reads its cache (the
    metadata of ``ragged_paged_attention``). ``S`` sequences, ``N`` query rows."""

    cu_q_lens: Array  # [S + 1] int32, non-decreasing from 0
    kv_lens: Array  # [S] int32: positions 0 .. kv_lens[s] - 1 are in the cache
    page_table: Array  # [S, pages_per_seq] int32
    # [1] int32: only sequences 0 .. num_seqs - 1 are real (the kernel skips the rest);
    # None: all S. Sequences with no query rows may also just have q_len 0.
    num_seqs: Array | None = None


def layout_for_rows(slots: Array, positions: Array, page_table: Array) -> RaggedLayout:
    """The layout of query rows given by their sequence ``slots [N]`` and ``positions
    [N]``: rows sorted by sequence, each sequence's rows at consecutive positions ending at
    its last (so ``kv_lens`` is its last position + 1). Sequences without rows get none."""
    num_seqs = page_table.shape[0]
    counts = jax.ops.segment_sum(jnp.ones_like(slots), slots, num_seqs)
    kv_lens = jax.ops.segment_max(positions + 1, slots, num_seqs)
    kv_lens = jnp.where(counts > 0, kv_lens, 0).astype(jnp.int32)
    cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts).astype(jnp.int32)])
    return RaggedLayout(cu, kv_lens, page_table.astype(jnp.int32))


def pages_per_sequence(max_len: int, page_size: int) -> int:
    return -(-max_len // page_size)


def init_paged_cache(
    num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int, dtype
) -> PagedKVCache:
    if num_pages < 2:
        raise ValueError(
            f"the page pool needs >= 2 pages (page 0 is the null page), got {num_pages}"
        )
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    shape = (num_layers, num_pages, page_size, 2 * num_kv_heads, head_dim)
    return PagedKVCache(jnp.zeros(shape, dtype))


def tpu_kernel_problem(head_dim: int) -> str | None:
    """Why the TPU kernel cannot run this model, or None (its softmax statistics and
    accumulators are laid out in 128-lane tiles of the head dimension)."""
    if head_dim % 128:
        return f"the TPU ragged_paged_attention kernel needs head_dim % 128 == 0, got {head_dim}"
    return None


def gpu_kernel_problem(head_dim: int) -> str | None:
    """Why the GPU kernel cannot run this model, or None (Triton's block shapes are powers
    of two, and its dot wants at least 16 along the contraction)."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return (
            f"the GPU ragged attention kernel needs a power-of-two head_dim >= 16, got {head_dim}"
        )
    return None


_KERNELS = {"pallas_tpu": ("tpu", tpu_kernel_problem), "pallas_gpu": ("gpu", gpu_kernel_problem)}


def resolve_backend(name: str = "auto", platform: str | None = None, head_dim: int = 128) -> str:
    """The concrete attention backend for ``name`` on ``platform`` (default: the default
    backend's platform) for a model with ``head_dim``: ``auto`` is the platform's kernel
    (TPU or GPU) when it supports the shape, else ``xla``."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; allowed: {list(ATTENTION_BACKENDS)}")
    if name in _KERNELS:
        problem = _KERNELS[name][1](head_dim)
        if problem:
            raise ValueError(f"attention backend {name!r} cannot serve this model: {problem}")
        return name
    if name != "auto":
        return name
    from dspark_jax.ops.flash_attention import current_platform

    here = current_platform(platform)
    for kernel, (kernel_platform, problem) in _KERNELS.items():
        if here == kernel_platform and problem(head_dim) is None:
            return kernel
    return "xla"


# ----------------------------------------------------------------------------------------
# writes
# ----------------------------------------------------------------------------------------
def write_kv(
    kv_flat: Array,
    k: Array,
    v: Array,
    page_table: Array,
    slots: Array,
    positions: Array,
    valid: Array,
    layer_offset: Array | int = 0,
) -> Array:
    """Write ``k, v [N, KV, D]`` of tokens at ``positions [N]`` of sequences ``slots [N]``
    into ``kv_flat [layers·P, page_size, 2·KV, D]`` (layer given by ``layer_offset =
    layer · P``). Tokens with ``valid`` False, or past their page table, write nothing."""
    page, offset = page_locations(
        page_table, slots, positions, valid, kv_flat.shape[1], kv_flat.shape[0], layer_offset
    )
    n, kv_heads, d = k.shape
    combined = jnp.stack([k, v], axis=2).reshape(n, 2 * kv_heads, d).astype(kv_flat.dtype)
    return kv_flat.at[page, offset].set(combined, mode="drop")


def page_locations(
    page_table: Array,
    slots: Array,
    positions: Array,
    valid: Array,
    page_size: int,
    num_pages: int,
    layer_offset: Array | int = 0,
) -> tuple[Array, Array]:
    """``(page, offset)`` of tokens at ``positions`` of sequences ``slots`` (rows of
    ``page_table``), pages offset by ``layer_offset``. Tokens with ``valid`` False, or
    past their table, get page ``num_pages`` (out of range: a ``mode="drop"`` scatter
    writes nothing for them)."""
    pages_per_seq = page_table.shape[1]
    page_slot = positions // page_size
    in_table = (page_slot < pages_per_seq) & (positions >= 0) & valid
    page = page_table[slots, jnp.clip(page_slot, 0, pages_per_seq - 1)] + layer_offset
    return jnp.where(in_table, page, num_pages), positions % page_size


# ----------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------
def ragged_attention(
    q: Array,
    kv_flat: Array,
    layout: RaggedLayout,
    layer_offset: Array | int = 0,
    backend: str = "xla",
    *,
    heads_axis: str | None = None,
    kv_pages_per_block: int | None = None,
    queries_per_block: int | None = None,
    max_rows_per_sequence: int | None = None,
) -> Array:
    """Causal attention of query rows ``q [N, H, D]`` over their sequences' paged cache
    (module docstring). Returns ``[N, H, D]`` in ``q``'s dtype; padding rows give 0.
    ``heads_axis``: the mesh axis the heads (and the cache's K/V heads) are split over;
    the kernels then run per device on their own heads. ``kv_pages_per_block`` /
    ``queries_per_block``: the TPU kernel's blocks; ``max_rows_per_sequence``: a bound on
    any sequence's query rows, which sizes the GPU kernel's row block (a drafted block is
    one row per slot)."""
    if backend == "xla":
        return reference_ragged_attention(q, kv_flat, layout, layer_offset)
    if backend == "pallas_tpu":
        blocks = (kv_pages_per_block, queries_per_block)
        return _pallas_tpu(q, kv_flat, layout, layer_offset, _split_axis(heads_axis), *blocks)
    if backend == "pallas_gpu":
        return _pallas_gpu(
            q, kv_flat, layout, layer_offset, _split_axis(heads_axis), max_rows_per_sequence
        )
    raise ValueError(f"no attention backend {backend!r} (resolve 'auto' with resolve_backend)")


def _row_metadata(layout: RaggedLayout, n: int):
    """Per query row: its sequence (clamped), its absolute position and whether it is a
    real row (not padding after the last sequence)."""
    cu = layout.cu_q_lens  # sequences past num_seqs have q_len 0 here, so they are inert
    num_seqs = layout.kv_lens.shape[0]
    rows = jnp.arange(n, dtype=jnp.int32)
    seq = jnp.searchsorted(cu[1:], rows, side="right").astype(jnp.int32)
    real = seq < num_seqs
    seq = jnp.minimum(seq, num_seqs - 1)
    q_len = cu[seq + 1] - cu[seq]
    position = layout.kv_lens[seq] - q_len + (rows - cu[seq])
    return seq, position, real


def reference_ragged_attention(
    q: Array, kv_flat: Array, layout: RaggedLayout, layer_offset: Array | int = 0
) -> Array:
    """The ``xla`` backend: blocks of pages up to the longest sequence, online softmax."""
    n, h, d = q.shape
    page_size, combined = kv_flat.shape[1], kv_flat.shape[2]
    kv_heads = combined // 2
    group = h // kv_heads
    pages_per_seq = layout.page_table.shape[1]
    ppb = max(1, min(pages_per_seq, XLA_BLOCK_TOKENS // page_size))
    block = ppb * page_size
    seq, position, real = _row_metadata(layout, n)
    # Pad the table to whole blocks (null pages: beyond every length, so masked).
    num_blocks_max = -(-pages_per_seq // ppb)
    table = jnp.pad(layout.page_table, ((0, 0), (0, num_blocks_max * ppb - pages_per_seq)))
    rows_table = table[seq]  # [N, blocks·ppb]
    last = jnp.max(jnp.where(real, position, -1))
    num_blocks = (last + block) // block  # blocks holding positions 0 .. last

    qf = q.reshape(n, kv_heads, group, d).astype(jnp.float32) * (d**-0.5)
    m0 = jnp.full((n, kv_heads, group), _MASKED, jnp.float32)
    s0 = jnp.zeros((n, kv_heads, group), jnp.float32)
    acc0 = jnp.zeros((n, kv_heads, group, d), jnp.float32)

    def body(b, carry):
        m, denom, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(rows_table, b * ppb, ppb, axis=1) + layer_offset
        kv = kv_flat[pages].reshape(n, block, combined, d)  # [N, block, 2KV, D]
        k = kv[:, :, 0::2].astype(jnp.float32)
        v = kv[:, :, 1::2].astype(jnp.float32)
        s = jnp.einsum("nkgd,nskd->nkgs", qf, k)
        key_pos = b * block + jnp.arange(block, dtype=jnp.int32)
        mask = (key_pos[None, :] <= position[:, None])[:, None, None, :]
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        denom = denom * scale + jnp.sum(p, axis=-1)
        acc = acc * scale[..., None] + jnp.einsum("nkgs,nskd->nkgd", p, v)
        return m_new, denom, acc

    _, denom, acc = jax.lax.fori_loop(0, num_blocks, body, (m0, s0, acc0))
    out = acc / jnp.maximum(denom, 1e-30)[..., None]
    out = jnp.where(real[:, None, None, None], out, 0.0)
    return out.reshape(n, h, d).astype(q.dtype)


def block_attention(
    q: Array,
    k: Array,
    v: Array,
    kv_flat: Array,
    page_table: Array,
    context_len: Array,
    writable: Array,
    layer_offset: Array | int = 0,
    backend: str = "xla",
    *,
    heads_axis: str | None = None,
) -> tuple[Array, Array]:
    """Attention of a drafted block over its slot's paged context and the whole block.

    ``q [S, G, H, D]``, ``k, v [S, G, KV, D]``: the block of slot ``s`` sits at positions
    ``context_len[s] … + G - 1``; each of its queries sees every context position before
    it and all ``G`` block keys (bidirectional inside the block: DSpark/DFlash drafting).
    The block's K/V are written into the pages at those positions first (only for slots
    with ``writable``: a finished slot may no longer own its pages), so the pages hold
    ``[context ; block]`` contiguously; the positions past the context are not committed
    and are overwritten when they are. Then every slot is *one* query row of a ragged
    layout whose ``G·H`` query heads are the block's positions × heads, at the row's last
    position ``context_len + G - 1``: causal attention from there reads exactly
    ``[context ; block]``, and the slot's pages are read once for its whole block (the TPU
    kernel), only up to its length. Returns ``(out [S, G, H, D], kv_flat)``.

    The page table must cover ``context_len + G`` positions (``decode.pages``: a drafter
    with a context cache reserves ``γ`` positions past ``max_len``)."""
    s, g, h, d = q.shape
    kv_heads = k.shape[2]
    positions = context_len[:, None].astype(jnp.int32) + jnp.arange(g, dtype=jnp.int32)
    slots = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[:, None], (s, g))
    valid = jnp.broadcast_to(writable[:, None], (s, g))
    kv_flat = write_kv(
        kv_flat,
        k.reshape(s * g, kv_heads, d),
        v.reshape(s * g, kv_heads, d),
        page_table,
        slots.reshape(-1),
        positions.reshape(-1),
        valid.reshape(-1),
        layer_offset,
    )
    # Heads ordered [KV, G, H/KV]: head j of the folded row maps to KV head j // (G·H/KV),
    # the kernel's grouping; a split of the heads over chips keeps whole KV groups.
    folded = q.reshape(s, g, kv_heads, h // kv_heads, d).transpose(0, 2, 1, 3, 4)
    layout = RaggedLayout(
        cu_q_lens=jnp.arange(s + 1, dtype=jnp.int32),
        kv_lens=(context_len + g).astype(jnp.int32),
        page_table=page_table.astype(jnp.int32),
    )
    # The TPU kernel's score tile is (query rows × heads per KV head) × KV block: with γ
    # positions folded into the heads, γ times fewer rows per block keep it the size the
    # verify call uses (32 rows of a 5-layer 8B drafter at tensor 4 overflowed the 16 MB
    # scoped VMEM of v5p).
    queries = max(1, default_tpu_blocks(page_table.shape[1], s)[1] // g)
    out = ragged_attention(
        folded.reshape(s, g * h, d), kv_flat, layout, layer_offset, backend,
        heads_axis=heads_axis, queries_per_block=queries, max_rows_per_sequence=1,
    )  # fmt: skip
    out = out.reshape(s, kv_heads, g, h // kv_heads, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(s, g, h, d), kv_flat


def _split_axis(axis: str | None) -> str | None:
    """``axis`` if the current mesh splits the heads over it (more than one device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if axis is None or mesh.empty or axis not in mesh.axis_names or mesh.shape[axis] == 1:
        return None
    return axis


def default_tpu_blocks(pages_per_seq: int, num_rows: int) -> tuple[int, int]:
    """The kernel's own untuned defaults (``tuned_block_sizes``: 128 pages, 32 queries),
    capped by the shapes. Fixed here because the kernel's lookup asks ``jax.devices()``,
    which on a CPU host compiling for a TPU topology is not a TPU."""
    return min(pages_per_seq, 128), min(num_rows, 32)


def _per_device_heads(kernel, axis: str | None):
    """``kernel(q, kv, *metadata)`` run per device on its own heads when ``axis`` splits
    them (the kernels are per chip), else as is."""
    if axis is None:
        mesh = jax.sharding.get_abstract_mesh()
        auto = () if mesh.empty else tuple(set(mesh.axis_names) - set(mesh.manual_axes))
        if mesh.empty or not mesh.manual_axes or not auto:
            return kernel
        # Inside a shard_map over some axes (decode.replicas: data) with the others not
        # splitting the heads: XLA cannot partition a Mosaic kernel, so it runs in a
        # region manual over every axis, whole on each device.
        return jax.shard_map(
            kernel, in_specs=PartitionSpec(), out_specs=PartitionSpec(),
            axis_names=set(auto), check_vma=False,
        )  # fmt: skip
    heads = PartitionSpec(None, axis, None)
    return jax.shard_map(
        kernel,
        in_specs=(heads, PartitionSpec(None, None, axis, None)) + (PartitionSpec(),) * 4,
        out_specs=heads,
        check_vma=False,
    )


def _num_seqs(layout: RaggedLayout) -> Array:
    if layout.num_seqs is None:
        return jnp.full((1,), layout.kv_lens.shape[0], jnp.int32)
    return layout.num_seqs


def _pallas_tpu(q, kv_flat, layout, layer_offset, axis, kv_pages_per_block, queries_per_block):
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    n, _, d = q.shape
    default_pages, default_queries = default_tpu_blocks(layout.page_table.shape[1], n)
    kernel = functools.partial(
        ragged_paged_attention,
        sm_scale=d**-0.5,
        num_kv_pages_per_block=kv_pages_per_block or default_pages,
        num_queries_per_block=queries_per_block or default_queries,
    )
    page_indices = (layout.page_table + layer_offset).astype(jnp.int32)
    args = (q, kv_flat, layout.kv_lens, page_indices, layout.cu_q_lens, _num_seqs(layout))
    kernel = _per_device_heads(kernel, axis)
    # The kernel's matmuls at the default (one-pass) precision: Mosaic rejects an fp32
    # contract precision on bf16 operands, which a global "highest" setting would request.
    with jax.default_matmul_precision("default"):
        out = kernel(*args)
    real = _row_metadata(layout, n)[2]  # the kernel leaves padding rows unwritten
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)


def _pallas_gpu(q, kv_flat, layout, layer_offset, axis, max_rows_per_sequence):
    from dspark_jax.ops.flash_attention import current_platform
    from dspark_jax.ops.ragged_attention_gpu import (
        default_gpu_blocks,
        ragged_paged_attention_gpu,
    )

    n, h, d = q.shape
    group = h // (kv_flat.shape[2] // 2)
    rows, _ = default_gpu_blocks(group, kv_flat.shape[1], layout.page_table.shape[1])
    if max_rows_per_sequence:
        rows = min(rows, max_rows_per_sequence)

    def kernel(q, kv, kv_lens, table, cu, num_seqs):
        return ragged_paged_attention_gpu(
            q, kv, cu, kv_lens, table, num_seqs, rows_per_block=rows,
            interpret=current_platform() != "gpu",
        )  # fmt: skip

    page_indices = (layout.page_table + layer_offset).astype(jnp.int32)
    args = (q, kv_flat, layout.kv_lens, page_indices, layout.cu_q_lens, _num_seqs(layout))
    out = _per_device_heads(kernel, axis)(*args)
    real = _row_metadata(layout, n)[2]  # the kernel leaves padding rows unwritten
    return jnp.where(real[:, None, None], out, 0).astype(q.dtype)


__all__ = [
    "ATTENTION_BACKENDS",
    "NULL_PAGE",
    "PagedKVCache",
    "RaggedLayout",
    "block_attention",
    "gpu_kernel_problem",
    "init_paged_cache",
    "layout_for_rows",
    "page_locations",
    "pages_per_sequence",
    "ragged_attention",
    "reference_ragged_attention",
    "resolve_backend",
    "write_kv",
]
