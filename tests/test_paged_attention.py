"""Paged KV cache and ragged attention: the XLA backend against jax's own dense reference
of the TPU kernel (``ref_ragged_paged_attention``), page writes and the host page pool. (The TPU kernel cannot run on CPU: XLA:TPU compiles
it inside the serving round in ``test_aot_tpu.py``.)"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import (
    ref_ragged_paged_attention,
)

from dspark_jax.decode.pages import PagePool, full_pool_pages
from dspark_jax.ops import paged_attention as pa


def _case(dtype, seed=0, page_size=4, pages_per_seq=6, kv_heads=2, heads=4, d=8):
    """Four sequences: ragged query and KV lengths, an empty one in the middle, one at
    the table's full length, pages handed out in shuffled order, padding rows at the end."""
    rng = np.random.default_rng(seed)
    num_seqs = 4
    total = 1 + num_seqs * pages_per_seq + 3  # null page + every sequence + spare pages
    kv = jnp.asarray(rng.normal(size=(total, page_size, 2 * kv_heads, d)), dtype)
    max_len = page_size * pages_per_seq
    kv_lens = np.array([7, 0, max_len, 1], np.int32)  # 0: no rows; max_len: a full slot
    q_lens = np.array([3, 0, 5, 1], np.int32)
    table = np.zeros((num_seqs, pages_per_seq), np.int32)
    shuffled = 1 + rng.permutation(total - 1)
    for s in range(num_seqs):
        n = -(-kv_lens[s] // page_size)
        table[s, :n] = shuffled[s * pages_per_seq : s * pages_per_seq + n]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    rows = int(cu[-1]) + 3  # three padding rows
    q = jnp.asarray(rng.normal(size=(rows, heads, d)), dtype)
    layout = pa.RaggedLayout(jnp.asarray(cu), jnp.asarray(kv_lens), jnp.asarray(table))
    return q, kv, layout


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_xla_backend_matches_the_kernels_reference(dtype, tol):
    q, kv, layout = _case(dtype)
    out = pa.ragged_attention(q, kv, layout, backend="xla")
    num_seqs = jnp.array([layout.kv_lens.shape[0]], jnp.int32)
    ref = ref_ragged_paged_attention(
        q, kv, layout.kv_lens, layout.page_table, layout.cu_q_lens, num_seqs,
        sm_scale=q.shape[-1] ** -0.5,
    )  # fmt: skip
    n = int(layout.cu_q_lens[-1])
    assert out.dtype == dtype and out.shape == q.shape
    np.testing.assert_allclose(
        np.asarray(out[:n], np.float32), np.asarray(ref, np.float32), atol=tol, rtol=tol
    )
    np.testing.assert_array_equal(np.asarray(out[n:], np.float32), 0)  # padding rows


def test_xla_backend_reads_only_within_each_length_and_layer():
    """Garbage everywhere a sequence does not own (other layers, the null page, positions
    past its length) leaves the result unchanged; moving a sequence's pages elsewhere in
    the pool with its table entries does too."""
    q, kv, layout = _case(jnp.float32, seed=1)
    layers = jnp.stack([kv, kv * 0 + 1e3])  # layer 1 is garbage: the result reads layer 0
    flat = layers.reshape((-1,) + kv.shape[1:])
    base = pa.ragged_attention(q, kv, layout)
    np.testing.assert_allclose(pa.ragged_attention(q, flat, layout, 0), base, atol=1e-6)
    # Layer 1 with the real values, reached through the offset.
    flat2 = jnp.stack([kv * 0 - 1e3, kv]).reshape(flat.shape)
    np.testing.assert_allclose(pa.ragged_attention(q, flat2, layout, kv.shape[0]), base, atol=1e-6)
    # Poison positions past each length and the null page.
    poisoned = np.array(kv)
    poisoned[0] = 1e4
    ps = kv.shape[1]
    for s, n in enumerate(np.asarray(layout.kv_lens)):
        for pos in range(int(n), layout.page_table.shape[1] * ps):
            page = int(layout.page_table[s, pos // ps])
            if page:
                poisoned[page, pos % ps] = -1e4
    np.testing.assert_allclose(
        pa.ragged_attention(q, jnp.asarray(poisoned), layout), base, atol=1e-6
    )


def test_write_kv_places_tokens_on_their_pages():
    total, ps, kv_heads, d = 10, 4, 1, 2
    flat = jnp.zeros((2 * total, ps, 2 * kv_heads, d))  # two layers of 10 pages
    table = jnp.array([[3, 7, 0], [5, 0, 0]], jnp.int32)
    k = jnp.arange(1, 5, dtype=jnp.float32)[:, None, None] * jnp.ones((4, kv_heads, d))
    v = -k
    slots = jnp.array([0, 0, 1, 1], jnp.int32)
    # 9: slot 1 owns no page there (null entry: the null page); 12: past the table, dropped.
    positions = jnp.array([1, 5, 9, 12], jnp.int32)
    valid = jnp.array([True, True, True, True])
    out = np.asarray(pa.write_kv(flat, k, v, table, slots, positions, valid, layer_offset=total))
    assert out[:total].sum() == 0  # layer 0 untouched
    layer1 = out[total:]
    np.testing.assert_array_equal(layer1[3, 1, 0], [1, 1])  # K at even heads
    np.testing.assert_array_equal(layer1[3, 1, 1], [-1, -1])  # V at odd heads
    np.testing.assert_array_equal(layer1[7, 1, 0], [2, 2])  # position 5: 2nd page, offset 1
    np.testing.assert_array_equal(layer1[0, 1, 0], [3, 3])  # the null page
    assert np.count_nonzero(layer1) == 3 * 2 * d  # and nothing else (position 12 dropped)
    none = pa.write_kv(flat, k, v, table, slots, positions, valid & False)
    assert float(jnp.abs(none).sum()) == 0


def test_layout_for_rows():
    table = jnp.zeros((3, 2), jnp.int32)
    lay = pa.layout_for_rows(jnp.array([0, 0, 2]), jnp.array([4, 5, 0]), table)
    np.testing.assert_array_equal(lay.cu_q_lens, [0, 2, 2, 3])
    np.testing.assert_array_equal(lay.kv_lens, [6, 0, 1])


def test_backend_resolution_and_errors():
    assert pa.resolve_backend("auto", "cpu") == "xla"
    assert pa.resolve_backend("auto", "tpu", head_dim=128) == "pallas_tpu"
    assert pa.resolve_backend("auto", "tpu", head_dim=64) == "xla"  # the kernel's tiling
    assert pa.resolve_backend("auto", "gpu") == "xla"
    with pytest.raises(ValueError, match="Unknown attention backend 'flash'"):
        pa.resolve_backend("flash")
    with pytest.raises(ValueError, match="head_dim % 128 == 0, got 64"):
        pa.resolve_backend("pallas_tpu", head_dim=64)
    with pytest.raises(ValueError, match="page 0 is the null page"):
        pa.init_paged_cache(1, 1, 8, 1, 4, jnp.float32)


def test_page_pool_reserves_frees_and_refuses():
    pool = PagePool(num_pages=9, page_size=4, max_len=16)  # 8 usable pages, 4 per slot
    assert pool.capacity == 8 and pool.pages_per_seq == 4
    assert pool.pages_for(5, 3) == 2 and pool.pages_for(10, 100) == 4  # capped at max_len
    a = pool.allocate(5, 3)
    np.testing.assert_array_equal(a, [1, 2, 0, 0])  # unowned entries: the null page
    b = pool.allocate(13, 3)
    assert pool.free == 2 and pool.allocate(9, 0) is None  # 3 needed: must wait
    pool.release(a)
    with pytest.raises(ValueError, match="double free"):
        pool.release(a)
    c = pool.allocate(9, 0)
    assert sorted(c[:3]) == [1, 2, 7] and pool.free == 1
    pool.release(b)
    pool.release(c)
    assert pool.free == pool.capacity
    with pytest.raises(ValueError, match=r"needs 5 KV pages of 4 tokens .* the page pool has 4"):
        PagePool(5, 4, 64).check_fits(10, 10)
    assert full_pool_pages(3, 10, 4) == 3 * 3 + 1
