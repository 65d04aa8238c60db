"""Ragged paged attention as a Pallas GPU (Triton) kernel: the ``pallas_gpu`` backend of
``ops.paged_attention.ragged_attention``.

jax ships a GPU paged-attention kernel (``pallas.ops.gpu.paged_attention``), but it takes
one query per sequence and the cache as ``[KV, pages, page_size, D]``; the verify pass has
up to γ + 1 causal query rows per sequence and our pool is ``[pages, page_size, 2·KV, D]``
(the TPU kernel's layout), so using it would cost a transposed copy of the cache each
layer. This kernel reads our layout in place.

One program per (sequence, KV head). It loads the sequence's query rows for that KV head,
``rows_per_block`` rows × the head group (the GQA heads sharing the KV head) as one
``[rows · group, D]`` operand, and streams the sequence's pages in blocks of
``pages_per_block`` pages (gathered through the page table) up to the last query's
position, with an online softmax in float32. A sequence with at most ``rows_per_block``
query rows (every verify row group: γ + 1 ≤ 16; a drafted block: one row) therefore reads
each of its pages once per KV head, only up to its length. Longer row groups loop over
row blocks, re-reading the pages per block.

The query and output arrays are padded (rows by one block, each head group to a power of
two, Triton's block shapes) so that every slice a program takes is in bounds; masks keep
padding out of the result. Off GPU the same kernel runs in Pallas interpret mode (slow:
tests only).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

Array = jax.Array

_MASKED = -1e30  # finite, as the other backends: a masked block must not produce NaNs
# The M dimension of a program's score tile (query rows × group heads) aims at this many
# rows: Triton's dot wants >= 16, and registers bound it from above.
TARGET_TILE_ROWS = 64
# Keys per score tile: pages gathered per loop step, at least this many keys.
TARGET_BLOCK_KEYS = 64


# Kinds jax's GPU table knows (jax._src.gpu_info.GpuVersion); the lowering reads the compute
# capability from it.
GPU_KINDS = {"h100": "NVIDIA H100", "h200": "NVIDIA H200", "a100": "NVIDIA A100"}


@contextlib.contextmanager
def gpu_lowering_target(gpu: str = "h100", num_cores: int = 132):
    """Lower for a GPU that this host does not have: inside this block, jit/export with
    ``platforms=["cuda"]`` builds the kernel for ``gpu`` (a key of ``GPU_KINDS`` or a jax
    device kind such as ``"NVIDIA H200"``).

    Since jax 0.12 the Pallas GPU lowering asks the target device for its compute
    capability, and without a GPU in the process it fails ("No supported GPU devices
    found"). An abstract mesh whose abstract device names the GPU answers that question on
    every jax line this project supports (0.10 ignores it). Build concrete arrays (model
    parameters, the decode state) outside the block: a concrete computation inside it would
    be placed on the abstract device."""
    kind = GPU_KINDS.get(gpu.lower(), gpu)
    device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=num_cores, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def default_gpu_blocks(group: int, page_size: int, pages_per_seq: int) -> tuple[int, int]:
    """``(rows_per_block, pages_per_block)`` for a head group of ``group`` and pages of
    ``page_size``: query rows such that rows × group fills ``TARGET_TILE_ROWS`` (at least
    one row), pages such that a key block holds ``TARGET_BLOCK_KEYS`` keys (at least one
    page, at most the table), both powers of two."""
    rows = max(1, TARGET_TILE_ROWS // _pow2(group))
    pages = max(1, min(_pow2(pages_per_seq), _pow2(-(-TARGET_BLOCK_KEYS // page_size))))
    return rows, pages


def _kernel(
    cu_ref, kv_lens_ref, table_ref, num_seqs_ref, q_ref, kv_ref, o_ref,
    *, group: int, rows: int, pages_per_block: int, scale: float,
):  # fmt: skip
    s = pl.program_id(0)
    h = pl.program_id(1)
    group_pad = q_ref.shape[1] // (kv_ref.shape[2] // 2)
    page_size, d = kv_ref.shape[1], kv_ref.shape[3]
    block_keys = pages_per_block * page_size
    tile = rows * group_pad

    q_start = cu_ref[s]
    q_len = cu_ref[s + 1] - q_start
    kv_len = kv_lens_ref[s]
    live = (s < num_seqs_ref[0]) & (q_len > 0)
    num_row_blocks = jnp.where(live, pl.cdiv(q_len, rows), 0)
    head_ok = jnp.arange(group_pad) < group  # [Gp]: padded heads are never stored
    exact = q_ref.dtype == jnp.float32  # fp32 caches: no TF32 rounding in the dots

    def row_block(b, carry):
        first = b * rows  # this block's first row within the sequence
        r = jnp.arange(rows)
        row_ok = first + r < q_len
        # Absolute position of each query row: the sequence's rows are its last q_len.
        pos = kv_len - q_len + first + r
        pos_m = jnp.broadcast_to(pos[:, None], (rows, group_pad)).reshape(tile)
        q = q_ref[pl.ds(q_start + first, rows), pl.ds(h * group_pad, group_pad), :]
        q = q.reshape(tile, d)
        last = kv_len - q_len + jnp.minimum(first + rows, q_len) - 1  # block's last query
        num_key_blocks = last // block_keys + 1

        def key_block(j, carry):
            m, denom, acc = carry
            pages = table_ref[s, pl.ds(j * pages_per_block, pages_per_block)]
            k = kv_ref[pages, :, 2 * h, :].reshape(block_keys, d)
            v = kv_ref[pages, :, 2 * h + 1, :].reshape(block_keys, d)
            sc = plgpu.dot(q, k, trans_b=True, allow_tf32=not exact).astype(jnp.float32) * scale
            key_pos = j * block_keys + jnp.arange(block_keys)
            mask = key_pos[None, :] <= pos_m[:, None]
            sc = jnp.where(mask, sc, _MASKED)
            m_new = jnp.maximum(m, jnp.max(sc, axis=1))
            p = jnp.where(mask, jnp.exp(sc - m_new[:, None]), 0.0)
            corr = jnp.exp(m - m_new)
            denom = denom * corr + jnp.sum(p, axis=1)
            pv = plgpu.dot(p.astype(v.dtype), v, allow_tf32=not exact).astype(jnp.float32)
            return m_new, denom, acc * corr[:, None] + pv

        init = (
            jnp.full((tile,), _MASKED, jnp.float32),
            jnp.zeros((tile,), jnp.float32),
            jnp.zeros((tile, d), jnp.float32),
        )
        _, denom, acc = jax.lax.fori_loop(0, num_key_blocks, key_block, init)
        out = (acc / jnp.maximum(denom, 1e-30)[:, None]).reshape(rows, group_pad, d)
        keep = row_ok[:, None, None] & head_ok[None, :, None]
        plgpu.store(
            o_ref.at[pl.ds(q_start + first, rows), pl.ds(h * group_pad, group_pad), :],
            out.astype(o_ref.dtype),
            mask=jnp.broadcast_to(keep, (rows, group_pad, d)),
        )
        return carry

    jax.lax.fori_loop(0, num_row_blocks, row_block, jnp.int32(0))


def ragged_paged_attention_gpu(
    q: Array,
    kv_flat: Array,
    cu_q_lens: Array,
    kv_lens: Array,
    page_table: Array,
    num_seqs: Array,
    *,
    rows_per_block: int | None = None,
    pages_per_block: int | None = None,
    interpret: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Array:
    """Causal attention of ``q [N, H, D]`` (rows grouped by sequence as ``cu_q_lens``
    says, each sequence's rows at its last positions) over ``kv_flat [P, page_size, 2·KV,
    D]`` through ``page_table [S, pages_per_seq]`` (absolute page indices). Returns ``[N,
    H, D]``; rows past the last sequence are left undefined (the caller masks them)."""
    n, heads, d = q.shape
    page_size, kv_heads = kv_flat.shape[1], kv_flat.shape[2] // 2
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    group = heads // kv_heads
    seqs, pages_per_seq = page_table.shape
    default_rows, default_pages = default_gpu_blocks(group, page_size, pages_per_seq)
    rows = _pow2(rows_per_block or default_rows)
    ppb = _pow2(pages_per_block or default_pages)
    group_pad = _pow2(group)
    # Padding that keeps every program's slices in bounds (see the module docstring).
    qp = q.reshape(n, kv_heads, group, d)
    qp = jnp.pad(qp, ((0, rows), (0, 0), (0, group_pad - group), (0, 0)))
    qp = qp.reshape(n + rows, kv_heads * group_pad, d)
    table = jnp.pad(page_table, ((0, 0), (0, -pages_per_seq % ppb)))  # null page (masked)
    kernel = functools.partial(_kernel, group=group, rows=rows, pages_per_block=ppb, scale=d**-0.5)
    out = pl.pallas_call(
        kernel,
        grid=(seqs, kv_heads),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 6,
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        out_shape=jax.ShapeDtypeStruct(qp.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(cu_q_lens, kv_lens, table, num_seqs, qp, kv_flat)
    out = out[:n].reshape(n, kv_heads, group_pad, d)[:, :, :group]
    return out.reshape(n, heads, d)


__all__ = ["default_gpu_blocks", "ragged_paged_attention_gpu"]
