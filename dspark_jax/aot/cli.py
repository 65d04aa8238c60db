"""``train.py --aot`` / ``--aot-serve``: the mesh, the program and its report."""

from __future__ import annotations

from typing import Any

from dspark_jax import sharding as shd
from dspark_jax.aot.serve_round import compile_serve_round
from dspark_jax.aot.topology import parse_mesh, topology_devices
from dspark_jax.aot.train_step import aot_task, compile_train_step


# ----------------------------------------------------------------------------------------
# CLI glue (train.py --aot)
# ----------------------------------------------------------------------------------------
def serve_configs(task) -> tuple[Any, Any]:
    """``(target Qwen3Config, DrafterConfig)`` of a drafter task, for ``--aot-serve``."""
    if task.name != "drafter":
        raise ValueError(f"--aot-serve needs a drafter config (task 'drafter'), got {task.name!r}")
    return task.frozen_config(), task.drafter_config


def aot_mesh(mesh_text: str | None, mesh_cfg=None, topology: str | None = None):
    """The ``(data, fsdp, tensor)`` mesh to compile for: over the devices of a TPU
    ``topology`` when given, else over this process's (fake CPU) devices."""
    devices = topology_devices(topology) if topology else None
    mesh = shd.make_mesh(*parse_mesh(mesh_text, mesh_cfg), devices=devices)
    return mesh


def run_cli(cfg, args) -> dict[str, Any]:
    topology = getattr(args, "aot_topology", None)
    mesh = aot_mesh(args.aot_mesh, cfg.get("mesh"), topology)
    task = aot_task(cfg)
    if args.aot_serve:
        tcfg, dcfg = serve_configs(task)
        report, _ = compile_serve_round(
            tcfg, dcfg, mesh, args.slots, args.max_len, device_memory_gb=args.aot_device_memory_gb
        )
    else:
        report, _ = compile_train_step(cfg, mesh, args.aot_device_memory_gb, task=task)
    if topology:
        report["topology"] = topology
    return report
