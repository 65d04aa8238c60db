"""Training throughput of candidate bundled targets on this machine, to size the test-bed
target's run (model, batch, sequence length, compute precision) from measurements.

    python benchmarks/target_sizing.py [--steps 30] [--arms NAME ...]

Each arm is ``train.py --config configs/bundled/target_pycode.py`` with overrides, run for
``--steps`` steps in a fresh work directory (no evaluation, no checkpoints) as its own
process, one after another. Reported per arm: parameters, tokens per step, the trainer's
own tokens/s (compilation excluded), the loss at the last step, and tokens/s relative to
the first arm. Results go to ``benchmarks/results/target_sizing.json``. Arms run one after
another on a shared machine: compare them within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from dspark_jax.perf.results import write_result  # noqa: E402

# name -> config overrides (on configs/bundled/target_pycode.py).
ARMS = {
    "small-fp32-4x512": {},
    "small-bf16-4x512": {"train.compute_dtype": "bfloat16"},
    "small-fp32-8x512": {"data.batch_size": 8},
    "small-fp32-16x256": {"data.batch_size": 16, "data.seq_len": 256},
    # ~17M parameters: width 384, 8 layers, 6 query / 3 KV heads of 64.
    "medium-fp32-8x512": {
        "data.batch_size": 8,
        "model.hidden_size": 384,
        "model.intermediate_size": 1152,
        "model.num_hidden_layers": 8,
        "model.num_attention_heads": 6,
        "model.num_key_value_heads": 3,
    },
}


def count_params(model: dict) -> int:
    """Parameters of the Qwen3 config a run resolved (``config.json``'s model section)."""
    import jax
    import numpy as np

    from dspark_jax.models.presets import get_preset
    from dspark_jax.models.qwen3 import Qwen3

    fields = {k: v for k, v in model.items() if k != "preset" and v is not None}
    cfg = get_preset(model["preset"]).replace(**fields)
    shapes = jax.eval_shape(
        lambda: Qwen3(cfg).init(jax.random.key(0), jax.numpy.zeros((1, 4), "int32"))
    )
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes)))


def run_arm(name: str, overrides: dict, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        args = [
            sys.executable, os.path.join(ROOT, "train.py"),
            "--config", os.path.join(ROOT, "configs", "bundled", "target_pycode.py"),
            "--workdir", workdir, "--no-progress",
            f"--config.train.steps={steps}", "--config.train.eval_every=0",
            "--config.train.checkpoint_every=0", "--config.train.log_every=5",
        ]  # fmt: skip
        args += [f"--config.{k}={v}" for k, v in overrides.items()]
        t0 = time.perf_counter()
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"arm {name} failed:\n{proc.stderr[-3000:]}")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        with open(os.path.join(workdir, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    data = cfg["data"]
    losses = [r["loss"] for r in rows if r.get("kind") == "train"]
    return {
        "overrides": overrides,
        "num_params": count_params(cfg["model"]),
        "tokens_per_step": data["batch_size"] * data["seq_len"],
        "tokens_per_s": summary["tokens_per_s"],
        "first_loss": losses[0] if losses else None,
        "last_loss": summary["final_loss"],
        "wall_seconds": round(wall, 1),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    p.add_argument("--out", default=os.path.join(HERE, "results", "target_sizing.json"))
    args = p.parse_args(argv)
    arms = {}
    for name in args.arms:
        arms[name] = run_arm(name, ARMS[name], args.steps)
        print(f"{name:>20s}  {arms[name]['tokens_per_s']:8.0f} tok/s", flush=True)
    first = arms[args.arms[0]]["tokens_per_s"]
    for a in arms.values():
        a["relative_tokens_per_s"] = a["tokens_per_s"] / first
    write_result(
        args.out,
        {
            "command": f"python benchmarks/target_sizing.py --steps {args.steps}",
            "arms": arms,
            "cpus": os.cpu_count(),
            "load_avg_at_end": list(os.getloadavg()),
        },
    )


if __name__ == "__main__":
    main()
