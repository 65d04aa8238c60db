"""Data-parallel decoding: replicas that each own their slots and their KV page pool.

On a decode mesh with ``data`` = D > 1 (``decode.mesh``), the decoder's R slots are D
blocks of R/D, block d held by data replica d; the target's page pool (and a drafter's
paged context, which shares its page table) is D pools of ``num_pages / D`` pages, pool d
on replica d with its own null page (local page 0), and a slot's page-table entries are
page numbers *inside its replica's pool*. Every step of the decoder runs under
``shard_map`` over the data axis only (``run_per_replica``): each replica runs the
single-replica step on its own block, and the tensor axis stays automatic inside, so
the weights and each pool still split over tensor exactly as without replicas.

Why not plain sharding propagation over a batch-sharded state: a gather of pages by a
page table the compiler cannot see into makes every replica able to read any page, so
XLA either keeps the whole pool on every replica or moves pages between them each round;
here no byte crosses replicas in a round (the roofline's bytes per chip are one
replica's).

Each replica is one server of the paper's Algorithm 1: its verify budget is chosen from
its own slots' survivals (``decode.policy.RoundPolicy``), and all replicas run the same
compiled bucket K = the largest of their budgets. A replica whose own budget is smaller
still admits only its own top-``k_d`` drafts (dynamic top-K: ``limit`` of
``sched.topk.admit_topk``); the rows it computes beyond its own bucket are the padding
counted in ``RoundDone.padding`` and ``/metrics``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from dspark_jax.sharding import rules_without

__all__ = ["DATA", "group_prefill_rows", "replica_count", "run_per_replica", "state_specs"]

DATA = "data"  # the mesh axis the replicas run over (sharding.MESH_AXES)


def replica_count(mesh) -> int:
    """Data replicas of ``mesh`` (1 without a mesh)."""
    return 1 if mesh is None else int(mesh.shape.get(DATA, 1))


def state_specs(state, paged_context: bool):
    """``PartitionSpec`` over the data axis of every field of a decode state ``state``
    (abstract or concrete): the pools ``[layers, pages, ...]`` by pages, every per-slot
    field ``[R, ...]`` by slots, a drafter placeholder (``paged_context`` False) whole."""

    def one(path, leaf):
        name = getattr(path[0], "name", None)
        if name == "cache" or (name == "ctx_feats" and paged_context):
            return P(None, DATA)
        if name == "ctx_feats":
            return P()
        return P(DATA)

    return jax.tree_util.tree_map_with_path(one, state)


def run_per_replica(fn, mesh, in_specs, out_specs):
    """``fn`` run by every data replica on its own blocks (``shard_map`` over ``data``,
    every other mesh axis left to the compiler). Inside, the logical-axis rules drop the
    data axis: a constraint may not name the axis the body is mapped over."""

    def body(*args):
        with nn.logical_axis_rules(rules_without((DATA,))):
            return fn(*args)

    body.__name__ = getattr(fn, "__name__", "per_replica")
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        axis_names={DATA},
        check_vma=False,
    )


def group_prefill_rows(slots: np.ndarray, replica_slots: int, replicas: int):
    """Where each of a prefill call's ``B`` rows goes when every replica gets ``B`` rows
    (so any split of the rows fits one compiled shape): returns ``take [D·B]`` (the
    caller's row each grouped row copies, -1 for padding), ``local [D·B]`` (its slot in
    its replica, ``replica_slots`` for padding: every write of it is dropped) and
    ``back [B]`` (each caller row's place in the grouped rows). Rows aimed at a slot
    ``>= R`` (the caller's own padding) stay padding."""
    slots = np.asarray(slots, np.int64).reshape(-1)
    b = slots.size
    take = np.full((replicas * b,), -1, np.int64)
    local = np.full((replicas * b,), replica_slots, np.int32)
    back = np.zeros((b,), np.int32)
    used = [0] * replicas
    spare = []
    for i, s in enumerate(slots):
        if not 0 <= s < replicas * replica_slots:
            spare.append(i)
            continue
        d = int(s) // replica_slots
        at = d * b + used[d]
        used[d] += 1
        take[at], local[at], back[i] = i, int(s) % replica_slots, at
    # The caller's padding rows read back from any padding row (their output is unused).
    free = [i for i in range(replicas * b) if take[i] < 0]
    for i, at in zip(spare, free):
        back[i] = at
    return take, local, back
