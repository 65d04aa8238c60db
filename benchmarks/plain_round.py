"""What a plain round costs (``SpeculativeDecoder.plain_round``, the draft-aware policy's
arm): the bundled target + DSpark drafter's plain round against the no-speculation round
(the same target with no drafter) and the drafting round of the smallest and the full
verify budget, side by side in one process, interleaved ``--rounds`` times.

The plain round runs the target alone over the anchors and writes the drafter's context
K/V of each committed token; the no-speculation round does only the first. Their ratio is
what keeping the drafter's context current costs; drafting / plain is what a probe costs
(the ``c`` that scales the probe gaps, ``sched.plain_rounds``).

    python benchmarks/plain_round.py                # R = 1 and 16 slots, context 64

Writes ``benchmarks/results/plain_round.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default=os.path.join(HERE, "..", "assets", "target"))
    p.add_argument("--drafter", default=os.path.join(HERE, "..", "assets", "drafters", "dspark"))
    p.add_argument("--slots", default="1,16", help="comma list of slot counts R")
    p.add_argument("--context", type=int, default=64, help="committed tokens per slot")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20, help="timed calls per arm and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved passes over the arms")
    p.add_argument("--out", default=os.path.join(HERE, "results", "plain_round.json"))
    args = p.parse_args(argv)

    from dspark_jax.decode.step import SpeculativeDecoder, StepConfig
    from dspark_jax.perf.results import write_result
    from dspark_jax.sched.sps import median_seconds
    from dspark_jax.serve.engine import load_models

    target, tp, _, drafter, dp, _ = load_models(args.target, args.drafter)
    out = {
        "command": "python benchmarks/plain_round.py " + " ".join(argv or sys.argv[1:]),
        "target": os.path.relpath(args.target, os.path.dirname(HERE)),
        "drafter": os.path.relpath(args.drafter, os.path.dirname(HERE)),
        "gamma": drafter.config.draft_len,
        "context": args.context,
        "rows": [],
    }
    for r in (int(x) for x in args.slots.split(",")):

        def config(scheduler, r=r):
            return StepConfig(num_slots=r, max_len=args.max_len, scheduler=scheduler, sampling=True)

        dec = SpeculativeDecoder(target, tp, drafter, dp, config("topk"))
        none = SpeculativeDecoder(target, tp, None, None, config("none"))
        full = dec.full_budget
        arms = {
            "no speculation": none.profile_step_fns([0], context_len=args.context)[r],
            "plain": dec.plain_step_fn(context_len=args.context),
            **{
                f"drafting, K = {k}": fn
                for k, fn in zip(
                    (1, full), dec.profile_step_fns([1, full], context_len=args.context).values()
                )
            },
        }
        times = {name: [] for name in arms}
        for _ in range(args.rounds):  # interleaved: machine noise hits every arm alike
            for name, fn in arms.items():
                times[name].append(median_seconds(fn, args.repeats, warmup=2))
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        out["rows"].append({
            "slots": r,
            "ms": ms,
            "plain_over_no_speculation": ms["plain"] / ms["no speculation"],
            "smallest_drafting_over_plain": ms["drafting, K = 1"] / ms["plain"],
        })  # fmt: skip
    write_result(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
