"""The shared budget of the bundled drafters (DESIGN §8): one place, so every arm gets the
same target, data, steps, batch, optimiser and schedule by construction."""

from __future__ import annotations

from dspark_jax.train.drafter_task import drafter_default_config

# 400 steps x 8 sequences x 384 tokens (128-token prompt + 256 generated) = 1.2M tokens,
# about two epochs of the 1536 distilled training prompts. 100 steps (the first bundled
# release) left every backbone close to its initialisation.
BUNDLED_STEPS = 400


def bundled_drafter_config(kind: str):
    """A drafter config of ``kind`` with the bundled models' common training budget."""
    cfg = drafter_default_config(kind)
    d = cfg.drafter
    d.anchors_per_seq = 32  # N: 32 blocks x 7 = 224 label positions of ~256 generated
    d.eval_anchors_per_seq = 32
    cfg.target.dir = "assets/target"
    cfg.target.dtype = "float32"
    cfg.data.data_dir = "data/distill"
    cfg.data.seq_len = 384
    cfg.data.batch_size = 8
    cfg.train.steps = BUNDLED_STEPS
    cfg.train.lr = 1e-3  # DeepSpec uses 6e-4 for long runs; short CPU runs need more
    cfg.train.warmup_frac = 0.04
    cfg.train.min_lr_ratio = 0.1
    cfg.train.log_every = 10
    cfg.train.eval_every = 100
    cfg.train.eval_batches = 4
    cfg.train.checkpoint_every = 100
    cfg.train.keep_checkpoints = 2
    return cfg
