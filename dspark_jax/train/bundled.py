"""The bundled models' training recipe (DESIGN §8), in one place: every bundled drafter
gets the same target, data, batch, optimiser, schedule and training *compute* by
construction (its step count is the shared FLOPs budget over its own FLOPs per step), and
the bundled target shares the schedule.

Each ``configs/bundled/drafter_<name>.py`` (dspark, dspark_rnn, dflash, eagle3, mtp1) is trained
and exported by ``scripts/build_bundled_models.sh``:

    python train.py --config configs/bundled/drafter_<name>.py --workdir workdirs/drafter_<name>
    python -m dspark_jax.export --workdir workdirs/drafter_<name> --out assets/drafters/<name>

against the "pycode-small" target in ``assets/target`` (d = 256, 6 layers, vocab 8192,
tied embeddings) on its self-distillation data in ``data/distill``. ``--config
configs/bundled/drafter_<name>.py:steps`` gives the equal-steps comparison run instead (every arm
``BUNDLED_STEPS`` steps, whatever its FLOPs).
"""

from __future__ import annotations

from dspark_jax.config import update_config
from dspark_jax.train.drafter_schema import drafter_default_config

# 400 steps x 8 sequences x 384 tokens (128-token prompt + 256 generated) = 1.2M tokens,
# about one epoch of the 3072 distilled training prompts (the drafter-quality curve is flat
# from 768 to 3072 prompts at this budget: benchmarks/drafter_data_curve.py). 100 steps
# (the first bundled release) left every backbone close to its initialisation.
BUNDLED_STEPS = 400

# Optimiser schedule of the bundled target and drafters. DeepSpec uses lr 6e-4 for long
# runs; short CPU runs need more.
BUNDLED_SCHEDULE = dict(
    lr=1e-3, warmup_frac=0.04, min_lr_ratio=0.1, log_every=10, checkpoint_every=100
)


# XLA's FLOPs for one training step of each bundled arm, in GFLOP: the compiled CPU step
# of ``train.py`` (frozen-target forward, drafter forward/backward and optimiser; every
# model loop unrolled), from ``python benchmarks/train_budget.py``
# (benchmarks/results/train_budget.json); tests/perf/test_train_cost.py recomputes them.
BUNDLED_STEP_GFLOPS = {
    "dspark": 108.53,
    "dspark_rnn": 115.31,
    "dflash": 85.85,
    "eagle3": 207.04,
    "mtp1": 59.57,
}
# The shared budget: BUNDLED_STEPS steps of the DSpark (Markov) arm, 43.4 TFLOP.
BUDGET_ARM = "dspark"


def equal_compute_steps(arm: str) -> int:
    """Steps that give ``arm`` the bundled FLOPs budget (``BUNDLED_STEPS`` steps of the
    budget arm), rounded to the nearest step."""
    if arm not in BUNDLED_STEP_GFLOPS:
        raise KeyError(
            f"no step FLOPs for bundled arm {arm!r}; known: {sorted(BUNDLED_STEP_GFLOPS)}"
        )
    budget = BUNDLED_STEPS * BUNDLED_STEP_GFLOPS[BUDGET_ARM]
    return round(budget / BUNDLED_STEP_GFLOPS[arm])


def bundled_drafter_config(kind: str, *, arm: str, budget: str = "compute", **drafter):
    """A drafter config of ``kind`` with the bundled models' common training recipe.

    ``arm``: the bundled arm's name (a key of ``BUNDLED_STEP_GFLOPS``); ``budget``:
    ``"compute"`` (default; equal training FLOPs, :func:`equal_compute_steps`) or
    ``"steps"`` (``BUNDLED_STEPS`` for every arm, the equal-steps comparison row);
    ``drafter`` sets the arm's own ``drafter.*`` fields (γ, depth, head, ...)."""
    if budget not in ("compute", "steps"):
        raise ValueError(f"budget must be 'compute' or 'steps', got {budget!r}")
    steps = equal_compute_steps(arm) if budget == "compute" else BUNDLED_STEPS
    return update_config(
        drafter_default_config(kind),
        # N: 32 blocks x 7 = 224 label positions of ~256 generated
        drafter=dict(anchors_per_seq=32, eval_anchors_per_seq=32, **drafter),
        target=dict(dir="assets/target", dtype="float32"),
        data=dict(data_dir="data/distill", seq_len=384, batch_size=8),
        # eval: 16 x 8 sequences = the whole 128-record held-out split of data/distill
        train=dict(
            steps=steps, eval_every=100, eval_batches=16, keep_checkpoints=2,
            **BUNDLED_SCHEDULE,
        ),
    )  # fmt: skip
