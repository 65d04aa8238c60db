"""The Qwen3 decoder (target model) in Flax Linen.

Architecture (DESIGN §3.1): token embedding; per layer RMSNorm -> attention (q/k/v/o
projections, per-head RMSNorm on q and k, RoPE, grouped-query attention) -> residual ->
RMSNorm -> SwiGLU MLP -> residual; final RMSNorm; tied or untied LM head.

Three fixed-shape modes share one set of parameters:

* ``__call__`` / ``forward``: full sequence (training, scoring). Attention is causal and
  restricted to equal ``segment_ids`` so packed documents never see each other.
* ``prefill``: the full-sequence forward that also writes each row's keys/values into
  the pages of its page-table row (positions ``0 .. length-1``).
* ``decode``: a cached forward over token rows ``[N, 1]`` at per-row positions. Every row
  belongs to one sequence (decode slot); its keys/values are written into that
  sequence's pages first, then each row attends to its sequence's cache up to itself with
  ragged paged attention (``ops.paged_attention``: the rows of a slot are grouped, its
  pages read only up to its length). The packed verify buffer is such a set of rows, so
  verify compute for projections/MLP/head scales with the number of packed tokens.

The cache (``ops.paged_attention.PagedKVCache``: a page pool shared by all sequences) is
never stored in the module: it is passed in and returned, carried through the layer scan
and updated in place. Layers are stacked
with ``nn.scan`` so compile time does not grow with depth. Any forward can return the
hidden states of chosen "tap" layers: tap id ``l`` is the output of decoder layer ``l``
(Hugging Face ``hidden_states[l + 1]``), the DFlash/DeepSpec convention.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.ops.flash_attention import (
    FLASH_BACKENDS,
    causal_attention,
    current_platform,
    resolve_flash_backend,
)
from dspark_jax.ops.paged_attention import (
    PagedKVCache,
    RaggedLayout,
    init_paged_cache,
    ragged_attention,
    write_kv,
)
from dspark_jax.sharding import LOGICAL_RULES

Array = jax.Array

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Gradient checkpointing (``jax.checkpoint``) of a decoder layer in training: "none" keeps
# every activation for the backward pass; "full" keeps only each layer's input and recomputes
# the rest (activation memory ~ one layer, ~1/3 more FLOPs); "dots" also keeps the outputs of
# weight matmuls (recomputes only norms, RoPE, softmax and elementwise ops).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Qwen3 hyper-parameters. Field names follow the Hugging Face ``config.json``."""

    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = True
    # Computation / storage precision (not part of the HF architecture).
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Gradient checkpointing of each decoder layer (training memory; see REMAT_POLICIES).
    remat: str = "none"
    # Full-sequence attention (training, scoring, prefill; ops.flash_attention): auto
    # (splash on TPU when the shapes allow, else the blocked XLA reference), splash, xla,
    # or dense (an explicit [T, T] mask: the exact reference).
    attention: str = "auto"
    # False: the layer scan is fully unrolled in the compiled program (same stacked
    # parameters). XLA's cost analysis counts a while-loop body once, so flop and byte
    # figures (benchmarks/roofline.py) need this; it costs compile time, nothing else.
    scan_layers: bool = True
    # Special token ids (informational; the tokenizer is the source of truth).
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        problems = []
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems and self.num_attention_heads % self.num_key_value_heads != 0:
            problems.append(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            problems.append(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                problems.append(
                    f"{name} must be one of {sorted(_DTYPES)}, got {getattr(self, name)!r}"
                )
        if self.attention not in FLASH_BACKENDS:
            problems.append(
                f"attention must be one of {list(FLASH_BACKENDS)}, got {self.attention!r}"
            )
        if self.remat not in REMAT_POLICIES:
            problems.append(f"remat must be one of {list(REMAT_POLICIES)}, got {self.remat!r}")
        if problems:
            raise ValueError("Invalid Qwen3Config: " + "; ".join(problems))

    # -- conveniences -------------------------------------------------------------------
    @property
    def compute_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def weight_dtype(self):
        return _DTYPES[self.param_dtype]

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    def replace(self, **kwargs) -> Qwen3Config:
        return dataclasses.replace(self, **kwargs)

    def num_params(self) -> int:
        d, f, v, h = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
        attn = d * h * (self.num_attention_heads * 2 + self.num_key_value_heads * 2) + 2 * h
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_hidden_layers * per_layer + d + head

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Qwen3Config:
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"Unknown Qwen3Config key(s) {unknown}; allowed keys: {cls.field_names()}"
            )
        return cls(**values)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any]) -> Qwen3Config:
        """Build from a Hugging Face ``config.json`` dict (unknown HF keys are ignored)."""
        archs = hf.get("architectures") or []
        model_type = hf.get("model_type")
        if model_type != "qwen3" and "Qwen3ForCausalLM" not in archs:
            raise ValueError(
                "Unsupported architecture: expected model_type 'qwen3' / Qwen3ForCausalLM, "
                f"got model_type={model_type!r}, architectures={archs!r}"
            )
        if hf.get("attention_bias"):
            raise ValueError("Unsupported Qwen3 variant: attention_bias=true")
        # Features this implementation does not have must fail loudly: ignoring them would
        # load fine and give wrong logits (at long context for RoPE scaling / windows).
        rope_params = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling")
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
        rope_type = rope_type or rope_params.get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(
                f"Unsupported Qwen3 variant: RoPE scaling {rope_type!r} (rope_scaling / "
                "rope_parameters); only plain RoPE is implemented"
            )
        if hf.get("use_sliding_window"):
            raise ValueError(
                "Unsupported Qwen3 variant: use_sliding_window=true (sliding-window attention "
                "is not implemented)"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"Unsupported Qwen3 variant: hidden_act={hf['hidden_act']!r} (expected 'silu')"
            )
        rope_theta = hf.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
            rope_theta = rope_params.get("rope_theta", 1_000_000.0)
        kw = {
            name: hf[name]
            for name in cls.field_names()
            if name in hf and name not in ("dtype", "param_dtype", "rope_theta")
        }
        kw["rope_theta"] = float(rope_theta)
        if kw.get("head_dim") is None:
            kw["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
        return cls(**kw)

    def to_hf_dict(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": torch_dtype,
            "initializer_range": 0.02,
            "use_cache": True,
        }

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


# ----------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------


def init_cache(config: Qwen3Config, num_pages: int, page_size: int, dtype=None) -> PagedKVCache:
    """A zeroed page pool for every layer (``ops.paged_attention``; page 0 is the null
    page, so ``num_pages - 1`` pages can be handed out)."""
    return init_paged_cache(
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        num_pages,
        page_size,
        dtype or config.compute_dtype,
    )


# ----------------------------------------------------------------------------------------
# Building blocks (shared with the drafters)
# ----------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, scale initialised to one (HF ``Qwen3RMSNorm``)."""

    eps: float = 1e-6
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    axis_name: str = "norm"

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = self.param(
            "scale",
            nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
            (x.shape[-1],),
            self.param_dtype,
        )
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (scale.astype(jnp.float32) * y).astype(self.dtype)


def rope_tables(positions: Array, head_dim: int, theta: float) -> tuple[Array, Array]:
    """cos/sin of shape ``positions.shape + [head_dim]`` (HF "rotate half" layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """Rotate ``x [..., T, heads, head_dim]`` with tables ``[..., T, head_dim]``."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[..., None, :] + rotated * sin[..., None, :]
    return out.astype(x.dtype)


class Projection(nn.Module):
    """A bias-free linear map contracting the last ``len(in_axes)`` input dims.

    The kernel has shape ``in_shape + features`` and carries logical axis names
    ``in_axes + out_axes`` (built directly in that shape so the names always match).
    With ``out_first`` the output dims lead instead, as torch's ``nn.Linear`` stores its
    weight ``[out, in]``: kernel ``features + in_shape`` named ``out_axes + in_axes``; the
    result is the same ``[..., *features]``.

    Why ``out_first`` for the q/k/v projections (kernel ``[heads, head_dim, d]``): a TPU
    array is tiled over its two minor dims (``T(8,128)``) and XLA:TPU computes q/k/v as
    one matmul per head, so each head's block must be contiguous, and the contraction dim
    ``d`` minor is the layout it picks when it may choose. Stored ``[d, heads, head_dim]``
    every q/k/v kernel was re-laid out on every call (0.9 GB per chip per round for
    Qwen3-8B at tensor = 4, ``benchmarks/roofline.py``;
    ``perf.hlo_bytes.parameter_relayouts``); ``[heads, d, head_dim]`` was read in place
    at small verify buckets but copied to ``[heads, head_dim, d]`` at the largest (0.75
    GB); ``[heads, head_dim, d]`` is read in place at every bucket. It is also the Hugging
    Face layout (``q_proj.weight`` is ``[heads·head_dim, d]``), so conversion is a reshape.
    """

    features: tuple[int, ...]
    in_axes: tuple[str, ...]
    out_axes: tuple[str, ...]
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    init_scale: float = 0.02
    out_first: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        n_in = len(self.in_axes)
        features = tuple(self.features)
        in_shape = tuple(x.shape[-n_in:])
        if self.out_first:
            shape, names = features + in_shape, self.out_axes + self.in_axes
            contracted = tuple(range(len(features), len(features) + n_in))
        else:
            shape, names = in_shape + features, self.in_axes + self.out_axes
            contracted = tuple(range(n_in))
        normal = nn.initializers.normal(self.init_scale)
        # An output-first kernel draws the input-major kernel's values and transposes them,
        # so the storage layout does not change the initial model (same seed, same weights).
        perm = tuple(range(n_in, n_in + len(features))) + tuple(range(n_in))

        def init(key, _shape, dtype):
            w = normal(key, in_shape + features, dtype)
            return jnp.transpose(w, perm) if self.out_first else w

        kernel = self.param(
            "kernel", nn.with_logical_partitioning(init, names), shape, self.param_dtype
        )
        x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
        if self.out_first and n_in == 1 and current_platform() == "cpu":
            # XLA:CPU copies a [*features, d] kernel into input-major order on every call;
            # as one [prod(features), d] matrix contracted on its minor dim (torch's
            # x @ W.T) it multiplies in place.
            flat = kernel.reshape(-1, in_shape[0])
            y = jax.lax.dot_general(x, flat, (((x.ndim - 1,), (1,)), ((), ())))
            return y.reshape(*x.shape[:-1], *features)
        contract = (tuple(range(x.ndim - n_in, x.ndim)), contracted)
        # Output dims: x's free dims, then the kernel's free dims in order (= features).
        return jax.lax.dot_general(x, kernel, (contract, ((), ())))


def _dense(features, in_axis_names, out_axis_names, name, cfg: Qwen3Config, out_first=False):
    features = features if isinstance(features, tuple) else (features,)
    return Projection(
        features=features,
        in_axes=tuple(in_axis_names),
        out_axes=tuple(out_axis_names),
        dtype=cfg.compute_dtype,
        param_dtype=cfg.weight_dtype,
        out_first=out_first,
        name=name,
    )


class SelfAttention(nn.Module):
    """Qwen3 attention projections: q/k/v with per-head RMSNorm on q and k, and o.

    The attention itself differs per mode (and per drafter), so this module only owns the
    parameters: ``project`` maps hidden states to (q, k, v) before RoPE, ``output`` maps
    attention results back to the model width.
    """

    config: Qwen3Config

    def setup(self):
        cfg = self.config
        hd = cfg.head_dim
        # q/k/v kernels [heads, head_dim, d] (Projection.out_first: the layout XLA:TPU
        # multiplies in place at every bucket); o stays [heads, head_dim, d], read in place.
        self.q_proj = _dense(
            (cfg.num_attention_heads, hd), ("embed",), ("q_heads", "kv"), "q_proj", cfg, True
        )
        self.k_proj = _dense(
            (cfg.num_key_value_heads, hd), ("embed",), ("kv_heads", "kv"), "k_proj", cfg, True
        )
        self.v_proj = _dense(
            (cfg.num_key_value_heads, hd), ("embed",), ("kv_heads", "kv"), "v_proj", cfg, True
        )
        norm_kw = dict(eps=cfg.rms_norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype)
        self.q_norm = RMSNorm(axis_name="kv", **norm_kw)
        self.k_norm = RMSNorm(axis_name="kv", **norm_kw)
        self.o_proj = _dense(cfg.hidden_size, ("q_heads", "kv"), ("embed",), "o_proj", cfg)

    def project(self, x: Array) -> tuple[Array, Array, Array]:
        return self.q_norm(self.q_proj(x)), self.k_norm(self.k_proj(x)), self.v_proj(x)

    def kv(self, x: Array) -> tuple[Array, Array]:
        """Keys (normed, before RoPE) and values only: used for drafter context injection."""
        return self.k_norm(self.k_proj(x)), self.v_proj(x)

    def output(self, attn: Array) -> Array:
        return self.o_proj(attn)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    config: Qwen3Config

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        gate = _dense(cfg.intermediate_size, ("embed",), ("mlp",), "gate_proj", cfg)(x)
        up = _dense(cfg.intermediate_size, ("embed",), ("mlp",), "up_proj", cfg)(x)
        hidden = nn.with_logical_constraint(
            nn.silu(gate) * up, ("activation_batch", "activation_length", "activation_mlp")
        )
        return _dense(cfg.hidden_size, ("mlp",), ("embed",), "down_proj", cfg)(hidden)


ACT_AXES = ("activation_batch", "activation_length", "activation_embed")


class DecoderLayer(nn.Module):
    """One Qwen3 decoder layer, written as a ``nn.scan`` body.

    ``carry = (hidden [B,T,d], tap_buffer [m,B,T,d] or None, layer_index, kv_flat)``:
    ``kv_flat`` is the whole paged cache ``[layers·P, page_size, 2·KV, D]`` (or ``None``
    in "full" mode), carried rather than scanned so each layer writes its new rows into it
    in place (``ops.paged_attention``); ``ctx`` holds the mode inputs broadcast to every
    layer.
    """

    config: Qwen3Config
    mode: str = "full"  # "full" | "prefill" | "decode"
    tap_index: tuple[int, ...] = ()  # per layer: slot in the tap buffer or -1
    pages_per_layer: int = 0  # P: layer l's pages are entries l·P … l·P + P - 1 of kv_flat
    attention: str = "xla"  # decode attention backend (ops.paged_attention)

    @nn.compact
    def __call__(self, carry, ctx):
        cfg = self.config
        h, taps, layer_idx, kv_flat = carry
        norm_kw = dict(eps=cfg.rms_norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype)

        x = RMSNorm(name="input_layernorm", **norm_kw)(h)
        attention = SelfAttention(cfg, name="self_attn")
        q, k, v = attention.project(x)
        cos, sin = rope_tables(ctx["positions"], cfg.head_dim, cfg.rope_theta)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)

        offset = layer_idx * self.pages_per_layer
        if self.mode in ("full", "prefill"):
            t = h.shape[1]
            rules = dict(LOGICAL_RULES)
            attn = causal_attention(
                q, k, v, ctx["segment_ids"],
                resolve_flash_backend(cfg.attention, t, cfg.head_dim),
                heads_axis=rules["activation_heads"], batch_axes=rules["activation_batch"],
            )  # fmt: skip
            if self.mode == "prefill":
                b, kv_heads, d = k.shape[0], k.shape[2], k.shape[3]
                kv_flat = write_kv(
                    kv_flat,
                    k.reshape(b * t, kv_heads, d),
                    v.reshape(b * t, kv_heads, d),
                    ctx["page_table"],
                    jnp.repeat(jnp.arange(b, dtype=jnp.int32), t),
                    ctx["positions"].reshape(-1),
                    ctx["write"].reshape(-1),
                    offset,
                )
        else:  # decode: rows [N, 1]; write first, then attend over each row's sequence
            kv_flat = write_kv(
                kv_flat, k[:, 0], v[:, 0], ctx["page_table"], ctx["slots"],
                ctx["positions"][:, 0], ctx["write"][:, 0], offset,
            )  # fmt: skip
            attn = ragged_attention(
                q[:, 0], kv_flat, ctx["layout"], offset, self.attention,
                heads_axis=dict(LOGICAL_RULES)["cache_kv_heads"],
            )[:, None]  # fmt: skip

        o = attention.output(attn)
        h = h + o
        h = h + MLP(cfg, name="mlp")(RMSNorm(name="post_attention_layernorm", **norm_kw)(h))
        h = nn.with_logical_constraint(h, ACT_AXES)

        if taps is not None:
            slot = jnp.asarray(self.tap_index, jnp.int32)[layer_idx]
            # Only tap layers touch the buffer. A select on every layer read and rewrote
            # a [rows, hidden] slice of it per layer (36x per 8B round, growing with B).
            taps = jax.lax.cond(
                slot >= 0,
                lambda t: t.at[slot].set(h.astype(t.dtype)),
                lambda t: t,
                taps,
            )
        return (h, taps, layer_idx + 1, kv_flat), None


class Qwen3(nn.Module):
    """The Qwen3 causal LM. ``apply({"params": p}, tokens)`` returns logits ``[B, T, V]``."""

    config: Qwen3Config

    def setup(self):
        cfg = self.config
        self.embed_tokens = nn.Embed(
            cfg.vocab_size,
            cfg.hidden_size,
            dtype=cfg.compute_dtype,
            param_dtype=cfg.weight_dtype,
            embedding_init=nn.with_logical_partitioning(
                nn.initializers.normal(0.02), ("vocab", "embed")
            ),
        )
        self.norm = RMSNorm(
            eps=cfg.rms_norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype
        )
        if not cfg.tie_word_embeddings:
            self.lm_head = _dense(cfg.vocab_size, ("embed",), ("vocab",), "lm_head", cfg)
        self.layers = _ScannedLayers(cfg)

    # -- pieces -----------------------------------------------------------------------
    def embed(self, tokens: Array) -> Array:
        h = self.embed_tokens(tokens)
        return nn.with_logical_constraint(h, ACT_AXES)

    def logits_from_hidden(self, h: Array) -> Array:
        """LM head over already-normed hidden states ``[..., d]``; float32 logits."""
        if self.config.tie_word_embeddings:
            logits = self.embed_tokens.attend(h)
        else:
            logits = self.lm_head(h)
        return logits.astype(jnp.float32)

    # -- modes ------------------------------------------------------------------------
    def __call__(
        self,
        tokens: Array,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        taps: tuple[int, ...] | None = None,
    ):
        """Full-sequence forward. Returns logits, or ``(logits, taps [m,B,T,d])``."""
        h, tap_states = self.hidden_states(tokens, positions, segment_ids, taps)
        logits = self.logits_from_hidden(h)
        return logits if taps is None else (logits, tap_states)

    def hidden_states(self, tokens, positions=None, segment_ids=None, taps=None):
        """Final-normed hidden states ``[B,T,d]`` and tap states (no LM head)."""
        b, t = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if segment_ids is None:
            segment_ids = jnp.ones((b, t), jnp.int32)
        ctx = {"positions": positions, "segment_ids": segment_ids}
        h, tap_states, _ = self.layers(self.embed(tokens), None, ctx, taps, "full")
        return self.norm(h), tap_states

    def prefill(
        self,
        tokens: Array,
        lengths: Array,
        page_table: Array,
        cache: PagedKVCache,
        taps: tuple[int, ...] | None = None,
        return_hidden: bool = False,
    ):
        """Causal forward over prompts ``[B,T]`` (left-aligned) writing their K/V to pages.

        Row ``b``'s positions ``0 .. lengths[b]-1`` go to the pages of ``page_table[b]``
        (``[B, pages_per_seq]``, see ``ops.paged_attention``); padding beyond
        ``lengths[b]`` is not written. Returns ``(logits, cache, taps)`` or, with
        ``return_hidden``, ``(final-normed hidden, cache, taps)`` so callers can apply the
        LM head only where they need it.
        """
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        ctx = {
            "positions": positions,
            "segment_ids": jnp.ones((b, t), jnp.int32),
            "page_table": page_table,
            "write": positions < lengths[:, None],
        }
        h, tap_states, new_cache = self.layers(self.embed(tokens), cache, ctx, taps, "prefill")
        h = self.norm(h)
        out = h if return_hidden else self.logits_from_hidden(h)
        return out, new_cache, tap_states

    def decode(
        self,
        tokens: Array,
        positions: Array,
        slots: Array,
        cache: PagedKVCache,
        layout: RaggedLayout,
        valid: Array | None = None,
        taps: tuple[int, ...] | None = None,
        return_hidden: bool = False,
        attention: str = "xla",
    ):
        """Cached forward over new token rows ``[N, 1]`` of sequences ``slots [N]``.

        Row ``n`` sits at position ``positions[n, 0]`` of sequence ``slots[n]`` (an index
        into ``layout``'s sequences, i.e. its page-table row); its K/V is
        written to that sequence's pages (unless ``valid`` is False), then it attends to
        its sequence's cache as ``layout`` describes (rows grouped by sequence, each
        sequence's rows at its last ``q_len`` positions, see ``ops.paged_attention``; the
        page table is ``layout.page_table``). Rows outside the layout give meaningless
        outputs. ``attention``: the backend (``ops.paged_attention.ATTENTION_BACKENDS``,
        resolved). Returns ``(logits, cache, taps)`` or, with ``return_hidden``,
        ``(hidden, cache, taps)``.
        """
        if tokens.ndim != 2 or tokens.shape[1] != 1:
            raise ValueError(f"decode takes token rows [N, 1], got shape {tokens.shape}")
        if valid is None:
            valid = jnp.ones(tokens.shape, bool)
        ctx = {
            "positions": positions,
            "slots": slots,
            "page_table": layout.page_table,
            "write": valid,
            "layout": layout,
        }
        h, tap_states, new_cache = self.layers(
            self.embed(tokens), cache, ctx, taps, "decode", attention
        )
        h = self.norm(h)
        out = h if return_hidden else self.logits_from_hidden(h)
        return out, new_cache, tap_states


class _ScannedLayers(nn.Module):
    """All decoder layers under one ``nn.scan`` (parameters stacked on a "layers" axis)."""

    config: Qwen3Config

    @nn.compact
    def __call__(self, h, cache, ctx, taps, mode, attention="xla"):
        cfg = self.config
        n = cfg.num_hidden_layers
        tap_index = [-1] * n
        tap_buffer = None
        if taps:
            for i, layer in enumerate(taps):
                if not 0 <= layer < n - 1:
                    raise ValueError(
                        f"tap layer {layer} is out of range: taps must be in [0, {n - 2}] "
                        f"for a {n}-layer model (the last layer may not be tapped)"
                    )
                tap_index[layer] = i
            tap_buffer = jnp.zeros((len(taps),) + h.shape, h.dtype)
        layer_cls = DecoderLayer
        if cfg.remat != "none":
            # prevent_cse=False: inside scan the rematerialisation cannot be CSE'd away.
            layer_cls = nn.remat(DecoderLayer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=False)
        scan = nn.scan(
            layer_cls,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast,),
            length=n,
            unroll=1 if cfg.scan_layers else n,
            metadata_params={nn.PARTITION_NAME: "layers"},
            # The body has no broadcast outputs, so flax's extra partial-evaluation trace
            # that checks loop invariance only costs trace time (one more trace of the
            # whole layer). It is also where jax 0.11.2 + flax 0.12.10 rejected the round
            # with the pallas_gpu kernel on an H200 ("broadcasted variable has a data
            # dependency on the scan body";
            # benchmarks/results/verify_cost_h200_pallas_gpu_error.txt).
            check_constancy_invariants=False,
        )
        kv_flat, pages = None, 0
        if cache is not None:
            if cache.num_layers != n:
                raise ValueError(f"cache has {cache.num_layers} layers, the model {n}")
            pages = cache.num_pages
            kv_flat = cache.kv.reshape((n * pages,) + cache.kv.shape[2:])
        stack = scan(
            cfg,
            mode=mode,
            tap_index=tuple(tap_index),
            pages_per_layer=pages,
            attention=attention,
            name="layer",
        )
        (h, tap_buffer, _, kv_flat), _ = stack((h, tap_buffer, jnp.int32(0), kv_flat), ctx)
        new_cache = None if cache is None else PagedKVCache(kv_flat.reshape(cache.kv.shape))
        return h, tap_buffer, new_cache
