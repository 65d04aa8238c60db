"""benchmarks/summarize.py and its renderers (benchmarks/render/): the manifest names result
files that exist, a page holds the table built from its result file, regenerating is
idempotent and the committed pages are up to date, headings are distinct; and a table
measured against other target weights than the bundled target's says so (silent when the
fingerprints match)."""

import copy
import json
import os
import pathlib
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture()
def render(monkeypatch):
    """The renderer package, with the bundled target's fingerprint pinned to a's."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import render.acceptance
    import render.common
    import render.cost
    import render.serving
    import render.training

    monkeypatch.setattr(render.common, "bundled_target_weights", lambda: "aaaaaaaaaaaaaaaa")
    yield render


@pytest.fixture()
def summarize(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import summarize

    yield summarize
    sys.modules.pop("summarize", None)


def _acceptance(weights):
    with open(os.path.join(REPO, "benchmarks", "results", "acceptance.json")) as f:
        acc = json.load(f)
    acc["config"].setdefault("target", {})["weights"] = weights
    return acc


def test_acceptance_tables_flag_other_target_weights(render):
    assert not any("earlier bundled" in line for line in
                   render.acceptance.acceptance_section(_acceptance("aaaaaaaaaaaaaaaa")))  # fmt: skip
    stale = "\n".join(render.acceptance.acceptance_section(_acceptance("bbbbbbbbbbbbbbbb")))
    assert "**Measured on earlier bundled models** (target weights `bbbbbbbbbbbbbbbb`" in stale
    assert "`assets/target` is `aaaaaaaaaaaaaaaa`" in stale
    unknown = "\n".join(render.acceptance.coupled_section(_acceptance(None)))
    assert "**Not matched to today's models**: the run recorded no target fingerprint" in unknown


def test_depth_table_is_flagged_and_not_divided_by_another_targets_eagle3(render):
    with open(os.path.join(REPO, "benchmarks", "results", "acceptance_depth.json")) as f:
        depth = json.load(f)
    depth["config"].setdefault("target", {})["weights"] = "bbbbbbbbbbbbbbbb"
    stale = "\n".join(render.acceptance.depth_section(depth, _acceptance("aaaaaaaaaaaaaaaa")))
    assert "**Measured on earlier bundled models** (target weights `bbbbbbbbbbbbbbbb`" in stale
    assert "DSpark / EAGLE-3" not in stale  # a ratio across two targets' runs
    depth["config"]["target"]["weights"] = "aaaaaaaaaaaaaaaa"
    fresh = "\n".join(render.acceptance.depth_section(depth, _acceptance("aaaaaaaaaaaaaaaa")))
    assert "earlier bundled" not in fresh and "DSpark / EAGLE-3 at T = 1" in fresh


def test_ablation_flags_only_runs_on_the_bundled_target(render):
    abl = {
        "runs": {
            "dspark": {"overrides": [], "target_weights": "aaaaaaaaaaaaaaaa"},
            "eagle3": {"overrides": [], "target_weights": "bbbbbbbbbbbbbbbb"},
            # A run against another target on purpose (the target-strength factor).
            "dspark_v1": {"overrides": ["target.dir=assets/target_v1"], "target_weights": "c"},
        }
    }
    note = " ".join(render.training._ablation_stale_note(abl))
    assert "`eagle3`" in note and "`dspark`" not in note and "dspark_v1" not in note
    fresh = copy.deepcopy(abl)
    fresh["runs"]["eagle3"]["target_weights"] = "aaaaaaaaaaaaaaaa"
    assert render.training._ablation_stale_note(fresh) == []


def test_simulations_are_flagged_by_the_weights_of_what_they_replay(render, tmp_path):
    md = tmp_path / "serving_sim_x.md"
    md.write_text("table\n")
    (tmp_path / "serving_sim_x.json").write_text(json.dumps({"target_weights": [None]}))
    assert "recorded no target fingerprint" in " ".join(render.serving._sim_stale_note(md))
    (tmp_path / "serving_sim_x.json").write_text(json.dumps({"target_weights": ["a" * 16]}))
    assert render.serving._sim_stale_note(md) == []
    mixed = {"target_weights": ["a" * 16, "b" * 16]}  # new acceptance, old serving run
    (tmp_path / "serving_sim_x.json").write_text(json.dumps(mixed))
    assert "target weights `bbbbbbbbbbbbbbbb`" in " ".join(render.serving._sim_stale_note(md))


def test_ablation_pairs_runs_only_on_one_target(render):
    """A partial re-run after the target changed leaves rows whose two runs trained against
    different weights: no ratio for those, and rows on earlier weights say so."""
    run = {"overrides": [], "heldout_tau_tf": 2.0}
    abl = {
        "runs": {
            "dspark": {**run, "target_weights": "aaaaaaaaaaaaaaaa"},
            "eagle3": {**run, "target_weights": "aaaaaaaaaaaaaaaa", "heldout_tau_tf": 1.6},
            "dspark_l5": {**run, "target_weights": None},
            "dspark_g4": {**run, "target_weights": None},
            "eagle3_g4": {**run, "target_weights": None, "heldout_tau_tf": 1.0},
        },
        "factors": [
            {"factor": f, "dspark_run": d, "eagle3_run": e}
            for f, d, e in [("bundled", "dspark", "eagle3"), ("depth", "dspark_l5", "eagle3"),
                            ("gamma", "dspark_g4", "eagle3_g4")]
        ],
    }  # fmt: skip
    for f in abl["factors"]:
        f["dspark_tau_tf"] = abl["runs"][f["dspark_run"]]["heldout_tau_tf"]
        f["eagle3_tau_tf"] = abl["runs"][f["eagle3_run"]]["heldout_tau_tf"]
    rows = render.training._ablation_factor_rows(abl)
    assert rows[0].endswith("| 1.250 |") and "earlier" not in rows[0]
    assert rows[1].endswith("| – (runs on different targets) |")
    assert "gamma (earlier target)" in rows[2] and rows[2].endswith("| 2.000 |")


def test_gpu_section_reports_the_kernel_and_why_the_round_used_xla(render, tmp_path):
    """The GPU lease's section: kernel errors against their tolerance, the speed-up and the
    kernel's KV read rate from the timings, and the traced error when the kernel's round
    failed; nothing at all without a GPU run."""
    assert render.cost.gpu_section(tmp_path) == []
    check = {
        "device": "gpu NVIDIA H200", "jax": "0.11.2", "reference": "ref_ragged_paged_attention",
        "shape": {"heads": 32, "kv_heads": 8, "head_dim": 128, "page_size": 16},
        "slots": 64, "gamma": 7, "errors": {"float32": {"xla": 2e-4, "pallas_gpu": 4e-4}},
        "tolerance": {"float32": 1e-3},
        "verify_ms": {"2048": {"xla": 6.0, "pallas_gpu": 0.5, "kv_bytes": 10**9},
                      "4080": {"xla": 12.0, "kv_bytes": 2 * 10**9}},
    }  # fmt: skip
    (tmp_path / "gpu_attention_h200.json").write_text(json.dumps(check))
    (tmp_path / "verify_cost_h200_pallas_gpu_error.txt").write_text(
        "Traceback (most recent call last):\n  File x\nValueError: it broke.\n"
    )
    text = "\n".join(render.cost.gpu_section(tmp_path))
    assert "| float32 | 2.0e-04 | 4.0e-04 | 0.001 |" in text
    assert "| 2048 | 6.00 | 0.50 | 12.0× | 2.00 TB/s |" in text
    assert "| 4080 |" not in text  # no kernel timing there: no row
    assert "`ValueError: it broke`. The round below uses `--attention xla`." in text


def test_run_tables_show_a_dash_where_no_wall_time_was_recorded(render):
    assert render.training._wall({"wall_s": None}) == "–"
    assert render.training._wall({}) == "–"
    assert render.training._wall({"wall_s": 612.4}) == "612.4"


def test_a_fresh_workdir_counts_as_trained_from_scratch_and_is_left_untouched(
    monkeypatch, tmp_path
):
    # drafter_runs.train_point records a wall time only when the call starts the run from
    # its first step; looking must not create the checkpoint directory train.py resumes from.
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmarks"))
    import drafter_runs

    assert drafter_runs._latest_checkpoint(str(tmp_path)) == (None, None)
    assert not (tmp_path / "checkpoints").exists()
    assert drafter_runs.train_wall_s(str(tmp_path)) is None
    (tmp_path / "wall_s.json").write_text('{"wall_s": 101.5}')
    assert drafter_runs.train_wall_s(str(tmp_path)) == 101.5


def test_greedy_share_table_divides_the_two_drafters_and_pairs_heldout_by_target(render):
    acc = _acceptance("aaaaaaaaaaaaaaaa")
    base = [r for r in acc["results"] if r["drafter"] == "dspark"]
    mixed = [
        {**r, "drafter": "dspark-greedy25", "tau": 1.1 * r["tau"],
         "tau_prompt_mean": 1.2 * r["tau_prompt_mean"]}
        for r in base
    ]  # fmt: skip
    acc["results"] = base + mixed
    abl = {
        "runs": {
            "dspark": {"heldout_tau_tf": 1.9, "target_weights": "aaaaaaaaaaaaaaaa"},
            "dspark_greedy25": {"heldout_tau_tf": 1.8, "target_weights": "aaaaaaaaaaaaaaaa"},
        }
    }
    text = "\n".join(render.acceptance.greedy_share_section(acc, abl))
    assert "earlier bundled" not in text
    r = next(r for r in base if r["prompt_set"] == "humaneval" and r["temperature"] == 0)
    assert (
        f"| humaneval | 0 | {r['tau']:.3f} / {r['tau_prompt_mean']:.3f} | "
        f"{1.1 * r['tau']:.3f} / {1.2 * r['tau_prompt_mean']:.3f} | 1.100 / 1.200 |"
    ) in text
    assert "`dspark` 1.900, `dspark_greedy25` 1.800" in text
    abl["runs"]["dspark_greedy25"]["target_weights"] = "bbbbbbbbbbbbbbbb"
    assert "Held-out" not in "\n".join(render.acceptance.greedy_share_section(acc, abl))
    with pytest.raises(ValueError, match="expected 2 drafters"):
        render.acceptance.greedy_share_section(_acceptance("aaaaaaaaaaaaaaaa"), abl)


def test_every_manifest_entry_reads_result_files_that_exist(summarize):
    import glob

    pages = [p.name for p in summarize.MANIFEST]
    assert len(pages) == len(set(pages)) and "README.md" not in pages
    for page in summarize.MANIFEST:
        assert page.entries, page.name
        for entry in page.entries:
            for source in entry.sources:
                assert glob.glob(os.path.join(REPO, source)), f"{page.name}: no {source}"


def test_a_page_holds_the_table_its_result_file_gives(summarize, tmp_path):
    """A small compile-time result in a scratch results directory: its page carries the
    command and one table row per result row; a missing file renders nothing."""
    (tmp_path / "compile_time.json").write_text(json.dumps({"rows": [
        {"preset": "qwen3-8b", "layers": 36, "params": 8.19e9, "lower_s": 1.234,
         "compile_s": 5.678},
    ]}))  # fmt: skip
    page = next(p for p in summarize.MANIFEST if p.name == "round-cost.md")
    text = summarize.render_page(page, tmp_path)
    assert text.startswith("# Round cost\n")
    assert "    python benchmarks/compile_time.py" in text
    assert "| qwen3-8b | 36 | 8190.0 M | 1.23 | 5.68 |" in text
    assert "Verify cost" not in text  # verify_cost.md is not in the scratch directory


def test_regenerating_is_idempotent_and_the_committed_pages_are_current(summarize):
    first = summarize.render_all()
    assert summarize.render_all() == first
    assert set(first) == {p.name for p in summarize.MANIFEST} | {"README.md"}
    assert summarize.main(["--check"]) == 0, "run python benchmarks/summarize.py"


def test_headings_are_distinct_and_the_index_lists_every_page(summarize):
    pages = summarize.render_all()
    for name, text in pages.items():
        heads = [line for line in text.splitlines() if line.startswith("## ")]
        assert len(heads) == len(set(heads)), f"{name}: repeated headings"
    roofline = [h for h in pages["roofline.md"].splitlines() if h.startswith("## ")]
    assert len(roofline) >= 2 and all("on v5p" in h for h in roofline)
    for page in summarize.MANIFEST:
        assert f"]({page.name})" in pages["README.md"]


# A fenced block: fences open and close at the start of a line (a ```` ```python ```` span
# inside a sentence is not one).
FENCED = r"^```.*?^```"


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_readme_stays_short_and_every_docs_link_resolves():
    """The README is the front door (two screens, no tables of figures), and every relative
    link in it, in DESIGN.md / BENCHMARKS.md and under docs/ names a file that exists and,
    with #anchor, a heading in it."""
    root = pathlib.Path(REPO)
    readme = (root / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "python serve.py --demo" in readme and "python -m pytest -q" in readme
    pages = [root / "README.md", root / "DESIGN.md", root / "BENCHMARKS.md"]
    pages += sorted((root / "docs").rglob("*.md"))
    for page in pages:
        text = re.sub(FENCED, "", page.read_text(), flags=re.S | re.M)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if link.startswith(("http://", "https://")):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            assert target.exists(), f"{page.relative_to(root)}: no {link}"
            if anchor and target.suffix == ".md":
                heads = re.sub(FENCED, "", target.read_text(), flags=re.S | re.M)
                slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", heads, flags=re.M)}
                assert anchor in slugs, f"{page.relative_to(root)}: no heading for {link}"
