"""Tiny Qwen3 LM for tests and smoke runs: the "tiny" preset, vocabulary = the tokenizer's.

    python train.py --config configs/tiny/target_tiny.py --workdir /tmp/tiny \
        --config.data.data_dir=DIR --config.data.tokenizer=DIR/tokenizer.json
"""

from dspark_jax.config import update_config
from dspark_jax.testing import smoke_schedule
from dspark_jax.train.trainer import default_config


def get_config():
    return update_config(
        default_config(),
        task="lm",
        model=dict(preset="tiny", vocab_size=None),  # None: match the tokenizer
        data=dict(data_dir="", tokenizer="", seq_len=64, batch_size=8),
        train=smoke_schedule(steps=40, eval_every=20, eval_batches=2, checkpoint_every=10),
    )
