"""AdamW with linear warm-up, cosine decay and global-norm clipping (DESIGN §4).

Defaults are DeepSpec's drafter recipe: lr 6e-4, weight decay 0, 4 % linear warm-up then
cosine, clip 1.0. Weight decay (when non-zero) skips 1-D parameters (norm scales), the
usual AdamW practice.
"""

from __future__ import annotations

import jax
import optax


def warmup_steps_for(steps: int, warmup_frac: float) -> int:
    """Number of warm-up steps: ``round(warmup_frac * steps)``, at least 1 when frac > 0."""
    if warmup_frac <= 0:
        return 0
    return max(1, round(warmup_frac * steps))


def make_schedule(
    lr: float, steps: int, warmup_frac: float = 0.04, min_lr_ratio: float = 0.0
) -> optax.Schedule:
    """Linear warm-up from 0 to ``lr``, then cosine decay to ``lr * min_lr_ratio`` at ``steps``."""
    if steps < 1:
        raise ValueError(f"train.steps must be >= 1, got {steps}")
    if not 0 <= warmup_frac < 1:
        raise ValueError(f"train.warmup_frac must be in [0, 1), got {warmup_frac}")
    if not 0 <= min_lr_ratio <= 1:
        raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    warmup = warmup_steps_for(steps, warmup_frac)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=lr,
        warmup_steps=warmup,
        # decay_steps counts the warm-up too: the cosine ends exactly at `steps`.
        decay_steps=max(steps, warmup + 1),
        end_value=lr * min_lr_ratio,
    )


def _decay_mask(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


def make_optimizer(train_cfg) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The optimizer and its schedule from a ``train`` config section."""
    schedule = make_schedule(
        train_cfg.lr, train_cfg.steps, train_cfg.warmup_frac, train_cfg.min_lr_ratio
    )
    parts = []
    if train_cfg.clip_norm and train_cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(train_cfg.clip_norm))
    parts.append(
        optax.adamw(
            schedule,
            b1=train_cfg.b1,
            b2=train_cfg.b2,
            eps=train_cfg.eps,
            weight_decay=train_cfg.weight_decay,
            mask=_decay_mask if train_cfg.weight_decay else None,
        )
    )
    return optax.chain(*parts), schedule
