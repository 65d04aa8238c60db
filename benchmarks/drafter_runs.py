"""One drafter training run as a benchmark point: ``train.py`` in a subprocess (it resumes
a killed run when called again), then the run's final held-out evaluation. Shared by
``drafter_data_curve.py`` and ``drafter_ablation.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def final_eval(workdir: str) -> dict:
    from dspark_jax.train.trainer import read_metrics

    evals = [m for m in read_metrics(workdir) if m.get("kind") == "eval"]
    if not evals:
        raise RuntimeError(f"{workdir}: the run logged no evaluation")
    return evals[-1]


def _latest_checkpoint(workdir: str):
    """``(checkpointer, latest step)`` of a run's workdir; ``(None, None)`` before its first
    checkpoint (nothing is created)."""
    from dspark_jax.train.checkpoint import Checkpointer
    from dspark_jax.train.trainer import CHECKPOINT_DIR

    path = os.path.join(workdir, CHECKPOINT_DIR)
    if not os.path.isdir(path):
        return None, None
    ckpt = Checkpointer(path, use_async=False)
    return ckpt, ckpt.latest_step()


def run_target_weights(workdir: str) -> str | None:
    """The weights fingerprint of the target the run trained against, from its last
    checkpoint's metadata (``summarize.py`` flags results measured on other models)."""
    ckpt, step = _latest_checkpoint(workdir)
    return None if step is None else ckpt.meta(step).get("target_fingerprint")


def train_wall_s(workdir: str) -> float | None:
    """Wall seconds of the run, recorded only when one call trained it from its first step
    to its last; ``None`` for a run resumed after a kill (its calls' times are not one
    run's) or trained by another script (e.g. ``scripts/build_bundled_models.sh``)."""
    path = os.path.join(workdir, "wall_s.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)["wall_s"]
    return None


def train_point(config: str, workdir: str, overrides: list[str] = ()) -> dict:
    """Train ``config`` (``path[:arg]``) with ``--config.KEY=VALUE`` ``overrides`` into
    ``workdir`` and return its final held-out evaluation with the wall time (``None``
    unless this call trained the run from scratch, ``train_wall_s``)."""
    cmd = [
        sys.executable, os.path.join(ROOT, "train.py"), "--config", config,
        "--workdir", workdir, "--no-progress", *[f"--config.{o}" for o in overrides],
    ]  # fmt: skip
    print("+", " ".join(cmd), flush=True)
    from_scratch = _latest_checkpoint(workdir)[1] is None
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    if from_scratch and train_wall_s(workdir) is None:
        with open(os.path.join(workdir, "wall_s.json"), "w") as f:
            json.dump({"wall_s": round(time.perf_counter() - t0, 1)}, f)
    ev = final_eval(workdir)
    return {
        "step": ev["step"],
        "heldout_tau_tf": ev["heldout_tau_tf"],
        "heldout_accept_mean": ev["heldout_accept_mean"],
        "heldout_loss": ev["heldout_loss"],
        "heldout_label_positions": ev["heldout_label_positions"],
        "wall_s": train_wall_s(workdir),
        "target_weights": run_target_weights(workdir),
    }
