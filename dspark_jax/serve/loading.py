"""The models a server runs, in ``Engine``'s argument order, read by the one directory
loader (``convert/loading.py``)."""

from __future__ import annotations

from dspark_jax.convert.loading import load_drafter_dir, load_target


def load_models(target_dir: str, drafter_dir: str | None = None, dtype=None):
    """``(target, target_params, tokenizer, drafter, drafter_params, sts)`` from a Hugging
    Face Qwen3 directory and an optional drafter directory (``sts``: its calibration from
    ``sts.json``, or None)."""
    target = load_target(target_dir, dtype=dtype, check_tokenizer=False)  # Engine checks
    if drafter_dir is None:
        return target.module, target.params, target.tokenizer, None, None, None
    d = load_drafter_dir(drafter_dir, target)
    return target.module, target.params, target.tokenizer, d.module, d.params, d.sts


__all__ = ["load_models"]
