"""The decode step's random streams: choosing between two key sets per slot, and the
position-keyed draws of coupled slots (``decode.step``'s module docstring)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.decode.state import DecodeState
from dspark_jax.ops.sampling import position_keys

Array = jax.Array

__all__ = ["select_keys", "slot_position_keys"]


def select_keys(which: Array, if_true: Array, if_false: Array) -> Array:
    """Typed keys chosen elementwise (``which`` broadcasts over the keys' shape)."""
    a, b = jax.random.key_data(if_true), jax.random.key_data(if_false)
    return jax.random.wrap_key_data(
        jnp.where(which.reshape(which.shape + (1,) * (a.ndim - which.ndim)), a, b)
    )


def slot_position_keys(dec, state: DecodeState) -> Array:
    """Coupled draws' keys ``[R, γ+1]``: key ``j`` of slot ``r`` is that of sequence
    position ``seq_len[r] + 1 + j`` (draft ``j``; ``j = γ`` the bonus position)."""
    pos = state.seq_len[:, None] + 1 + jnp.arange(dec.gamma + 1, dtype=jnp.int32)
    return position_keys(jax.random.wrap_key_data(state.slot_keys), pos)
