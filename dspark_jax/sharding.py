"""Device mesh, the one logical-axis rules table, and helpers to place params and batches.

Mesh axes (DESIGN §4): ``data`` (pure data parallelism), ``fsdp`` (data parallelism whose
parameters and optimizer state are sharded too), ``tensor`` (Megatron-style: heads, MLP
width and vocabulary split across devices). Every parameter and the main activations carry
logical axis names; ``LOGICAL_RULES`` is the single place that maps them to mesh axes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# Logical name -> mesh axis (or tuple of axes, or None = replicated).
LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("norm", None),
    ("layers", None),
    # Low-rank sequential-head factors (Markov W1 [vocab, rank], W2 [rank, vocab]): split
    # over fsdp, which their vocab axis (tensor) leaves free; without it the ~0.3 GB fp32
    # factors (+ AdamW moments) are replicated on an fsdp-only mesh.
    ("rank", "fsdp"),
    ("rank_in", None),  # input side of the RNN/gated head projections
    ("taps", None),
    # activations
    ("activation_batch", BATCH_AXES),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_mlp", "tensor"),
    ("activation_heads", "tensor"),
    ("activation_vocab", "tensor"),
    # caches
    ("cache_layers", None),
    ("cache_slots", BATCH_AXES),
    ("cache_length", None),
    ("cache_kv_heads", "tensor"),
    # The paged KV pool is shared by every slot, so its pages are not split over the batch
    # axes (a page may belong to any slot); its combined K/V heads follow the KV heads.
    ("cache_pages", None),
    ("cache_page_len", None),
)


def make_mesh(
    data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[Any] | None = None
) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh with Auto axis types; one size may be -1 (fill)."""
    devices = list(devices) if devices is not None else jax.devices()
    n = len(devices)
    sizes = [data, fsdp, tensor]
    if sum(s == -1 for s in sizes) > 1:
        raise ValueError(
            f"At most one mesh axis may be -1, got data={data} fsdp={fsdp} tensor={tensor}"
        )
    if any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"Mesh axis sizes must be positive or -1, got {sizes}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n % known:
            raise ValueError(f"Cannot fill mesh {sizes} over {n} devices: {n} % {known} != 0")
        sizes[sizes.index(-1)] = n // known
    if math.prod(sizes) != n:
        raise ValueError(
            f"Mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} = {math.prod(sizes)} "
            f"devices, but {n} are available"
        )
    axis_types = (AxisType.Auto,) * 3
    try:
        return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError:
        # A TPU slice whose torus axes do not factor into the logical sizes (8 x 8 over a
        # 4x4x4 v5p): let a logical axis span part of a physical one. Valid, with collectives
        # over partial rings instead of whole ones.
        from jax.experimental import mesh_utils

        arr = mesh_utils.create_device_mesh(
            tuple(sizes), devices=devices, allow_split_physical_axes=True
        )
        return Mesh(arr, MESH_AXES, axis_types=axis_types)


def mesh_from_config(mesh_cfg) -> Mesh:
    return make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)


def _axis_size(mesh: Mesh, axis) -> int:
    if axis is None:
        return 1
    if isinstance(axis, str):
        return mesh.shape[axis]
    return math.prod(mesh.shape[a] for a in axis)


def logical_to_spec(
    names: Sequence[str | None], shape: Sequence[int] | None = None, mesh: Mesh | None = None
) -> PartitionSpec:
    """Map logical axis names to a ``PartitionSpec`` with ``LOGICAL_RULES``.

    When ``shape`` and ``mesh`` are given, a dimension that the mesh axes do not divide
    is replicated instead (e.g. 2 KV heads on a 4-way tensor axis), and a mesh axis is
    used at most once per array.
    """
    rules = dict(LOGICAL_RULES)
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        if name is not None and name not in rules:
            raise ValueError(
                f"Logical axis {name!r} has no entry in LOGICAL_RULES; known: {sorted(rules)}"
            )
        axis = rules.get(name) if name is not None else None
        members = () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
        if any(m in used for m in members):
            axis = None
        elif mesh is not None:
            members = tuple(m for m in members if m in mesh.shape)
            axis = None if not members else (members[0] if len(members) == 1 else members)
            if shape is not None and shape[i] % _axis_size(mesh, axis):
                axis = None
        if axis is not None:
            used.update((axis,) if isinstance(axis, str) else axis)
        spec.append(axis)
    return PartitionSpec(*spec)


def _is_boxed(x) -> bool:
    return isinstance(x, nn.Partitioned)


def unboxed(boxed_tree):
    """The values of a tree with ``nn.Partitioned`` leaves. Unlike ``nn.unbox`` this adds no
    sharding constraint, which under an active rules context outside ``jit`` would act on
    the leaves eagerly (and fails on abstract ones)."""
    return jax.tree.map(lambda x: x.value if _is_boxed(x) else x, boxed_tree, is_leaf=_is_boxed)


def param_shardings(boxed_params, mesh: Mesh):
    """``NamedSharding`` tree for a (possibly abstract) tree of ``nn.Partitioned`` leaves.

    Leaves that are not boxed (no logical names) are replicated.
    """

    def one(leaf):
        if _is_boxed(leaf):
            spec = logical_to_spec(leaf.names, leaf.value.shape, mesh)
        else:
            spec = PartitionSpec()
        return NamedSharding(mesh, spec)

    return jax.tree.map(one, boxed_params, is_leaf=_is_boxed)


def shard_params(boxed_params, mesh: Mesh):
    """Place a boxed parameter tree on ``mesh`` and return the plain (unboxed) tree."""
    shardings = param_shardings(boxed_params, mesh)
    plain = nn.unbox(boxed_params)
    return jax.tree.map(jax.device_put, plain, shardings)


def logical_names_of(boxed_params):
    """The logical axis names of every leaf (``None`` for unboxed leaves)."""
    return jax.tree.map(
        lambda x: tuple(x.names) if _is_boxed(x) else None, boxed_params, is_leaf=_is_boxed
    )


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Shard the leading (batch) dimension over ``data`` x ``fsdp``; replicate the rest."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def place_batch(batch, mesh: Mesh):
    """Put a host batch (tree of numpy arrays, leading dim = global batch) on the mesh."""

    def one(x):
        x = np.asarray(x)
        n = _axis_size(mesh, BATCH_AXES)
        if x.shape[0] % n:
            raise ValueError(
                f"Global batch size {x.shape[0]} is not divisible by the data-parallel "
                f"degree data x fsdp = {n}"
            )
        return jax.device_put(x, batch_sharding(mesh, x.ndim))

    return jax.tree.map(one, batch)


def place_host_tree(tree, shardings):
    """Host arrays (numpy) placed on their ``shardings``, each device given only its
    slice (works for a mesh spanning several hosts). Every process must pass the same
    values: unlike ``jax.device_put``, nothing checks it, because across processes that
    check is a collective (an all-gather of the value, per call) and a collective
    dispatched outside the decoding loop's order can leave processes waiting on each
    other (a two-process server hung in warm-up on jax 0.12 until its prefill inputs came
    through here)."""

    def place(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree.map(place, tree, shardings)


def array_from_blocks(shape: tuple[int, ...], sharding, read_block) -> jax.Array:
    """A global array on ``sharding`` built one block at a time: ``read_block(index)``
    (``index``: a tuple of slices, one per axis) returns the host block the devices at that
    index hold. Each distinct block is read once (devices holding the same block, e.g. the
    replicas of a data axis, share the read), sent to its devices and dropped before the
    next is read, so the host holds one block at a time; ``make_array_from_callback``
    would hold all of a process's blocks. Only this process's devices are read for."""
    devices_of: dict[tuple, tuple[tuple, list]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((s.start, s.stop, s.step) for s in index)  # slices are not hashable
        devices_of.setdefault(key, (index, []))[1].append(device)
    arrays = []
    for index, devices in devices_of.values():
        host = read_block(index)
        arrays += [jax.device_put(host, device) for device in devices]
        del host
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def rules_context(mesh: Mesh):
    """Context under which ``nn.with_logical_constraint`` resolves with our rules."""
    return nn.logical_axis_rules(_rules_for_mesh(mesh))


def _rules_for_mesh(mesh: Mesh):
    out = []
    for name, axis in LOGICAL_RULES:
        members = () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
        members = tuple(m for m in members if m in mesh.shape and mesh.shape[m] > 1)
        out.append((name, None if not members else (members[0] if len(members) == 1 else members)))
    return tuple(out)


# -- constraints inside jitted code (the drafter training step) ------------------------
def batch_axes_dividing(n: int) -> tuple[str, ...]:
    """The batch mesh axes (``data``, ``fsdp``; those of size > 1) of the current mesh when
    their product divides ``n``, else ``()`` (no mesh, one device, or an uneven split)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return ()
    axes = tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    size = math.prod(mesh.shape[a] for a in axes)
    return axes if axes and n % size == 0 else ()


def batch_constraint(x, axes: tuple[str, ...] | None = None):
    """Split the leading axis of ``x`` over the batch mesh axes (``axes``, default: those
    dividing it); a no-op without a mesh. Pins the layout that sharding propagation would
    otherwise leave open after gathers and reshapes of the batch."""
    axes = batch_axes_dividing(x.shape[0]) if axes is None else axes
    if not axes:
        return x
    spec = jax.sharding.PartitionSpec(axes, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, spec)


def gather_batch_axes(w, names):
    """``w`` (logical axis ``names``) constrained to its rules-table layout minus the batch
    axes: an explicit all-gather over data/fsdp that keeps any tensor split (the FSDP
    gather of a weight before use). A no-op without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return w

    def strip(axis):
        members = () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
        members = tuple(m for m in members if m not in BATCH_AXES)
        return None if not members else (members[0] if len(members) == 1 else members)

    spec = logical_to_spec(names, w.shape, mesh)
    return jax.lax.with_sharding_constraint(w, jax.sharding.PartitionSpec(*map(strip, spec)))


def rules_without(axes: tuple[str, ...]):
    """The active logical-axis rules with the mesh axes ``axes`` removed from every entry
    (for code vmapped with ``spmd_axis_name=axes``, which already owns those axes)."""
    out = []
    for name, axis in nn.get_logical_axis_rules():
        members = () if axis is None else ((axis,) if isinstance(axis, str) else tuple(axis))
        members = tuple(m for m in members if m not in axes)
        out.append((name, None if not members else (members[0] if len(members) == 1 else members)))
    return tuple(out)
