"""Loading the models a server runs: a Hugging Face Qwen3 target directory and an optional
drafter directory (weights, config and its STS calibration)."""

from __future__ import annotations

from dspark_jax.tokenizer import Tokenizer


def load_models(target_dir: str, drafter_dir: str | None = None, dtype=None):
    """``(target, target_params, tokenizer, drafter, drafter_params, sts)`` from a Hugging
    Face Qwen3 directory (with ``tokenizer.json``) and an optional drafter directory;
    ``sts`` is the drafter's calibration from its ``sts.json`` (or None)."""
    import os

    from dspark_jax.convert import load_hf
    from dspark_jax.eval.calibration import load_sts
    from dspark_jax.models.qwen3 import Qwen3

    if not os.path.isdir(target_dir):
        raise FileNotFoundError(f"target model directory {target_dir} does not exist")
    config, params = load_hf(target_dir, dtype=dtype)
    tokenizer = Tokenizer(target_dir)
    target = Qwen3(config)
    drafter = drafter_params = sts = None
    if drafter_dir is not None:
        if not os.path.isdir(drafter_dir):
            raise FileNotFoundError(f"drafter directory {drafter_dir} does not exist")
        from dspark_jax.models.drafter_io import load_drafter

        drafter, drafter_params = load_drafter(drafter_dir, config)
        gamma = drafter.config.draft_len
        sts = load_sts(drafter_dir, gamma)
    return target, params, tokenizer, drafter, drafter_params, sts


__all__ = ["load_models"]
