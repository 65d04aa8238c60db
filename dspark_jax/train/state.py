"""Training state: a plain pytree so it can be jitted, donated, sharded and checkpointed.

Only *trainable* parameters live here. Frozen parameters (e.g. the target of a drafter
task) are a separate argument of the step: never donated, never given to the optimizer
and not part of the training checkpoint.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dspark_jax import sharding as shd


class TrainState(flax.struct.PyTreeNode):
    step: jax.Array  # int32 scalar: number of optimizer updates done
    params: Any  # trainable parameters (float32 master copy)
    opt_state: Any
    rng: jax.Array  # raw uint32[2] key; per-step keys are fold_in(rng, step)

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "params": self.params,
            "opt_state": self.opt_state,
            "rng": self.rng,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainState:
        return cls(step=d["step"], params=d["params"], opt_state=d["opt_state"], rng=d["rng"])


def state_shardings(
    abstract_boxed_params: Any,
    abstract_state: TrainState,
    tx: optax.GradientTransformation,
    mesh: Mesh,
) -> TrainState:
    """``NamedSharding`` for every leaf of the state.

    Parameters follow their logical names (``dspark_jax.sharding``); optimizer moments
    follow the parameter they belong to (found with ``optax.tree_map_params``, so masks
    and chains need no special casing); counters and the RNG key are replicated.
    """
    p_sh = shd.param_shardings(abstract_boxed_params, mesh)
    rep = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_utils.tree_map_params(
        # Abstract init: the optimizer's counters are never created on the mesh's devices
        # (which may be a TPU topology this host does not have; see dspark_jax/aot/).
        lambda placeholder: jax.eval_shape(tx.init, placeholder),
        lambda _, s: s,
        abstract_state.opt_state,
        p_sh,
        transform_non_params=lambda _: rep,
    )
    return TrainState(step=rep, params=p_sh, opt_state=opt_sh, rng=rep)


def with_shardings(abstract_tree: Any, shardings: Any) -> Any:
    """Attach shardings to a tree of ``ShapeDtypeStruct`` (an Orbax restore target)."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, shardings
    )
