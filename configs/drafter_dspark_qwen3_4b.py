"""DSpark drafter for Qwen3-4B: the Qwen3-8B recipe (configs/drafter_dspark_qwen3_8b.py:
5 layers, Markov rank 256, γ = 7, bf16 compute / fp32 master weights, FSDP) on this target.

    python train.py --config configs/drafter_dspark_qwen3_4b.py --workdir WD \
        --config.target.dir=QWEN3_4B_DIR --config.data.data_dir=DISTILL_DIR
    python train.py --config configs/drafter_dspark_qwen3_4b.py --aot --aot-devices 64
"""

import os

from dspark_jax.config import load_config_file

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafter_dspark_qwen3_8b.py")


def get_config():
    return load_config_file(_BASE + ":qwen3-4b")
