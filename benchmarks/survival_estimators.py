"""Survival estimates side by side: the draft-probability estimate (``c_k`` from the
largest probability of the drafter's own distribution at position k, ``decode.plan_step``)
calibrated by STS for every bundled drafter, against DSpark's learned confidence head, on
the same prompts, settings and seed as the head's shipped calibration (``sts.json``).

For each drafter it runs ``calibrate --survival-estimator draft-probability`` with the
settings the head's fit recorded (``--refit-head`` first refits the head itself with them,
rewriting ``assets/drafters/dspark/sts.json``), writing ``<drafter>/sts_draft_probability.json``
(the file serving reads for that estimate), and collects the held-out per-position ECE /
AUROC before and after STS of every fit.
A fixed-block run's rounds do not depend on the estimator (every draft is verified, the
key streams do not read survivals), so DSpark's two estimates are compared on identical
rounds: the script checks that the held-out acceptance labels of both files are equal.

    python benchmarks/survival_estimators.py                 # all bundled drafters
    python benchmarks/survival_estimators.py --drafters eagle3 --reuse
    python benchmarks/survival_estimators.py --temperature 0 --limit 100 \
        --fits-dir benchmarks/results/survival_fits_t0 \
        --out benchmarks/results/survival_estimators_t0.json     # greedy, not shipped

Each fit also records the three STS modes (temperature, affine, isotonic) refitted on its
own stored rounds (``<stem>_data.npz``: same fit split, same held-out split, no decoding),
so the calibration map is compared on identical data. ``--refit-mode MODE`` rewrites the
selected drafters' draft-probability files with that mode's fit from their stored rounds
(refused where it makes a held-out position worse than uncalibrated):

    python benchmarks/survival_estimators.py --drafters mtp1 --refit-mode isotonic
    python benchmarks/survival_estimators.py --reuse

Writes ``benchmarks/results/survival_estimators.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

DRAFTERS = ("dspark", "dspark-rnn", "dflash", "eagle3", "mtp1")


def _calibrate_args(
    head: dict, target: str, drafter_dir: str, out: str, estimator: str = "draft-probability"
) -> list[str]:
    """The calibrate command of the head's shipped fit, for ``estimator``."""
    data = head["data"]
    args = ["--target", target, "--drafter", drafter_dir]
    for f in data["prompt_files"]:
        args += ["--prompts", os.path.normpath(os.path.join(ROOT, f))]
    args += [
        "--limit", str(data["limit"]),
        "--split-fraction", str(data["split_fraction"]),
        "--temperature", str(data["temperature"]),
        "--max-new-tokens", str(data["max_new_tokens"]),
        "--max-prompt-tokens", str(data["max_prompt_tokens"]),
        "--slots", str(data["slots"]),
        "--seed", str(data["seed"]),
        "--bins", str(data["bins"]),
        "--mode", data["mode"],
        "--prompt-style", data["prompt_style"],
        "--survival-estimator", estimator,
        "--out", out, "--overwrite", "--no-progress",
    ]  # fmt: skip
    return args


def _summary(payload: dict) -> dict:
    """Held-out per-position metrics of one STS file, and their means over the positions
    that have labels."""
    rows = payload["heldout_metrics"] or []

    def mean(key):
        xs = [r[key] for r in rows if r[key] is not None and math.isfinite(r[key])]
        return sum(xs) / len(xs) if xs else None

    def worst(key):
        xs = [r[key] for r in rows if r[key] is not None and math.isfinite(r[key])]
        return max(xs) if xs else None

    return {
        "estimator": payload.get("estimator", "confidence_head"),
        "mode": payload["mode"],
        "fit_rounds": payload["data"]["fit_rounds"],
        "heldout_rounds": payload["data"]["heldout_rounds"],
        "per_position": [
            {
                k: r[k]
                for k in (
                    "position",
                    "n",
                    "ece_before",
                    "ece_after",
                    "ece_floor_after",
                    "auroc_before",
                    "auroc_after",
                )
            }  # fmt: skip
            for r in rows
        ],
        "mean_ece_before": mean("ece_before"),
        "mean_ece_after": mean("ece_after"),
        "max_ece_after": worst("ece_after"),
        "mean_auroc": mean("auroc_after"),
        "worse_heldout_positions": payload["data"].get("worse_heldout_positions", []),
        # --refit-mode: the mode of the decoded fit whose stored rounds this one refitted
        "refit_from_mode": payload["data"].get("refit_from_stored_rounds_of_mode"),
    }


def _stored_rounds(fit_path: str):
    import numpy as np

    from dspark_jax.models.drafter_io import sts_data_path

    d = np.load(sts_data_path(fit_path))
    return ((d["fit_logits"], d["fit_accepted"], d["fit_verified"]),
            (d["heldout_logits"], d["heldout_accepted"], d["heldout_verified"]))  # fmt: skip


def _modes_on_stored_rounds(fit_path: str, bins: int) -> dict:
    """Every STS mode refitted on the fit's own stored fit split and scored on its held-out
    split: mean / worst held-out ECE after, and mean AUROC after (ties within isotonic
    steps can lower it)."""
    import numpy as np

    from dspark_jax.eval import calibration as cal

    (zf, af, vf), (zh, ah, vh) = _stored_rounds(fit_path)
    out = {}
    for mode in cal.STS_MODES:
        sts = cal.fit_sts(zf, af, vf, n_bins=bins, mode=mode).sts
        rows = cal.before_after_report(zh, ah, vh, sts, bins)
        ece = [r["ece_after"] for r in rows if r["ece_after"] is not None]
        auroc = [r["auroc_after"] for r in rows if r["auroc_after"] is not None]
        out[mode] = {
            "mean_ece_after": float(np.mean(ece)),
            "max_ece_after": float(np.max(ece)),
            "mean_auroc": float(np.mean(auroc)) if auroc else None,
        }
    return out


def _refit_from_stored_rounds(fit_path: str, mode: str) -> None:
    """Rewrite an STS file with ``mode``'s fit on the rounds stored beside it (no decoding),
    keeping its data description; refused where a held-out position gets worse."""
    import numpy as np

    from dspark_jax.eval import calibration as cal
    from dspark_jax.eval.__main__ import worse_positions
    from dspark_jax.models.drafter_io import sts_data_path

    with open(fit_path) as f:
        old = json.load(f)
    bins, gamma = old["data"]["bins"], old["gamma"]
    (zf, af, vf), (zh, ah, vh) = _stored_rounds(fit_path)
    res = cal.fit_sts(zf, af, vf, n_bins=bins, mode=mode).padded(gamma)
    sts = res.sts.first(zf.shape[1])
    held = cal.before_after_report(zh, ah, vh, sts, bins)
    worse = worse_positions(held)
    if worse:
        raise SystemExit(
            f"error: {mode} makes {fit_path} worse at held-out position(s) "
            f"{[r['position'] for r in worse]}; not written"
        )
    data = dict(old["data"], mode=mode, refit_from_stored_rounds_of_mode=old["mode"])
    arrays = dict(np.load(sts_data_path(fit_path)))
    cal.save_sts(
        fit_path,
        res,
        heldout=held,
        fit_report=cal.before_after_report(zf, af, vf, sts, bins),
        data=data,
        arrays=arrays,
        overwrite=True,
        estimator=old.get("estimator", "confidence_head"),
    )
    print(f"rewrote {fit_path} with the {mode} fit of its stored rounds")


def _first_position_deciles(fit_path: str) -> list[float]:
    """Held-out acceptance of the first draft by decile of its raw estimate ``z_1``
    (from the label arrays beside the fit): whether survival rises with the estimate,
    which an increasing calibration map needs."""
    import numpy as np

    from dspark_jax.models.drafter_io import sts_data_path

    d = np.load(sts_data_path(fit_path))
    z, accepted = d["heldout_logits"][:, 0], d["heldout_accepted"]
    edges = np.quantile(z, np.linspace(0, 1, 11))
    decile = np.clip(np.searchsorted(edges, z, side="right") - 1, 0, 9)
    return [round(float(np.mean(accepted[decile == i] >= 1)), 3) for i in range(10)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default=os.path.join(ROOT, "assets", "target"))
    p.add_argument("--drafters-dir", default=os.path.join(ROOT, "assets", "drafters"))
    p.add_argument("--drafters", default=",".join(DRAFTERS), help="comma list of names")
    p.add_argument(
        "--reuse",
        action="store_true",
        help="collect the existing fits (sts.json, sts_draft_probability.json) instead of "
        "refitting",
    )
    p.add_argument(
        "--refit-head",
        action="store_true",
        help="refit DSpark's head first (rewrites assets/drafters/dspark/sts.json)",
    )
    p.add_argument(
        "--fits-dir",
        default=None,
        help="write every fit here (<name>_sts_draft_probability.json, dspark_sts.json: the "
        "head refitted with the same settings) instead of the drafter directories, with "
        "--force (a comparison, not what serving reads); for --temperature / --limit runs",
    )
    p.add_argument("--temperature", type=float, default=None, help="override the head's")
    p.add_argument("--limit", type=int, default=None, help="override the head's (per file)")
    p.add_argument(
        "--refit-mode",
        choices=("temperature", "affine", "isotonic"),
        default=None,
        help="rewrite the drafters' draft-probability fits with this STS mode, fitted on the "
        "rounds stored beside each (no decoding); implies --reuse",
    )
    p.add_argument("--out", default=os.path.join(HERE, "results", "survival_estimators.json"))
    args = p.parse_args(argv)
    if args.refit_mode:
        args.reuse = True

    import numpy as np

    from dspark_jax.eval.__main__ import main as eval_main

    head_path = os.path.join(args.drafters_dir, "dspark", "sts.json")
    with open(head_path) as f:
        head = json.load(f)
    for key in ("temperature", "limit"):
        if getattr(args, key) is not None:
            head["data"][key] = getattr(args, key)
    result = {
        "command": "python benchmarks/survival_estimators.py " + " ".join(argv or sys.argv[1:]),
        "settings": {
            k: head["data"][k]
            for k in (
                "prompt_files",
                "limit",
                "split_fraction",
                "temperature",
                "max_new_tokens",
                "slots",
                "seed",
                "bins",
                "mode",
            )
        },  # fmt: skip
        "shipped": args.fits_dir is None,
        "fits": [],
    }
    extra = ["--force"] if args.fits_dir else []

    def calibrate(label, drafter_dir, out, estimator):
        if args.reuse:
            return 0
        cmd = _calibrate_args(head, args.target, drafter_dir, out, estimator) + extra
        print(f"== {label}: calibrate {' '.join(cmd)}", flush=True)
        rc = eval_main(["calibrate", *cmd])
        if rc != 0:
            print(f"error: calibrate of {label} exited with {rc}", file=sys.stderr)
        return rc

    dspark_dir = os.path.join(args.drafters_dir, "dspark")
    if args.fits_dir:
        os.makedirs(args.fits_dir, exist_ok=True)
        head_path = os.path.join(args.fits_dir, "dspark_sts.json")
    if args.fits_dir or args.refit_head:  # the head first, with the same settings
        if calibrate("dspark head", dspark_dir, head_path, "confidence-head"):
            return 1
    with open(head_path) as f:
        head_fit = json.load(f)
    outs = {}
    for name in args.drafters.split(","):
        d = os.path.join(args.drafters_dir, name)
        outs[name] = out = (
            os.path.join(args.fits_dir, f"{name}_sts_draft_probability.json")
            if args.fits_dir
            else os.path.join(d, "sts_draft_probability.json")
        )
        start = time.time()
        if calibrate(name, d, out, "draft-probability"):
            return 1
        if args.refit_mode:
            _refit_from_stored_rounds(out, args.refit_mode)
        with open(out) as f:
            fit = _summary(json.load(f))
        fit.update(drafter=name, seconds=None if args.reuse else round(time.time() - start, 1))
        fit["first_draft_acceptance_by_decile"] = _first_position_deciles(out)
        fit["modes_on_stored_rounds"] = _modes_on_stored_rounds(out, head["data"]["bins"])
        result["fits"].append(fit)
        print(
            f"{name:>10s} draft probability: held-out ECE {fit['mean_ece_before']:.4f} -> "
            f"{fit['mean_ece_after']:.4f} (max {fit['max_ece_after']:.4f}), "
            f"AUROC {fit['mean_auroc']}",
            flush=True,
        )
    fit = _summary(head_fit)
    fit.update(drafter="dspark", seconds=None)
    fit["first_draft_acceptance_by_decile"] = _first_position_deciles(head_path)
    fit["modes_on_stored_rounds"] = _modes_on_stored_rounds(head_path, head["data"]["bins"])
    result["fits"].append(fit)

    # DSpark's two estimates on identical rounds: the labels saved beside each fit agree.
    if "dspark" in outs:
        from dspark_jax.models.drafter_io import sts_data_path

        arrays = [np.load(sts_data_path(f)) for f in (head_path, outs["dspark"])]
        same = all(
            np.array_equal(arrays[0][k], arrays[1][k])
            for k in ("fit_accepted", "heldout_accepted", "heldout_prompt_index")
        )
        result["dspark_same_rounds"] = bool(same)
        print(f"DSpark's head and draft-probability fits on identical rounds: {same}")

    from dspark_jax.perf.results import write_result

    write_result(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
