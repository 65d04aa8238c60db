"""History page: before/after tables of finished work (drafter training memory, the paged
KV cache, the q/k/v weight layout), each comparing today's results with a baseline kept
under benchmarks/results/<change>_baseline/ or measured against an earlier revision."""

from __future__ import annotations

import json
import pathlib

from . import common


def training_memory(results: pathlib.Path) -> list[str]:
    """Drafter training memory per chip before (the whole LM head gathered on every device,
    one dense block-over-context softmax; kept in results/gathered_lm_head_baseline/) and
    after (vocab-parallel LM head, key-chunked draft attention)."""
    old_path = results / "gathered_lm_head_baseline" / "aot_memory_v5p.json"
    new_path = results / "aot_memory_v5p.json"
    if not (old_path.is_file() and new_path.is_file()):
        return []
    before = {r["name"]: r for r in json.loads(old_path.read_text()) if "memory" in r}
    rows, stale = [], []
    for r in json.loads(new_path.read_text()):
        b = before.get(r["name"])
        if r.get("kind") != "train_step" or "memory" not in r or b is None:
            continue
        if r.get("libtpu") != b.get("libtpu"):
            continue  # another compiler: not a like-for-like comparison
        if r["memory"] == b["memory"] and r.get("compile_s") == b.get("compile_s"):
            stale.append(r["name"])  # the same report: not re-measured since
            continue
        t0, t1 = b["memory"]["temp_bytes"], r["memory"]["temp_bytes"]
        p0, p1 = b["memory"]["peak_bytes"], r["memory"]["peak_bytes"]
        rows.append(
            f"| {r['name']} | {t0 / 1e9:.2f} | {t1 / 1e9:.2f} | {t0 / t1:.2f}x | "
            f"{p0 / 1e9:.2f} | {p1 / 1e9:.2f} |"
        )
    if not rows:
        return []
    return [
        "## Drafter training memory: before and after",
        "",
        "    python benchmarks/aot_memory.py --tpu v5p",
        "",
        "XLA:TPU's per-chip plan for the DSpark training step (v5p slices, the rows of the "
        "v5p table in [memory](memory.md)). Before: the frozen LM head all-gathered whole on "
        "every device (`[4096, 151936]` bf16 for Qwen3-8B, held twice by the gather) and one "
        "dense softmax of every block over its whole context (results in "
        "`benchmarks/results/gathered_lm_head_baseline/`, the command above at commit "
        "356819c). After: the LM head vocab-parallel for the label "
        "rows and the draft attention read in 512-key chunks with an online softmax "
        "(`DrafterTask._lm_head`, `models.backbone._blocked_attention`), measured at the "
        "current tree (which also stores q/k/v kernels `[heads, head_dim, d]`). At 512 anchors "
        "the label rows (64 × 512 × 7 ≈ 229k) outnumber the vocabulary, so the head keeps "
        "the gathered layout there and only the attention change applies.",
        "",
        "| run | temp before GB | temp after GB | temp before / after | peak before GB "
        "| peak after GB |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
    ] + (
        [
            "Not re-measured since (their rows in the v5p table are still the before "
            "figures): " + ", ".join(stale) + ".",
            "",
        ]
        if stale
        else []
    )


_BEFORE_AFTER_HEADER = [
    "| topology | drafter | B | bytes before GB | after GB | / floor before | after "
    "| SPS(B)/SPS(R) before | after | peak memory before GB | after GB |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
]


def _roofline_before_after_rows(results: pathlib.Path, baseline: pathlib.Path) -> list[str]:
    """One table row per bucket present in both a baseline roofline file (kept under
    ``baseline/``) and today's file of the same name in results/."""
    rows = []
    for old_path in sorted(baseline.glob("roofline_*.json")):
        new_path = results / old_path.name
        if not new_path.is_file():
            continue
        old, new = json.loads(old_path.read_text()), json.loads(new_path.read_text())
        before = {r["B"]: r for r in old["rows"]}
        for r in new["rows"]:
            b = before.get(r["B"])
            if b is None:
                continue
            rows.append(
                f"| {new['topology']} tensor {new['tensor']} | {new.get('drafter_kind', 'dspark')} "
                f"| {r['B']} | {b['bytes'] / 1e9:.2f} | {r['bytes'] / 1e9:.2f} | "
                f"{b['bytes_over_floor']:.2f} | {r['bytes_over_floor']:.2f} | "
                f"{b['sps_over_sps_R']:.2f} | {r['sps_over_sps_R']:.2f} | "
                f"{b['peak_memory_bytes'] / 1e9:.1f} | {r['peak_memory_bytes'] / 1e9:.1f} |"
            )
    return rows


def qkv_layout(results: pathlib.Path) -> list[str]:
    """The q/k/v weight layout: roofline before (``[d, heads, head_dim]`` kernels, kept in
    results/qkv_layout_baseline/) and after (``[heads, head_dim, d]``)."""
    rows = _roofline_before_after_rows(results, results / "qkv_layout_baseline")
    if not rows:
        return []
    relayouts = []
    for path in sorted((results / "qkv_layout_baseline").glob("roofline_*.json")):
        new_path = results / path.name
        if new_path.is_file():
            new = json.loads(new_path.read_text())
            moved = max(sum(r.get("parameter_relayouts", {}).values()) for r in new["rows"])
            relayouts.append(f"{path.stem.removeprefix('roofline_')}: {moved / 1e9:.2f} GB")
    return [
        "## q/k/v weight layout: the roofline before and after",
        "",
        "Before: q/k/v kernels stored `[d, heads, head_dim]`, which XLA:TPU copied into "
        "another layout on every round (results in `benchmarks/results/qkv_layout_baseline/`, "
        "the same `benchmarks/roofline.py` commands at commit 13c8d31, listed in "
        "[roofline](roofline.md)). After: stored `[heads, head_dim, d]` "
        "(`models.qwen3.Projection.out_first`). Per chip, Qwen3-8B, R = 64, max_len = 4096, "
        "every slot full.",
        "",
        *_BEFORE_AFTER_HEADER,
        *rows,
        "",
        "Weights still copied into another layout at any bucket after the change "
        "(`perf.hlo_bytes.parameter_relayouts`, largest over the buckets): "
        + "; ".join(relayouts)
        + ".",
        "",
    ]


def paged_roofline(results: pathlib.Path) -> list[str]:
    """The paged KV cache: roofline before (dense gather, kept in
    results/dense_gather_baseline/) and after."""
    rows = _roofline_before_after_rows(results, results / "dense_gather_baseline")
    if not rows:
        return []
    return [
        "## Paged KV cache and ragged verify attention: the roofline before and after",
        "",
        "Before: the dense per-slot cache, each packed verify row gathering its slot's "
        "whole cache row (results in `benchmarks/results/dense_gather_baseline/`, from "
        "the same `benchmarks/roofline.py` commands at commit d6354a4, listed in "
        "[roofline](roofline.md)). After: today's round, with the paged cache, the TPU "
        "ragged-paged-attention kernel (its bytes modelled, see the roofline tables) and the "
        "DSpark drafter's context K/V in pages of the same table, read by the same kernel once "
        "per draft layer (`ops.paged_attention.block_attention`). Per chip, Qwen3-8B, R = 64, "
        "max_len = 4096, every slot full.",
        "",
        *_BEFORE_AFTER_HEADER,
        *rows,
        "",
    ]


# Each CPU round-time file compares this tree with the revision a layout change started
# from: round_time*.md the paged cache, round_time_qkv_layout.md the q/k/v weights stored
# [heads, head_dim, d].
ROUND_TIME_CHANGES = {
    "round_time.md": "The paged KV cache, long contexts.",
    "round_time_ctx128.md": "The paged KV cache, short contexts.",
    "round_time_qkv_layout.md": "The q/k/v weights stored `[heads, head_dim, d]`.",
}


def round_time(results: pathlib.Path) -> list[str]:
    out = []
    for path in sorted(results.glob("round_time*.md")):
        change = ROUND_TIME_CHANGES.get(path.name, "A change against an earlier revision.")
        out += common.included(path, common.command_of(path), [f"Change measured: {change}", ""])
    return out
