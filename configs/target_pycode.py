"""The bundled target (DESIGN §8): "pycode-small" Qwen3 (~6.8M params, vocab 8192,
1024 positions) trained on the Python standard library's sources.

    python -m dspark_jax.data.prepare --kind source_tree --data-dir data/stdlib \
        --train-tokenizer --vocab-size 8192
    python train.py --config configs/target_pycode.py --workdir workdirs/target_pycode

Sized for <= ~50 minutes on 2 busy CPU cores: measured ~600 tokens/s (load ~7 from other
jobs), so 900 steps x 8 x 256 = 1.84M tokens (~0.2 epoch of the ~8.5M-token train split).
"""

from dspark_jax.train.trainer import default_config


def get_config():
    cfg = default_config()
    cfg.task = "lm"
    cfg.model.preset = "pycode-small"
    cfg.model.vocab_size = 8192
    cfg.data.data_dir = "data/stdlib"
    cfg.data.tokenizer = "data/stdlib/tokenizer.json"
    cfg.data.seq_len = 512
    cfg.data.batch_size = 4
    cfg.train.steps = 900
    cfg.train.lr = 1e-3
    cfg.train.warmup_frac = 0.04
    cfg.train.min_lr_ratio = 0.1
    cfg.train.log_every = 10
    cfg.train.eval_every = 150
    cfg.train.eval_batches = 8
    cfg.train.checkpoint_every = 100
    cfg.train.keep_checkpoints = 3
    return cfg
