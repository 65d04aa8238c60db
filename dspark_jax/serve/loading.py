"""The models a server runs, in ``Engine``'s argument order, read by the one directory
loader (``convert/loading.py``)."""

from __future__ import annotations

import dataclasses

from dspark_jax.convert.loading import load_drafter_dir, load_target
from dspark_jax.models.qwen3 import Qwen3


def load_models(
    target_dir: str,
    drafter_dir: str | None = None,
    dtype=None,
    mesh=None,
    survival_estimator: str | None = None,
):
    """``(target, target_params, tokenizer, drafter, drafter_params, sts)`` from a Hugging
    Face Qwen3 directory and an optional drafter directory (``sts``: the calibration of
    its survival estimate, ``LoadedDrafter.calibration``; ``survival_estimator`` as
    ``convert.loading.load_drafter_dir`` takes it). ``dtype`` (a name: float32, bfloat16, float16) sets the
    weights and the compute dtype of both models (None: as the loaders read them).
    ``mesh``: the target's weights are read straight onto it (``decode.mesh``); pass the
    same mesh to ``Engine``."""
    target = load_target(target_dir, dtype=dtype, check_tokenizer=False, mesh=mesh)
    if dtype is not None:  # the loader casts the weights; compute in the same dtype
        config = target.config.replace(dtype=target.config.param_dtype)
        target = dataclasses.replace(target, module=Qwen3(config), config=config)
    if drafter_dir is None:
        return target.module, target.params, target.tokenizer, None, None, None
    d = load_drafter_dir(drafter_dir, target, survival_estimator=survival_estimator)
    return target.module, target.params, target.tokenizer, d.module, d.params, d.calibration


__all__ = ["load_models"]
