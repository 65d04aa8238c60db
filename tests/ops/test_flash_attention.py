"""Full-sequence attention without a dense [T, T] mask: the blocked XLA backend and TPU
splash attention (Pallas interpret mode on CPU) against the dense reference, values and
gradients, packed segments; the target uses it in training, scoring and prefill."""

from __future__ import annotations

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models.presets import PRESETS
from dspark_jax.models.qwen3 import Qwen3, Qwen3Config
from dspark_jax.ops import flash_attention as fa


def _qkv(dtype, b=2, t=200, h=4, kv=2, d=16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
    k = jnp.asarray(rng.normal(size=(b, t, kv, d)), dtype)
    v = jnp.asarray(rng.normal(size=(b, t, kv, d)), dtype)
    # Three packed documents in row 0 (ragged), one in row 1.
    seg = np.ones((b, t), np.int32)
    seg[0, 70:150], seg[0, 150:] = 2, 3
    return q, k, v, jnp.asarray(seg)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_blocked_matches_dense_values_and_gradients(dtype, tol):
    q, k, v, seg = _qkv(dtype)
    dense = fa.dense_attention(q, k, v, seg)
    blocked = jax.jit(lambda *a: fa.blocked_attention(*a, block=64))(q, k, v, seg)  # 200 % 64
    chex.assert_equal_shape([blocked, dense, q])
    chex.assert_type(blocked, dtype)
    chex.assert_trees_all_close(
        blocked.astype(jnp.float32), dense.astype(jnp.float32), atol=tol, rtol=tol
    )
    if dtype != jnp.float32:
        return

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v, seg)))

    want = jax.grad(loss(fa.dense_attention), argnums=(0, 1, 2))(q, k, v)
    got = jax.grad(loss(lambda *a: fa.blocked_attention(*a, block=64)), argnums=(0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)  # d/dq, d/dk, d/dv


def test_splash_in_interpret_mode_matches_dense():
    q, k, v, seg = _qkv(jnp.float32, b=1, t=256, d=128, seed=1)
    got = fa.causal_attention(q, k, v, seg, "splash", interpret=True)
    chex.assert_trees_all_close(got, fa.dense_attention(q, k, v, seg), atol=1e-5, rtol=1e-5)


def test_training_step_has_no_dense_mask():
    """The target's loss and gradients with the blocked backend: no [T, T] array in the
    compiled program (the dense backend has them, as the check's control)."""
    t = 1024
    tokens = jnp.zeros((1, t), jnp.int32)
    for backend, want in (("xla", False), ("dense", True)):
        cfg = PRESETS["tiny"].replace(attention=backend)
        model = Qwen3(cfg)
        params = jax.eval_shape(lambda m=model: nn.unbox(m.init(jax.random.key(0), tokens[:, :8])))

        def loss(p, m=model):
            return jnp.mean(m.apply(p, tokens))

        hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
        assert (f"{t},{t}]" in hlo) is want, backend


def test_target_forward_is_the_same_with_every_backend():
    cfg = PRESETS["tiny"]
    tokens = jax.random.randint(jax.random.key(2), (2, 40), 0, cfg.vocab_size)
    seg = jnp.asarray(np.repeat([[1] * 25 + [2] * 15], 2, axis=0))
    params = nn.unbox(Qwen3(cfg).init(jax.random.key(0), tokens[:, :8]))
    out = {
        b: Qwen3(cfg.replace(attention=b)).apply(params, tokens, None, seg)
        for b in ("dense", "xla")
    }
    chex.assert_shape(out["xla"], (2, 40, cfg.vocab_size))
    chex.assert_trees_all_close(out["xla"], out["dense"], atol=1e-5, rtol=1e-5)


def test_backend_resolution_and_errors():
    assert fa.resolve_flash_backend("auto", 4096, 128, "cpu") == "xla"
    assert fa.resolve_flash_backend("auto", 4096, 128, "tpu") == "splash"
    assert fa.resolve_flash_backend("auto", 1000, 128, "tpu") == "xla"  # T % 128
    with fa.compile_platform("tpu"):  # ahead-of-time compilation for a TPU topology
        assert fa.resolve_flash_backend("auto", 4096, 128) == "splash"
    assert fa.current_platform() == jax.default_backend()
    with pytest.raises(ValueError, match=r"head_dim % 128 == 0, got 64"):
        fa.resolve_flash_backend("splash", 4096, 64, "tpu")
    with pytest.raises(ValueError, match="Unknown attention backend 'flash'"):
        fa.resolve_flash_backend("flash", 16, 16)
    with pytest.raises(ValueError, match="attention must be one of"):
        Qwen3Config(attention="flash")


@pytest.mark.parametrize(
    "dtype, tol", [(jnp.float32, 1e-5), pytest.param(jnp.bfloat16, 3e-2, marks=pytest.mark.slow)]
)
def test_draft_attention_by_key_chunks_matches_dense(dtype, tol):
    """The drafter's multi-source attention read in key chunks (online softmax, chunks
    rematerialised) equals the one dense softmax, values and gradients: a shared context
    longer than a chunk and not a multiple of it, per-row and per-query sources,
    anchor-bounded masks, and a query whose keys are all masked."""
    from dspark_jax.models import backbone

    rng = np.random.default_rng(0)
    n, g, h, kv, d, c = 3, 4, 4, 2, 16, 300  # blocks, block length, heads, context
    q = jnp.asarray(rng.normal(size=(n, g, h, d)), dtype)
    ctx_k, ctx_v = (jnp.asarray(rng.normal(size=(c, kv, d)), dtype) for _ in range(2))
    anchors = np.array([0, 120, 299])  # block 0 sees no context
    ctx_mask = jnp.asarray(np.arange(c)[None, None, :] < anchors[:, None, None])
    own_k, own_v = (jnp.asarray(rng.normal(size=(n, g, kv, d)), dtype) for _ in range(2))
    own_mask = jnp.asarray(np.tril(np.ones((g, g), bool))[None].repeat(n, 0))
    own_mask = own_mask.at[0, 0].set(False)  # query 0 of block 0: every key masked
    chain_k, chain_v = (jnp.asarray(rng.normal(size=(n, g, 2, kv, d)), dtype) for _ in range(2))
    chain_mask = jnp.ones((1, g, 2), bool)
    sources = [(ctx_k, ctx_v, ctx_mask), (own_k, own_v, own_mask), (chain_k, chain_v, chain_mask)]

    def run(chunk):
        def f(q, ck, cv):
            srcs = [(ck, cv, ctx_mask)] + sources[1:]
            if chunk is None:
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(backbone, "KEY_CHUNK", 10**6)
                    return backbone.multi_source_attention(q, srcs)
            return backbone._blocked_attention(q, srcs, chunk)

        out = f(q, ctx_k, ctx_v)
        grads = jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2), (0, 1, 2))(
            q, ctx_k, ctx_v
        )
        return out, grads

    dense, dense_g = run(None)
    for chunk in (64, 128):  # 300 keys: 5 and 3 chunks, the last padded
        out, grads = run(chunk)
        chex.assert_trees_all_close(
            out.astype(jnp.float32), dense.astype(jnp.float32), atol=tol, rtol=tol
        )
        for a, b in zip(grads, dense_g):
            scale = float(jnp.max(jnp.abs(b.astype(jnp.float32)))) + 1.0
            np.testing.assert_allclose(np.asarray(a, np.float32) / scale,
                                       np.asarray(b, np.float32) / scale, atol=tol)  # fmt: skip
    # Long sources take the chunked path by themselves (what packed training runs).
    long_k = jnp.tile(ctx_k, (3, 1, 1))[:700]
    long_v = jnp.tile(ctx_v, (3, 1, 1))[:700]
    long_mask = jnp.asarray(np.arange(700)[None, None, :] < np.array([5, 400, 699])[:, None, None])
    auto = backbone.multi_source_attention(q, [(long_k, long_v, long_mask)] + sources[1:])
    explicit = backbone._blocked_attention(q, [(long_k, long_v, long_mask)] + sources[1:], 512)
    chex.assert_trees_all_equal(auto, explicit, strict=True)


def test_draft_attention_stores_no_query_by_context_scores():
    """Gradients of the drafter's attention over a 2048-key context: the chunked path has
    no [.., Q, 2048] float32 score array in the compiled program; the dense one does."""
    from dspark_jax.models import backbone

    n, g, h, kv, d, c = 2, 4, 4, 2, 16, 2048
    q = jnp.zeros((n, g, h, d))
    k = v = jnp.zeros((c, kv, d))
    mask = jnp.ones((n, 1, c), bool)
    scores = f"f32[{n},{kv},{h // kv},{g},{c}]"

    def hlo(chunk):
        def loss(q, k, v):
            return jnp.sum(backbone.multi_source_attention(q, [(k, v, mask)]) ** 2)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(backbone, "KEY_CHUNK", chunk)
            return jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, k, v).compile().as_text()

    assert scores not in hlo(backbone.KEY_CHUNK)
    assert scores in hlo(10**6)  # the control: one dense softmax
