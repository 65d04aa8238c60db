"""Causal self-attention over packed documents without a dense ``[T, T]`` mask: the
full-sequence path of the target (training, scoring, prefill).

A query at index ``t`` attends to keys ``s <= t`` with the same segment id (packed
documents never see each other). Backends (``causal_attention``):

* ``splash``: TPU splash attention (``jax.experimental.pallas.ops.tpu.splash_attention``)
  with a causal mask and segment ids; its mask is block-sparse, so blocks above the
  diagonal are skipped and nothing ``T × T`` is stored, forward or backward (its own
  VJP). Per device under ``shard_map`` (batch over the batch axes, heads over the tensor
  axis). ``interpret=True`` runs it on CPU (tests).
* ``xla``: a blocked reference in plain XLA: keys in blocks of ``XLA_BLOCK`` with an
  online softmax in float32, each block rematerialised in the backward pass, so the
  scores alive at once are ``[T, block]`` per head, never ``[T, T]``.
* ``dense``: the whole score matrix with an explicit mask (the exact reference).

``auto`` is ``splash`` on TPU when the shapes suit it (sequence a multiple of 128,
head_dim a multiple of 128) and ``xla`` elsewhere (``resolve_flash_backend``).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

Array = jax.Array

FLASH_BACKENDS = ("auto", "splash", "xla", "dense")
XLA_BLOCK = 512
_MASKED = -1e30


# The platform "auto" resolves for: the default backend's, unless a program is being
# compiled for another one (ahead-of-time compilation for a TPU topology on a CPU host).
_COMPILE_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "compile_platform", default=None
)


@contextlib.contextmanager
def compile_platform(platform: str):
    """Resolve ``auto`` attention backends for ``platform`` inside this block."""
    token = _COMPILE_PLATFORM.set(platform)
    try:
        yield
    finally:
        _COMPILE_PLATFORM.reset(token)


def current_platform(platform: str | None = None) -> str:
    return platform or _COMPILE_PLATFORM.get() or jax.default_backend()


def splash_problem(seq_len: int, head_dim: int) -> str | None:
    """Why splash attention cannot run these shapes, or None."""
    if seq_len % 128:
        return f"splash attention needs the sequence length % 128 == 0, got {seq_len}"
    if head_dim % 128:
        return f"splash attention needs head_dim % 128 == 0, got {head_dim}"
    return None


def resolve_flash_backend(
    name: str, seq_len: int, head_dim: int, platform: str | None = None
) -> str:
    if name not in FLASH_BACKENDS:
        raise ValueError(f"Unknown attention backend {name!r}; allowed: {list(FLASH_BACKENDS)}")
    problem = splash_problem(seq_len, head_dim)
    platform = current_platform(platform)
    if name == "splash" and problem and platform == "tpu":
        raise ValueError(f"attention backend 'splash' cannot run this shape: {problem}")
    if name != "auto":
        return name
    return "splash" if platform == "tpu" and problem is None else "xla"


def causal_attention(
    q: Array,
    k: Array,
    v: Array,
    segment_ids: Array,
    backend: str = "xla",
    *,
    heads_axis: str | None = None,
    batch_axes: tuple[str, ...] = (),
    interpret: bool = False,
) -> Array:
    """``q [B, T, H, D]``, ``k, v [B, T, KV, D]`` (grouped heads), ``segment_ids [B, T]``
    -> ``[B, T, H, D]``. Scores and softmax in float32."""
    if backend == "dense":
        return dense_attention(q, k, v, segment_ids)
    if backend == "xla":
        return blocked_attention(q, k, v, segment_ids)
    if backend == "splash":
        return _splash(q, k, v, segment_ids, heads_axis, batch_axes, interpret)
    raise ValueError(f"no attention backend {backend!r} (resolve 'auto' first)")


def dense_attention(q, k, v, segment_ids):
    b, t, h, d = q.shape
    kv = k.shape[2]
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    mask = causal[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[:, None, None], scores * d**-0.5, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, d)


def blocked_attention(q, k, v, segment_ids, block: int = XLA_BLOCK):
    b, t, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    block = min(block, t)
    pad = -t % block
    if pad:  # padded keys get segment -1: no query attends to them
        k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    kv_seg = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)
    qg = (q.reshape(b, t, kv, g, d).astype(jnp.float32) * d**-0.5).astype(q.dtype)
    q_pos = jnp.arange(t)

    def step(carry, j):
        m, denom, acc = carry
        kj = jax.lax.dynamic_slice_in_dim(k, j * block, block, axis=1)
        vj = jax.lax.dynamic_slice_in_dim(v, j * block, block, axis=1)
        sj = jax.lax.dynamic_slice_in_dim(kv_seg, j * block, block, axis=1)
        s = jnp.einsum("btkgd,bskd->bkgts", qg, kj, preferred_element_type=jnp.float32)
        k_pos = j * block + jnp.arange(block)
        mask = (q_pos[:, None] >= k_pos[None, :])[None] & (
            segment_ids[:, :, None] == sj[:, None, :]
        )
        mask = mask[:, None, None]  # [B, 1, 1, T, block]
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        scale = jnp.exp(m - m_new)
        denom = denom * scale + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), vj,
                        preferred_element_type=jnp.float32)  # fmt: skip
        return (m_new, denom, acc * scale[..., None] + pv), None

    num_blocks = (t + pad) // block
    if num_blocks > 1:  # recompute each block's scores in the backward pass (memory)
        step = jax.checkpoint(step, prevent_cse=False)
    init = (
        jnp.full((b, kv, g, t), _MASKED, jnp.float32),
        jnp.zeros((b, kv, g, t), jnp.float32),
        jnp.zeros((b, kv, g, t, d), jnp.float32),
    )
    (_, denom, acc), _ = jax.lax.scan(step, init, jnp.arange(num_blocks))
    out = acc / jnp.maximum(denom, 1e-30)[..., None]  # every query sees itself: denom > 0
    return jnp.moveaxis(out, 3, 1).reshape(b, t, h, d).astype(q.dtype)


def _split(mesh, axes, size: int):
    """The mesh axes among ``axes`` that split a dimension of ``size`` evenly (or None)."""
    axes = tuple(a for a in axes if a in mesh.axis_names and mesh.shape[a] > 1)
    n = 1
    for a in axes:
        n *= mesh.shape[a]
    return axes if axes and size % n == 0 else None


def _splash(q, k, v, segment_ids, heads_axis, batch_axes, interpret):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as masks,
    )

    b, t, h, d = q.shape
    kvh = k.shape[2]
    mesh = jax.sharding.get_abstract_mesh()
    batch = None if mesh.empty else _split(mesh, batch_axes, b)
    heads = None
    if not mesh.empty and heads_axis:
        heads = _split(mesh, (heads_axis,), kvh)  # q heads are a multiple of kv heads

    def per_device(q, k, v, seg):
        local_h = q.shape[2]
        block = min(512, t)
        kernel = splash.make_splash_mha(
            masks.MultiHeadMask([masks.CausalMask((t, t)) for _ in range(local_h)]),
            block_sizes=splash.BlockSizes(
                block_q=block, block_kv=block, block_q_dkv=block, block_kv_dkv=block,
                block_q_dq=block, block_kv_dq=block,
            ),
            head_shards=1,
            q_seq_shards=1,
            interpret=interpret,
        )  # fmt: skip
        # Splash takes [heads, T, D] per example and applies no softmax scale.
        qh = jnp.swapaxes(q * jnp.asarray(d**-0.5, q.dtype), 1, 2)
        kh, vh = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)
        out = jax.vmap(lambda a, b_, c, s: kernel(a, b_, c, segment_ids=splash.SegmentIds(s, s)))(
            qh, kh, vh, seg
        )
        return jnp.swapaxes(out, 1, 2)

    if batch is None and heads is None:
        return per_device(q, k, v, segment_ids)
    spec = PartitionSpec(batch, None, heads[0] if heads else None, None)
    return jax.shard_map(
        per_device,
        in_specs=(spec, spec, spec, PartitionSpec(batch, None)),
        out_specs=spec,
        check_vma=False,
    )(q, k, v, segment_ids)


__all__ = [
    "FLASH_BACKENDS",
    "compile_platform",
    "current_platform",
    "blocked_attention",
    "causal_attention",
    "dense_attention",
    "resolve_flash_backend",
    "splash_problem",
]
