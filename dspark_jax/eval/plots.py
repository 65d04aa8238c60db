"""Diagrams from an acceptance ``results.json`` (matplotlib, Agg backend, PNG).

* ``position_acceptance.png`` — conditional acceptance ``P(accepted ≥ k | accepted ≥ k−1)``
  per draft position, one line per drafter, one panel per (prompt set, temperature)
  (paper Fig. 2).
* ``reliability_<drafter>_<set>_T<t>.png`` — reliability diagram of the prefix survival
  ``a_k`` (all positions pooled) against "first k drafts accepted", before and after STS,
  with the per-bin sample histogram underneath (paper Fig. 6).
* ``threshold_<drafter>_<set>_T<t>.png`` — static-threshold sweep (paper Fig. 5):
  acceptance rate of the verified drafts and the share of drafts pruned, for thresholds
  0…1. The curves are computed offline from the fixed-block run; see
  :func:`dspark_jax.eval.metrics.threshold_sweep` for why no re-run is needed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: never needs a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def _slug(*parts) -> str:
    text = "_".join(str(p) for p in parts)
    return re.sub(r"[^A-Za-z0-9._+-]+", "-", text).strip("-")


def _nan(x):
    return np.array([np.nan if v is None else v for v in x], float)


def load_results(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"results file not found: {p}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise ValueError(f"{p} is not an acceptance results file (no 'results' list)")
    return data


def plot_position_acceptance(entries: list[dict], path: str | Path) -> Path:
    groups: dict[tuple, list[dict]] = {}
    for e in entries:
        groups.setdefault((e["prompt_set"], e["temperature"]), []).append(e)
    n = len(groups)
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, ((name, temp), group) in zip(axes.flat, sorted(groups.items())):
        for e in group:
            y = _nan(e["conditional_acceptance"])
            x = np.arange(1, y.size + 1)
            tau = "n/a" if e["tau"] is None else f"{e['tau']:.2f}"
            ax.plot(x, y, marker="o", label=f"{e['drafter']} (τ={tau})")
            ax.set_xticks(x)
        ax.set_title(f"{name}, T={temp:g}")
        ax.set_xlabel("draft position k")
        ax.set_ylabel("P(accept k | 1..k−1 accepted)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_reliability(entry: dict, path: str | Path) -> Path:
    calib = entry["calibration"]
    arms = [("raw", "raw confidence")] + ([("sts", "after STS")] if calib.get("sts") else [])
    fig, axes = plt.subplots(
        2,
        len(arms),
        figsize=(4.4 * len(arms), 5.2),
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 1]},
        sharex=True,
    )
    for col, (key, title) in enumerate(arms):
        rel = calib[key]["reliability"]
        lo, hi = np.array(rel["lower"]), np.array(rel["upper"])
        centers, width = (lo + hi) / 2, hi - lo
        acc, conf = _nan(rel["accuracy"]), _nan(rel["mean_confidence"])
        count = np.array(rel["count"], float)
        ax = axes[0, col]
        ax.bar(
            centers,
            np.nan_to_num(acc),
            width=width * 0.95,
            color="tab:blue",
            alpha=0.7,
            label="accuracy (first k accepted)",
        )
        # Mean confidence of each bin at the bin centre: the bar-to-dot gap is the error.
        ax.plot(centers, conf, "_", color="tab:red", ms=12, mew=2, label="mean confidence")
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
        ece = calib[key]["pooled_ece"]
        ax.set_title(f"{title}: ECE {100 * ece:.2f}%" if ece is not None else title)
        ax.set_ylabel("fraction with first k accepted")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7, loc="upper left")
        hx = axes[1, col]
        hx.bar(centers, count, width=width * 0.95, color="gray")
        hx.set_xlabel("prefix survival a_k")
        hx.set_ylabel("samples")
    fig.suptitle(f"{entry['drafter']} — {entry['prompt_set']}, T={entry['temperature']:g}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_threshold_sweep(entry: dict, path: str | Path) -> Path:
    calib = entry["calibration"]
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for key, style in (("raw", "-"), ("sts", "--")):
        if not calib.get(key):
            continue
        sw = calib[key]["threshold_sweep"]
        t = np.array(sw["threshold"])
        ax.plot(
            t,
            _nan(sw["acceptance_rate"]),
            style,
            color="tab:blue",
            label=f"acceptance rate of verified ({key})",
        )
        ax.plot(
            t, _nan(sw["pruned_share"]), style, color="tab:orange", label=f"pruned share ({key})"
        )
    ax.set_xlabel("static confidence threshold on a_k")
    ax.set_ylabel("fraction")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title(f"{entry['drafter']} — {entry['prompt_set']}, T={entry['temperature']:g}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_results(results: str | Path | dict, out_dir: str | Path) -> list[Path]:
    """Every diagram for a results file (or its loaded dict); returns the PNG paths."""
    data = load_results(results) if not isinstance(results, dict) else results
    entries = data["results"]
    if not entries:
        raise ValueError("the results file holds no entries to plot")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot_position_acceptance(entries, out / "position_acceptance.png")]
    for e in entries:
        if not e.get("calibration"):
            continue
        stem = _slug(e["drafter"], e["prompt_set"], f"T{e['temperature']:g}")
        paths.append(plot_reliability(e, out / f"reliability_{stem}.png"))
        paths.append(plot_threshold_sweep(e, out / f"threshold_{stem}.png"))
    return paths


__all__ = [
    "load_results",
    "plot_position_acceptance",
    "plot_reliability",
    "plot_results",
    "plot_threshold_sweep",
]
