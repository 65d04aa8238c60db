"""Tiny drafter runs for tests and smoke checks: ``--config configs/drafter_tiny.py:KIND``
with KIND in dspark | dspark_rnn | dflash | eagle3 | mtp1 (default dspark).

    python train.py --config configs/drafter_tiny.py:dspark --workdir /tmp/d \
        --config.target.dir=TARGET_HF_DIR --config.data.data_dir=DISTILL_DIR
"""

from dspark_jax.train.drafter_task import drafter_default_config


def get_config(kind: str = "dspark"):
    head = None
    if kind == "dspark_rnn":
        kind, head = "dspark", "rnn"
    cfg = drafter_default_config(kind)
    d = cfg.drafter
    d.gamma = 1 if kind == "mtp1" else 4
    d.num_layers = 1
    d.head = head
    d.markov_rank = 16
    d.rnn_rank = 16
    d.anchors_per_seq = 4
    d.eval_anchors_per_seq = 4
    cfg.target.dir = ""
    cfg.data.data_dir = ""
    cfg.data.seq_len = 32
    cfg.data.batch_size = 8
    cfg.train.steps = 12
    cfg.train.lr = 3e-3
    cfg.train.warmup_frac = 0.1
    cfg.train.log_every = 1
    cfg.train.eval_every = 6
    cfg.train.eval_batches = 1
    cfg.train.checkpoint_every = 4
    cfg.train.keep_checkpoints = 2
    return cfg
