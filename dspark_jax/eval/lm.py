"""Held-out language-model loss of an exported target (model cards and their test).

``python -m dspark_jax.eval.lm --target DIR --data-dir DIR`` evaluates the first
``num_batches`` unshuffled held-out batches of a prepared corpus with the exported weights,
so a model card's number can be recomputed from the repository alone.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import numpy as np

from dspark_jax.convert.loading import load_target
from dspark_jax.data import make_packed_batches
from dspark_jax.train.lm_task import lm_loss_sums, next_token_targets


def heldout_loss(
    target_dir: str,
    data_dir: str,
    seq_len: int = 512,
    batch_size: int = 4,
    num_batches: int = 16,
    split: str = "heldout",
) -> dict:
    """Mean next-token cross-entropy (nats) over the first held-out batches, in order."""
    target = load_target(target_dir, dtype="float32")
    model, params, tokenizer = target.module, target.params, target.tokenizer
    batches = make_packed_batches(
        data_dir, split, tokenizer, seq_len, batch_size, seed=0, shuffle=False, num_epochs=1
    )

    @jax.jit
    def sums(p, batch):
        logits = model.apply(
            {"params": p}, batch["tokens"], batch["positions"], batch["segment_ids"]
        )
        targets, mask = next_token_targets(batch)
        return lm_loss_sums(logits, targets, mask)

    total, count, correct, seen = 0.0, 0.0, 0.0, 0
    for batch in batches:
        if seen == num_batches:
            break
        s, n, c = sums(params, {k: np.asarray(v) for k, v in batch.items()})
        total, count, correct, seen = (
            total + float(s),
            count + float(n),
            correct + float(c),
            seen + 1,
        )
    if count == 0:
        raise ValueError(f"No held-out tokens found in {data_dir} (split {split!r})")
    loss = total / count
    return {
        "heldout_loss": loss,
        "heldout_perplexity": math.exp(loss),
        "heldout_accuracy": correct / count,
        "tokens": int(count),
        "batches": seen,
        "seq_len": seq_len,
        "batch_size": batch_size,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-batches", type=int, default=16)
    args = parser.parse_args(argv)
    from dspark_jax.cli import run_main

    def cli(args):
        result = heldout_loss(
            args.target, args.data_dir, args.seq_len, args.batch_size, args.num_batches
        )
        print(json.dumps(result, indent=2))

    return run_main(cli, args)


if __name__ == "__main__":
    sys.exit(main())
