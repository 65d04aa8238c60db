"""Tiny Qwen3 LM for tests and smoke runs: the "tiny" preset, vocabulary = the tokenizer's.

    python train.py --config configs/target_tiny.py --workdir /tmp/tiny \
        --config.data.data_dir=DIR --config.data.tokenizer=DIR/tokenizer.json
"""

from dspark_jax.train.trainer import default_config


def get_config():
    cfg = default_config()
    cfg.task = "lm"
    cfg.model.preset = "tiny"
    cfg.model.vocab_size = None  # match the tokenizer
    cfg.data.data_dir = ""
    cfg.data.tokenizer = ""
    cfg.data.seq_len = 64
    cfg.data.batch_size = 8
    cfg.train.steps = 40
    cfg.train.lr = 3e-3
    cfg.train.warmup_frac = 0.1
    cfg.train.log_every = 1
    cfg.train.eval_every = 20
    cfg.train.eval_batches = 2
    cfg.train.checkpoint_every = 10
    cfg.train.keep_checkpoints = 2
    return cfg
