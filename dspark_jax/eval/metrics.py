"""Acceptance and calibration metrics (numpy, host side; DESIGN §7).

All functions take the per-round records of a **fixed-block** run (scheduler ``fixed``,
confidence threshold 0): every round verifies all γ drafts, so the label of every position
is observed rather than censored by the scheduler. The only rounds where fewer than γ
drafts are verified are the last rounds of a request (cache room / ``max_new_tokens``); the
functions take the per-round ``verified`` count and drop exactly the labels that those
rounds leave unknown.

Definitions (``accepted[n]`` = draft tokens accepted in round n, ``0 … γ``):

* τ per round = ``accepted + 1``: the bonus/correction token sampled from the target is
  always committed, so one round yields at most γ + 1 tokens (DESIGN §5.1, DeepSpec).
* Conditional acceptance at position k: ``P(accepted ≥ k | accepted ≥ k−1)`` (paper Fig. 2).
* Prefix label at position k: "the first k drafts were all accepted" = ``accepted ≥ k``.
  The matching score is the prefix survival ``a_k = Π_{i≤k} c_i`` (DESIGN §3.4), so the
  calibration metrics (ECE, AUROC, Brier) are computed per position on ``(a_k, accepted ≥ k)``.
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_BINS = 20  # DESIGN §5.3: 20 equal-width bins


def _as_1d(x, name: str, dtype=None) -> np.ndarray:
    a = np.asarray(x, dtype=dtype)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    return a


def _check_counts(accepted, gamma: int, verified=None):
    acc = _as_1d(accepted, "accepted").astype(np.int64)
    if not isinstance(gamma, (int, np.integer)) or gamma < 1:
        raise ValueError(f"gamma must be a positive integer, got {gamma!r}")
    if acc.size and (acc.min() < 0 or acc.max() > gamma):
        raise ValueError(
            f"accepted counts must lie in [0, {gamma}], got range [{acc.min()}, {acc.max()}]"
        )
    if verified is None:
        ver = np.full_like(acc, gamma)
    else:
        ver = _as_1d(verified, "verified").astype(np.int64)
        if ver.shape != acc.shape:
            raise ValueError(f"verified has shape {ver.shape}, accepted {acc.shape}")
        if ver.size and (np.any(acc > ver) or ver.max() > gamma or ver.min() < 0):
            raise ValueError("need 0 <= accepted <= verified <= gamma in every round")
    return acc, ver


# -- accepted length τ -----------------------------------------------------------------------


def tau_per_round(accepted) -> np.ndarray:
    """Tokens committed per round: accepted drafts + the target's bonus/correction token."""
    return _as_1d(accepted, "accepted").astype(np.int64) + 1


def mean_tau(accepted) -> float:
    """Mean accepted length τ over rounds (counts the bonus token; max γ + 1)."""
    t = tau_per_round(accepted)
    return float(t.mean()) if t.size else math.nan


# -- position-wise acceptance ---------------------------------------------------------------


def conditional_acceptance(accepted, gamma: int, verified=None) -> np.ndarray:
    """``[γ]``: ``P(accepted ≥ k | accepted ≥ k−1)`` for k = 1…γ (NaN where never reached).

    Only rounds in which position k was actually verified (``verified ≥ k``) count, so the
    short final rounds of a request do not look like rejections.
    """
    acc, ver = _check_counts(accepted, gamma, verified)
    out = np.full(gamma, np.nan)
    for k in range(1, gamma + 1):
        reached = (acc >= k - 1) & (ver >= k)
        n = int(reached.sum())
        if n:
            out[k - 1] = float((acc[reached] >= k).sum()) / n
    return out


def prefix_labels(accepted, gamma: int, verified=None) -> tuple[np.ndarray, np.ndarray]:
    """Labels ``[N, γ]`` ("first k drafts accepted") and a mask of the observed ones.

    A label is observed when position k was verified, or when an earlier rejection already
    decided it (``accepted < verified`` means the first rejection happened at
    ``accepted + 1``, so every later prefix is known to fail).
    """
    acc, ver = _check_counts(accepted, gamma, verified)
    k = np.arange(1, gamma + 1)[None, :]
    labels = acc[:, None] >= k
    observed = (k <= ver[:, None]) | (acc < ver)[:, None]
    return labels, observed


# -- calibration --------------------------------------------------------------------------


def _check_scores(conf, labels):
    c = _as_1d(conf, "confidence", np.float64)
    y = _as_1d(labels, "labels")
    if c.shape != y.shape:
        raise ValueError(f"confidence has shape {c.shape}, labels {y.shape}")
    if c.size and (np.any(~np.isfinite(c)) or c.min() < 0 or c.max() > 1):
        raise ValueError("confidences must be finite probabilities in [0, 1]")
    return c, y.astype(bool)


def _bin_index(conf: np.ndarray, n_bins: int) -> np.ndarray:
    # Equal-width bins [i/n, (i+1)/n); a confidence of exactly 1 goes into the last bin.
    return np.minimum((conf * n_bins).astype(np.int64), n_bins - 1)


def reliability_bins(conf, labels, n_bins: int = DEFAULT_BINS) -> dict[str, list]:
    """Reliability-diagram data: per equal-width bin its edges, mean confidence, accuracy
    (fraction of positive labels) and sample count. Empty bins have NaN mean/accuracy."""
    c, y = _check_scores(conf, labels)
    idx = _bin_index(c, n_bins)
    count = np.bincount(idx, minlength=n_bins)
    s_conf = np.bincount(idx, weights=c, minlength=n_bins)
    s_pos = np.bincount(idx, weights=y.astype(np.float64), minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.where(count > 0, s_conf / count, np.nan)
        acc = np.where(count > 0, s_pos / count, np.nan)
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    return {
        "lower": edges[:-1].tolist(),
        "upper": edges[1:].tolist(),
        "mean_confidence": mean_conf.tolist(),
        "accuracy": acc.tolist(),
        "count": count.astype(int).tolist(),
    }


def ece(conf, labels, n_bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error: ``Σ_b (n_b / N)·|acc_b − conf_b|`` over equal-width bins."""
    c, y = _check_scores(conf, labels)
    if not c.size:
        return math.nan
    return _ece_fast(c, y.astype(np.float64), n_bins)


def _ece_fast(c: np.ndarray, y: np.ndarray, n_bins: int) -> float:
    """ECE without input validation (the STS grid search calls this thousands of times)."""
    idx = np.minimum((c * n_bins).astype(np.int64), n_bins - 1)
    s_conf = np.bincount(idx, weights=c, minlength=n_bins)
    s_pos = np.bincount(idx, weights=y, minlength=n_bins)
    # Σ_b (n_b/N)|acc_b − conf_b| = Σ_b |Σ y − Σ c| / N: no division by empty bins.
    return float(np.abs(s_pos - s_conf).sum() / c.size)


def ece_noise_floor(conf, n_bins: int = DEFAULT_BINS, draws: int = 200, seed: int = 0) -> float:
    """Mean ECE of a *perfectly calibrated* predictor with these confidences: labels drawn
    ``y ~ Bernoulli(conf)``, averaged over ``draws``. Binned ECE is biased upwards on finite
    samples (each bin's accuracy has sampling error ~ sqrt(p(1-p)/n_b)), so an ECE near
    this floor is as calibrated as the sample can show."""
    c = _as_1d(conf, "confidence", np.float64)
    if not c.size:
        return math.nan
    rng = np.random.default_rng(seed)
    ys = rng.random((draws, c.size)) < c[None, :]
    return float(np.mean([_ece_fast(c, y.astype(np.float64), n_bins) for y in ys]))


def auroc(scores, labels) -> float:
    """Area under the ROC curve via the Mann–Whitney rank statistic.

    Tied scores get their average rank, which counts a positive–negative tie as ½ — the
    same value as the trapezoidal ROC area. NaN when only one class is present.
    """
    s = _as_1d(scores, "scores", np.float64)
    y = _as_1d(labels, "labels").astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"scores has shape {s.shape}, labels {y.shape}")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return math.nan
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    # Average 1-based rank of each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], s.size]
    run_rank = (starts + 1 + ends) / 2.0
    ranks = np.empty(s.size)
    ranks[order] = np.repeat(run_rank, ends - starts)
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def brier(conf, labels) -> float:
    """Mean squared error between confidence and the 0/1 label."""
    c, y = _check_scores(conf, labels)
    return float(np.mean((c - y) ** 2)) if c.size else math.nan


def position_calibration(
    survival, accepted, verified=None, n_bins: int = DEFAULT_BINS
) -> list[dict[str, float]]:
    """Per position k: ECE / AUROC / Brier of ``a_k`` against "first k drafts accepted".

    ``survival``: ``[N, γ]`` prefix survival ``a_k = Π_{i≤k} c_i`` per round.
    Returns one dict per position with ``ece``, ``auroc``, ``brier``, ``n`` (observed
    labels), ``mean_confidence`` and ``accept_rate`` (fraction of positive labels).
    """
    a = np.asarray(survival, np.float64)
    if a.ndim != 2:
        raise ValueError(f"survival must be [rounds, gamma], got shape {a.shape}")
    gamma = a.shape[1]
    labels, observed = prefix_labels(accepted, gamma, verified)
    if labels.shape[0] != a.shape[0]:
        raise ValueError(f"survival has {a.shape[0]} rounds, accepted {labels.shape[0]}")
    out = []
    for k in range(gamma):
        m = observed[:, k]
        c, y = a[m, k], labels[m, k]
        out.append(
            {
                "position": k + 1,
                "ece": ece(c, y, n_bins),
                "ece_floor": ece_noise_floor(c, n_bins),
                "auroc": auroc(c, y),
                "brier": brier(c, y),
                "n": int(m.sum()),
                "mean_confidence": float(c.mean()) if c.size else math.nan,
                "accept_rate": float(y.mean()) if y.size else math.nan,
            }
        )
    return out


def pooled_scores(survival, accepted, verified=None) -> tuple[np.ndarray, np.ndarray]:
    """All observed ``(a_k, label)`` pairs over rounds and positions, flattened (for the
    pooled reliability diagram)."""
    a = np.asarray(survival, np.float64)
    labels, observed = prefix_labels(accepted, a.shape[1], verified)
    return a[observed], labels[observed]


# -- static-threshold sweep -----------------------------------------------------------------


def threshold_sweep(survival, accepted, verified=None, thresholds=None) -> dict[str, list]:
    """Offline static-threshold arm (paper Fig. 5) from a fixed-block run.

    Under a static threshold t the scheduler verifies the prefix ``l(t) = #{k : a_k ≥ t}``
    (a prefix, because ``a`` is non-increasing in k). Verification of a prefix decides each
    of its tokens exactly as verifying the full block does — position k's accept test reads
    only the target and draft distributions at k, and ``a_k`` depends only on drafts ``< k``
    (non-anticipation, DESIGN §5.4) — so the tokens accepted under t are
    ``min(accepted, l(t))`` in the same round. Since the fixed-block run verified every
    draft, the sweep needs no re-run. It is a per-round counterfactual: later rounds would
    start from different contexts, so τ here is the expected τ per round, not a trace.

    Returns per threshold: ``acceptance_rate`` (accepted / verified drafts), ``pruned_share``
    (drafts not verified / drafts proposed), ``tau`` (mean ``min(accepted, l) + 1``) and
    ``verified_per_round``.
    """
    a = np.asarray(survival, np.float64)
    if a.ndim != 2:
        raise ValueError(f"survival must be [rounds, gamma], got shape {a.shape}")
    gamma = a.shape[1]
    acc, ver = _check_counts(accepted, gamma, verified)
    ts = np.linspace(0.0, 1.0, 101) if thresholds is None else np.asarray(thresholds, float)
    rate, pruned, tau, per_round = [], [], [], []
    proposed = max(int(ver.sum()), 1)
    for t in ts:
        lengths = np.minimum((a >= t).sum(axis=1), ver)
        acc_t = np.minimum(acc, lengths)
        n_ver = int(lengths.sum())
        rate.append(float(acc_t.sum() / n_ver) if n_ver else math.nan)
        pruned.append(1.0 - n_ver / proposed)
        tau.append(float((acc_t + 1).mean()) if acc.size else math.nan)
        per_round.append(float(lengths.mean()) if acc.size else math.nan)
    return {
        "threshold": ts.tolist(),
        "acceptance_rate": rate,
        "pruned_share": pruned,
        "tau": tau,
        "verified_per_round": per_round,
    }


def ends_in_loop(tokens, n: int = 4, tail: int = 32, max_distinct: float = 0.5) -> bool:
    """Whether a continuation ends in a repeated n-gram loop: at most ``max_distinct`` of
    the ``n``-grams in its last ``tail`` tokens are distinct (e.g. ``' the'`` and ``'\n #'``
    repeated with varying line lengths; running code repeats few 4-grams within 32
    tokens). Such a tail makes greedy τ a coin flip on whether the drafter's argmax lands
    on the loop. Outputs shorter than ``tail`` are judged on what there is (at least
    ``3 · n`` tokens)."""
    toks = [int(t) for t in list(tokens)[-tail:]]
    if len(toks) < 3 * n:
        return False
    grams = [tuple(toks[i : i + n]) for i in range(len(toks) - n + 1)]
    return len(set(grams)) <= max_distinct * len(grams)


__all__ = [
    "DEFAULT_BINS",
    "ends_in_loop",
    "auroc",
    "brier",
    "conditional_acceptance",
    "ece",
    "mean_tau",
    "pooled_scores",
    "position_calibration",
    "prefix_labels",
    "reliability_bins",
    "tau_per_round",
    "threshold_sweep",
]
