"""Checkpoint interop: Hugging Face Qwen3 directories <-> dspark_jax parameter trees."""

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
    "hf_state_dict_to_params",
    "hf_tensor_shapes",
    "load_hf",
    "param_shapes",
    "params_to_hf_state_dict",
    "read_hf_config",
    "save_hf",
]
