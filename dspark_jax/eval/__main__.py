"""``python -m dspark_jax.eval {acceptance,calibrate,plot}`` (see ``dspark_jax.eval``)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from dspark_jax.cli import add_survival_estimator_argument
from dspark_jax.decode.mesh import add_mesh_arguments, mesh_from_args

# 20 ECE bins need ~10 rounds each before a bin's accuracy means anything.
MIN_FIT_ROUNDS = 200
# Warn when a perfectly calibrated head would itself show this mean ECE on the reporting
# rounds: differences below it are sampling noise.
NOISY_FLOOR = 0.015


def check_fit_rounds(n_rounds: int, minimum: int) -> None:
    """A fit from too few rounds is refused: its temperatures are mostly noise."""
    if n_rounds < minimum:
        raise ValueError(
            f"only {n_rounds} decode rounds to fit on (at least {minimum} needed with "
            "--min-fit-rounds): use more prompts (--limit, more --prompts files) or more "
            "--max-new-tokens; nothing was written"
        )


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, help="Hugging Face Qwen3 directory (target)")
    p.add_argument(
        "--prompts",
        required=True,
        action="append",
        metavar="FILE.jsonl",
        help="prompt set (JSON lines with 'turns'); repeatable",
    )
    p.add_argument(
        "--gamma",
        type=int,
        default=None,
        help="drafts verified per round (default: the drafter's draft length)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--limit", type=int, default=None, help="first N prompts of each file")
    p.add_argument("--slots", type=int, default=8, help="request slots per decode round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--max-prompt-tokens", type=int, default=512, help="longer prompts keep their last N tokens"
    )
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    add_mesh_arguments(p)
    p.add_argument(
        "--prompt-style",
        default="auto",
        choices=("auto", "raw", "code", "docstring", "comment"),
        help="how first turns are rendered for a base code model (auto: a fenced block "
        "extracted, an instruction as a docstring or comments; plain text, a 'prompt' "
        "string or a turn that is already code, is left as it is unless a style is named)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dspark_jax.eval",
        description="Offline evaluation: accepted length, calibration (STS), diagrams.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    a = sub.add_parser("acceptance", help="τ, position-wise acceptance, calibration metrics")
    _add_common(a)
    a.add_argument(
        "--drafter",
        required=True,
        action="append",
        metavar="DIR",
        help="drafter directory; repeatable (compared side by side)",
    )
    a.add_argument(
        "--temperature",
        type=float,
        nargs="+",
        default=[0.0],
        help="sampling temperature(s); 0 = greedy verification",
    )
    a.add_argument(
        "--verification",
        nargs="+",
        default=["standard"],
        choices=["standard", "coupled"],
        help="verification rule(s) at T > 0: standard rejection sampling, coupled "
        "(position-keyed Gumbel-max, the serving default for seeded requests)",
    )
    a.add_argument("--out", required=True, help="results JSON (a .rounds.npz is written beside)")

    c = sub.add_parser(
        "calibrate",
        help="fit STS temperatures of a survival estimate; writes --out (an sts.json)",
    )
    _add_common(c)
    c.add_argument("--drafter", required=True, metavar="DIR")
    add_survival_estimator_argument(
        c,
        "; calibrating the draft probability writes sts_draft_probability.json, which "
        "serving reads for that estimate",
    )
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument(
        "--split-fraction",
        type=float,
        default=0.5,
        help="first fraction of each prompt file fits, the rest reports",
    )
    c.add_argument("--bins", type=int, default=20, help="ECE bins (the paper's 20)")
    c.add_argument(
        "--out",
        default=None,
        help="STS file to write (default: sts_<drafter name>.json in the current directory, "
        "sts_draft_probability_<drafter name>.json for that estimate); serving reads "
        "<drafter>/sts.json (<drafter>/sts_draft_probability.json), so pass --out <drafter> "
        "--overwrite to replace a drafter's calibration. Label arrays go beside it "
        "(<stem>_data.npz)",
    )
    c.add_argument(
        "--overwrite", action="store_true", help="replace --out (and its arrays) if it exists"
    )
    c.add_argument(
        "--force",
        action="store_true",
        help="write --out even when the fit makes a position's held-out ECE worse than "
        "uncalibrated (refused by default, naming the positions)",
    )
    c.add_argument(
        "--min-fit-rounds",
        type=int,
        default=MIN_FIT_ROUNDS,
        help=f"refuse to write a fit from fewer decode rounds (default {MIN_FIT_ROUNDS}; "
        "0 accepts any)",
    )
    c.add_argument(
        "--mode",
        choices=("temperature", "affine", "isotonic"),
        default="temperature",
        help="temperature: c = σ(z/T) per position (DESIGN §5.3); affine: σ(z/T + b), for "
        "heads whose confidences are too weakly ranked for a temperature alone; isotonic: a "
        "non-decreasing step map of z per position, for estimates no σ(z/T + b) follows "
        "(ties rounds within a step; needs more rounds)",
    )

    p = sub.add_parser("plot", help="PNG diagrams from an acceptance results.json")
    p.add_argument("--results", required=True)
    p.add_argument("--out-dir", required=True)
    return parser


def _load_sets(args):
    from dspark_jax.eval.prompts import load_prompts

    sets = {}
    for path in args.prompts:
        ps = load_prompts(path, args.limit, args.prompt_style)
        name = ps[0].set_name
        if name in sets:
            raise ValueError(f"two prompt files share the set name {name!r}: {path}")
        sets[name] = ps
    return sets


def _say(message: str) -> None:
    """A progress line on stderr (results go to stdout)."""
    print(message, file=sys.stderr, flush=True)


def _check_common(args):
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.slots < 1:
        raise ValueError(f"--slots must be >= 1, got {args.slots}")
    if args.gamma is not None and args.gamma < 1:
        raise ValueError(f"--gamma must be >= 1, got {args.gamma}")


def cmd_acceptance(args) -> int:
    from dspark_jax.convert.loading import load_drafter_dir, load_target
    from dspark_jax.eval import acceptance as acc

    _check_common(args)
    for t in args.temperature:
        if not math.isfinite(t) or t < 0:
            raise ValueError(f"--temperature must be finite and >= 0, got {t}")
    sets = _load_sets(args)
    n = sum(len(ps) for ps in sets.values())
    _say(f"loading target {args.target} and {len(args.drafter)} drafter(s)")
    target = load_target(args.target, mesh=mesh_from_args(args))
    _say(f"decoding {n} prompts per drafter and temperature (the first rounds compile)")
    labels = [Path(d).name or d for d in args.drafter]
    if len(set(labels)) != len(labels):  # same directory name in different places
        labels = [f"{i}:{lab}" for i, lab in enumerate(labels)]
    drafters = [load_drafter_dir(d, target, lab) for d, lab in zip(args.drafter, labels)]
    entries, arrays = acc.evaluate(
        target,
        drafters,
        sets,
        temperatures=args.temperature,
        gamma=args.gamma,
        max_new_tokens=args.max_new_tokens,
        slots=args.slots,
        seed=args.seed,
        max_prompt_tokens=args.max_prompt_tokens,
        verifications=args.verification,
        progress_bars=not args.no_progress,
    )
    meta = acc.run_metadata(target, drafters, vars(args))
    meta["prompt_sets"] = {
        n: {"file": str(f), "num_prompts": len(ps)}
        for (n, ps), f in zip(sets.items(), args.prompts)
    }
    from dspark_jax import distributed

    if distributed.process_index() != 0:  # every process holds the results; one writes
        return 0
    out, rounds_file = acc.write_results(args.out, entries, arrays, meta)
    print(f"wrote {out} and {rounds_file}")
    return 0


def cmd_calibrate(args) -> int:
    from dspark_jax.convert.loading import load_drafter_dir, load_target
    from dspark_jax.eval import acceptance as acc
    from dspark_jax.eval import calibration as cal
    from dspark_jax.eval.prompts import split_prompts

    _check_common(args)
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise ValueError(f"--temperature must be finite and >= 0, got {args.temperature}")
    if args.bins < 2:
        raise ValueError(f"--bins must be >= 2, got {args.bins}")
    if args.min_fit_rounds < 0:
        raise ValueError(f"--min-fit-rounds must be >= 0, got {args.min_fit_rounds}")
    # The estimator is known from the directory alone (whether it has a confidence head),
    # so the output is checked before anything is loaded.
    from dspark_jax.models.drafter_io import resolve_estimator, sts_path

    estimator = resolve_estimator(
        args.survival_estimator, _has_confidence_head(args.drafter), f"drafter {args.drafter}"
    )
    stem = "sts" if estimator == "confidence_head" else "sts_draft_probability"
    out = Path(args.out or f"{stem}_{Path(args.drafter).name or 'drafter'}.json")
    if out.is_dir():
        out = sts_path(out, estimator)
    if not args.overwrite:
        cal.check_new_file(out)  # before decoding: fail fast, not after the expensive part
    sets = _load_sets(args)
    fit_prompts, held_prompts = [], []
    for ps in sets.values():
        f, h = split_prompts(ps, args.split_fraction)
        fit_prompts += f
        held_prompts += h
    _say(f"loading target {args.target} and drafter {args.drafter}")
    target = load_target(args.target, mesh=mesh_from_args(args))
    spec = load_drafter_dir(args.drafter, target, survival_estimator=estimator)
    g = acc.effective_gamma(spec, args.gamma)
    prompts = fit_prompts + held_prompts
    room = target.config.max_position_embeddings - args.max_new_tokens - g - 2
    if room < 1:
        raise ValueError(
            f"--max-new-tokens {args.max_new_tokens} + gamma {g} leaves no room for a prompt "
            f"in the target's {target.config.max_position_embeddings} positions"
        )
    ids = acc.encode_prompts(target.tokenizer, prompts, min(args.max_prompt_tokens, room))
    max_len = max(len(p) for p in ids) + args.max_new_tokens + g + 2
    dec = acc.make_decoder(
        target, spec, gamma=g, temperature=args.temperature, slots=args.slots, max_len=max_len
    )
    _say(f"decoding {len(prompts)} prompts (the first rounds compile)")
    rec = acc.collect_rounds(
        dec,
        ids,
        gamma=g,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        progress=None if args.no_progress else "calibrate: decoding",
    )
    n_fit = len(fit_prompts)
    fit = rec.subset(range(n_fit))
    held = rec.subset(range(n_fit, len(prompts))) if held_prompts else None
    check_fit_rounds(int(fit.accepted.size), args.min_fit_rounds)
    res = cal.fit_sts(fit.logits, fit.accepted, fit.verified, n_bins=args.bins, mode=args.mode)
    # Positions beyond --gamma were never verified: they keep T = 1, b = 0.
    res = res.padded(spec.draft_len)
    sts = res.sts.first(g)

    def report(r):
        if r is None or r.accepted.size == 0:
            return None
        return cal.before_after_report(r.logits, r.accepted, r.verified, sts, args.bins)

    fit_report, held_report = report(fit), report(held)
    data = {
        "target": args.target,
        "drafter": args.drafter,
        "prompt_files": args.prompts,
        "prompt_style": args.prompt_style,
        "split_fraction": args.split_fraction,
        "limit": args.limit,
        "fit_prompts": [f"{p.set_name}[{p.index}]" for p in fit_prompts],
        "heldout_prompts": [f"{p.set_name}[{p.index}]" for p in held_prompts],
        "fit_rounds": int(fit.accepted.size),
        "heldout_rounds": 0 if held is None else int(held.accepted.size),
        "temperature": args.temperature,
        "gamma": g,
        "max_new_tokens": args.max_new_tokens,
        "max_prompt_tokens": args.max_prompt_tokens,
        "slots": args.slots,
        "seed": args.seed,
        "bins": args.bins,
        "mode": args.mode,
        "scheduler": "fixed",
        "survival_estimator": estimator,
    }
    arrays = {
        "fit_logits": fit.logits.astype(np.float32),
        "fit_accepted": fit.accepted,
        "fit_verified": fit.verified,
        "fit_prompt_index": fit.prompt_index,
    }
    if held is not None:
        arrays.update(
            heldout_logits=held.logits.astype(np.float32),
            heldout_accepted=held.accepted,
            heldout_verified=held.verified,
            heldout_prompt_index=held.prompt_index,
        )

    def pct(x):
        return "   -  " if x is None or not math.isfinite(x) else f"{100 * x:5.2f}%"

    print(
        f"STS fit on {len(fit_prompts)} prompts ({fit.accepted.size} rounds); "
        f"reported on {len(held_prompts)} held-out prompts"
    )
    print(
        (" k  steps  " if res.knots else " k      T       b   ")
        + "ECE fit before/after   ECE held-out before/after   AUROC held-out   ECE floor held-out"
    )
    for k in range(g):
        h = held_report[k] if held_report else None
        if res.knots:  # isotonic: the number of steps of the position's map
            fitted_map = f"{len(res.knots[k]['edges']) if res.knots[k] else 0:5d}  "
        else:
            fitted_map = f"{res.temperatures[k]:6.3f} {res.biases[k]:+7.3f}"
        print(
            f"{k + 1:2d} {fitted_map}   "
            f"{pct(res.ece_before[k])} / "
            f"{pct(res.ece_after[k])}        {pct(h and h['ece_before'])} / "
            f"{pct(h and h['ece_after'])}          "
            f"{'-' if not h or h['auroc_after'] is None else format(h['auroc_after'], '.3f')}"
            f"          {pct(h and h['ece_floor_after'])}"
        )
    edge = [k + 1 for k in range(g) if res.fitted[k] and _at_grid_edge(res.temperatures[k])]
    if edge and args.mode == "temperature":
        print(
            f"note: T at the edge of the search grid for position(s) {edge}: temperature "
            "alone cannot calibrate these (e.g. logits near 0 with acceptance far from 1/2); "
            "try --mode affine"
        )
    rep = held_report or fit_report
    floors = [r["ece_floor_after"] for r in rep or () if r["ece_floor_after"] is not None]
    floors = [f for f in floors if math.isfinite(f)]
    if floors and np.mean(floors) > NOISY_FLOOR:
        split = "held-out" if held_report else "fit"
        n = held.accepted.size if held_report else fit.accepted.size
        print(
            f"warning: {n} {split} rounds are few: a perfectly calibrated head would show a "
            f"mean ECE of {100 * np.mean(floors):.1f}% on them (the floor column), so ECE "
            "differences below that are noise; use more prompts"
        )
    worse = worse_positions(held_report)
    name = Path(args.drafter).name or args.drafter
    if worse:
        detail = ", ".join(
            f"k = {r['position']} ({100 * r['ece_before']:.2f}% -> {100 * r['ece_after']:.2f}%)"
            for r in worse
        )
        message = (
            f"calibration makes drafter {name} worse at position(s) {detail}: held-out ECE "
            "after STS is above the uncalibrated ECE there"
        )
        if not args.force:
            raise ValueError(
                f"{message}; {out} was not written (use more prompts, try --mode affine, "
                "or pass --force to write it anyway)"
            )
        print(f"warning: {message}; writing {out} anyway (--force)")
        data["worse_heldout_positions"] = [r["position"] for r in worse]
    from dspark_jax import distributed

    if distributed.process_index() != 0:  # every process fitted the same; one writes
        return 0
    path = cal.save_sts(
        out,
        res,
        heldout=held_report,
        fit_report=fit_report,
        data=data,
        arrays=arrays,
        overwrite=args.overwrite,
        estimator=estimator,
    )

    print(f"wrote {path}")
    serving_reads = sts_path(args.drafter, estimator)
    if path.resolve() != serving_reads.resolve():
        print(f"serving reads {serving_reads}; copy the file there to use it")
    return 0


def _has_confidence_head(drafter_dir) -> bool:
    """Whether the drafter directory's config has a confidence head (a missing or broken
    directory is left to the loader, which names the problem)."""
    from dspark_jax.models.drafter_io import read_drafter_config

    try:
        return bool(read_drafter_config(drafter_dir).has_confidence)
    except (OSError, ValueError):
        return True


def worse_positions(held_report) -> list[dict]:
    """The held-out report rows (one per position) whose ECE after STS is above before."""
    out = []
    for r in held_report or ():
        before, after = r["ece_before"], r["ece_after"]
        if before is None or after is None or not (math.isfinite(before) and math.isfinite(after)):
            continue
        if after > before + 1e-12:
            out.append(r)
    return out


def _at_grid_edge(t: float) -> bool:
    from dspark_jax.eval.calibration import COARSE_GRID

    return math.isclose(t, COARSE_GRID[0], rel_tol=1e-6) or math.isclose(
        t, COARSE_GRID[-1], rel_tol=1e-6
    )


def cmd_plot(args) -> int:
    from dspark_jax.eval.plots import plot_results

    for p in plot_results(args.results, args.out_dir):
        print(p)
    return 0


def main(argv=None) -> int:
    from dspark_jax.cli import run_main

    args = build_parser().parse_args(argv)
    commands = {"acceptance": cmd_acceptance, "calibrate": cmd_calibrate, "plot": cmd_plot}
    return run_main(commands[args.command], args)


if __name__ == "__main__":
    sys.exit(main())
