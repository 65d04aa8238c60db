"""Branches of jitted code that must be taken alike by every device."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["same_on_every_device"]


def same_on_every_device(pred):
    """A ``lax.cond`` predicate made the same on every device: OR-ed over the mesh axes
    the code is manually mapped over (``shard_map``; e.g. the data replicas of
    ``decode.replicas``), a no-op elsewhere. Devices of different replicas that took
    different branches would each wait, in a branch's collectives over the other axes, on
    a device that never comes (the CPU runtime meets every device of the program there)."""
    axes = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    if not axes:
        return pred
    return jax.lax.psum(jnp.asarray(pred, jnp.int32), axes) > 0
