"""Offline evaluation (DESIGN §7): accepted length τ, position-wise acceptance,
confidence calibration (ECE/AUROC/Brier, reliability diagrams), STS fitting, threshold
sweeps and diagrams.

Command line::

    python -m dspark_jax.eval acceptance --target DIR --drafter DIR [--drafter DIR ...] \\
        --prompts FILE.jsonl [--prompts ...] [--temperature 0 1] [--gamma 7] --out results.json
    python -m dspark_jax.eval calibrate --target DIR --drafter DIR --prompts FILE.jsonl
    python -m dspark_jax.eval plot --results results.json --out-dir figures/

Modules: :mod:`~dspark_jax.eval.metrics` (numpy metrics), :mod:`~dspark_jax.eval.calibration`
(STS fit, ``sts.json``), :mod:`~dspark_jax.eval.acceptance` (jitted fixed-block runs),
:mod:`~dspark_jax.eval.prompts` (prompt formatting for a base code model),
:mod:`~dspark_jax.eval.plots` (PNG diagrams). Only the numpy-level modules are imported
here; ``acceptance`` and ``plots`` load JAX / matplotlib when imported.
"""

from dspark_jax.eval.calibration import STSResult, apply_sts, fit_sts, load_sts, save_sts
from dspark_jax.eval.metrics import (
    auroc,
    brier,
    conditional_acceptance,
    ece,
    mean_tau,
    position_calibration,
    reliability_bins,
    tau_per_round,
    threshold_sweep,
)
from dspark_jax.eval.prompts import format_prompt, load_prompts

__all__ = [
    "STSResult",
    "apply_sts",
    "auroc",
    "brier",
    "conditional_acceptance",
    "ece",
    "fit_sts",
    "format_prompt",
    "load_prompts",
    "load_sts",
    "mean_tau",
    "position_calibration",
    "reliability_bins",
    "save_sts",
    "tau_per_round",
    "threshold_sweep",
]
