"""Decoding on a device mesh: the mesh every decode entry point takes, and the placement
of the models on it.

The entry points (``serve.py``, ``python -m dspark_jax.eval``, ``data.distill``,
``generate`` and ``LLM``) take ``--data N --tensor M``, named as ``train.py`` names its
mesh (``config.mesh.data`` / ``config.mesh.tensor``); the default, one device, is no mesh
at all. On a mesh:

* the target's weights follow the one logical-axis rules table training uses
  (``sharding.LOGICAL_RULES``: heads, MLP width and vocabulary over ``tensor``), read
  straight onto the devices by ``convert.hf_mesh`` when loaded from a checkpoint;
* the drafter follows the same table. Its tensor split is the one that moves fewer bytes:
  a replicated drafter would make every chip read all of its layers and its
  vocabulary-wide Markov factor each round, the split one reads 1/tensor of them for two
  all-reduces of ``[R, γ, d]`` activations per layer;
* the decode state by ``SpeculativeDecoder.state_shardings``: the KV page pool over KV
  heads (whole when ``tensor`` does not divide them), per-slot fields over the batch axes.

* with ``--data N`` > 1, N replicas that each own R/N slots and their own page pool, every
  step run per replica (``decode.replicas``); the tensor split above applies inside each.
"""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jax.sharding import Mesh

# JAX is imported inside the functions: serve.py and the other entry points parse their
# flags (``add_mesh_arguments``) before the seconds-long JAX import, so --help and a bad
# flag answer at once.


def decode_mesh(data: int = 1, tensor: int = 1, devices=None) -> Mesh | None:
    """The mesh for ``data`` × ``tensor`` devices (the first ``data·tensor`` of
    ``devices``, default ``jax.devices()``), or None for one device. Errors name the
    problem and what to try."""
    import jax

    from dspark_jax.sharding import make_mesh

    for name, n in (("data", data), ("tensor", tensor)):
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"--{name} must be a positive integer, got {n!r}")
    devices = list(jax.devices() if devices is None else devices)
    need = data * tensor
    if need > len(devices):
        raise ValueError(
            f"--data {data} --tensor {tensor} needs {need} devices but {len(devices)} "
            f"{devices[0].platform if devices else ''} device(s) are visible".rstrip()
        )
    if need == 1:
        return None
    return make_mesh(data=data, fsdp=1, tensor=tensor, devices=devices[:need])


def add_mesh_arguments(parser: argparse.ArgumentParser) -> None:
    """``--data`` / ``--tensor``, the decode mesh's options (as ``train.py``'s mesh), and
    the multi-process flags (``dspark_jax.distributed``: a mesh over several hosts)."""
    from dspark_jax import distributed

    distributed.add_arguments(parser, "decoding: one process per host, one global mesh")
    g = parser.add_argument_group("device mesh (default: one device)")
    g.add_argument(
        "--tensor", type=int, default=1, metavar="M",
        help="split the models' heads, MLP and vocabulary over M devices (tensor parallel)",
    )  # fmt: skip
    g.add_argument(
        "--data", type=int, default=1, metavar="N",
        help="data-parallel replicas, each with its own slots and KV page pool "
        "(--slots must be a multiple of N)",
    )  # fmt: skip


def mesh_from_args(args: argparse.Namespace) -> Mesh | None:
    """The mesh of ``--data``/``--tensor``, after starting the multi-process runtime when
    the flags (or the environment) ask for one; then the mesh must hold every process's
    devices (a process without a device in it could not take part)."""
    import jax

    from dspark_jax import distributed

    if not jax.distributed.is_initialized():
        distributed.initialize_from_args(args)
    data, tensor = getattr(args, "data", 1), getattr(args, "tensor", 1)
    if jax.process_count() > 1 and data * tensor != jax.device_count():
        raise ValueError(
            f"with {jax.process_count()} processes the mesh must hold all "
            f"{jax.device_count()} devices ({jax.local_device_count()} per process); "
            f"--data {data} --tensor {tensor} holds {data * tensor}"
        )
    return decode_mesh(data, tensor)


def mesh_context(mesh):
    """The context a meshed program is traced and run in: the mesh and the logical-axis
    rules (``nn.with_logical_constraint`` and the kernels' ``shard_map`` resolve
    against them); a no-op for ``mesh`` None."""
    import contextlib

    import jax

    from dspark_jax.sharding import rules_context

    stack = contextlib.ExitStack()
    if mesh is not None:
        stack.enter_context(jax.set_mesh(mesh))
        stack.enter_context(rules_context(mesh))
    return stack


def describe(mesh: Mesh | None) -> dict:
    """The mesh as ``/metrics`` and result files report it."""
    import jax

    if mesh is None:
        dev = jax.devices()[0]
        return {"data": 1, "tensor": 1, "devices": 1, "platform": dev.platform}
    return {
        "data": int(mesh.shape["data"]),
        "tensor": int(mesh.shape["tensor"]),
        "devices": int(mesh.size),
        "platform": mesh.devices.flat[0].platform,
    }


def target_layout(config, mesh: Mesh):
    """``(shapes, shardings)`` of the target's parameters: abstract leaves and their
    ``NamedSharding`` by the rules table (as training places the frozen target)."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.models.qwen3 import Qwen3
    from dspark_jax.sharding import param_shardings, unboxed

    boxed = jax.eval_shape(
        lambda: Qwen3(config).init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))["params"]
    )
    return unboxed(boxed), param_shardings(boxed, mesh)


def drafter_layout(drafter, mesh: Mesh):
    """``(shapes, shardings)`` of the drafter's parameters by the rules table."""
    import jax

    from dspark_jax.models.drafters import init_drafter_params
    from dspark_jax.sharding import param_shardings, unboxed

    boxed = jax.eval_shape(lambda: init_drafter_params(drafter, jax.random.key(0)))
    return unboxed(boxed), param_shardings(boxed, mesh)


def place_params(params, layout, what: str):
    """``params`` on the shardings of ``layout`` (``(shapes, shardings)``; leaves already
    there stay put). A tree whose names or shapes differ from the model's is refused with
    the first difference named, not with a JAX traceback."""
    import jax

    from dspark_jax.sharding import place_host_tree

    shapes, shardings = layout
    if jax.tree_util.tree_structure(shapes) != jax.tree_util.tree_structure(params):
        raise ValueError(
            f"the {what} parameters do not match the {what} model: "
            f"{_leaf_paths_diff(params, shapes)}"
        )

    def one(path, x, want, s):
        if tuple(np.shape(x)) != tuple(want.shape):
            raise ValueError(
                f"{what} parameter {jax.tree_util.keystr(path)} has shape {np.shape(x)}, "
                f"the {what} model needs {tuple(want.shape)}: wrong checkpoint for this model"
            )
        if getattr(x, "sharding", None) == s:
            return x
        if not isinstance(x, jax.Array):  # host weights: no cross-process check (see there)
            return place_host_tree(np.asarray(x), s)
        return jax.device_put(x, s)

    return jax.tree_util.tree_map_with_path(one, params, shapes, shardings)


def _leaf_paths_diff(have, want) -> str:
    import jax

    pa = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(have)}
    pb = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(want)}
    extra, missing = sorted(pa - pb)[:3], sorted(pb - pa)[:3]
    return f"unexpected {extra or 'none'}, missing {missing or 'none'}"


def per_device_bytes(tree) -> int:
    """Bytes one device holds of ``tree`` (placed arrays or sharded ShapeDtypeStructs): the
    largest shard of each leaf, summed."""
    import jax
    import jax.numpy as jnp

    total = 0
    for x in jax.tree.leaves(tree):
        shape = np.shape(x)
        sharding = getattr(x, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def check_fits(decoder, device_bytes: int | None = None, headroom: float = 0.9) -> None:
    """Refuse a decoder whose weights and decode state cannot fit one device, before
    anything is compiled: ``device_bytes`` per device (default: the device's own limit,
    where the runtime reports one; the CPU reports none, so nothing is checked there).
    The error gives the figures and what to try."""
    import jax

    if device_bytes is None:
        devices = jax.devices() if decoder.mesh is None else list(decoder.mesh.devices.flat)
        # This process's own device (only those report their memory).
        dev = next(d for d in devices if d.process_index == jax.process_index())
        stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
        device_bytes = (stats or {}).get("bytes_limit")
        if not device_bytes:
            return
    state = jax.eval_shape(lambda: decoder._empty_state(0))
    if decoder.mesh is not None:
        state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            state,
            decoder._state_shardings,
        )
    weights = per_device_bytes((decoder.target_params, decoder.drafter_params))
    cache = per_device_bytes(state)
    if weights + cache <= headroom * device_bytes:
        return
    tensor = 1 if decoder.mesh is None else int(decoder.mesh.shape["tensor"])
    gib = 2.0**30
    raise ValueError(
        f"the models do not fit: per device the weights take {weights / gib:.2f} GiB and the "
        f"KV page pool with the decode state {cache / gib:.2f} GiB, against "
        f"{device_bytes / gib:.2f} GiB of device memory ({headroom:.0%} usable). Try "
        f"--tensor {2 * tensor} (weights and KV heads over more devices), fewer slots, "
        "a shorter --max-len or fewer KV pages, or bfloat16 weights"
    )


__all__ = [
    "add_mesh_arguments",
    "check_fits",
    "decode_mesh",
    "describe",
    "drafter_layout",
    "mesh_context",
    "mesh_from_args",
    "per_device_bytes",
    "place_params",
    "target_layout",
]
