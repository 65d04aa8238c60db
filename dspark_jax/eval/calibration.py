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

The fit needs raw logits of a fixed-block run (every draft verified, so labels are not
censored). The runner records the survival ``a`` with STS off; ``c_k = a_k / a_{k−1}`` and
``z_k = logit(c_k)`` recover the logits (exact up to float32 rounding; a logit large enough
that σ saturates to 1.0 in float32 comes back as ``logit(1 − 2⁻²⁴) ≈ 16.6``, which the
decode step could not distinguish either).

Files: ``sts.json`` beside the drafter (``<drafter_dir>/sts.json``) holds the temperatures
(and biases, zero in temperature mode), per-position ECE/AUROC before and after, sample
counts and a description of the data (``sts_data.npz`` next to it keeps the fitted
arrays). Callers apply it with::

    sts = load_sts(drafter_dir)              # STS(temperatures [γ], biases [γ]) or None
    SpeculativeDecoder(target, tp, drafter, dp, step_config,
                       sts_temperatures=sts.temperatures, sts_biases=sts.biases)

``None`` (no file) means temperatures of 1 and no bias, the decoder's default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from dspark_jax.eval import metrics

STS_FILENAME = "sts.json"
# Coarse grid of the 1-D search (DESIGN §5.3 leaves the grid open): log-spaced 0.05 … 20.
COARSE_GRID = np.geomspace(0.05, 20.0, 121)
FINE_POINTS = 41
# Affine mode: the bias grid (logit units, added after the temperature) and a coarser
# temperature grid, since the search is 2-D; each is refined around the best pair.
BIAS_GRID = np.linspace(-4.0, 4.0, 81)
AFFINE_TEMPERATURE_GRID = np.geomspace(0.05, 20.0, 61)
AFFINE_FINE_POINTS = 21
STS_MODES = ("temperature", "affine")
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


class STS(NamedTuple):
    """Fitted calibration of a drafter's confidence head, applied as ``σ(z / T + b)``."""

    temperatures: np.ndarray  # [γ], > 0
    biases: np.ndarray  # [γ]; all zero for DESIGN's temperature-only STS

    def first(self, n: int) -> STS:
        """The calibration of the first ``n`` positions (a run drafting fewer than γ)."""
        return STS(np.asarray(self.temperatures)[:n], np.asarray(self.biases)[:n])


def apply_sts(logits, temperatures, biases=None) -> np.ndarray:
    """Calibrated confidences ``c_k = σ(z_k / T_k + b_k)`` for logits ``[N, γ]``
    (``b = 0`` when ``biases`` is None: plain temperature scaling)."""
    z = np.asarray(logits, np.float64)
    t = _check_temperatures(temperatures, z.shape[-1])
    b = _check_biases(biases, z.shape[-1])
    return _sigmoid(z / t + b)


def survival_from_logits(logits, temperatures=None, biases=None) -> np.ndarray:
    """Prefix survival ``a_k = Π_{i≤k} σ(z_i / T_i + b_i)`` ``[N, γ]`` (T = 1, b = 0 when
    None)."""
    z = np.asarray(logits, np.float64)
    t = np.ones(z.shape[-1]) if temperatures is None else temperatures
    return np.cumprod(apply_sts(z, t, biases), axis=-1)


def _check_temperatures(temperatures, gamma: int) -> np.ndarray:
    t = np.asarray(temperatures, np.float64).reshape(-1)
    if t.shape != (gamma,):
        raise ValueError(f"need {gamma} temperatures (one per position), got {t.shape[0]}")
    if np.any(~np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"STS temperatures must be finite and > 0, got {t.tolist()}")
    return t


def _check_biases(biases, gamma: int) -> np.ndarray:
    if biases is None:
        return np.zeros(gamma)
    b = np.asarray(biases, np.float64).reshape(-1)
    if b.shape != (gamma,):
        raise ValueError(f"need {gamma} STS biases (one per position), got {b.shape[0]}")
    if np.any(~np.isfinite(b)):
        raise ValueError(f"STS biases must be finite, got {b.tolist()}")
    return b


@dataclasses.dataclass
class STSResult:
    temperatures: list[float]  # [γ]
    fitted: list[bool]  # positions with observed labels (others keep T = 1, b = 0)
    ece_before: list[float]  # per position, on the data the fit used
    ece_after: list[float]
    num_samples: list[int]  # observed labels per position
    biases: list[float] = dataclasses.field(default_factory=list)  # [γ]; zeros unless affine
    mode: str = "temperature"

    def __post_init__(self):
        if not self.biases:
            self.biases = [0.0] * len(self.temperatures)

    @property
    def sts(self) -> STS:
        return STS(np.asarray(self.temperatures), np.asarray(self.biases))

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
    """Fit per-position temperatures (and, with ``mode="affine"``, biases) left to right
    (module docstring).

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
    return STSResult(temps.tolist(), fitted, before, after, counts, biases.tolist(), mode)


def calibration_report(logits, accepted, verified=None, temperatures=None, n_bins=20, biases=None):
    """Per-position ECE/AUROC/Brier of ``a_k`` with the given temperatures and biases
    (None: raw)."""
    return metrics.position_calibration(
        survival_from_logits(logits, temperatures, biases), accepted, verified, n_bins
    )


# -- files ------------------------------------------------------------------------------


def sts_path(drafter_dir: str | os.PathLike) -> Path:
    """Where the decoder and the engine read a drafter's calibration."""
    return Path(drafter_dir) / STS_FILENAME


def check_new_file(path: str | os.PathLike) -> None:
    """Refuse to replace an STS file (or its label arrays) silently."""
    for p in (Path(path), sts_data_path(path)):
        if p.exists():
            raise FileExistsError(
                f"{p} already exists; pass --overwrite to replace it, or choose another --out"
            )


def sts_data_path(path: str | os.PathLike) -> Path:
    """The label arrays beside an STS file: ``sts.json`` -> ``sts_data.npz``."""
    path = Path(path)
    return path.with_name(path.stem + "_data.npz")


def save_sts(
    path: str | os.PathLike,
    result: STSResult,
    *,
    heldout: list[dict] | None = None,
    fit_report: list[dict] | None = None,
    data: dict[str, Any] | None = None,
    arrays: dict[str, np.ndarray] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the STS file ``path`` (a ``.json`` file, or a directory: ``<dir>/sts.json``,
    where the decoder and engine look for it) and, with ``arrays``, the labels beside it
    (``<stem>_data.npz``). An existing file is replaced only with ``overwrite``.

    ``heldout``: per-position before/after metrics on the reporting split;
    ``fit_report``: AUROC etc. on the fit split; ``data``: a description of the prompts
    and decode settings the labels came from.
    """
    path = Path(path)
    if path.is_dir():
        path = sts_path(path)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist")
    if not overwrite:
        check_new_file(path)
    payload: dict[str, Any] = {
        "format": "dspark_jax.sts/1",
        "gamma": len(result.temperatures),
        "mode": result.mode,
        "temperatures": result.temperatures,
        "biases": result.biases,
        "fit": result.to_dict(),
        "fit_metrics": fit_report,
        "heldout_metrics": heldout,
        "data": data or {},
    }
    if arrays:
        np.savez_compressed(sts_data_path(path), **arrays)
        payload["data"]["arrays_file"] = sts_data_path(path).name
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(to_jsonable(payload), indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return path


def load_sts(drafter_dir: str | os.PathLike, gamma: int | None = None) -> STS | None:
    """``STS(temperatures, biases)`` (each ``[γ]``) from ``<drafter_dir>/sts.json``, or None
    when there is none. Files without ``biases`` (temperature-only STS) get zeros.

    Pass the fields as ``sts_temperatures=`` / ``sts_biases=`` to ``SpeculativeDecoder``
    (or the tuple as ``sts=`` to the serving ``Engine``). ``gamma`` (the drafter's draft
    length), when given, is checked against the file.
    """
    path = sts_path(drafter_dir)
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(payload, dict) or "temperatures" not in payload:
        raise ValueError(f"{path} has no 'temperatures' list")
    temps = payload["temperatures"]
    if not isinstance(temps, list) or not temps:
        raise ValueError(f"{path}: 'temperatures' must be a non-empty list, got {temps!r}")
    n = len(temps) if gamma is None else gamma
    if len(temps) != n:
        raise ValueError(
            f"{path} holds {len(temps)} temperatures but the drafter drafts {gamma} tokens"
        )
    biases = payload.get("biases")
    if biases is not None and not isinstance(biases, list):
        raise ValueError(f"{path}: 'biases' must be a list, got {biases!r}")
    try:
        return STS(
            _check_temperatures(temps, n).astype(np.float32),
            _check_biases(biases, n).astype(np.float32),
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def to_jsonable(x):
    """JSON-safe copy: numpy scalars/arrays to Python, NaN/inf to None."""
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return to_jsonable(x.tolist())
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    return x


__all__ = [
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
    "survival_from_logits",
    "to_jsonable",
]
