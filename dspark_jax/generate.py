"""Offline (speculative) generation from a JSONL prompt file.

    python -m dspark_jax.generate --target DIR [--drafter DIR] --prompts FILE.jsonl \\
        --out OUT.jsonl [--scheduler fixed] [--max-new-tokens 256] [--temperature 0] ...

* ``--target``: a Hugging Face-style Qwen3 directory (``config.json``, ``model.safetensors``,
  ``tokenizer.json``), read with ``dspark_jax.convert.load_hf``.
* ``--drafter``: a directory written by ``dspark_jax.models.drafter_io.save_drafter``. Without
  it there is no speculation (every round verifies only the anchor: plain decoding through
  the same engine).
* ``--prompts``: JSONL, one object per line with ``turns`` (a list of strings); ``turns[0]``
  is rendered for a base code model by ``--prompt-style`` (the same rendering as
  ``python -m dspark_jax.eval``; default ``auto``: a fenced code block is extracted, a
  code instruction becomes a docstring + ``def``, anything else a comment; plain text, a
  ``"prompt"`` string or a turn that already reads as code, is left as it is; ``raw``
  passes every turn through unchanged).
* Output: one JSON line per sample: ``prompt_index``, ``sample_index``, ``tokens`` (generated
  ids), ``text``, ``finish_reason`` (``eos`` | ``length``), ``rounds``,
  ``accepted_per_round`` (accepted draft tokens per round; τ of a round is that + 1),
  ``verified_per_round``. A summary (τ = mean accepted + 1 per round, tokens/s after
  compilation) is printed.
* ``--scheduler`` defaults to ``fixed`` (every draft verified: the accepted length of the
  drafter alone, as offline evaluation measures it); ``serve.py`` defaults to ``topk``, the
  load-aware production scheduler. ``prefix`` / ``topk`` profile ``SPS(B)`` on this machine
  with the decoder's own compiled rounds, cached in the per-user cache
  (``~/.cache/dspark_jax/sps.json``, shared with ``serve.py``; ``--sps-cache`` to change).
* Slots: ``min(--slots, prompts × samples)``, so a short run does not verify rows of
  empty slots.

Errors (missing directory, drafter trained for another target, prompt longer than the
cache, ...) print one line naming the problem and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import numpy as np

from dspark_jax.cli import add_survival_estimator_argument
from dspark_jax.decode.mesh import add_mesh_arguments

__all__ = ["main", "parse_args", "read_prompts", "run"]


def parse_args(argv=None) -> argparse.Namespace:
    from dspark_jax.decode.step import SCHEDULER_MODES
    from dspark_jax.eval.prompts import PROMPT_STYLES

    p = argparse.ArgumentParser(
        prog="python -m dspark_jax.generate", description=__doc__.split("\n")[0]
    )
    p.add_argument("--target", required=True, help="HF-style Qwen3 directory")
    p.add_argument("--drafter", default=None, help="drafter directory (omit: no speculation)")
    add_survival_estimator_argument(p)
    p.add_argument("--prompts", required=True, help="JSONL file with a 'turns' list per line")
    p.add_argument("--out", required=True, help="output JSONL path")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument(
        "--scheduler",
        choices=SCHEDULER_MODES,
        default=None,
        help="verification policy (default: fixed with a drafter, i.e. every draft verified, "
        "as offline evaluation measures acceptance; none without; serve.py defaults to topk)",
    )
    p.add_argument(
        "--gamma",
        type=int,
        default=None,
        help="'fixed' arm: drafts verified per slot (<= the drafter's γ; default all)",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=8,
        help="concurrent request slots R (capped at the number of requests)",
    )
    p.add_argument(
        "--prompt-style",
        default="auto",
        choices=PROMPT_STYLES,
        help="how first turns are rendered for a base code model (as in dspark_jax.eval; "
        "auto leaves plain text as it is)",
    )
    p.add_argument("--num-samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threshold", type=float, default=0.5, help="'threshold' arm cut-off")
    p.add_argument("--max-len", type=int, default=None, help="cache length per slot")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument(
        "--sps-cache", default=None, help="SPS JSON cache (default: ~/.cache/dspark_jax/sps.json)"
    )
    add_mesh_arguments(p)
    return p.parse_args(argv)


def read_prompts(path: str, limit: int | None = None, style: str = "auto") -> list[str]:
    """``turns[0]`` of every JSONL line (blank lines skipped), rendered by ``style``
    (``dspark_jax.eval.prompts.format_prompt``; ``raw`` = unchanged)."""
    from dspark_jax.eval.prompts import load_prompts

    return [p.formatted for p in load_prompts(path, limit, style)]


def _check_args(args) -> None:
    checks = [
        (args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"),
        (args.temperature >= 0, f"--temperature must be >= 0, got {args.temperature}"),
        (0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}"),
        (args.top_k >= 0, f"--top-k must be >= 0, got {args.top_k}"),
        (args.slots >= 1, f"--slots must be >= 1, got {args.slots}"),
        (args.num_samples >= 1, f"--num-samples must be >= 1, got {args.num_samples}"),
        (args.limit is None or args.limit >= 1, f"--limit must be >= 1, got {args.limit}"),
        (0 <= args.threshold <= 1, f"--threshold must be in [0, 1], got {args.threshold}"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(msg)


def run(args: argparse.Namespace) -> dict:
    """Generate for every prompt and write ``args.out``; returns the summary dict."""
    import flax.linen as nn

    from dspark_jax.convert.loading import load_drafter_dir, load_target
    from dspark_jax.decode.step import SpeculativeDecoder, StepConfig
    from dspark_jax.engine.offline import Request, Runner
    from dspark_jax.sched import sps as sps_lib

    _check_args(args)
    from dspark_jax.decode.mesh import mesh_from_args

    loaded = load_target(args.target, mesh=mesh_from_args(args))
    tcfg, tparams, tok, target = loaded.config, loaded.params, loaded.tokenizer, loaded.module
    drafter = dparams = sts = None
    if args.drafter is not None:
        d = load_drafter_dir(args.drafter, loaded, survival_estimator=args.survival_estimator)
        dparams = nn.unbox(d.params)
        if loaded.mesh is None:  # on a mesh the loader placed them already
            dparams = jax.device_put(dparams)
        drafter, sts = d.module, d.calibration
    scheduler = args.scheduler or ("fixed" if drafter is not None else "none")
    if drafter is None and scheduler != "none":
        raise ValueError(f"--scheduler {scheduler} needs --drafter (without one use 'none')")
    max_len = args.max_len or min(tcfg.max_position_embeddings, 2048)
    if drafter is not None and args.gamma is not None:
        g = drafter.config.draft_len
        if not 0 <= args.gamma <= g:
            raise ValueError(f"--gamma {args.gamma} must be in [0, {g}] (the drafter's γ)")

    texts = read_prompts(args.prompts, args.limit, args.prompt_style)
    ids = [tok.encode(t) for t in texts]
    for i, p in enumerate(ids):
        if not p:
            raise ValueError(f"prompt {i} of {args.prompts} is empty after tokenisation")
        if len(p) + 1 >= max_len:
            raise ValueError(
                f"prompt {i} of {args.prompts} has {len(p)} tokens; it does not fit the cache "
                f"of {max_len} positions (--max-len; prompt + 1 generated token must fit)"
            )

    # No more slots than requests: every slot's rows are verified each round, filled or not.
    num_slots = min(args.slots, len(ids) * args.num_samples)
    config = StepConfig(
        num_slots=num_slots,
        max_len=max_len,
        scheduler=scheduler,
        sampling=args.temperature > 0,
        threshold=args.threshold,
        fixed_length=args.gamma,
        eos_id=tok.eos_id,
    )
    # The drafter's sts.json calibrates its confidences, as in serving (threshold/prefix/topk).
    decoder = SpeculativeDecoder(
        target,
        tparams,
        drafter,
        dparams,
        config,
        sts=sts,
        mesh=loaded.mesh,
    )
    runner = Runner(decoder, seed=args.seed)
    if scheduler in ("prefix", "topk"):
        cache_path = args.sps_cache or sps_lib.default_cache_path()
        key = sps_lib.cache_key(
            os.path.abspath(args.target),
            os.path.abspath(args.drafter),
            f"R={num_slots}",
            f"M={max_len}",
            scheduler,
            f"sampling={config.sampling}",
        )
        table = runner.policy.profile_sps(cache_path=cache_path, key=key)
        print(f"SPS(B) for B={list(table.buckets)}: {[round(s, 1) for s in table.sps]}")

    from dspark_jax.decode.autoregressive import length_bucket

    runner.warmup(sorted({min(length_bucket(len(p)), max_len) for p in ids}))
    requests = [
        Request(
            p,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            prompt_index=i,
        )
        for i, p in enumerate(ids)
        for _ in range(args.num_samples)
    ]
    results, stats = runner.generate(requests)

    from dspark_jax import distributed

    out_dir = os.path.dirname(os.path.abspath(args.out))
    per_prompt: dict[int, int] = {}
    # On several processes every one holds the same results; process 0 writes them.
    leader = distributed.process_index() == 0
    if leader:
        os.makedirs(out_dir, exist_ok=True)
    with open(args.out if leader else os.devnull, "w") as f:
        for res in results:
            s = per_prompt.get(res.prompt_index, 0)
            per_prompt[res.prompt_index] = s + 1
            line = {
                "prompt_index": res.prompt_index,
                "sample_index": s,
                "tokens": res.tokens,
                "text": tok.decode(res.tokens, skip_special_tokens=True),
                "finish_reason": res.finish_reason,
                "rounds": res.rounds,
                "accepted_per_round": res.accepted_per_round,
                "verified_per_round": res.verified_per_round,
            }
            f.write(json.dumps(line) + "\n")
    accepted = [a for r in results for a in r.accepted_per_round]
    summary = {
        "samples": len(results),
        "generated_tokens": stats.generated_tokens,
        "rounds": stats.rounds,
        "tau": float(np.mean(accepted) + 1.0) if accepted else float("nan"),
        "tokens_per_second": stats.tokens_per_second,
        "wall_seconds": stats.wall_seconds,
        "scheduler": scheduler,
        "slots": num_slots,
        "mean_budget": stats.mean_budget,
    }
    print(
        f"{summary['samples']} samples, {summary['generated_tokens']} tokens in "
        f"{summary['wall_seconds']:.2f}s: tau={summary['tau']:.3f} "
        f"tokens/s={summary['tokens_per_second']:.1f} (scheduler={scheduler}, "
        f"slots={num_slots}, mean verify budget {summary['mean_budget']:.1f}) -> {args.out}"
    )
    return summary


def main(argv=None) -> int:
    from dspark_jax.cli import run_main

    return run_main(run, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
