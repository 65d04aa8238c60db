"""Acceptance pages: τ per drafter and prompt set (Table 1 analog), position-wise
acceptance, coupled verification, draft depth and the greedy share in the distilled data."""

from __future__ import annotations

import pathlib

from . import common
from .common import PAPER_DFLASH, PAPER_EAGLE, acceptance_command, acceptance_weights, ratio


def acceptance_section(
    acc, out_name: str = "acceptance.json", title: str = "## Acceptance (Table 1 analog)"
) -> list[str]:
    args = acc["config"]["args"]
    cmd = acceptance_command(args, out_name)
    rows = acc["results"]
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
    temps = sorted({r["temperature"] for r in rows})
    tau = {(r["drafter"], r["prompt_set"], r["temperature"]): r["tau"] for r in rows}
    out = [
        title,
        "",
        f"Bundled target and drafters, γ = {args['gamma']}, fixed block (every draft verified), "
        f"first {args['limit']} prompts per set, {args['max_new_tokens']} new tokens. "
        "τ = mean tokens per round including the bonus token.",
        "",
        f"    {cmd}",
        "",
        *common.stale_models_note(acceptance_weights(acc)),
        "| set | T | "
        + " | ".join(drafters)
        + " | DSpark/DFlash | DSpark/EAGLE-3 | DSpark-RNN/DFlash | DSpark-RNN/EAGLE-3 |",
        "|---|---|" + "---|" * (len(drafters) + 4),
    ]

    for s in sets:
        for t in temps:
            vals = [tau.get((d, s, t)) for d in drafters]
            ds, rnn, df, ea = (
                tau.get((d, s, t)) for d in ("dspark", "dspark-rnn", "dflash", "eagle3")
            )
            out.append(
                f"| {s} | {t:g} | "
                + " | ".join("–" if v is None else f"{v:.3f}" for v in vals)
                + f" | {ratio(ds, df)} | {ratio(ds, ea)} | {ratio(rnn, df)} | {ratio(rnn, ea)} |"
            )
    out += [
        "",
        f"Paper (Qwen3, T = 1): DSpark/DFlash {PAPER_DFLASH}, DSpark/EAGLE-3 {PAPER_EAGLE}.",
        "",
        "Read T = 0 with care: where a greedy continuation ends in a short loop (the share "
        "per set is below), its τ mostly says whether a drafter's argmax happens to land on "
        "the loop (τ → γ+1) or not (τ → 1); T = 1 is the comparison that matches the "
        "paper's.",
        "",
        *_greedy_honesty(rows, drafters, sets),
        "Position-wise conditional acceptance P(accept k | accepted k−1), T = 1:",
        "",
        "| drafter | set | " + " | ".join(f"k={k}" for k in range(1, args["gamma"] + 1)) + " |",
        "|---|---|" + "---|" * args["gamma"],
    ]
    for r in rows:
        if r["temperature"] != 1.0:
            continue
        ca = list(r.get("conditional_acceptance") or [])
        ca += [None] * (args["gamma"] - len(ca))  # MTP-1 drafts one token
        cells = ["–" if c is None or c != c else f"{c:.3f}" for c in ca]
        out.append(f"| {r['drafter']} | {r['prompt_set']} | " + " | ".join(cells) + " |")
    if out_name == "acceptance.json":
        out += [
            "",
            "![position-wise acceptance]"
            f"({common.TO_ROOT}/benchmarks/results/figs/position_acceptance.png)",
        ]
    out.append("")
    return out


def _greedy_honesty(rows, drafters, sets) -> list[str]:
    """Greedy τ pooled over rounds beside its per-prompt mean, and the share of prompts
    whose greedy continuation ends in a repeated n-gram loop (``eval.metrics.ends_in_loop``).
    Empty for results written before these fields existed."""
    greedy = {(r["drafter"], r["prompt_set"]): r for r in rows if r["temperature"] == 0}
    if not greedy or any("loop_share" not in r for r in greedy.values()):
        return []
    out = [
        "Greedy (T = 0) τ pooled over rounds / mean over prompts, and the share of prompts "
        "whose continuation ends in a loop (at most half of the 4-grams in its last 32 tokens "
        "are distinct):",
        "",
        "| set | " + " | ".join(drafters) + " | prompts ending in a loop |",
        "|---|" + "---|" * (len(drafters) + 1),
    ]
    for s in sets:
        cells, share = [], None
        for d in drafters:
            r = greedy.get((d, s))
            if r is None:
                cells.append("–")
                continue
            cells.append(f"{r['tau']:.2f} / {r['tau_prompt_mean']:.2f}")
            share = r["loop_share"] if share is None else share
        loop = "–" if share is None else f"{100 * share:.0f} %"
        out.append(f"| {s} | " + " | ".join(cells) + f" | {loop} |")
    out += [
        "",
        "(The loop share is the first drafter's run; greedy output is the target's own, so "
        "every drafter's run shows the same continuations up to floating-point ties.)",
        "",
    ]
    return out


def coupled_section(acc) -> list[str]:
    """τ under coupled (position-keyed Gumbel-max) vs standard verification, same prompts,
    seeds and drafters (``acceptance_coupled.json``): the price of seeds that hold under
    any load."""
    if not acc:
        return []
    args = acc["config"]["args"]
    tau = {(r["drafter"], r["prompt_set"], r["verification"]): r["tau"] for r in acc["results"]}
    drafters = list(dict.fromkeys(r["drafter"] for r in acc["results"]))
    sets = list(dict.fromkeys(r["prompt_set"] for r in acc["results"]))
    cmd = acceptance_command(args, "acceptance_coupled.json").replace(
        " --out ", " --verification standard coupled --out "
    )
    out = [
        "## Coupled verification: the cost of load-invariant seeds",
        "",
        "Seeded requests are verified coupled by default (position-keyed Gumbel-max: the "
        "output is the target's own sample for the seed, whatever the load and scheduler). "
        "Both rules are exact; rejection sampling accepts at least as often as any coupling. "
        f"T = 1, γ = {args['gamma']}, every draft verified, first {args['limit']} prompts per "
        f"set, {args['max_new_tokens']} new tokens, the same seeds for both rules.",
        "",
        f"    {cmd}",
        "",
        *common.stale_models_note(acceptance_weights(acc)),
        "| drafter | set | τ standard | τ coupled | coupled / standard |",
        "|---|---|---|---|---|",
    ]
    for d in drafters:
        for s in sets:
            std, cpl = tau.get((d, s, "standard")), tau.get((d, s, "coupled"))
            cells = ["–" if v is None else f"{v:.3f}" for v in (std, cpl)]
            out.append(f"| {d} | {s} | {cells[0]} | {cells[1]} | {ratio(cpl, std)} |")
    out.append("")
    return out


def depth_section(acc, main_acc=None) -> list[str]:
    """Draft depth ablation: DSpark and DFlash at the bundled 2 layers and at DeepSpec's
    released 5, same data and steps (``acceptance_depth.json``)."""
    if acc is None:
        return []
    args = acc["config"]["args"]
    layers = {d["label"]: d["config"]["num_layers"] for d in acc["config"]["drafters"]}
    rows = [r for r in acc["results"] if r["temperature"] == 1.0]
    tau = {(r["drafter"], r["prompt_set"]): r["tau"] for r in rows}
    sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
    cmd = acceptance_command(args, "acceptance_depth.json")
    pairs = []  # (dspark label, dflash label) per depth
    for n in sorted(set(layers.values())):
        ds = [d for d, k in layers.items() if k == n and d.startswith("dspark")]
        df = [d for d, k in layers.items() if k == n and d.startswith("dflash")]
        if ds and df:
            pairs.append((n, ds[0], df[0]))
    out = [
        "## Draft depth (2 vs 5 layers)",
        "",
        "DSpark and DFlash retrained with 5 draft layers (DeepSpec's released depth), each at "
        "its bundled steps and data (more FLOPs per step than the 2-layer drafter), T = 1, "
        "otherwise as the Table 1 analog:",
        "",
        "    python benchmarks/drafter_ablation.py --runs dspark_l5 dflash_l5",
        "    python -m dspark_jax.export --workdir workdirs/ablation/dspark_l5 --out "
        "workdirs/drafters/dspark-l5 --dtype bfloat16   # likewise dflash_l5",
        f"    {cmd}",
        "",
        *common.stale_models_note(acceptance_weights(acc)),
        "| set | "
        + " | ".join(f"{d} ({layers[d]} layers)" for d in layers)
        + " | "
        + " | ".join(f"DSpark/DFlash, {n} layers" for n, _, _ in pairs)
        + " |",
        "|---|" + "---|" * (len(layers) + len(pairs)),
    ]
    for s in sets:
        cells = [f"{tau[(d, s)]:.3f}" if (d, s) in tau else "–" for d in layers]
        ratios = [ratio(tau.get((a, s)), tau.get((b, s))) for _, a, b in pairs]
        out.append(f"| {s} | " + " | ".join(cells + ratios) + " |")
    # DSpark at each depth against the bundled EAGLE-3 of the Table 1 run (same prompts),
    # only when both runs decoded against the same target weights.
    if main_acc is not None and acceptance_weights(main_acc) == acceptance_weights(acc):
        eagle = {
            r["prompt_set"]: r["tau"]
            for r in main_acc["results"]
            if r["drafter"] == "eagle3" and r["temperature"] == 1.0
        }
        per_set = [
            f"{s}: "
            + ", ".join(f"{a} {tau[(a, s)] / eagle[s]:.3f}" for _, a, _ in pairs if (a, s) in tau)
            for s in sets
            if s in eagle
        ]
        if per_set:
            out += ["", "DSpark / EAGLE-3 at T = 1 (EAGLE-3 from the Table 1 run, same prompts): "
                    + "; ".join(per_set) + "."]  # fmt: skip
    return out + [""]


GREEDY_SHARE_RUN = "dspark_greedy25"


def greedy_share_section(acc, abl) -> list[str]:
    """Does a greedy share in the distilled data help greedy acceptance? The bundled DSpark
    (all-T = 1 data) decoded beside one trained on data whose every fourth train batch was
    generated greedily (``acceptance_greedy_share.json``), with both runs' held-out τ_tf
    from ``drafter_ablation.json`` (same held-out records)."""
    if acc is None:
        return []
    args = acc["config"]["args"]
    rows = acc["results"]
    drafters = list(dict.fromkeys(r["drafter"] for r in rows))
    if len(drafters) != 2:
        raise ValueError(f"acceptance_greedy_share.json: expected 2 drafters, got {drafters}")
    base, mixed = drafters
    sets = list(dict.fromkeys(r["prompt_set"] for r in rows))
    temps = sorted({r["temperature"] for r in rows})
    res = {(r["drafter"], r["prompt_set"], r["temperature"]): r for r in rows}
    out = [
        "## Greedy share in the distilled data",
        "",
        f"`{base}` is the bundled DSpark (distilled data all sampled at T = 1); `{mixed}` is "
        "the same recipe (config, steps, prompts) trained on data whose every fourth train "
        "batch was generated greedily (`--greedy-share 0.25`; the held-out split is the same "
        "T = 1 records). τ pooled over rounds / mean over prompts, γ = "
        f"{args['gamma']}, first {args['limit']} prompts per set, {args['max_new_tokens']} new "
        "tokens:",
        "",
        "    python -m dspark_jax.data.distill --target assets/target --corpus-dir data/stdlib "
        "--out-dir data/distill_greedy25 --prompt-len 128 --max-new-tokens 256 "
        "--max-prompts 3072 --batch-size 32 --temperature 1.0 --seed 0 --greedy-share 0.25",
        f"    python benchmarks/drafter_ablation.py --runs {GREEDY_SHARE_RUN}",
        f"    python -m dspark_jax.export --workdir workdirs/ablation/{GREEDY_SHARE_RUN} "
        f"--out workdirs/drafters/{mixed} --dtype bfloat16",
        f"    {acceptance_command(args, 'acceptance_greedy_share.json')}",
        "",
        *common.stale_models_note(acceptance_weights(acc)),
        f"| set | T | {base} | {mixed} | {mixed}/{base} (pooled / per prompt) |",
        "|---|---|---|---|---|",
    ]
    for st in sets:
        for t in temps:
            a, b = res.get((base, st, t)), res.get((mixed, st, t))
            if a is None or b is None:
                continue
            cells = [f"{r['tau']:.3f} / {r['tau_prompt_mean']:.3f}" for r in (a, b)]
            both = (
                f"{ratio(b['tau'], a['tau'])} / {ratio(b['tau_prompt_mean'], a['tau_prompt_mean'])}"
            )
            out.append(f"| {st} | {t:g} | " + " | ".join(cells) + f" | {both} |")
    runs = (abl or {}).get("runs", {})
    ds, gs = runs.get("dspark"), runs.get(GREEDY_SHARE_RUN)
    if ds and gs and ds.get("target_weights") == gs.get("target_weights"):
        out += [
            "",
            f"Held-out τ_tf (T = 1 records): `dspark` {ds['heldout_tau_tf']:.3f}, "
            f"`{GREEDY_SHARE_RUN}` {gs['heldout_tau_tf']:.3f}.",
        ]
    return out + [""]


# Page entries: each takes the results directory and returns Markdown lines.


def main_table(results: pathlib.Path) -> list[str]:
    acc = common.load(results / "acceptance.json")
    return acceptance_section(acc) if acc else []


def other_sets(results: pathlib.Path) -> list[str]:
    other = common.load(results / "acceptance_other_sets.json")
    if not other:
        return []
    title = "## Acceptance on the other prompt sets"
    return acceptance_section(other, "acceptance_other_sets.json", title)


def coupled(results: pathlib.Path) -> list[str]:
    return coupled_section(common.load(results / "acceptance_coupled.json"))


def depth(results: pathlib.Path) -> list[str]:
    main = common.load(results / "acceptance.json")
    return depth_section(common.load(results / "acceptance_depth.json"), main)


def greedy_share(results: pathlib.Path) -> list[str]:
    return greedy_share_section(
        common.load(results / "acceptance_greedy_share.json"),
        common.load(results / "drafter_ablation.json"),
    )
