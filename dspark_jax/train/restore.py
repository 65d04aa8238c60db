"""Reading a training workdir back: its run config and a checkpoint's parameters on one
device (used by ``dspark_jax.export`` and the drafter export)."""

from __future__ import annotations

import json
import os
from typing import Any

import ml_collections

__all__ = ["load_run_config", "restore_params"]


def load_run_config(workdir: str) -> ml_collections.ConfigDict:
    from dspark_jax.train.trainer import CONFIG_FILE

    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} not found: --workdir must be a directory written by train.py"
        )
    with open(path) as f:
        return ml_collections.ConfigDict(json.load(f))


def restore_params(
    workdir: str, step: int | None = None, tasks: tuple[str, ...] = ("lm",)
) -> tuple[Any, Any, int, Any, dict[str, Any]]:
    """``(cfg, model_config, step, params, meta)`` of a workdir's checkpoint, on one device
    (its trainable params and the task's ``checkpoint_meta``; ``tasks`` = the task names the
    caller can export)."""
    import jax

    from dspark_jax import sharding as shd
    from dspark_jax.train.checkpoint import Checkpointer
    from dspark_jax.train.state import TrainState
    from dspark_jax.train.trainer import CHECKPOINT_DIR, build_state_spec, make_task

    cfg = load_run_config(workdir)
    task = make_task(cfg)
    if task.name not in tasks:
        raise ValueError(f"{workdir} trained task {task.name!r}; this export handles {list(tasks)}")
    model_config = task.model_config()
    ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"No checkpoints in {workdir} (expected {ckpt_dir})")
    ckpt = Checkpointer(ckpt_dir, keep=cfg.train.keep_checkpoints, use_async=False)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise FileNotFoundError(f"No finished checkpoint in {ckpt_dir}")
        if step is None:
            step = max(steps)
        elif step not in steps:
            raise ValueError(f"No checkpoint for step {step} in {ckpt_dir}; available: {steps}")
        mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
        with jax.set_mesh(mesh), shd.rules_context(mesh):
            spec = build_state_spec(task, cfg, mesh)
            abstract = spec.abstract.to_dict()
            ckpt.check_compatible(step, abstract)
            state = TrainState.from_dict(ckpt.restore(step, abstract))
        meta = ckpt.meta(step)
    finally:
        ckpt.close()
    return cfg, model_config, step, state.params, meta
