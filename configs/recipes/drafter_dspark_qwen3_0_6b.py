"""DSpark drafter for Qwen3-0.6B: the Qwen3-8B recipe (``drafter_dspark_qwen3_8b.py``, whose
docstring has the commands) with this target's shape."""

import os

from dspark_jax.config import load_config_file


def get_config():
    here = os.path.dirname(os.path.abspath(__file__))
    return load_config_file(os.path.join(here, "drafter_dspark_qwen3_8b.py") + ":qwen3-0.6b")
