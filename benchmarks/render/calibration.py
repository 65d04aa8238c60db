"""Calibration page: the bundled DSpark drafter's STS fit (``sts.json``), before and after,
per position, with the ECE noise floor."""

from __future__ import annotations

import pathlib

from . import common


def _temperature_only_heldout(sts_dir: pathlib.Path, bins: int) -> list[float] | None:
    """Held-out per-position ECE of the paper's temperature-only STS, refitted from the rounds
    an affine calibration saved (``sts_data.npz``): the two modes on identical data."""
    path = sts_dir / "sts_data.npz"
    if not path.is_file():
        return None
    import numpy as np

    from dspark_jax.eval import calibration as cal

    d = np.load(path)
    if "heldout_logits" not in d.files:
        return None
    res = cal.fit_sts(d["fit_logits"], d["fit_accepted"], d["fit_verified"], n_bins=bins)
    g = d["fit_logits"].shape[1]
    rep = cal.calibration_report(
        d["heldout_logits"], d["heldout_accepted"], d["heldout_verified"],
        res.temperatures[:g], bins,
    )  # fmt: skip
    return [r["ece"] for r in rep]


def calibration_section(sts, sts_dir=common.ROOT / "assets" / "drafters" / "dspark") -> list[str]:
    out = ["## Calibration (STS)", ""]
    if sts is None:
        return out + ["No `sts.json` for the DSpark drafter yet.", ""]
    data = sts.get("data", {})
    mode = sts.get("mode", "temperature")
    # The command, rebuilt from what calibrate recorded in sts.json.
    files = data.get("prompt_files", [])
    limit = f" --limit {data['limit']}" if data.get("limit") else ""
    cmd = (
        f"python -m dspark_jax.eval calibrate --target {data.get('target')} --drafter "
        f"{data.get('drafter')} "
        + " ".join(f"--prompts {f}" for f in files)
        + f"{limit} --split-fraction "
        f"{data.get('split_fraction')} --temperature {data.get('temperature')} "
        f"--max-new-tokens {data.get('max_new_tokens')} --slots {data.get('slots')}"
        + (f" --mode {mode}" if mode != "temperature" else "")
    )
    fit_r, held_r = data.get("fit_rounds"), data.get("heldout_rounds")
    temp_only = (
        _temperature_only_heldout(sts_dir, data.get("bins", 20)) if mode == "affine" else None
    )
    fitted = "temperatures and biases" if mode == "affine" else "temperatures"
    out += [
        f"Per-position {fitted} fitted left to right on the first half of the prompts, "
        "ECE (20 bins) of the cumulative product against 'first k accepted' reported on the "
        f"held-out half ({fit_r} / {held_r} rounds; `assets/drafters/dspark/sts.json`, "
        f"mode `{mode}`):",
        "",
        f"    {cmd}",
        "",
    ]
    if temp_only:
        out += [
            "| k | T_k | b_k | ECE before | ECE after, temperature only | ECE after, affine "
            "| ECE floor | AUROC |",
            "|---|---|---|---|---|---|---|---|",
        ]
    else:
        out += [
            "| k | T_k | ECE before | ECE after | ECE floor | AUROC |",
            "|---|---|---|---|---|---|",
        ]
    before, after, floor = [], [], []
    biases = sts.get("biases") or [0.0] * len(sts["temperatures"])
    for k, m in enumerate(sts["heldout_metrics"]):
        before.append(m["ece_before"])
        after.append(m["ece_after"])
        floor.append(m.get("ece_floor_after", float("nan")))
        t_col = f"{sts['temperatures'][k]:.3f} | "
        mid = f"{100 * m['ece_after']:.2f} % | "
        if temp_only:
            t_col += f"{biases[k]:+.3f} | "
            mid = f"{100 * temp_only[k]:.2f} % | " + mid
        out.append(
            f"| {k + 1} | {t_col}{100 * m['ece_before']:.2f} % | {mid}"
            f"{100 * floor[-1]:.2f} % | {m.get('auroc_after', float('nan')):.3f} |"
        )
    mean = lambda xs: 100 * sum(xs) / len(xs)  # noqa: E731
    mean_row = f"| mean | | {mean(before):.2f} % | {mean(after):.2f} % | {mean(floor):.2f} % | |"
    if temp_only:
        mean_row = (
            f"| mean | | | {mean(before):.2f} % | {mean(temp_only):.2f} % | {mean(after):.2f} % "
            f"| {mean(floor):.2f} % | |"
        )
    out += [
        mean_row,
        "",
        "ECE floor: the mean ECE of a perfectly calibrated predictor with the same calibrated "
        "confidences on the same number of rounds (labels drawn from Bernoulli(a_k)); binned "
        "ECE cannot be read below it on this sample size. Both modes keep each position's "
        "ranking (AUROC is unchanged). When AUROC is near 0.5 the calibrated optimum is close "
        "to a constant (the acceptance rate), which σ(z/T) cannot express (it tends to 0.5 as "
        "T grows); and the product of per-position confidences runs above the observed "
        "survival, because c_k is as high after an earlier rejection as after an acceptance. "
        "A per-position bias b_k (`--mode affine`, an extension of the paper's "
        "temperature-only STS) removes both.",
    ]
    if temp_only:
        out += [
            "",
            "The temperature-only column is the paper's STS refitted on the same fit-half rounds "
            "(`sts_data.npz`) and scored on the same held-out half.",
        ]
    out += [
        "",
        "Paper: raw 3–8 % → ≈ 1 % after STS. Reliability diagrams and the static-threshold "
        "sweep (Fig. 5/6 analogs) for the acceptance runs are in "
        f"[`benchmarks/results/figs/`]({common.TO_ROOT}/benchmarks/results/figs/) "
        "(`python -m dspark_jax.eval plot --results benchmarks/results/acceptance.json "
        "--out-dir benchmarks/results/figs`).",
        "",
    ]
    return out


def calibration(results: pathlib.Path) -> list[str]:
    sts_dir = common.ROOT / "assets" / "drafters" / "dspark"
    return calibration_section(common.load(sts_dir / "sts.json"), sts_dir)


def survival_estimators(results: pathlib.Path) -> list[str]:
    """The draft-probability estimate per bundled drafter against DSpark's head
    (``benchmarks/survival_estimators.py``): the shipped fits, then any comparison runs."""
    out = ["## Survival estimates side by side", ""]
    files = sorted(results.glob("survival_estimators*.json"))
    if not files:
        return out + ["No `survival_estimators.json` yet.", ""]
    for path in files:
        out += _survival_table(common.load(path))
    return out


def _survival_table(res: dict) -> list[str]:
    st = res["settings"]
    where = (
        "The fits are the files serving reads "
        "(`assets/drafters/<name>/sts_draft_probability.json`; DSpark's head: its `sts.json`)."
        if res.get("shipped", True)
        else "A comparison run: the fits (DSpark's head refitted with the same settings "
        "included) are written beside the result, not into the drafters."
    )
    out = [
        f"### T = {st['temperature']:g}",
        "",
        "Each drafter's draft-probability estimate (`c_k` from `max_v q_k(v)`, its own "
        "untempered draft distribution at position k; "
        f"[design]({common.TO_ROOT}/docs/design/scheduling.md#survivals-for-every-drafter-decodeplan_steppy-survival_logits-our-addition)) "
        "calibrated by STS exactly as the head "
        f"(mode `{st['mode']}`, {len(st['prompt_files'])} prompt files × {st['limit']} "
        f"prompts, split {st['split_fraction']:g}, {st['max_new_tokens']} tokens, seed "
        f"{st['seed']}); held-out ECE of the survival `a_k` per position and AUROC of "
        f"`c_k`, means over the γ positions (the worst position in brackets). {where}",
        "",
        f"    {res['command']}",
        "",
        "| drafter | estimate | STS mode | held-out rounds | ECE before STS "
        "| ECE after STS (worst k) | AUROC | positions STS made worse |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = {"confidence_head": "confidence head", "draft_probability": "draft probability"}

    def pct(x):
        return "–" if x is None else f"{100 * x:.2f} %"

    for f in res["fits"]:
        worse = ", ".join(map(str, f["worse_heldout_positions"])) or "none"
        auroc = "–" if f["mean_auroc"] is None else f"{f['mean_auroc']:.3f}"
        out.append(
            f"| {f['drafter']} | {names[f['estimator']]} | {f.get('mode', st['mode'])} | "
            f"{f['heldout_rounds']} | {pct(f['mean_ece_before'])} | {pct(f['mean_ece_after'])} "
            f"({pct(f['max_ece_after'])}) | {auroc} | {worse} |"
        )
    out.append("")
    refits = [f for f in res["fits"] if f.get("refit_from_mode")]
    if refits:
        out += [
            "Refitted without decoding (`python benchmarks/survival_estimators.py --drafters "
            "NAME --refit-mode MODE`: the same stored rounds, another map): "
            + ", ".join(
                f"{f['drafter']} ({f['mode']}, from its {f['refit_from_mode']} fit's rounds)"
                for f in refits
            )
            + ".",
            "",
        ]
    modes = [f for f in res["fits"] if "modes_on_stored_rounds" in f]
    if modes:
        names_m = list(modes[0]["modes_on_stored_rounds"])
        out += [
            "Each STS mode refitted on the same stored rounds of each fit (its fit split; "
            "scored on its held-out split; no decoding): held-out ECE after, mean (worst "
            "position), and AUROC. Isotonic steps tie the rounds within a step.",
            "",
            "| drafter | estimate | " + " | ".join(names_m) + " |",
            "|---|---|" + "---|" * len(names_m),
        ]
        for f in modes:
            cells = []
            for m in names_m:
                r = f["modes_on_stored_rounds"][m]
                auroc = "–" if r["mean_auroc"] is None else f"{r['mean_auroc']:.3f}"
                cells.append(
                    f"{pct(r['mean_ece_after'])} ({pct(r['max_ece_after'])}), AUROC {auroc}"
                )
            out.append(f"| {f['drafter']} | {names[f['estimator']]} | " + " | ".join(cells) + " |")
        out.append("")
    if "dspark_same_rounds" in res:
        same = "identical" if res["dspark_same_rounds"] else "NOT identical"
        out += [
            "DSpark's two rows are fitted and scored on the same rounds (the saved acceptance "
            f"labels of both fits are {same}): a fixed-block run's rounds do not depend on "
            "the estimator.",
            "",
        ]
    return out
