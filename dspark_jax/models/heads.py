"""DSpark sequential heads and confidence head (DESIGN §3.3–3.4).

Each head owns parameters (Linen modules) and exposes them as a plain dict of arrays via
``tables()``; the per-token math is in pure functions of those tables so it can run inside
``jax.lax.scan`` (Linen modules may not be called inside raw JAX transforms).

Heads, with ``x_0`` = the anchor and ``h_k`` the backbone's final-normed state at block
position k (DeepSpec ``markov_head.py``):

* ``markov`` (DeepSpec "vanilla"): ``bias_k = W1[x_{k-1}] W2``.
* ``gated``: ``g = σ(W_g [h_k; W1[x_{k-1}]] + b_g)``, ``bias_k = (g ⊙ W1[x_{k-1}]) W2``.
* ``rnn``: ``z = [s_{k-1}; W1[x_{k-1}]; h_k]``, ``[g; c; o] = W z + b`` (one 2r+d → 3r
  projection, with bias as in DeepSpec), ``s_k = σ(g)⊙s_{k-1} + (1-σ(g))⊙tanh(c)``,
  ``s_0 = 0``, ``bias_k = tanh(o) W2``.

Draft logits are ``U_k + bias_k`` where ``U_k`` is the target LM head applied to ``h_k``.
Confidence: ``z_k = wᵀ[h_k; W1[x_{k-1}]] + b`` (a logit; ``c_k = σ(z_k)``). It depends on
``x_{<k}`` only — never on ``x_k`` (non-anticipation, DESIGN §5.4).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
Tables = dict[str, Array]


def _param(module: nn.Module, name: str, shape, axes, init, dtype):
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, dtype)


class SequentialHead(nn.Module):
    """Parameters of a DSpark sequential head (``markov`` | ``gated`` | ``rnn``).

    ``init`` sets how the factors start:

    * ``deepspec``: W1, W2 (and the gate / joint kernels) ~ N(0, 0.02), which is what
      DeepSpec's Hugging Face ``post_init`` gives its ``nn.Embedding``/``nn.Linear``. The
      bias ``W1[x] W2`` then starts near 0 but both factors' gradients are scaled by the
      other's 0.02 entries, so the head learns slowly; fine for long runs.
    * ``zero_bias``: W1 ~ N(0, 1) (PyTorch's ``nn.Embedding`` default), W2 = 0. The bias
      is exactly 0 at step 0 and W2's gradient ``W1[x]ᵀ (p_d - y)`` is O(1), so a bigram
      correction is learnt within a short budget. The gated/RNN kernels take PyTorch's
      ``nn.Linear`` default, U(±1/√fan_in).
    """

    kind: str
    vocab_size: int
    rank: int
    hidden_size: int
    init: str = "deepspec"
    param_dtype: Any = jnp.float32

    def setup(self):
        if self.kind not in ("markov", "gated", "rnn"):
            raise ValueError(f"unknown sequential head {self.kind!r}")
        if self.rank < 1:
            raise ValueError(f"sequential head rank must be >= 1, got {self.rank}")
        if self.init not in ("deepspec", "zero_bias"):
            raise ValueError(f"unknown head init {self.init!r}; allowed: deepspec, zero_bias")
        v, r, d = self.vocab_size, self.rank, self.hidden_size
        init = nn.initializers.normal(0.02)
        zero_bias = self.init == "zero_bias"
        w1_init = nn.initializers.normal(1.0) if zero_bias else init
        w2_init = nn.initializers.zeros if zero_bias else init
        # PyTorch's nn.Linear default (U(±1/√fan_in)) for the gate / joint kernels, so the
        # RNN output tanh(o) that multiplies W2 is O(1) rather than O(0.02·|z|).
        proj_init = (
            nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform") if zero_bias else init
        )
        pd = self.param_dtype
        self.markov_w1 = _param(self, "markov_w1", (v, r), ("vocab", "rank"), w1_init, pd)
        self.markov_w2 = _param(self, "markov_w2", (r, v), ("rank", "vocab"), w2_init, pd)
        if self.kind == "gated":
            self.gate_kernel = _param(
                self, "gate_kernel", (d + r, r), ("rank_in", "rank"), proj_init, pd
            )
            self.gate_bias = _param(self, "gate_bias", (r,), ("rank",), nn.initializers.zeros, pd)
        if self.kind == "rnn":
            self.joint_kernel = _param(
                self, "joint_kernel", (2 * r + d, 3 * r), ("rank_in", "rank"), proj_init, pd
            )
            self.joint_bias = _param(
                self, "joint_bias", (3 * r,), ("rank",), nn.initializers.zeros, pd
            )

    def tables(self) -> Tables:
        t = {"w1": self.markov_w1, "w2": self.markov_w2}
        if self.kind == "gated":
            t.update(gate_kernel=self.gate_kernel, gate_bias=self.gate_bias)
        if self.kind == "rnn":
            t.update(joint_kernel=self.joint_kernel, joint_bias=self.joint_bias)
        return t


class ConfidenceHead(nn.Module):
    """``z = wᵀ features + b`` (DeepSpec ``AcceptRatePredictor``: Linear(in, 1))."""

    input_dim: int
    param_dtype: Any = jnp.float32

    def setup(self):
        self.kernel = _param(
            self,
            "kernel",
            (self.input_dim,),
            ("norm",),
            nn.initializers.normal(0.02),
            self.param_dtype,
        )
        self.bias = _param(self, "bias", (1,), ("norm",), nn.initializers.zeros, self.param_dtype)

    def tables(self) -> Tables:
        return {"kernel": self.kernel, "bias": self.bias}


# ----------------------------------------------------------------------------------------
# Pure per-token math
# ----------------------------------------------------------------------------------------


def prev_embedding(tables: Tables, prev_tokens: Array) -> Array:
    """``W1[x_{k-1}]``: ``[..., r]`` float32."""
    return jnp.take(tables["w1"], prev_tokens, axis=0).astype(jnp.float32)


def init_state(kind: str, tables: Tables, batch_shape: tuple[int, ...]) -> Array:
    """``s_0 = 0`` for the RNN head; a dummy (size-0) state for the memoryless heads."""
    r = tables["w1"].shape[1] if kind == "rnn" else 0
    return jnp.zeros(batch_shape + (r,), jnp.float32)


def head_step(
    kind: str, tables: Tables, state: Array, prev_tokens: Array, h: Array
) -> tuple[Array, Array]:
    """One position: ``(new_state, logit bias [..., V])`` from ``x_{k-1}`` and ``h_k``."""
    e = prev_embedding(tables, prev_tokens)
    w2 = tables["w2"].astype(jnp.float32)
    hf = h.astype(jnp.float32)
    if kind == "markov":
        return state, e @ w2
    if kind == "gated":
        gate = jax.nn.sigmoid(
            jnp.concatenate([hf, e], -1) @ tables["gate_kernel"].astype(jnp.float32)
            + tables["gate_bias"].astype(jnp.float32)
        )
        return state, (gate * e) @ w2
    if kind == "rnn":
        z = jnp.concatenate([state, e, hf], -1)
        proj = z @ tables["joint_kernel"].astype(jnp.float32) + tables["joint_bias"].astype(
            jnp.float32
        )
        g, c, o = jnp.split(proj, 3, axis=-1)
        gate = jax.nn.sigmoid(g)
        new_state = gate * state + (1.0 - gate) * jnp.tanh(c)
        return new_state, jnp.tanh(o) @ w2
    raise ValueError(f"unknown sequential head {kind!r}")


def teacher_forced_bias(kind: str, tables: Tables, prev_tokens: Array, h: Array) -> Array:
    """Biases for a whole block with known previous tokens: ``prev [N, γ]``, ``h [N, γ, d]``.

    Memoryless heads are vectorised over γ; the RNN head scans over γ from ``s_0 = 0``.
    """
    if kind != "rnn":
        return head_step(kind, tables, init_state(kind, tables, prev_tokens.shape), prev_tokens, h)[
            1
        ]

    def body(state, xs):
        prev_k, h_k = xs
        state, bias = head_step(kind, tables, state, prev_k, h_k)
        return state, bias

    state0 = init_state(kind, tables, prev_tokens.shape[:1])
    # Unrolled: γ steps are few, and a while loop's body is counted once by XLA's cost
    # analysis (benchmarks/train_budget.py sizes the equal-compute budgets from it).
    _, biases = jax.lax.scan(body, state0, (prev_tokens.T, jnp.swapaxes(h, 0, 1)), unroll=True)
    return jnp.swapaxes(biases, 0, 1)


def confidence_logit(tables: Tables, h: Array, prev_emb: Array | None) -> Array:
    """``z_k = wᵀ[h_k; W1[x_{k-1}]] + b`` (or ``wᵀ h_k + b`` without a W1): ``[...]``."""
    feats = h.astype(jnp.float32)
    if prev_emb is not None:
        feats = jnp.concatenate([feats, prev_emb.astype(jnp.float32)], axis=-1)
    w = tables["kernel"].astype(jnp.float32)
    if feats.shape[-1] != w.shape[0]:
        raise ValueError(
            f"confidence head expects {w.shape[0]} input features, got {feats.shape[-1]}"
        )
    return feats @ w + tables["bias"].astype(jnp.float32)[0]
