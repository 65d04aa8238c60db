"""Held-out language-model loss of an exported target, and how often its greedy output
degenerates into a loop (model cards and their test).

``python -m dspark_jax.eval.lm --target DIR --data-dir DIR`` evaluates the first
``num_batches`` unshuffled held-out batches of a prepared corpus with the exported weights,
so a model card's number can be recomputed from the repository alone. ``--loop-prompts
FILE.jsonl`` (repeatable) also decodes those prompts greedily and reports the share whose
continuation ends in a repeated n-gram loop (``eval.metrics.ends_in_loop``): a target whose
greedy output is mostly loops makes greedy acceptance figures say little.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import jax
import numpy as np

from dspark_jax.convert.loading import LoadedTarget, load_target
from dspark_jax.data import make_packed_batches
from dspark_jax.train.lm_task import lm_loss_sums, next_token_targets


def heldout_loss(
    target_dir: str | LoadedTarget,
    data_dir: str,
    seq_len: int = 512,
    batch_size: int = 4,
    num_batches: int = 16,
    split: str = "heldout",
) -> dict:
    """Mean next-token cross-entropy (nats) over the first held-out batches, in order."""
    target = target_dir
    if not isinstance(target, LoadedTarget):
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


def greedy_loop_share(
    target: LoadedTarget,
    prompt_files: list[str],
    max_new_tokens: int = 64,
    limit: int | None = None,
    max_prompt_tokens: int = 512,
) -> dict:
    """Per prompt file: the share of prompts whose greedy continuation (``max_new_tokens``,
    stopping at EOS) ends in a loop, and the mean generated length."""
    from dspark_jax.decode.autoregressive import generate
    from dspark_jax.eval.acceptance import encode_prompts
    from dspark_jax.eval.metrics import ends_in_loop
    from dspark_jax.eval.prompts import load_prompts

    out = {}
    for path in prompt_files:
        prompts = load_prompts(path, limit=limit)
        ids = encode_prompts(target.tokenizer, prompts, max_prompt_tokens)
        max_len = min(
            target.config.max_position_embeddings, max(map(len, ids)) + max_new_tokens + 1
        )
        gen = generate(
            target.module, target.params, ids, max_new_tokens,
            eos_id=target.tokenizer.eos_id, max_len=max_len,
        )  # fmt: skip
        loops = [ends_in_loop(t) for t in gen.tokens]
        out[prompts[0].set_name if prompts else path] = {
            "prompts": len(loops),
            "loop_share": float(np.mean(loops)) if loops else 0.0,
            "mean_new_tokens": float(np.mean([len(t) for t in gen.tokens])) if loops else 0.0,
        }
    return {"max_new_tokens": max_new_tokens, "limit": limit, "sets": out}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--num-batches", type=int, default=16)
    parser.add_argument("--loop-prompts", action="append", default=[], metavar="JSONL",
                        help="prompt set whose greedy continuations are checked for loops")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, default=None, help="prompts per --loop-prompts set")
    args = parser.parse_args(argv)
    from dspark_jax.cli import run_main

    def cli(args):
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        target = load_target(args.target, dtype="float32", drafter_flag=None)  # once for both
        result = heldout_loss(
            target, args.data_dir, args.seq_len, args.batch_size, args.num_batches
        )
        if args.loop_prompts:
            result["greedy"] = greedy_loop_share(
                target, args.loop_prompts, args.max_new_tokens, args.limit
            )
        print(json.dumps(result, indent=2))

    return run_main(cli, args)


if __name__ == "__main__":
    sys.exit(main())
