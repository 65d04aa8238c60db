"""Drafter-training pages: the bundled drafters (from their model cards), the equal-compute
budget, drafter quality against the amount of distilled data, and the controlled DSpark
vs EAGLE-3 training runs."""

from __future__ import annotations

import pathlib

from . import common
from .common import PAPER_EAGLE

BUNDLED = ("dspark", "dspark-rnn", "dflash", "eagle3", "mtp1")


def _shape(card: dict) -> str:
    c = card["drafter_config"]
    kind = c["kind"]
    if kind == "dspark":
        head = f"{c['head'].upper() if c['head'] == 'rnn' else c['head'].title()} head"
        rank = c["rnn_rank"] if c["head"] == "rnn" else c["markov_rank"]
        conf = " + confidence" if c.get("confidence") else ""
        return f"{c['num_layers']} layers + {head} r = {rank}{conf}"
    if kind == "dflash":
        return f"{c['num_layers']} layers (backbone, no heads)"
    if kind == "eagle3":
        return f"1 fused layer, training-time test over γ = {c['gamma']}"
    if kind == "mtp1":
        return "1 MTP block, one draft token"
    return kind


def bundled_section(drafters_dir: pathlib.Path) -> list[str]:
    """One row per bundled drafter, read from its ``model_card.json``."""
    rows = []
    for name in BUNDLED:
        card = common.load(drafters_dir / name / "model_card.json")
        if card is None:
            continue
        h = card.get("heldout", {})
        rows.append(
            f"| `{name}` | {_shape(card)} | {card['parameters'] / 1e6:.2f}M | {card['steps']} | "
            f"{h.get('heldout_tau_tf', float('nan')):.3f} | "
            f"{h.get('heldout_accept_mean', float('nan')):.3f} |"
        )
    if not rows:
        return []
    return [
        "## The bundled drafters",
        "",
        "    bash scripts/build_bundled_models.sh",
        "",
        "Read from each `assets/drafters/<name>/model_card.json`. Every arm trained against "
        "`assets/target` on the same distilled data, batch, optimiser and schedule, with the "
        "same training FLOPs (the budget below), so the steps differ. τ_tf: held-out "
        "teacher-forced accepted length at T = 1, 1 + Σ_k Π_{i≤k} α_i, over the whole "
        "held-out split; mean α: the mean of the per-position teacher-forced acceptances.",
        "",
        "| drafter | shape | parameters | steps | τ_tf | mean α |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _wall(run: dict) -> str:
    """A training run's wall seconds, or "–" when none was recorded
    (``drafter_runs.train_wall_s``: resumed runs' partial times are not shown)."""
    return "–" if run.get("wall_s") is None else f"{run['wall_s']}"


def _ablation_run_target(run: dict) -> str:
    """Which target a controlled run trained against: today's bundled one, the one its
    ``target.dir`` override names, or earlier bundled weights."""
    override = [o.split("=", 1)[1] for o in run["overrides"] if o.startswith("target.dir=")]
    if override:
        return f"`{override[0]}`"
    if run.get("target_weights") == common.bundled_target_weights():
        return "bundled"
    return f"earlier (`{run.get('target_weights')}`)"


def _ablation_stale_note(abl: dict) -> list[str]:
    """Flag the ablation when a run on the bundled target (no ``target.dir`` override) was
    trained against other weights than today's."""
    today = common.bundled_target_weights()
    stale = sorted(
        name
        for name, r in abl["runs"].items()
        if not any(o.startswith("target.dir=") for o in r["overrides"])
        and r.get("target_weights") != today
    )
    if not stale:
        return []
    recorded = {abl["runs"][n].get("target_weights") for n in stale}
    rerun = f"rerun {', '.join(f'`{n}`' for n in stale)} (scripts/regenerate_weight_results.sh)"
    return common.stale_models_note(recorded.pop() if len(recorded) == 1 else None, rerun)


def _ablation_factor_rows(abl: dict) -> list[str]:
    """One table row per factor measured; a ratio only between two runs trained against the
    same target weights (after a partial re-run on a new target, a row may pair a new run
    with an old one), and rows on earlier bundled weights marked as such."""
    out = []
    for f in abl["factors"]:
        if "dspark_tau_tf" not in f:
            continue
        ds, e3 = abl["runs"][f["dspark_run"]], abl["runs"][f["eagle3_run"]]
        if ds.get("target_weights") != e3.get("target_weights"):
            r = "– (runs on different targets)"
        else:
            r = f"{f['dspark_tau_tf'] / f['eagle3_tau_tf']:.3f}"
        factor = f["factor"]
        if _ablation_run_target(ds).startswith("earlier"):
            factor += " (earlier target)"
        out.append(
            f"| {factor} | `{f['dspark_run']}` | {f['dspark_tau_tf']:.3f} | "
            f"`{f['eagle3_run']}` | {f['eagle3_tau_tf']:.3f} | {r} |"
        )
    return out


def ablation_section(abl) -> list[str]:
    if not abl:
        return []
    out = [
        "## What moves DSpark against EAGLE-3 (controlled training runs)",
        "",
        f"    {abl['command']}",
        "",
        "One change to the bundled recipe per row, DSpark (Markov) and EAGLE-3 otherwise as "
        "bundled (same target, data, batch, schedule; equal training FLOPs unless the row "
        "says otherwise). τ_tf: held-out teacher-forced accepted length at T = 1 "
        f"({abl['eval_batches']} held-out batches). The paper reports DSpark/EAGLE-3 "
        f"{PAPER_EAGLE} (decoded, Qwen3 targets).",
        "",
        *_ablation_stale_note(abl),
        "| factor | DSpark run | τ_tf | EAGLE-3 run | τ_tf | DSpark/EAGLE-3 |",
        "|---|---|---|---|---|---|",
        *_ablation_factor_rows(abl),
        "",
        "Runs (config, overrides, steps, wall time on 2 CPU cores shared with other "
        "jobs, so wall times are not comparable across runs; the budget is FLOPs; "
        "– where no single call trained the run from scratch: resumed after a kill, or "
        "trained by scripts/build_bundled_models.sh; target: the weights the run "
        "trained against):",
        "",
        "| run | config | overrides | target | steps | τ_tf | mean α | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in abl["runs"].items():
        over = ", ".join(f"`{o}`" for o in r["overrides"]) or "–"
        out.append(
            f"| `{name}` | `{r['config']}` | {over} | {_ablation_run_target(r)} | "
            f"{r['step']} | {r['heldout_tau_tf']:.3f} | {r['heldout_accept_mean']:.3f} | "
            f"{_wall(r)} |"
        )
    return out + [""]


def data_curve_section(curve) -> list[str]:
    if not curve:
        return []
    out = [
        "## Drafter quality vs distilled data",
        "",
        f"    {curve['command']}",
        "",
        f"`{curve['config']}` ({curve['steps']} steps × {curve['batch_size']} × "
        f"{curve['seq_len']} tokens) on the first N records of one distillation "
        f"({curve['distill_manifest'].get('max_prompts')} prompts); held-out teacher-forced "
        f"τ_tf at T = 1 on the same {curve['eval_batches']} held-out batches for every point "
        "(wall s: – where a point was resumed after a kill).",
        "",
        *common.stale_models_note(
            curve["distill_manifest"].get("target_fingerprint"),
            "rerun the command above after removing workdirs/data_curve",
        ),
        "| training records | epochs | τ_tf | mean α | held-out loss | wall s |",
        "|---|---|---|---|---|---|",
    ]
    for p in curve["points"]:
        out.append(
            f"| {p['train_records']} | {p['epochs']} | {p['heldout_tau_tf']:.3f} | "
            f"{p['heldout_accept_mean']:.3f} | {p['heldout_loss']:.3f} | {_wall(p)} |"
        )
    return out + [""]


# Page entries: each takes the results directory and returns Markdown lines.


def bundled(results: pathlib.Path) -> list[str]:
    return bundled_section(common.ROOT / "assets" / "drafters")


def budget(results: pathlib.Path) -> list[str]:
    path = results / "train_budget.md"
    if not path.is_file():
        return []
    return ["## The equal-compute budget", ""] + common.included(
        path, "python benchmarks/train_budget.py"
    )


def data_curve(results: pathlib.Path) -> list[str]:
    return data_curve_section(common.load(results / "drafter_data_curve.json"))


def ablation(results: pathlib.Path) -> list[str]:
    return ablation_section(common.load(results / "drafter_ablation.json"))


def train_roofline(results: pathlib.Path) -> list[str]:
    """The training step's roofline on TPU slices and the chip-hour table for DeepSpec's
    recipe (``benchmarks/train_roofline.py``; its own Markdown, with its commands)."""
    path = results / "train_roofline.md"
    if not path.is_file():
        return []
    return common.included(path, "python benchmarks/train_roofline.py --case CASE [--case ...]")
