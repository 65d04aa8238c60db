"""The drafter run's config schema (DESIGN §4): every key of a ``task = "drafter"`` run with
its default, the allowed values and validators (registered with ``dspark_jax.config`` on
import, so ``--config.drafter.*`` overrides are checked at load), and the per-kind loss
weights. ``configs/*/drafter_*.py`` start from ``drafter_default_config``.
"""

from __future__ import annotations

import ml_collections

from dspark_jax.config import CHOICES, VALIDATORS, ConfigDict
from dspark_jax.models.drafter_config import (
    DRAFTER_KINDS,
    HEAD_INITS,
    HEADS,
    KINDS,
    drafter_kind,
)
from dspark_jax.models.qwen3 import REMAT_POLICIES
from dspark_jax.train.trainer import default_config

__all__ = ["DEFAULT_ALPHAS", "drafter_default_config", "loss_alphas"]

# Per-kind default loss weights (DESIGN §4), from the drafter kind registry.
DEFAULT_ALPHAS = {name: kind.loss_weights for name, kind in DRAFTER_KINDS.items()}


def _positive(name):
    def check(v):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")

    return check


def _non_negative_or_none(name):
    def check(v):
        if v is not None and (not isinstance(v, (int, float)) or v < 0):
            raise ValueError(f"{name} must be a number >= 0 (or None for the kind's default)")

    return check


def _decay_check(v):
    if not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"loss.decay must be > 0, got {v!r}")


def _step_weight_check(v):
    if not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise ValueError(f"loss.eagle3_step_weight must be in (0, 1], got {v!r}")


CHOICES["drafter.kind"] = list(KINDS)
CHOICES["drafter.head"] = list(HEADS) + [None]
CHOICES["drafter.head_init"] = list(HEAD_INITS)
CHOICES["target.dtype"] = ["float32", "bfloat16"]
CHOICES["drafter.sequence_positions"] = ["all", "anchors"]
CHOICES["drafter.remat"] = list(REMAT_POLICIES)
for _key in ("drafter.gamma", "drafter.anchors_per_seq", "drafter.eval_anchors_per_seq",
             "drafter.pack_sequences"):  # fmt: skip
    VALIDATORS[_key] = _positive(_key)
for _key in ("loss.alpha_ce", "loss.alpha_tv", "loss.alpha_conf"):
    VALIDATORS[_key] = _non_negative_or_none(_key)
VALIDATORS["loss.decay"] = _decay_check
VALIDATORS["loss.eagle3_step_weight"] = _step_weight_check


def _record_cap_check(v):
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"data.max_train_records must be an integer >= 0 (0 = all), got {v!r}")


VALIDATORS["data.max_train_records"] = _record_cap_check


def drafter_default_config(kind: str = "dspark") -> ConfigDict:
    """Every key of a drafter run with DESIGN §4 defaults; ``configs/*/drafter_*.py`` fill it."""
    cfg = default_config()
    del cfg["model"]  # the trained model is the drafter; the target comes from target.dir
    cfg.task = "drafter"
    cfg.drafter = ml_collections.ConfigDict(
        {
            "kind": kind,
            "gamma": 1 if drafter_kind(kind).single_token else 7,
            "num_layers": None,  # None = per-kind default (5 dspark/dflash, 1 eagle3/mtp1)
            "taps": None,  # None = per-kind default taps of the target
            "head": None,  # dspark: markov (default) | gated | rnn | none
            "markov_rank": 256,
            "rnn_rank": 256,
            # "deepspec": W1, W2 ~ N(0, 0.02); "zero_bias": W1 ~ N(0, 1), W2 = 0 (learns a
            # bigram bias within short budgets; models/drafter_config.py).
            "head_init": "deepspec",
            "confidence": None,  # None = on for dspark only
            "confidence_with_prev": True,
            "mask_token": "<|mask|>",  # name in the target tokenizer (dspark/dflash)
            "anchors_per_seq": 32,  # N: anchors sampled per sequence and step
            "eval_anchors_per_seq": 32,
            "pack_sequences": 1,  # sequences sharing one packed attention call
            # EAGLE-3 / MTP-1 loss positions: "all" eligible positions, or the sampled
            # "anchors" only (LM head only there; same labels per step as DSpark).
            "sequence_positions": "all",
            # Gradient checkpointing of each draft layer (DSpark/DFlash backbone):
            # "none" | "full" | "dots" (qwen3.REMAT_POLICIES). Same values, less memory.
            "remat": "none",
        }
    )
    # preset: the target's shape for --aot when ``dir`` holds no model (e.g. qwen3-8b).
    cfg.target = ml_collections.ConfigDict(
        {"dir": "assets/target", "dtype": "float32", "preset": ""}
    )
    cfg.data.data_dir = "data/distill"
    cfg.data.tokenizer = ""  # "" = <target.dir>/tokenizer.json
    # Train on the first N distilled training records only (0 = all): the data-size axis
    # of a drafter-quality-vs-data curve without distilling each size apart.
    cfg.data.max_train_records = 0
    cfg.loss = ml_collections.ConfigDict(
        {
            "decay": 4.0,
            "alpha_ce": None,  # None = the kind's default (DEFAULT_ALPHAS)
            "alpha_tv": None,
            "alpha_conf": None,
            "eagle3_step_weight": 0.8,
        }
    )
    return cfg


def loss_alphas(cfg: ConfigDict) -> tuple[float, float, float]:
    """(α_CE, α_TV, α_conf) of a run: the configured ones, the kind's defaults for None."""
    kind = cfg.drafter.kind
    base = DEFAULT_ALPHAS.get(kind, (0.0, 0.0, 0.0))
    given = (cfg.loss.alpha_ce, cfg.loss.alpha_tv, cfg.loss.alpha_conf)
    return tuple(float(b if g is None else g) for g, b in zip(given, base))
