"""The bundled models' training recipe (DESIGN §8), in one place: every bundled drafter
gets the same target, data, steps, batch, optimiser and schedule by construction, and the
bundled target shares the schedule.

Each ``configs/drafter_<name>.py`` (dspark, dspark_rnn, dflash, eagle3, mtp1) is trained
and exported by ``scripts/build_bundled_models.sh``:

    python train.py --config configs/drafter_<name>.py --workdir workdirs/drafter_<name>
    python -m dspark_jax.export --workdir workdirs/drafter_<name> --out assets/drafters/<name>

against the "pycode-small" target in ``assets/target`` (d = 256, 6 layers, vocab 8192,
tied embeddings) on its self-distillation data in ``data/distill``.
"""

from __future__ import annotations

from dspark_jax.config import update_config
from dspark_jax.train.drafter_schema import drafter_default_config

# 400 steps x 8 sequences x 384 tokens (128-token prompt + 256 generated) = 1.2M tokens,
# about two epochs of the 1536 distilled training prompts. 100 steps (the first bundled
# release) left every backbone close to its initialisation.
BUNDLED_STEPS = 400

# Optimiser schedule of the bundled target and drafters. DeepSpec uses lr 6e-4 for long
# runs; short CPU runs need more.
BUNDLED_SCHEDULE = dict(
    lr=1e-3, warmup_frac=0.04, min_lr_ratio=0.1, log_every=10, checkpoint_every=100
)


def bundled_drafter_config(kind: str, **drafter):
    """A drafter config of ``kind`` with the bundled models' common training budget;
    ``drafter`` sets the arm's own ``drafter.*`` fields (γ, depth, head, ...)."""
    return update_config(
        drafter_default_config(kind),
        # N: 32 blocks x 7 = 224 label positions of ~256 generated
        drafter=dict(anchors_per_seq=32, eval_anchors_per_seq=32, **drafter),
        target=dict(dir="assets/target", dtype="float32"),
        data=dict(data_dir="data/distill", seq_len=384, batch_size=8),
        train=dict(
            steps=BUNDLED_STEPS, eval_every=100, eval_batches=4, keep_checkpoints=2,
            **BUNDLED_SCHEDULE,
        ),
    )  # fmt: skip
