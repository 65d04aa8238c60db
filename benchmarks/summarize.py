"""Write the results pages under docs/results/ from the result files in benchmarks/results/.

    python benchmarks/summarize.py           # regenerate every page
    python benchmarks/summarize.py --check   # exit 1 if a page differs from what it would write

Every figure in those pages comes from a file a documented command produced; the renderers
(``benchmarks/render/``) only format them, and each table names its command. The manifest
below says which result files feed which renderer, on which page.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Callable
from dataclasses import dataclass

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from render import (  # noqa: E402
    acceptance,
    calibration,
    common,
    cost,
    history,
    memory,
    roofline,
    serving,
    training,
)

RESULTS = common.RESULTS
PAGES_DIR = ROOT / "docs" / "results"


@dataclass(frozen=True)
class Entry:
    sources: tuple[str, ...]  # result files (paths from the repository root; globs allowed)
    render: Callable[[pathlib.Path], list[str]]  # results dir -> Markdown lines


@dataclass(frozen=True)
class Page:
    name: str
    title: str
    about: str
    entries: tuple[Entry, ...]


R = "benchmarks/results/"
MANIFEST = (
    Page("acceptance.md", "Acceptance", "τ per drafter and prompt set, position-wise acceptance, "
         "coupled verification, draft depth, greedy share in the distilled data", (
        Entry((R + "acceptance.json",), acceptance.main_table),
        Entry((R + "acceptance_other_sets.json",), acceptance.other_sets),
        Entry((R + "acceptance_coupled.json",), acceptance.coupled),
        Entry((R + "acceptance_depth.json", R + "acceptance.json"), acceptance.depth),
        Entry((R + "acceptance_greedy_share.json", R + "drafter_ablation.json"),
              acceptance.greedy_share),
    )),
    Page("training.md", "Drafter training", "the bundled drafters, the equal-compute budget, "
         "quality against distilled data, controlled DSpark vs EAGLE-3 runs", (
        Entry(("assets/drafters/*/model_card.json",), training.bundled),
        Entry((R + "train_budget.md",), training.budget),
        Entry((R + "drafter_data_curve.json",), training.data_curve),
        Entry((R + "drafter_ablation.json",), training.ablation),
    )),
    Page("calibration.md", "Calibration", "the bundled DSpark drafter's STS fit per position, "
         "and every drafter's draft-probability survival estimate against it", (
        Entry(("assets/drafters/dspark/sts.json", "assets/drafters/dspark/sts_data.npz"),
              calibration.calibration),
        Entry((R + "survival_estimators*.json",), calibration.survival_estimators),
    )),
    Page("round-cost.md", "Round cost", "verify cost and step anatomy on CPU, the H200 "
         "measurements, serving options per round, compile time", (
        Entry((R + "verify_cost.md",), cost.verify),
        Entry((R + "round_options.json",), cost.round_options),
        Entry((R + "plain_round.json",), cost.plain_round),
        Entry((R + "gpu_attention_h200.json", R + "verify_cost_h200_xla.md"), cost.gpu),
        Entry((R + "compile_time.json",), cost.compile_time),
    )),
    Page("memory.md", "Memory", "ahead-of-time per-device memory (4B / 8B / 14B), the "
         "serving layouts that fit a v5e / v5p slice, decode state vs the KV page pool", (
        Entry((R + "aot_memory.md",), memory.aot),
        Entry((R + "aot_memory_*.md",), memory.aot_tpu),
        Entry((R + "serve_fit.md", R + "serve_fit.json"), memory.serve_fit),
        Entry((R + "kv_memory.md", R + "kv_memory.json"), memory.kv),
    )),
    Page("roofline.md", "Roofline of the decode round", "XLA:TPU's cost analysis of the "
         "Qwen3-8B serving round per verify bucket, by drafter and topology", (
        Entry((R + "roofline_*.md", R + "roofline_*.json"), roofline.roofline),
    )),
    Page("serving.md", "Serving", "start-up, soak, serving under load on CPU, the serving "
         "simulator and its validation, mesh layouts compared, the decode mesh's overhead, serving on two processes", (
        Entry((R + "startup.json",), serving.startup),
        Entry((R + "soak.json",), serving.soak),
        Entry((R + "serving.json", R + "serving_t1.json", R + "serving_eagle3*.json"),
              serving.serving),
        Entry((R + "serving_sim_validation*.md",), serving.sim_validation),
        Entry((R + "serving_sim_v5p_*.md",), serving.sim_modelled),
        Entry((R + "serving_sim_layouts.md", R + "serving_sim_layouts.json"),
              serving.sim_layouts),
        Entry((R + "mesh_overhead.md", R + "mesh_overhead.json"), serving.mesh_overhead),
        Entry((R + "lockstep_exchange.md", R + "lockstep_exchange.json"),
              serving.lockstep_exchange),
    )),
    Page("train-cost.md", "Training cost on TPU slices", "the drafter training step's "
         "roofline (XLA:TPU, modelled step time and MFU) and chip-hours for DeepSpec's recipe, "
         "online target features against a feature cache", (
        Entry((R + "train_roofline.md",), training.train_roofline),
    )),
    Page("history.md", "History: before and after", "finished changes measured against "
         "their baselines (training memory, paged KV cache, q/k/v layout, CPU round time)", (
        Entry((R + "gathered_lm_head_baseline/aot_memory_v5p.json", R + "aot_memory_v5p.json"),
              history.training_memory),
        Entry((R + "dense_gather_baseline/roofline_*.json",), history.paged_roofline),
        Entry((R + "qkv_layout_baseline/roofline_*.json",), history.qkv_layout),
        Entry((R + "round_time*.md",), history.round_time),
    )),
)  # fmt: skip

NOTE = (
    "Generated by `python benchmarks/summarize.py` from the files in `benchmarks/results/` "
    "(do not edit by hand). Runs are on this project's 2-core CPU machines unless a table "
    "says otherwise; timings there are noisy, so compare arms within a table and read ratios."
)


def render_page(page: Page, results: pathlib.Path = RESULTS) -> str:
    lines = [f"# {page.title}", "", NOTE, "", "[All results pages](README.md)", ""]
    for entry in page.entries:
        lines += entry.render(results)
    return "\n".join(lines).rstrip() + "\n"


def render_index(pages: dict[str, str]) -> str:
    lines = ["# Results", "", NOTE, ""]
    for page in MANIFEST:
        lines += [f"- [{page.title}]({page.name}): {page.about}."]
        for line in pages[page.name].splitlines():
            if line.startswith("## "):
                lines.append(f"  - {line[3:]}")
    return "\n".join(lines) + "\n"


def render_all(results: pathlib.Path = RESULTS) -> dict[str, str]:
    """Every page's text by file name, the index (README.md) included."""
    pages = {page.name: render_page(page, results) for page in MANIFEST}
    pages["README.md"] = render_index(pages)
    return pages


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    pages = render_all()
    if args.check:
        stale = [n for n, text in pages.items() if _read(PAGES_DIR / n) != text]
        for name in stale:
            print(f"out of date: docs/results/{name} (run python benchmarks/summarize.py)")
        return 1 if stale else 0
    PAGES_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in pages.items():
        (PAGES_DIR / name).write_text(text)
    print(f"wrote {len(pages)} pages to {PAGES_DIR}")
    return 0


def _read(path: pathlib.Path) -> str | None:
    return path.read_text() if path.is_file() else None


if __name__ == "__main__":
    sys.exit(main())
