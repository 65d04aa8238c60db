"""Checkpoint interop: Hugging Face Qwen3 directories and DeepSpec drafter checkpoints
<-> dspark_jax parameter trees."""

from dspark_jax.convert.deepspec import load_deepspec_drafter, save_deepspec_drafter
from dspark_jax.convert.hf_qwen3 import (
    hf_state_dict_to_params,
    hf_tensor_shapes,
    load_hf,
    param_shapes,
    params_to_hf_state_dict,
    read_hf_config,
    save_hf,
)

__all__ = [
    "load_deepspec_drafter",
    "save_deepspec_drafter",
    "hf_state_dict_to_params",
    "hf_tensor_shapes",
    "load_hf",
    "param_shapes",
    "params_to_hf_state_dict",
    "read_hf_config",
    "save_hf",
]
