"""STS: sequential temperature scaling of the confidence head (DESIGN §5.3, paper §4).

The confidence head emits a logit ``z_k`` per draft position; the scheduler uses
``c_k = σ(z_k / T_k)`` and the prefix survival ``a_k = Π_{i≤k} c_i``. STS fits one
temperature per position, **left to right**: for k = 1…γ a 1-D grid search picks ``T_k``
minimising the 20-bin ECE of ``a_k`` against "the first k drafts were accepted", with
``T_1 … T_{k−1}`` already fixed. Because ``T_k > 0`` the map ``z ↦ σ(z / T)`` is strictly
increasing, so STS never changes the ranking of ``c_k`` across rounds (AUROC of ``c_k`` is
unchanged); it only moves probabilities to where they match observed acceptance.

``mode="affine"`` (an extension; DESIGN §5.3 specifies temperatures only) fits
``c_k = σ(z_k / T_k + b_k)`` by a 2-D grid search per position, still left to right. Why
it exists: the cumulative product of confidences that are calibrated one position at a
time is not calibrated itself — ``c_k`` is evaluated on every round, including those whose
earlier drafts were rejected, where it is as high as on accepted ones. On the bundled
drafter's calibration rounds (its ``sts_data.npz``) the raw ``a_k`` runs 1–3 points above
the observed survival at every position. When the
head discriminates weakly (AUROC ≈ 0.55–0.6) the ECE-optimal map is close to a constant,
which ``σ(z / T)`` can only approach at ½; one shift per position expresses it. The map
stays strictly increasing, so the ranking (AUROC) is unchanged in both modes.

``mode="isotonic"`` (an extension too) fits a non-decreasing step function per position,
left to right: pool-adjacent-violators on the rounds k was verified in, minimising the
squared error of ``a_{k−1} · c_k`` against the label (weights ``a_{k−1}²``, targets
``y / a_{k−1}``), so each step's prefix survival equals the observed survival of its rounds
on the fit split. It is for estimates whose miscalibration no ``σ(z / T + b)`` follows:
MTP-1's draft probability, the bundled drafter the affine fit calibrates worst
(``benchmarks/survival_estimators.py`` compares the modes on held-out rounds). Its price: rounds within a
step tie, so AUROC can drop a little, and it needs more rounds than two numbers do. The
map is stored as knots (left edges in ``z`` units and the step's logit) and applied as
``σ(step_k(z))`` by the decoder (``decode.plan_step``).

The fit needs raw logits of a fixed-block run (every draft verified, so labels are not
censored). The runner records the survival ``a`` with STS off; ``c_k = a_k / a_{k−1}`` and
``z_k = logit(c_k)`` recover the logits (exact up to float32 rounding; a logit large enough
that σ saturates to 1.0 in float32 comes back as ``logit(1 − 2⁻²⁴) ≈ 16.6``, which the
decode step could not distinguish either).

The same fit calibrates the *draft-probability* survival estimate of any drafter
(``decode.plan_step.survival_logits``: ``z_k = logit(max_v q_k(v))``), recorded the same way.

Files: ``sts.json`` beside the drafter (``<drafter_dir>/sts.json``; the draft-probability
estimate's ``sts_draft_probability.json``) holds the temperatures (and biases, zero in
temperature mode), per-position ECE/AUROC before and after, sample counts and a description
of the data (``sts_data.npz`` next to it keeps the fitted arrays). Callers apply it with::

    sts = load_sts(drafter_dir)   # STS(temperatures [γ], biases [γ], estimator) or None
    SpeculativeDecoder(target, tp, drafter, dp, step_config, sts=sts)

``None`` (no file) means temperatures of 1 and no bias, the decoder's default.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from dspark_jax.eval import metrics
from dspark_jax.models.drafter_io import (  # the drafter directory's sts.json (re-exported)
    MAX_KNOTS,
    STS,
    STS_FILENAME,
    check_biases,
    check_knots,
    check_new_file,
    check_temperatures,
    load_sts,
    save_sts,
    sts_data_path,
    sts_path,
    to_jsonable,
)

# Coarse grid of the 1-D search (DESIGN §5.3 leaves the grid open): log-spaced 0.05 … 20.
COARSE_GRID = np.geomspace(0.05, 20.0, 121)
FINE_POINTS = 41
# Affine mode: the bias grid (logit units, added after the temperature) and a coarser
# temperature grid, since the search is 2-D; each is refined around the best pair.
BIAS_GRID = np.linspace(-4.0, 4.0, 81)
AFFINE_TEMPERATURE_GRID = np.geomspace(0.05, 20.0, 61)
AFFINE_FINE_POINTS = 21
STS_MODES = ("temperature", "affine", "isotonic")
# Isotonic mode: calibrated conditional survivals stay in [1e-4, 1 - 1e-4] (finite logits;
# a step of 0 would end every prefix through it whatever comes later).
_ISOTONIC_CLIP = 1e-4
# float32 σ saturates at 1 - 2^-24; clip so recovered logits stay finite.
_EPS = 2.0**-24


def confidence_from_survival(survival) -> np.ndarray:
    """Per-position confidences ``c_k = a_k / a_{k−1}`` from prefix survival ``[N, γ]``.

    Where ``a_{k−1}`` is 0 (underflow), ``a_k`` is 0 for any ``c_k``; those entries get
    ``c_k = ½`` (logit 0), which cannot affect the fit since the product stays 0.
    """
    a = np.asarray(survival, np.float64)
    if a.ndim != 2:
        raise ValueError(f"survival must be [rounds, gamma], got shape {a.shape}")
    prev = np.concatenate([np.ones_like(a[:, :1]), a[:, :-1]], axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        c = np.where(prev > 0, a / np.where(prev > 0, prev, 1.0), 0.5)
    return np.clip(c, 0.0, 1.0)


def logits_from_confidence(conf) -> np.ndarray:
    """``z = logit(c)`` with c clipped to ``[2⁻²⁴, 1 − 2⁻²⁴]`` (float32 σ's range)."""
    c = np.clip(np.asarray(conf, np.float64), _EPS, 1.0 - _EPS)
    return np.log(c) - np.log1p(-c)


def logits_from_survival(survival) -> np.ndarray:
    """Raw confidence logits ``[N, γ]`` from a run recorded with STS off."""
    return logits_from_confidence(confidence_from_survival(survival))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -x))  # overflow-free, accurate in both tails


def step_logits(z, edges, values) -> np.ndarray:
    """The isotonic step map: ``values[j]`` for ``edges[j] <= z < edges[j+1]`` (the first
    step below ``edges[0]``, the last beyond its edge). ``decode.plan_step`` applies the
    same map in the jitted round."""
    j = np.searchsorted(np.asarray(edges), np.asarray(z), side="right") - 1
    return np.asarray(values)[np.clip(j, 0, len(edges) - 1)]


def apply_sts(logits, temperatures, biases=None, knots=None) -> np.ndarray:
    """Calibrated confidences ``c_k = σ(z_k / T_k + b_k)`` for logits ``[N, γ]``
    (``b = 0`` when ``biases`` is None: plain temperature scaling), or ``σ(step_k(z_k))``
    at positions with isotonic ``knots`` (``STS.knots``: ``[γ, 2, J]``, NaN rows none)."""
    z = np.asarray(logits, np.float64)
    t = check_temperatures(temperatures, z.shape[-1])
    b = check_biases(biases, z.shape[-1])
    x = z / t + b
    if knots is not None:
        knots = np.asarray(knots, np.float64)
        for k in range(z.shape[-1]):
            if not np.isnan(knots[k, 0, 0]):
                x[..., k] = step_logits(x[..., k], knots[k, 0], knots[k, 1])
    return _sigmoid(x)


def survival_from_logits(logits, temperatures=None, biases=None, knots=None) -> np.ndarray:
    """Prefix survival ``a_k = Π_{i≤k} c_i`` ``[N, γ]`` with ``c`` from ``apply_sts``
    (T = 1, b = 0, no steps when None)."""
    z = np.asarray(logits, np.float64)
    t = np.ones(z.shape[-1]) if temperatures is None else temperatures
    return np.cumprod(apply_sts(z, t, biases, knots), axis=-1)


def survival_from_sts(logits, sts: STS | None) -> np.ndarray:
    """Prefix survival under a loaded calibration (None: raw)."""
    if sts is None:
        return survival_from_logits(logits)
    return survival_from_logits(logits, sts.temperatures, sts.biases, sts.knots)


def _pool_adjacent_violators(x, y, w) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least-squares non-decreasing fit of ``y`` on ``x``: ``(left edges, values)``
    of its steps. Equal ``x`` are pooled first (one step cannot split them)."""
    ux, inv = np.unique(x, return_inverse=True)
    sw = np.bincount(inv, weights=w)
    keep = sw > 0
    ux, sy, sw = ux[keep], np.bincount(inv, weights=w * y)[keep], sw[keep]
    edges, sums, weights = [], [], []
    for xi, syi, swi in zip(ux, sy, sw):
        edges.append(xi)
        sums.append(syi)
        weights.append(swi)
        while len(sums) > 1 and sums[-2] / weights[-2] >= sums[-1] / weights[-1]:
            s, sw_ = sums.pop(), weights.pop()
            sums[-1] += s
            weights[-1] += sw_
            edges.pop()  # the pooled step starts at the earlier edge
    edges, sums, weights = np.array(edges), np.array(sums), np.array(weights)
    while edges.size > MAX_KNOTS:  # pool neighbouring pairs: the means stay non-decreasing
        n = edges.size // 2 * 2
        pair_s = sums[:n].reshape(-1, 2).sum(1)
        pair_w = weights[:n].reshape(-1, 2).sum(1)
        edges = np.r_[edges[:n:2], edges[n:]]
        sums, weights = np.r_[pair_s, sums[n:]], np.r_[pair_w, weights[n:]]
    return edges, sums / weights


def _fit_isotonic_step(zk, pk, y) -> dict[str, list[float]]:
    """Position k's step map (module docstring): PAV of ``y / a_{k−1}`` with weights
    ``a_{k−1}²``, values clipped to ``[1e-4, 1 − 1e-4]`` and stored as logits."""
    p = np.maximum(pk, 1e-12)
    edges, c = _pool_adjacent_violators(zk, y / p, p * p)
    c = np.clip(c, _ISOTONIC_CLIP, 1.0 - _ISOTONIC_CLIP)
    return {"edges": edges.tolist(), "logits": (np.log(c) - np.log1p(-c)).tolist()}


@dataclasses.dataclass
class STSResult:
    temperatures: list[float]  # [γ]
    fitted: list[bool]  # positions with observed labels (others keep T = 1, b = 0)
    ece_before: list[float]  # per position, on the data the fit used
    ece_after: list[float]
    num_samples: list[int]  # observed labels per position
    biases: list[float] = dataclasses.field(default_factory=list)  # [γ]; zeros unless affine
    mode: str = "temperature"
    # Isotonic mode: per position {"edges": [...], "logits": [...]} or None (not fitted).
    knots: list | None = None

    def __post_init__(self):
        if not self.biases:
            self.biases = [0.0] * len(self.temperatures)

    @property
    def sts(self) -> STS:
        return STS(
            np.asarray(self.temperatures),
            np.asarray(self.biases),
            knots=check_knots(self.knots, len(self.temperatures)),
        )

    def padded(self, gamma: int) -> STSResult:
        """The same fit extended to ``gamma`` positions; the extra ones (never verified in
        the fitting run) keep ``T = 1, b = 0``."""
        pad = gamma - len(self.temperatures)
        if pad < 0:
            raise ValueError(f"cannot pad a {len(self.temperatures)}-position fit to {gamma}")
        return STSResult(
            self.temperatures + [1.0] * pad,
            self.fitted + [False] * pad,
            self.ece_before + [math.nan] * pad,
            self.ece_after + [math.nan] * pad,
            self.num_samples + [0] * pad,
            self.biases + [0.0] * pad,
            self.mode,
            None if self.knots is None else self.knots + [None] * pad,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _search(objective, grid: np.ndarray) -> float:
    """argmin over ``grid``; exact ties go to the temperature nearest 1 (no rescaling)."""
    vals = np.array([objective(t) for t in grid])
    best = np.flatnonzero(vals <= vals.min() + 1e-12)
    return float(grid[best[np.argmin(np.abs(np.log(grid[best])))]])


def _search_2d(objective, t_grid: np.ndarray, b_grid: np.ndarray) -> tuple[float, float]:
    """argmin of ``objective(t, b)`` over the product grid; exact ties go to the pair
    closest to the identity map (T = 1, b = 0)."""
    vals = np.array([[objective(t, b) for b in b_grid] for t in t_grid])
    ti, bi = np.nonzero(vals <= vals.min() + 1e-12)
    dist = np.abs(np.log(t_grid[ti])) + np.abs(b_grid[bi])
    j = int(np.argmin(dist))
    return float(t_grid[ti[j]]), float(b_grid[bi[j]])


def _neighbours(grid: np.ndarray, x: float) -> tuple[float, float]:
    i = int(np.searchsorted(grid, x))
    return grid[max(i - 1, 0)], grid[min(i + 1, grid.size - 1)]


def fit_sts(
    logits,
    accepted,
    verified=None,
    n_bins: int = metrics.DEFAULT_BINS,
    grid=None,
    fine_points: int = FINE_POINTS,
    mode: str = "temperature",
) -> STSResult:
    """Fit per-position temperatures (and, with ``mode="affine"``, biases; with
    ``mode="isotonic"``, step maps) left to right (module docstring).

    ``logits``: raw confidence logits ``[N, γ]`` of a fixed-block run; ``accepted`` /
    ``verified``: ``[N]`` per-round counts. For each k the coarse grid (log-spaced
    0.05 … 20) is searched, then ``fine_points`` log-spaced values between the best grid
    point's neighbours. Affine mode searches temperature (default grid
    ``AFFINE_TEMPERATURE_GRID``) × bias (``BIAS_GRID``) the same way, refining over
    ``AFFINE_FINE_POINTS`` per axis. Positions with no observed label keep ``T = 1, b = 0``.
    """
    if mode not in STS_MODES:
        raise ValueError(f"unknown STS mode {mode!r}; allowed: {list(STS_MODES)}")
    z = np.asarray(logits, np.float64)
    if z.ndim != 2 or z.shape[0] == 0:
        raise ValueError(f"logits must be a non-empty [rounds, gamma] array, got {z.shape}")
    if not np.all(np.isfinite(z)):
        raise ValueError("confidence logits contain NaN/inf")
    gamma = z.shape[1]
    labels, observed = metrics.prefix_labels(accepted, gamma, verified)
    if labels.shape[0] != z.shape[0]:
        raise ValueError(f"logits have {z.shape[0]} rounds, accepted has {labels.shape[0]}")
    default = AFFINE_TEMPERATURE_GRID if mode == "affine" else COARSE_GRID
    grid = default if grid is None else np.sort(np.asarray(grid, np.float64))
    if grid.ndim != 1 or grid.size < 2 or grid.min() <= 0:
        raise ValueError("the STS grid needs >= 2 positive temperatures")

    temps, biases = np.ones(gamma), np.zeros(gamma)
    knots: list | None = [None] * gamma if mode == "isotonic" else None
    prefix = np.ones(z.shape[0])  # a_{k-1} under the temperatures fixed so far
    raw_prefix = np.ones(z.shape[0])
    fitted, before, after, counts = [], [], [], []
    for k in range(gamma):
        m = observed[:, k]
        y = labels[m, k].astype(np.float64)
        zk, pk = z[m, k], prefix[m]
        counts.append(int(m.sum()))
        raw_prefix = raw_prefix * _sigmoid(z[:, k])
        if not m.any():
            fitted.append(False)
            before.append(math.nan)
            after.append(math.nan)
            prefix = prefix * _sigmoid(z[:, k])
            continue

        def objective(t, b=0.0, zk=zk, pk=pk, y=y):
            return metrics._ece_fast(pk * _sigmoid(zk / t + b), y, n_bins)

        if mode == "isotonic":
            knots[k] = _fit_isotonic_step(zk, pk, y)
            step = _sigmoid(step_logits(z[:, k], knots[k]["edges"], knots[k]["logits"]))
            fitted.append(True)
            before.append(metrics._ece_fast(raw_prefix[m], y, n_bins))
            after.append(metrics._ece_fast(pk * step[m], y, n_bins))
            prefix = prefix * step
            continue
        if mode == "temperature":
            t0 = _search(objective, grid)
            lo, hi = _neighbours(grid, t0)
            fine = np.unique(np.r_[np.geomspace(lo, hi, fine_points), t0])
            t_best, b_best = _search(objective, fine), 0.0
        else:
            t0, b0 = _search_2d(objective, grid, BIAS_GRID)
            lo, hi = _neighbours(grid, t0)
            b_lo, b_hi = _neighbours(BIAS_GRID, b0)
            t_best, b_best = _search_2d(
                objective,
                np.unique(np.r_[np.geomspace(lo, hi, AFFINE_FINE_POINTS), t0]),
                np.unique(np.r_[np.linspace(b_lo, b_hi, AFFINE_FINE_POINTS), b0]),
            )
        temps[k], biases[k] = t_best, b_best
        fitted.append(True)
        before.append(metrics._ece_fast(raw_prefix[m], y, n_bins))
        after.append(objective(t_best, b_best))
        prefix = prefix * _sigmoid(z[:, k] / t_best + b_best)
    return STSResult(temps.tolist(), fitted, before, after, counts, biases.tolist(), mode, knots)


def calibration_report(
    logits, accepted, verified=None, temperatures=None, n_bins=20, biases=None, knots=None
):
    """Per-position ECE/AUROC/Brier of ``a_k`` with the given temperatures, biases and
    step maps (None: raw)."""
    return metrics.position_calibration(
        survival_from_logits(logits, temperatures, biases, knots), accepted, verified, n_bins
    )


def before_after_report(logits, accepted, verified, sts: STS, n_bins: int = 20) -> list[dict]:
    """Per position: ECE (and its floor after), AUROC and Brier of the prefix survival
    before (raw) and after ``sts``: the rows an STS file's ``heldout_metrics`` holds."""
    before = calibration_report(logits, accepted, verified, None, n_bins)
    after = calibration_report(
        logits, accepted, verified, sts.temperatures, n_bins, sts.biases, sts.knots
    )
    return [
        {
            "position": b["position"],
            "n": b["n"],
            "ece_before": b["ece"],
            "ece_after": a["ece"],
            "ece_floor_after": a["ece_floor"],
            "auroc_before": b["auroc"],
            "auroc_after": a["auroc"],
            "brier_before": b["brier"],
            "brier_after": a["brier"],
        }
        for b, a in zip(before, after)
    ]


__all__ = [
    "before_after_report",
    "STS",
    "STSResult",
    "STS_MODES",
    "STS_FILENAME",
    "apply_sts",
    "calibration_report",
    "confidence_from_survival",
    "fit_sts",
    "load_sts",
    "logits_from_confidence",
    "logits_from_survival",
    "check_new_file",
    "save_sts",
    "sts_data_path",
    "sts_path",
    "step_logits",
    "survival_from_logits",
    "survival_from_sts",
    "to_jsonable",
]
