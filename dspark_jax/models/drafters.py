"""Drafter registry/factory.

``make_drafter(drafter_config, target_config)`` resolves the config against the target and
returns the Linen module; ``init_drafter_params`` creates its (boxed, logically named)
parameters without touching the real target embedding (zeros stand in, shape-only).

All drafters share one ``draft`` signature (``models/draft_api.py``): a ``DraftContext``
whose rows are ``feature_dim(config, target)`` wide (or cached K/V rows), the anchors, a
key, ``SamplingSettings``, and the target's embedding / LM head.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.models.draft_api import DraftContext, DraftOutput, SamplingSettings
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.dspark import DSparkDrafter
from dspark_jax.models.eagle3 import Eagle3Drafter
from dspark_jax.models.mtp import MTPDrafter
from dspark_jax.models.qwen3 import Qwen3Config

__all__ = [
    "DraftContext",
    "DraftOutput",
    "SamplingSettings",
    "DrafterConfig",
    "DSparkDrafter",
    "Eagle3Drafter",
    "MTPDrafter",
    "feature_dim",
    "init_drafter_params",
    "make_drafter",
]

_REGISTRY: dict[str, type[nn.Module]] = {
    "dspark": DSparkDrafter,
    "dflash": DSparkDrafter,
    "eagle3": Eagle3Drafter,
    "mtp1": MTPDrafter,
}


def make_drafter(drafter_config: DrafterConfig, target_config: Qwen3Config) -> nn.Module:
    """The drafter module for ``drafter_config`` (resolved against ``target_config``)."""
    if not isinstance(drafter_config, DrafterConfig):
        raise ValueError(f"make_drafter needs a DrafterConfig, got {type(drafter_config).__name__}")
    if not isinstance(target_config, Qwen3Config):
        raise ValueError(f"make_drafter needs a Qwen3Config, got {type(target_config).__name__}")
    resolved = drafter_config.resolve(target_config)
    return _REGISTRY[resolved.kind](config=resolved, target=target_config)


def feature_dim(drafter_config: DrafterConfig, target_config: Qwen3Config) -> int:
    """Width of one context feature row: ``len(taps)·d`` (MTP-1: ``d``, the final hidden)."""
    return drafter_config.resolve(target_config).feature_width(target_config)


def init_drafter_params(drafter: nn.Module, rng: jax.Array):
    """Boxed (``nn.Partitioned``) parameters of ``drafter`` from tiny dummy inputs.

    The target embedding / LM head are shape-only stand-ins (callables returning zeros), so
    nothing of target size is allocated; wrap in ``jax.eval_shape`` for an abstract tree.
    """
    cfg, tgt = drafter.config, drafter.target
    d, v = tgt.hidden_size, tgt.vocab_size
    embed = lambda ids: jnp.zeros(ids.shape + (d,), tgt.compute_dtype)
    lm_head = lambda h: jnp.zeros(h.shape[:-1] + (v,), jnp.float32)
    f = feature_dim(cfg, tgt)
    t = cfg.gamma + 2
    feats = jnp.zeros((1, t, f), tgt.compute_dtype)
    valid = jnp.ones((1, t), bool)
    if cfg.parallel_block:
        args = (
            feats,
            valid,
            jnp.zeros((1, cfg.gamma), jnp.int32),
            jnp.zeros((1,), jnp.int32),
            jnp.ones((1,), jnp.int32),
            embed,
            lm_head,
        )
    else:
        args = (feats, jnp.zeros((1, t), jnp.int32), valid, embed, lm_head)
    # Jitted: eager init dispatches every op separately, which is slow on CPU.
    init = jax.jit(lambda key: drafter.init(key, *args, method="train_forward")["params"])
    return init(rng)
