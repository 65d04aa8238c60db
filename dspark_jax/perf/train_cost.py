"""Training compute per step, from XLA's cost analysis of the compiled training step.

The bundled drafters are compared at an equal *compute* budget (issue: equal training
FLOPs, not equal steps): an EAGLE-3 step evaluates the LM head at every position for each
of its γ unrolled steps, a DSpark step only at the supervised block positions, so equal
steps gave EAGLE-3 ~1.9× the FLOPs (and 2.6× the wall time on CPU).

:func:`train_step_flops` compiles ``train.py``'s own step (``aot.compile_train_step``:
same loss, optimiser and donation; the frozen target's forward included) for one device
and reads ``compiled.cost_analysis()``. XLA counts a while loop's body once, so the
target's layer scan is unrolled here, the sequential heads' teacher-forced scan is
unrolled in the model (``models.heads.teacher_forced_bias``), and a loop that remains
(other than the threefry loops of ``jax.random``, which do no model work) is an error
rather than an undercount.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from dspark_jax.perf.roofline import _OP_NAME, cost_of

_WHILE = re.compile(r"while\(.*?body=%?([\w.\-]+)")
_RNG_OPS = ("threefry", "_uniform", "random_bits", "random_split", "random_fold_in")


def _computation_text(hlo: str, name: str) -> str:
    """The text of computation ``name`` (header line to its closing brace)."""
    start = re.search(rf"^\s*%?{re.escape(name)}\s*\(", hlo, re.M)
    if start is None:
        return ""
    end = hlo.find("\n}", start.end())
    return hlo[start.start() : end if end >= 0 else len(hlo)]


def model_loops(hlo: str) -> list[list[str]]:
    """The while loops of a compiled program that do model work, each as the op names in
    its body (random-number loops are left out)."""
    loops = []
    for m in _WHILE.finditer(hlo):
        names = sorted(set(_OP_NAME.findall(_computation_text(hlo, m.group(1)))))
        if not any(tag in n for n in names for tag in _RNG_OPS):
            loops.append(names)
    return loops


def train_step_flops(cfg) -> dict[str, Any]:
    """``{"flops", "bytes", "tokens"}`` of one training step of ``cfg`` (a drafter or
    target config) on one device: XLA's figures for the compiled step with every model
    loop unrolled; ``tokens`` = batch × seq_len."""
    from dspark_jax import aot

    task = aot.aot_task(cfg)
    if hasattr(task, "_read_target_config"):  # a drafter task: unroll its frozen target
        read = task._read_target_config
        task._read_target_config = lambda: read().replace(scan_layers=False)
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    _, compiled = aot.compile_train_step(cfg, mesh, task=task)
    loops = model_loops(compiled.as_text())
    if loops:
        raise RuntimeError(
            f"{len(loops)} while loop(s) with model work remain in the compiled step (XLA "
            f"counts their bodies once, so its FLOPs would be too low); first: {loops[0][:3]}"
        )
    return {**cost_of(compiled), "tokens": int(cfg.data.batch_size * cfg.data.seq_len)}


__all__ = ["model_loops", "train_step_flops"]
