"""Paged KV cache and ragged attention: the XLA backend and the Pallas GPU kernel (in
interpret mode) against jax's own dense reference of the TPU kernel
(``ref_ragged_paged_attention``), page writes and the host page pool. (The TPU kernel
cannot run on CPU: XLA:TPU compiles it inside the serving round in
``tests/aot/test_aot_tpu.py``; the GPU kernel's Triton lowering for CUDA is checked here.)"""

from __future__ import annotations

import functools

import chex
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


BACKENDS = ["xla", "pallas_gpu"]  # the ones that run on CPU (the GPU kernel interpreted)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_backends_match_the_kernels_reference(backend, dtype, tol):
    q, kv, layout = _case(dtype)
    out = pa.ragged_attention(q, kv, layout, backend=backend)
    num_seqs = jnp.array([layout.kv_lens.shape[0]], jnp.int32)
    ref = ref_ragged_paged_attention(
        q, kv, layout.kv_lens, layout.page_table, layout.cu_q_lens, num_seqs,
        sm_scale=q.shape[-1] ** -0.5,
    )  # fmt: skip
    n = int(layout.cu_q_lens[-1])
    chex.assert_shape(out, q.shape)
    chex.assert_type(out, dtype)
    chex.assert_trees_all_close(
        out[:n].astype(jnp.float32), ref.astype(jnp.float32), atol=tol, rtol=tol
    )
    chex.assert_trees_all_equal(out[n:], jnp.zeros_like(out[n:]))  # padding rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_read_only_within_each_length_and_layer(backend):
    """Garbage everywhere a sequence does not own (other layers, the null page, positions
    past its length) leaves the result unchanged; moving a sequence's pages elsewhere in
    the pool with its table entries does too."""
    q, kv, layout = _case(jnp.float32, seed=1)
    layers = jnp.stack([kv, kv * 0 + 1e3])  # layer 1 is garbage: the result reads layer 0
    flat = layers.reshape((-1,) + kv.shape[1:])
    attend = functools.partial(pa.ragged_attention, backend=backend)
    base = attend(q, kv, layout)
    chex.assert_trees_all_close(attend(q, flat, layout, 0), base, atol=1e-6, rtol=0)
    # Layer 1 with the real values, reached through the offset.
    flat2 = jnp.stack([kv * 0 - 1e3, kv]).reshape(flat.shape)
    chex.assert_trees_all_close(attend(q, flat2, layout, kv.shape[0]), base, atol=1e-6, rtol=0)
    # Poison positions past each length and the null page.
    poisoned = np.array(kv)
    poisoned[0] = 1e4
    ps = kv.shape[1]
    for s, n in enumerate(np.asarray(layout.kv_lens)):
        for pos in range(int(n), layout.page_table.shape[1] * ps):
            page = int(layout.page_table[s, pos // ps])
            if page:
                poisoned[page, pos % ps] = -1e4
    chex.assert_trees_all_close(attend(q, jnp.asarray(poisoned), layout), base, atol=1e-6, rtol=0)


@pytest.mark.parametrize("rows, pages", [(1, 1), (2, 2), (4, 8)])
def test_gpu_kernel_blocks_do_not_change_the_result(rows, pages):
    """Row blocks shorter than a sequence's rows (the kernel loops over them) and key
    blocks of one to every page give the same result."""
    from dspark_jax.ops.ragged_attention_gpu import ragged_paged_attention_gpu

    q, kv, layout = _case(jnp.float32, seed=2)
    n = int(layout.cu_q_lens[-1])
    num_seqs = jnp.array([layout.kv_lens.shape[0]], jnp.int32)
    out = ragged_paged_attention_gpu(
        q, kv, layout.cu_q_lens, layout.kv_lens, layout.page_table, num_seqs,
        rows_per_block=rows, pages_per_block=pages, interpret=True,
    )  # fmt: skip
    ref = pa.ragged_attention(q, kv, layout, backend="xla")
    chex.assert_equal_shape([out, ref, q])
    chex.assert_trees_all_close(out[:n], ref[:n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "rows, heads, kv_heads, d, page_size, dtype",
    [
        (512, 32, 8, 128, 16, jnp.bfloat16),  # Qwen3-8B verify rows, one GPU
        (64, 32 * 7, 8, 128, 16, jnp.bfloat16),  # its drafted block: γ = 7 folded in heads
        (16, 4, 2, 64, 4, jnp.float32),  # the bundled target
    ],
)
def test_gpu_kernel_lowers_to_triton_for_cuda(rows, heads, kv_heads, d, page_size, dtype):
    """The kernel's Triton lowering for CUDA (what a GPU compiles; no GPU needed): every
    block shape it builds is one Triton accepts, for the shapes the server runs."""
    import jax

    from dspark_jax.ops.ragged_attention_gpu import gpu_lowering_target, ragged_paged_attention_gpu

    seqs, pages_per_seq = 64, 257
    args = (
        jax.ShapeDtypeStruct((rows, heads, d), dtype),
        jax.ShapeDtypeStruct((4096, page_size, 2 * kv_heads, d), dtype),
        jax.ShapeDtypeStruct((seqs + 1,), jnp.int32),
        jax.ShapeDtypeStruct((seqs,), jnp.int32),
        jax.ShapeDtypeStruct((seqs, pages_per_seq), jnp.int32),
        jax.ShapeDtypeStruct((1,), jnp.int32),
    )
    triton = "__gpu$xla.gpu.triton"
    with gpu_lowering_target("h100"):  # no GPU here: name the one to lower for
        exported = jax.export.export(
            jax.jit(ragged_paged_attention_gpu),
            platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(triton)],
        )(*args)
    assert exported.mlir_module().count(f"@{triton}") == 1


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
    assert pa.resolve_backend("auto", "gpu") == "pallas_gpu"
    assert pa.resolve_backend("auto", "gpu", head_dim=64) == "pallas_gpu"
    assert pa.resolve_backend("auto", "gpu", head_dim=96) == "xla"  # Triton's power of two
    assert pa.resolve_backend("pallas_gpu", "cpu") == "pallas_gpu"  # interpreted off GPU
    with pytest.raises(ValueError, match="power-of-two head_dim >= 16, got 96"):
        pa.resolve_backend("pallas_gpu", head_dim=96)
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


def test_page_pool_reserves_the_draft_block_past_the_budget():
    """With ``extra_positions = γ`` (a DSpark/DFlash drafter writes its block after the
    context), a request reserves γ positions past prompt + max_new, also at max_len."""
    pool = PagePool(num_pages=30, page_size=4, max_len=16, extra_positions=3)
    assert pool.pages_per_seq == 5  # 16 + 3 positions
    assert pool.pages_for(5, 3) == 3 and pool.pages_for(10, 100) == 5
    assert len(np.nonzero(pool.allocate(5, 4))[0]) == 3  # 12 positions: 3 pages


def _dense_block_attention(q, k, v, ctx_k, ctx_v, ctx_len):
    """Per slot: softmax over [context keys < ctx_len ; all block keys], float64."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s_, g, h, d = q.shape
    group = h // k.shape[2]
    out = np.zeros_like(q)
    for s in range(s_):
        n = int(ctx_len[s])
        keys = np.concatenate([np.asarray(ctx_k[s, :n], np.float64), k[s]])
        vals = np.concatenate([np.asarray(ctx_v[s, :n], np.float64), v[s]])
        for j in range(h):
            sc = q[s, :, j] @ keys[:, j // group].T * d**-0.5  # [G, keys]
            p = np.exp(sc - sc.max(-1, keepdims=True))
            out[s, :, j] = (p / p.sum(-1, keepdims=True)) @ vals[:, j // group]
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_block_attention_reads_context_and_whole_block_and_writes_it(backend, dtype, tol):
    """``block_attention`` (the drafted block over the paged drafter context) against a
    dense reference: ragged contexts (empty, short, one filling the table with its block),
    pages out of order in a pool of garbage, a second layer reached by its offset. The
    block's K/V land right after each writable slot's context; a slot that may not write
    leaves the pool unchanged."""
    rng = np.random.default_rng(3)
    s_, g, kv_heads, heads, d, ps, pps = 4, 3, 2, 4, 8, 4, 5
    ctx_len = np.array([5, 0, ps * pps - g, 9], np.int32)  # slot 2: block fills the table
    writable = np.array([True, True, True, False])
    total = 1 + s_ * pps + 2
    table = (1 + rng.permutation(total - 1))[: s_ * pps].reshape(s_, pps).astype(np.int32)
    layer_pages = rng.normal(size=(2, total, ps, 2 * kv_heads, d))
    ctx_k = np.zeros((s_, ps * pps, kv_heads, d))
    ctx_v = np.zeros_like(ctx_k)
    for s in range(s_):
        for t in range(ps * pps):
            page = layer_pages[1, table[s, t // ps], t % ps]
            ctx_k[s, t], ctx_v[s, t] = page[0::2], page[1::2]
    q = rng.normal(size=(s_, g, heads, d))
    k = rng.normal(size=(s_, g, kv_heads, d))
    v = rng.normal(size=(s_, g, kv_heads, d))
    flat = jnp.asarray(layer_pages.reshape((-1,) + layer_pages.shape[2:]), dtype)
    out, written = pa.block_attention(
        *(jnp.asarray(x, dtype) for x in (q, k, v)), flat, jnp.asarray(table),
        jnp.asarray(ctx_len), jnp.asarray(writable), layer_offset=total, backend=backend,
    )  # fmt: skip
    chex.assert_shape(out, q.shape)
    chex.assert_type(out, dtype)
    chex.assert_equal_shape([written, flat])
    q32, k32, v32 = (np.asarray(jnp.asarray(x, dtype), np.float32) for x in (q, k, v))
    ref = _dense_block_attention(q32, k32, v32, ctx_k, ctx_v, ctx_len)
    ok = writable  # a slot that may not write reads its block positions as they are
    np.testing.assert_allclose(np.asarray(out, np.float32)[ok], ref[ok], atol=tol, rtol=tol)
    # The writes: each writable slot's block at ctx_len .. ctx_len + g - 1 of layer 1.
    want = np.asarray(flat, np.float32).copy()
    for s in np.nonzero(writable)[0]:
        for j in range(g):
            t = ctx_len[s] + j
            row = np.stack([k32[s, j], v32[s, j]], axis=1).reshape(2 * kv_heads, d)
            want[total + table[s, t // ps], t % ps] = row
    np.testing.assert_array_equal(np.asarray(written, np.float32), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_split_over_kv_heads_equal_the_unsplit_result(backend):
    """Under tensor parallelism (heads and the cache's K/V heads split over a mesh axis)
    each device attends with its own heads; the result is the single-device one."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    q, kv, layout = _case(jnp.float32, seed=4)
    base = pa.ragged_attention(q, kv, layout, backend=backend)
    from dspark_jax.sharding import make_mesh

    mesh = make_mesh(data=1, tensor=2, devices=jax.devices()[:2])
    with jax.set_mesh(mesh):
        qs = jax.device_put(q, NamedSharding(mesh, PartitionSpec(None, "tensor", None)))
        kvs = jax.device_put(kv, NamedSharding(mesh, PartitionSpec(None, None, "tensor", None)))
        attend = jax.jit(
            lambda q, kv: pa.ragged_attention(q, kv, layout, backend=backend, heads_axis="tensor")
        )
        out = attend(qs, kvs)
        # The kernel runs per device (shard_map over the heads); the reference needs none.
        assert ("shard_map" in str(jax.make_jaxpr(attend)(qs, kvs))) == (backend != "xla")
    chex.assert_trees_all_close(out, base, atol=1e-5, rtol=1e-5)


def test_serving_round_with_the_gpu_kernel_lowers_for_cuda():
    """The whole verify+commit round (the target's layer scan included) traced with the
    real pallas_gpu kernel and lowered for CUDA for an H200, on both tested jax lines
    (0.10 and 0.12; on jax 0.11.2/flax 0.12.10 it had stopped tracing on an H200)."""
    import flax.linen as nn
    import jax

    from dspark_jax.decode.step import SpeculativeDecoder, StepConfig
    from dspark_jax.models.drafters import DrafterConfig, init_drafter_params, make_drafter
    from dspark_jax.models.presets import get_preset
    from dspark_jax.models.qwen3 import Qwen3
    from dspark_jax.ops.flash_attention import compile_platform
    from dspark_jax.ops.ragged_attention_gpu import gpu_lowering_target

    cfg = get_preset("tiny").replace(head_dim=16)
    target = Qwen3(cfg)
    tp = nn.unbox(target.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    dcfg = DrafterConfig(kind="dspark", gamma=3, num_layers=1, mask_token_id=cfg.vocab_size - 1)
    drafter = make_drafter(dcfg, cfg)
    dp = nn.unbox(init_drafter_params(drafter, jax.random.key(1)))
    config = StepConfig(num_slots=2, max_len=64, scheduler="prefix", attention="pallas_gpu")
    dec = SpeculativeDecoder(target, tp, drafter, dp, config)
    state = dec.init_state()  # concrete arrays: built outside the abstract GPU block
    _, plan = dec._plan(dec._params, state, 6)
    with compile_platform("gpu"), gpu_lowering_target("h200"):
        lowered = dec._commit.trace(dec._params, state, plan, 6).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("xla.gpu.triton") >= 1
