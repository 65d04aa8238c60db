"""The full-size training step compiled ahead of time, with the abstract frozen inputs
and batch a task provides."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from dspark_jax import sharding as shd
from dspark_jax.aot.memory import (
    abstract_tree,
    global_bytes,
    memory_fields,
    param_count,
    per_device_bytes,
    with_fit,
)
from dspark_jax.aot.topology import compiler_info
from dspark_jax.ops.flash_attention import compile_platform


# ----------------------------------------------------------------------------------------
# What a task must provide for AOT (abstract frozen params and batch shapes)
# ----------------------------------------------------------------------------------------
def abstract_frozen(task, mesh) -> tuple[Any, Any]:
    """``(ShapeDtypeStruct tree with shardings, shardings)`` of the task's frozen inputs.

    Tasks with frozen parameters implement ``abstract_frozen_params(mesh)`` (the drafter
    task: the target, sharded by the rules table); the LM task has none.
    """
    if hasattr(task, "abstract_frozen_params"):
        return task.abstract_frozen_params(mesh)
    if task.name == "lm":
        return {}, {}
    raise ValueError(
        f"task {task.name!r} cannot be compiled ahead of time: it does not implement "
        "abstract_frozen_params(mesh) (the frozen inputs as sharded ShapeDtypeStructs)"
    )


def abstract_batch(task, batch_size: int, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The global batch as ``ShapeDtypeStruct``s sharded over (data, fsdp)."""
    if hasattr(task, "batch_shapes"):
        shapes = task.batch_shapes(batch_size)
    elif task.name == "lm":  # packed LM batches (data/packing.py): five int32 [B, T] arrays
        t = task.cfg.data.seq_len
        keys = ("tokens", "targets", "segment_ids", "positions", "loss_mask")
        shapes = {k: jax.ShapeDtypeStruct((batch_size, t), jnp.int32) for k in keys}
    else:
        raise ValueError(
            f"task {task.name!r} cannot be compiled ahead of time: it does not implement "
            "batch_shapes(batch_size) (the global batch as ShapeDtypeStructs)"
        )
    return {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shd.batch_sharding(mesh, len(v.shape)))
        for k, v in shapes.items()
    }


def aot_task(cfg):
    """The task of ``cfg`` for compilation only: a drafter task whose ``target.dir`` holds no
    model takes the target's shape from ``target.preset`` (e.g. ``qwen3-8b``), and no data,
    tokenizer or weights are read (see :func:`_abstract_drafter_task`)."""
    from dspark_jax.train.trainer import make_task

    task = make_task(cfg)
    if task.name == "drafter":
        return _abstract_drafter_task(cfg)
    return task


def _abstract_drafter_task(cfg):
    import os

    from dspark_jax.models.drafter_config import DrafterConfig
    from dspark_jax.models.presets import get_preset
    from dspark_jax.models.qwen3 import Qwen3
    from dspark_jax.train.drafter_task import DrafterTask

    class AbstractDrafterTask(DrafterTask):
        """The drafter task seen by the compiler: shapes and shardings, nothing loaded."""

        def _read_target_config(self):
            d = self.cfg.target.dir
            if d and os.path.isfile(os.path.join(d, "config.json")):
                return super()._read_target_config()
            preset = self.cfg.target.preset
            if not preset:
                raise FileNotFoundError(
                    f"--aot needs the target's shape: target.dir = {d!r} holds no config.json "
                    "and target.preset is not set (e.g. --config.target.preset=qwen3-8b)"
                )
            if self._target_config is None:
                self._target_config = get_preset(preset)
            return self._target_config

        @property
        def drafter_config(self) -> DrafterConfig:
            if self._drafter_config is None:
                d = self.cfg.drafter
                try:  # the real mask id when a tokenizer is at hand
                    mask_id = self.tokenizer.mask_id
                except (FileNotFoundError, ValueError):
                    # Compilation depends on shapes only; any in-vocabulary id will do.
                    mask_id = self.model_config().vocab_size - 1
                dc = DrafterConfig.from_section(d, mask_id)
                self._drafter_config = dc.resolve(self.model_config())
            return self._drafter_config

        def abstract_frozen_params(self, mesh):
            """The frozen target as sharded ``ShapeDtypeStruct``s (``target.dtype``), laid
            out by the rules table exactly as ``frozen_params`` places the loaded weights."""
            fcfg = self.frozen_config()
            boxed = jax.eval_shape(
                lambda: Qwen3(fcfg).init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))["params"]
            )
            return abstract_tree(boxed, mesh)

        def batch_shapes(self, batch_size: int):
            """The distillation batch (``data/distill.py``): tokens, loss_mask ``[B, T]``,
            length ``[B]``, all int32."""
            t = self.cfg.data.seq_len
            return {
                "tokens": jax.ShapeDtypeStruct((batch_size, t), jnp.int32),
                "loss_mask": jax.ShapeDtypeStruct((batch_size, t), jnp.int32),
                "length": jax.ShapeDtypeStruct((batch_size,), jnp.int32),
            }

    return AbstractDrafterTask(cfg)


# ----------------------------------------------------------------------------------------
# Training step
# ----------------------------------------------------------------------------------------
def compile_train_step(
    cfg, mesh, device_memory_gb: float | None = None, task=None
) -> tuple[dict[str, Any], Any]:
    """Lower and compile the training step of ``cfg`` for ``mesh``; returns (report, compiled).

    The step is the loop's own (``trainer.make_train_step``), with the same shardings and
    donation, so the report is for the executable ``train.py`` would run.
    """
    from dspark_jax.train.trainer import build_state_spec, check_mesh_and_batch, make_train_step

    task = task or aot_task(cfg)
    check_mesh_and_batch(cfg, mesh)
    rep = NamedSharding(mesh, PartitionSpec())
    # "auto" attention backends resolve for the mesh's chips, not this host's.
    platform = compile_platform(mesh.devices.flat[0].platform)
    with jax.set_mesh(mesh), shd.rules_context(mesh), platform:
        spec = build_state_spec(task, cfg, mesh)
        frozen, frozen_sh = abstract_frozen(task, mesh)
        batch = abstract_batch(task, cfg.data.batch_size, mesh)
        batch_sh = jax.tree.map(lambda x: x.sharding, batch)
        step = jax.jit(
            make_train_step(task, spec.tx, spec.schedule),
            in_shardings=(spec.shardings, frozen_sh, batch_sh),
            out_shardings=(spec.shardings, rep),
            donate_argnums=(0,),
        )
        t0 = time.perf_counter()
        lowered = step.lower(spec.abstract, frozen, batch)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
    params, opt_state = spec.abstract.params, spec.abstract.opt_state
    report = {
        "kind": "train_step",
        **compiler_info(mesh),
        "task": task.name,
        "mesh": dict(mesh.shape),
        "num_devices": int(mesh.size),
        "batch_size": int(cfg.data.batch_size),
        "seq_len": int(cfg.data.seq_len),
        "compute_dtype": cfg.train.compute_dtype,
        "remat": _remat_of(task),
        "anchors_per_seq": _anchors_of(cfg),
        "lower_s": round(t1 - t0, 2),
        "compile_s": round(t2 - t1, 2),
        "trainable_params": param_count(params),
        "frozen_params": param_count(frozen),
        "per_device": {
            "params_bytes": per_device_bytes(params),
            "opt_state_bytes": per_device_bytes(opt_state),
            "frozen_bytes": per_device_bytes(frozen),
            "batch_bytes": per_device_bytes(batch),
        },
        "global": {
            "params_bytes": global_bytes(params),
            "opt_state_bytes": global_bytes(opt_state),
            "frozen_bytes": global_bytes(frozen),
        },
        "memory": memory_fields(compiled),
    }
    return with_fit(report, device_memory_gb), compiled


def _anchors_of(cfg) -> int | None:
    """Supervised draft blocks per sequence (drafter tasks; None for the others)."""
    drafter = cfg.get("drafter")
    return None if drafter is None else drafter.get("anchors_per_seq")


def _remat_of(task) -> str | None:
    try:
        return getattr(task.model_config(), "remat", None)
    except (ValueError, FileNotFoundError):
        return None
