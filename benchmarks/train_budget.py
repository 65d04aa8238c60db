"""Training FLOPs per step of the bundled drafters, and their equal-compute step counts.

    python benchmarks/train_budget.py [--target assets/target]

For each bundled arm (``configs/bundled/drafter_<arm>.py``) it compiles ``train.py``'s training
step for one CPU device and reads XLA's cost analysis (``perf.train_cost``: frozen-target
forward included, every model loop unrolled), then gives each arm the steps that spend
the shared budget (``train.bundled``: ``BUNDLED_STEPS`` steps of the budget arm). The FLOPs
do not depend on the target's weights, only on its shape. Writes
``benchmarks/results/train_budget.json`` and ``.md``; ``train/bundled.py``'s
``BUNDLED_STEP_GFLOPS`` table is these figures (tests/perf/test_train_cost.py checks it).
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def run(args) -> dict:
    from dspark_jax.config import load_config
    from dspark_jax.perf.train_cost import train_step_flops
    from dspark_jax.train import bundled

    arms = {}
    for arm in bundled.BUNDLED_STEP_GFLOPS:
        cfg = load_config(
            os.path.join(ROOT, "configs", "bundled", f"drafter_{arm}.py"),
            [("target.dir", args.target)],
        )
        cost = train_step_flops(cfg)
        arms[arm] = {
            "kind": cfg.drafter.kind,
            "gflops_per_step": round(cost["flops"] / 1e9, 2),
            "gbytes_per_step": round(cost["bytes"] / 1e9, 2),
            "tokens_per_step": cost["tokens"],
        }
        print(arm, arms[arm], flush=True)
    ref = arms[bundled.BUDGET_ARM]["gflops_per_step"]
    budget = bundled.BUNDLED_STEPS * ref
    for a in arms.values():
        a["equal_compute_steps"] = round(budget / a["gflops_per_step"])
        a["flops_vs_budget_arm"] = round(a["gflops_per_step"] / ref, 3)
    return {
        "command": " ".join(["python benchmarks/train_budget.py", *sys.argv[1:]]),
        "backend": "cpu (XLA cost analysis of the compiled step, one device)",
        "target": args.target,
        "budget_arm": bundled.BUDGET_ARM,
        "budget_steps": bundled.BUNDLED_STEPS,
        "budget_tflops": round(budget / 1e3, 2),
        "arms": arms,
    }


def to_markdown(res: dict) -> str:
    lines = [
        f"Training budget: {res['budget_steps']} steps of `{res['budget_arm']}` = "
        f"{res['budget_tflops']} TFLOP per arm (`{res['command']}`).",
        "",
        "| arm | GFLOP / step | GB accessed / step | × budget arm | equal-compute steps |",
        "|---|---|---|---|---|",
    ]
    for arm, a in res["arms"].items():
        lines.append(
            f"| {arm} | {a['gflops_per_step']} | {a['gbytes_per_step']} | "
            f"{a['flops_vs_budget_arm']} | {a['equal_compute_steps']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="assets/target")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "train_budget"))
    args = p.parse_args(argv)
    from dspark_jax.perf.results import write_result

    res = write_result(args.out + ".json", run(args))
    with open(args.out + ".md", "w") as f:
        f.write(to_markdown(res))
    print(to_markdown(res))


if __name__ == "__main__":
    main()
