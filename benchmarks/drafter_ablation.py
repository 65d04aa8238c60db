"""What moves DSpark against EAGLE-3: controlled drafter training runs (issue 14).

    python benchmarks/drafter_ablation.py [--runs NAME ...] [--eval-batches 16]

Each factor is one change to the bundled recipe (``dspark_jax/train/bundled.py``: same
target, distilled data, batch, optimiser and schedule) applied to the DSpark (Markov) arm,
and to the EAGLE-3 arm where the factor exists for it, with everything else held. A factor
is read as the ratio of held-out teacher-forced τ_tf (T = 1, the same held-out batches for
every run) of its DSpark run over its EAGLE-3 run, beside the bundled ratio. Runs go to
``workdirs/<name>`` (the bundled arms reuse ``scripts/build_bundled_models.sh``'s
``workdirs/drafter_<arm>``), resume if killed (re-run the command) and are trained once
even when several factors read them. The result file is rewritten after every run, so a
partial sweep is readable. Writes ``benchmarks/results/drafter_ablation.json``.

The target-strength factor trains both arms against the first bundled target
(``assets/target_v1``, 0.22 epochs) on its own self-distillation data, made first with the
bundled data's command:

    python -m dspark_jax.data.distill --target assets/target_v1 --corpus-dir data/stdlib \
        --out-dir data/distill_v1 --prompt-len 128 --max-new-tokens 256 --max-prompts 3072 \
        --batch-size 32 --temperature 1.0 --seed 0

The greedy-share run (``dspark_greedy25``) trains on the bundled data's command with
``--out-dir data/distill_greedy25 --greedy-share 0.25``: every fourth train batch
regenerated at temperature 0, the held-out split unchanged, so its held-out τ_tf reads
against the bundled DSpark's on the same records. It is no EAGLE-3 factor (no row in the
factor table); ``benchmarks/summarize.py`` shows it beside its decoded acceptance.
"""

from __future__ import annotations

import argparse
import json
import os

from drafter_runs import ROOT, train_point

DSPARK = "configs/bundled/drafter_dspark.py"
EAGLE3 = "configs/bundled/drafter_eagle3.py"

_V1 = ["target.dir=assets/target_v1", "data.data_dir=data/distill_v1"]

# name -> (config, overrides, workdir under workdirs/)
RUNS = {
    "dspark": (DSPARK, [], "drafter_dspark"),
    "dspark_rnn": ("configs/bundled/drafter_dspark_rnn.py", [], "drafter_dspark_rnn"),
    "dflash": ("configs/bundled/drafter_dflash.py", [], "drafter_dflash"),
    "eagle3": (EAGLE3, [], "drafter_eagle3"),
    "mtp1": ("configs/bundled/drafter_mtp1.py", [], "drafter_mtp1"),
    # Equal steps: every arm BUNDLED_STEPS (400), EAGLE-3 then gets 1.9x DSpark's FLOPs.
    "eagle3_steps": (EAGLE3 + ":steps", [], "ablation/eagle3_steps"),
    # Twice the compute budget: DSpark 800 steps; the EAGLE-3 arm is eagle3_steps (400
    # steps, 1.9x its bundled 210) rather than a 420-step run: 5 % less compute for
    # EAGLE-3 for one CPU run fewer.
    "dspark_2x": (DSPARK, ["train.steps=800"], "ablation/dspark_2x"),
    # Four times the compute budget for both arms (4 x 400 and 4 x 210 steps): where the
    # ratio goes as both arms approach convergence.
    "dspark_4x": (DSPARK, ["train.steps=1600"], "ablation/dspark_4x"),
    "eagle3_4x": (EAGLE3, ["train.steps=840"], "ablation/eagle3_4x"),
    # A quarter of the distilled data (768 of 3072 prompts), same steps. The DSpark arm is
    # the same training as drafter_data_curve.py's 768 point (same config, same overrides),
    # so it shares that workdir and is trained once for both benchmarks.
    "dspark_768": (DSPARK, ["data.max_train_records=768"], "data_curve/768"),
    "eagle3_768": (EAGLE3, ["data.max_train_records=768"], "ablation/eagle3_768"),
    # DeepSpec's released draft depth (5 layers), same steps (more FLOPs per step).
    "dspark_l5": (DSPARK, ["drafter.num_layers=5"], "ablation/dspark_l5"),
    "dflash_l5": (
        "configs/bundled/drafter_dflash.py",
        ["drafter.num_layers=5"],
        "ablation/dflash_l5",
    ),
    # Block size γ = 4 for both arms (EAGLE-3's training-time test unrolls 4 steps).
    "dspark_g4": (DSPARK, ["drafter.gamma=4"], "ablation/dspark_g4"),
    "eagle3_g4": (EAGLE3, ["drafter.gamma=4"], "ablation/eagle3_g4"),
    # Markov rank 64 instead of 256.
    "dspark_r64": (DSPARK, ["drafter.markov_rank=64"], "ablation/dspark_r64"),
    # Position decay 7 (= γ, as the paper writes it) instead of DeepSpec's released 4.0.
    "dspark_decay7": (DSPARK, ["loss.decay=7.0"], "ablation/dspark_decay7"),
    # A quarter of the distilled train batches generated greedily (module docstring): does
    # a greedy share help greedy acceptance? Same prompts, steps and held-out records.
    "dspark_greedy25": (
        DSPARK,
        ["data.data_dir=data/distill_greedy25"],
        "ablation/dspark_greedy25",
    ),
    # The weaker first target, on data distilled from it (module docstring).
    "dspark_v1": (DSPARK, _V1, "ablation/dspark_v1"),
    "eagle3_v1": (EAGLE3, _V1, "ablation/eagle3_v1"),
}

# (factor, DSpark run, EAGLE-3 run)
FACTORS = [
    ("bundled recipe (equal compute)", "dspark", "eagle3"),
    ("equal steps (400 each; EAGLE-3 1.9x FLOPs)", "dspark", "eagle3_steps"),
    ("training length: 2x compute (EAGLE-3 1.9x)", "dspark_2x", "eagle3_steps"),
    ("training length: 4x compute", "dspark_4x", "eagle3_4x"),
    ("data size: 768 prompts", "dspark_768", "eagle3_768"),
    ("draft depth: 5 layers (DSpark only)", "dspark_l5", "eagle3"),
    # Same steps as bundled: both steps get cheaper at γ = 4, EAGLE-3's (4 TTT steps, not 7)
    # the most, so this row gives EAGLE-3 less than DSpark's compute, not more.
    ("block size: gamma = 4 (bundled steps)", "dspark_g4", "eagle3_g4"),
    ("Markov rank 64 (DSpark only)", "dspark_r64", "eagle3"),
    ("loss decay 7 = gamma (DSpark only)", "dspark_decay7", "eagle3"),
    ("RNN head instead of Markov", "dspark_rnn", "eagle3"),
    ("target: v1 (0.22 epochs, held-out loss 5.11)", "dspark_v1", "eagle3_v1"),
]


def _result(args, points: dict) -> dict:
    factors = []
    for name, ds, e3 in FACTORS:
        row = {"factor": name, "dspark_run": ds, "eagle3_run": e3}
        if ds in points and e3 in points:
            row["dspark_tau_tf"] = points[ds]["heldout_tau_tf"]
            row["eagle3_tau_tf"] = points[e3]["heldout_tau_tf"]
            # A ratio only between runs trained against the same target weights: after the
            # bundled target changes, a partial re-run leaves rows pairing a new run with an
            # old one, and their ratio would mix two targets.
            if points[ds].get("target_weights") == points[e3].get("target_weights"):
                row["ratio"] = row["dspark_tau_tf"] / row["eagle3_tau_tf"]
            else:
                row["unpaired"] = "the two runs trained against different target weights"
        factors.append(row)
    return {
        # The runs in the file may come from several calls; this one command remakes them all.
        "command": " ".join(
            ["python benchmarks/drafter_ablation.py --runs", *(n for n in RUNS if n in points)]
            + ([f"--eval-batches {args.eval_batches}"] if args.eval_batches != 16 else [])
        ),
        "eval_batches": args.eval_batches,
        "runs": {
            name: {"config": RUNS[name][0], "overrides": RUNS[name][1], **points[name]}
            for name in RUNS
            if name in points
        },
        "factors": factors,
    }


def _earlier_points(path: str) -> dict:
    """The runs an earlier (partial) call wrote to the result file, kept beside new ones."""
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        earlier = json.load(f).get("runs", {})
    skip = ("config", "overrides")
    return {
        name: {k: v for k, v in run.items() if k not in skip}
        for name, run in earlier.items()
        if name in RUNS
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--workdir", default=os.path.join(ROOT, "workdirs"))
    p.add_argument(
        "--out", default=os.path.join(ROOT, "benchmarks", "results", "drafter_ablation.json")
    )
    args = p.parse_args(argv)
    from dspark_jax.perf.results import write_result

    for name in args.runs:
        config, overrides, workdir = RUNS[name]
        point = train_point(
            config,
            os.path.join(args.workdir, workdir),
            [*overrides, f"train.eval_batches={args.eval_batches}"],
        )
        # Re-read before writing: another call may have added runs to the file meanwhile.
        points = {**_earlier_points(args.out), name: point}
        write_result(args.out, _result(args, points))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
