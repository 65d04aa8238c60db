"""Round-cost pages: verify cost and step anatomy on CPU, the H200 measurements, what
serving options cost per round, and forward compile time."""

from __future__ import annotations

import pathlib

from . import common


def verify(results: pathlib.Path) -> list[str]:
    path = results / "verify_cost.md"
    if not path.is_file():
        return []
    return common.included(path, "python benchmarks/verify_cost.py")


def gpu_section(results: pathlib.Path) -> list[str]:
    """The H200 lease: the Pallas GPU kernel's check and timing, and the 8B round's
    measured cost beside the floor model (recorded by ``scripts/device_verify_cost.sh``,
    which ``scripts/device_gpu_check.sh`` replaced; it writes the same files)."""
    check = common.load(results / "gpu_attention_h200.json")
    if check is None:
        return []
    command = (
        "OUT=benchmarks/results bash scripts/device_gpu_check.sh   # on a GPU machine "
        "(recorded by its predecessor, scripts/device_verify_cost.sh)"
    )
    out = [
        "## On an H200: the Pallas GPU verify-attention kernel",
        "",
        f"    {command}",
        "",
        f"{check['device']}, jax {check['jax']}. Verify attention at Qwen3-8B's shape "
        f"({check['shape']['heads']} query heads over {check['shape']['kv_heads']} KV heads, "
        f"head_dim {check['shape']['head_dim']}, pages of {check['shape']['page_size']}); "
        f"max |error| against jax's `{check['reference']}`:",
        "",
        "| dtype | xla | pallas_gpu | tolerance |",
        "|---|---|---|---|",
    ]
    for dtype, errs in check["errors"].items():
        cells = [e if isinstance(e, str) else f"{e:.1e}" for e in errs.values()]
        out.append(f"| {dtype} | {' | '.join(cells)} | {check['tolerance'][dtype]:g} |")
    out += [
        "",
        f"Time of one verify attention pass, {check['slots']} slots × {check['gamma'] + 1} "
        "rows, bf16, median:",
        "",
        "| context | xla ms | pallas_gpu ms | xla / pallas_gpu | KV read by pallas_gpu |",
        "|---|---|---|---|---|",
    ]
    for ctx, row in check["verify_ms"].items():
        if "pallas_gpu" not in row:
            continue
        rate = row["kv_bytes"] / (row["pallas_gpu"] * 1e-3) / 1e12
        out.append(
            f"| {ctx} | {row['xla']:.2f} | {row['pallas_gpu']:.2f} | "
            f"{row['xla'] / row['pallas_gpu']:.1f}× | {rate:.2f} TB/s |"
        )
    out.append("")
    err = results / "verify_cost_h200_pallas_gpu_error.txt"
    if err.exists():
        last = err.read_text().strip().splitlines()
        reason = next((line for line in reversed(last) if "Error" in line), last[-1])
        reason = reason.strip().rstrip(".")
        out += [
            "The round with `--attention pallas_gpu` stopped while tracing on this jax/flax "
            f"pair (`{err.name}`): `{reason}`. The round below uses `--attention xla`. "
            "The layer scan no longer runs the flax check that raised this "
            "([attention design](../design/attention.md)); the round has not been re-run on "
            "a GPU since.",
            "",
        ]
    xla = results / "verify_cost_h200_xla.md"
    if xla.exists():
        out += common.included(xla, command)
    return out


def round_options_section(ro) -> list[str]:
    """Round time with logprobs (top-20) and with coupled verification vs the plain round
    (``round_options.json``)."""
    if not ro:
        return []
    out = [
        "## What serving options cost per round",
        "",
        f"Bundled target + DSpark, R = {ro['slots']} active slots at T = 1, γ = {ro['gamma']}, "
        f"vocabulary {ro['vocab_size']}, every draft verified; median of {ro['rounds']} rounds "
        "per arm, arms interleaved round by round.",
        "",
        f"    {ro['command']}",
        "",
        "| arm | median round ms | vs base |",
        "|---|---|---|",
    ]
    for name, a in ro["arms"].items():
        out.append(f"| {name} | {a['median_round_ms']:.2f} | {a['ratio_to_base']:.3f} |")
    out += [
        "",
        "`top20`: the round also computes each verified row's top-20 target log-probabilities "
        "(the server's default `--max-logprobs 20`). `coupled`: every slot verified coupled "
        "(Gumbel noise over the vocabulary for each verified row; only rounds with a coupled "
        "slot pay it).",
        "",
    ]
    return out


def plain_round_section(pr) -> list[str]:
    """The plain round (draft-aware rounds) against no speculation and drafting rounds
    (``plain_round.json``)."""
    if not pr:
        return []
    out = [
        "## What a plain round costs",
        "",
        f"Bundled target + DSpark (γ = {pr['gamma']}), every slot active at {pr['context']} "
        "committed tokens, T = 1; median ms per round, arms interleaved. *plain*: the target "
        "alone over the anchors, the drafter's context K/V of the committed token written "
        "(what `--plain-rounds` runs when drafting would not pay); *no speculation*: the same "
        "target without a drafter.",
        "",
        f"    {pr['command'].strip()}",
        "",
        "| R | no speculation | plain | drafting, K = 1 | drafting, K = R·γ | plain / none "
        "| drafting K = 1 / plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in pr["rows"]:
        ms = r["ms"]
        full = next(v for k, v in ms.items() if k.startswith("drafting") and k != "drafting, K = 1")
        out.append(
            f"| {r['slots']} | {ms['no speculation']:.2f} | {ms['plain']:.2f} | "
            f"{ms['drafting, K = 1']:.2f} | {full:.2f} | {r['plain_over_no_speculation']:.2f} | "
            f"{r['smallest_drafting_over_plain']:.2f} |"
        )
    return out + [""]


def plain_round(results: pathlib.Path) -> list[str]:
    return plain_round_section(common.load(results / "plain_round.json"))


def compile_section(ct) -> list[str]:
    if ct is None:
        return []
    out = common.table_head(
        "## Forward compile time with abstract parameters",
        "python benchmarks/compile_time.py",
        ["preset", "layers", "params", "lower s", "compile s"],
    )
    for r in ct["rows"]:
        out.append(
            f"| {r['preset']} | {r['layers']} | {r['params'] / 1e6:.1f} M | {r['lower_s']:.2f} | "
            f"{r['compile_s']:.2f} |"
        )
    return out + ["", "`nn.scan` keeps compile time flat in depth (4 → 36 layers).", ""]


# Page entries: each takes the results directory and returns Markdown lines.


def gpu(results: pathlib.Path) -> list[str]:
    return gpu_section(results)


def round_options(results: pathlib.Path) -> list[str]:
    return round_options_section(common.load(results / "round_options.json"))


def compile_time(results: pathlib.Path) -> list[str]:
    return compile_section(common.load(results / "compile_time.json"))
