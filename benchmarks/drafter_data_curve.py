"""Drafter quality vs self-distillation data: the curve that sizes ``data/distill``.

    python benchmarks/drafter_data_curve.py [--config configs/bundled/drafter_dspark.py] \
        [--records 768 1536 3072] [--eval-batches 16]

Trains the config once per training-set size, each on the first N distilled training
records (``data.max_train_records``: exactly what ``distill --max-prompts N`` would have
written, so one distillation serves every point) with the config's own budget (steps,
batch, schedule), and reads the final held-out evaluation: teacher-forced τ_tf, the mean
per-position acceptance Σ min(p_t, p_d) and the loss, on the same ``--eval-batches`` of the
held-out split for every point. Runs go to ``workdirs/data_curve/<N>`` and resume if
killed (re-run the command). Writes ``benchmarks/results/drafter_data_curve.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from drafter_runs import ROOT, train_point


def run(args) -> dict:
    from dspark_jax.config import load_config
    from dspark_jax.data.corpus import find_dataset_dir, read_metadata
    from dspark_jax.data.distill import DistillDataset

    cfg = load_config(args.config)
    points = []
    for n in args.records:
        workdir = os.path.join(args.workdir, str(n))
        point = train_point(
            args.config, workdir,
            [f"data.max_train_records={n}", f"train.eval_batches={args.eval_batches}"],
        )  # fmt: skip
        points.append(
            {
                "train_records": n,
                "step": point["step"],
                "epochs": round(point["step"] * cfg.data.batch_size / n, 2),
                **{k: v for k, v in point.items() if k != "step"},
            }
        )
        print(json.dumps(points[-1]), flush=True)
    ds_dir = find_dataset_dir(cfg.data.data_dir, DistillDataset.name)
    manifest = read_metadata(ds_dir).get("manifest", {})
    return {
        "config": args.config,
        "command": " ".join(["python benchmarks/drafter_data_curve.py", *sys.argv[1:]]),
        "steps": int(cfg.train.steps),
        "batch_size": int(cfg.data.batch_size),
        "seq_len": int(cfg.data.seq_len),
        "eval_batches": args.eval_batches,
        "data_dir": cfg.data.data_dir,
        "distill_manifest": manifest,
        "points": points,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/bundled/drafter_dspark.py")
    p.add_argument("--records", type=int, nargs="+", default=[768, 1536, 3072])
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--workdir", default=os.path.join(ROOT, "workdirs", "data_curve"))
    p.add_argument(
        "--out", default=os.path.join(ROOT, "benchmarks", "results", "drafter_data_curve.json")
    )
    args = p.parse_args(argv)
    from dspark_jax.perf.results import write_result

    write_result(args.out, run(args))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
