"""What the serving options cost per decode round: logprobs (a top-N over the vocabulary of
every verified row) and coupled verification (Gumbel noise over the vocabulary of every
verified row), measured side by side on the bundled target + DSpark drafter.

    python benchmarks/round_options.py [--slots 8] [--rounds 40]

Arms (one decoder each, all slots active at T = 1, every draft verified, the same state
and keys): ``base`` (standard rejection sampling, no top-N), ``top20`` (top-20 logprobs),
``coupled`` (every slot coupled). Rounds alternate between arms (A B C A B C ...) so
machine noise hits all of them alike; the median round time and its ratio to ``base`` are
written to ``benchmarks/results/round_options.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from dspark_jax.convert.loading import load_drafter_dir, load_target  # noqa: E402
from dspark_jax.decode.step import SpeculativeDecoder, StepConfig, request_key_data  # noqa: E402
from dspark_jax.perf.results import write_result  # noqa: E402

ROOT = os.path.dirname(HERE)
PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=os.path.join(ROOT, "assets", "target"))
    p.add_argument("--drafter", default=os.path.join(ROOT, "assets", "drafters", "dspark"))
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--out", default=os.path.join(HERE, "results", "round_options.json"))
    args = p.parse_args(argv)

    target = load_target(args.target)
    drafter = load_drafter_dir(args.drafter, target)
    r = args.slots
    ids = target.tokenizer.encode(PROMPT)
    prompts = np.zeros((r, 64), np.int32)
    prompts[:, : len(ids)] = ids
    keys = np.stack([request_key_data(1, s) for s in range(r)])

    def arm(top_logprobs: int, coupled: bool):
        cfg = StepConfig(
            num_slots=r, max_len=args.max_len, scheduler="fixed", sampling=True,
            top_logprobs=top_logprobs,
        )  # fmt: skip
        dec = SpeculativeDecoder(target.module, target.params, drafter.module, drafter.params, cfg)

        def fresh():
            st = dec.init_state(0)
            st, _ = dec.prefill(
                st, np.arange(r, dtype=np.int32), prompts, np.full(r, len(ids), np.int32),
                np.full(r, args.max_len, np.int32), np.ones(r, np.float32),
                np.zeros(r, np.int32), np.ones(r, np.float32), keys, np.full(r, coupled),
            )  # fmt: skip
            return st

        return {"dec": dec, "fresh": fresh, "state": fresh(), "times": []}

    arms = {"base": arm(0, False), "top20": arm(20, False), "coupled": arm(0, True)}
    for a in arms.values():  # compile
        a["state"], out = a["dec"].round(a["state"])
        jax.block_until_ready(out.tokens)
    room = args.max_len - len(ids) - 2 * (drafter.config.draft_len + 1)
    used = 0
    for _ in range(args.rounds):
        for a in arms.values():
            t0 = time.perf_counter()
            a["state"], out = a["dec"].round(a["state"])
            jax.block_until_ready(out.tokens)
            a["times"].append(time.perf_counter() - t0)
        used += drafter.config.draft_len + 1
        if used >= room:  # refill before any slot reaches the end of its cache row
            for a in arms.values():
                a["state"] = a["fresh"]()
            used = 0
    base = statistics.median(arms["base"]["times"])
    result = {
        "command": "python benchmarks/round_options.py "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k in ("slots", "rounds", "max_len")
        ),  # fmt: skip
        "slots": r,
        "gamma": drafter.config.draft_len,
        "vocab_size": target.config.vocab_size,
        "rounds": args.rounds,
        "arms": {
            name: {
                "median_round_ms": 1e3 * statistics.median(a["times"]),
                "ratio_to_base": statistics.median(a["times"]) / base,
            }
            for name, a in arms.items()
        },
        "device": str(jax.devices()[0]),
    }
    write_result(args.out, result)
    for name, a in result["arms"].items():
        print(f"{name:>8s}  {a['median_round_ms']:8.2f} ms  x{a['ratio_to_base']:.3f}")


if __name__ == "__main__":
    main()
