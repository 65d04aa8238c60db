"""The bundled target (DESIGN §8): "pycode-small" Qwen3 (~6.8M params, vocab 8192,
1024 positions) trained on the Python standard library's sources.

    python -m dspark_jax.data.prepare --kind source_tree --data-dir data/stdlib \
        --train-tokenizer --vocab-size 8192
    python train.py --config configs/bundled/target_pycode.py --workdir workdirs/target_pycode

Sized for <= ~50 minutes on 2 busy CPU cores: measured ~600 tokens/s (load ~7 from other
jobs), so 900 steps x 8 x 256 = 1.84M tokens (~0.2 epoch of the ~8.5M-token train split).
"""

from dspark_jax.config import update_config
from dspark_jax.train.bundled import BUNDLED_SCHEDULE
from dspark_jax.train.trainer import default_config


def get_config():
    return update_config(
        default_config(),
        task="lm",
        model=dict(preset="pycode-small", vocab_size=8192),
        data=dict(data_dir="data/stdlib", tokenizer="data/stdlib/tokenizer.json", seq_len=512,
                  batch_size=4),
        train=dict(steps=900, eval_every=150, eval_batches=8, keep_checkpoints=3,
                   **BUNDLED_SCHEDULE),
    )  # fmt: skip
