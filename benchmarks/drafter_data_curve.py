"""Drafter quality vs self-distillation data: the curve that sizes ``data/distill``.

    python benchmarks/drafter_data_curve.py [--config configs/drafter_dspark.py] \
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
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _final_eval(workdir: str) -> dict:
    from dspark_jax.train.trainer import read_metrics

    evals = [m for m in read_metrics(workdir) if m.get("kind") == "eval"]
    if not evals:
        raise RuntimeError(f"{workdir}: the run logged no evaluation")
    return evals[-1]


def _train_wall_s(workdir: str) -> float | None:
    path = os.path.join(workdir, "wall_s.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)["wall_s"]
    return None


def run(args) -> dict:
    from dspark_jax.config import load_config
    from dspark_jax.data.corpus import find_dataset_dir, read_metadata
    from dspark_jax.data.distill import DistillDataset

    cfg = load_config(args.config)
    points = []
    for n in args.records:
        workdir = os.path.join(args.workdir, str(n))
        cmd = [
            sys.executable, os.path.join(ROOT, "train.py"), "--config", args.config,
            "--workdir", workdir, "--no-progress",
            f"--config.data.max_train_records={n}",
            f"--config.train.eval_batches={args.eval_batches}",
        ]  # fmt: skip
        t0 = time.perf_counter()
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
        if _train_wall_s(workdir) is None:  # first completion: keep its wall time
            with open(os.path.join(workdir, "wall_s.json"), "w") as f:
                json.dump({"wall_s": round(time.perf_counter() - t0, 1)}, f)
        ev = _final_eval(workdir)
        points.append(
            {
                "train_records": n,
                "step": ev["step"],
                "epochs": round(ev["step"] * cfg.data.batch_size / n, 2),
                "heldout_tau_tf": ev["heldout_tau_tf"],
                "heldout_accept_mean": ev["heldout_accept_mean"],
                "heldout_loss": ev["heldout_loss"],
                "heldout_label_positions": ev["heldout_label_positions"],
                "wall_s": _train_wall_s(workdir),
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
    p.add_argument("--config", default="configs/drafter_dspark.py")
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
