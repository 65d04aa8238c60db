"""Serving pages: server start-up, the soak test, serving under load (Figs. 7–8 analog on
CPU) and the serving simulator on modelled hardware."""

from __future__ import annotations

import pathlib

from dspark_jax.perf.serving_report import serving_goals, serving_table

from . import common


def _serving_command(data: dict) -> str:
    """The benchmark command that reproduces a serving JSON (from the settings it records)."""
    levels = ",".join(str(r["concurrency"]) for r in next(iter(data["arms"].values())))
    cmd = "    python benchmarks/serving.py"
    if data.get("quick"):
        return cmd + " --quick"
    drafter = data.get("drafter") or "assets/drafters/dspark"
    mtp = " --mtp-drafter assets/drafters/mtp1" if "MTP-1" in data["arms"] else ""
    cmd += (
        f" --target assets/target --drafter {drafter}{mtp} --concurrency {levels} --time-limit "
        f"{data.get('time_limit', 15):g} --max-tokens {data['max_tokens']} --slots "
        f"{data['slots']} --requests-per-client {data.get('requests_per_client', 4)}"
    )
    if data.get("temperature", 0.0):
        cmd += f" --temperature {data['temperature']:g}"
    if _drafter_name(data) != "dspark":  # a run of some arms with another drafter
        cmd += f' --arms "{",".join(data["arms"])}" --stem {data["stem"]}'
    return cmd


def _drafter_name(data: dict) -> str:
    return pathlib.PurePath(data.get("drafter") or "dspark").name


def _serving_table(name: str, data: dict) -> list[str]:
    quick = data.get("quick", False)
    temp = data.get("temperature", 0.0)
    sampling = "greedy requests" if temp == 0 else f"requests sampled at T = {temp:g}"
    limit = data.get("time_limit", 15)
    drafter = _drafter_name(data)
    title = "Greedy" if temp == 0 else f"T = {temp:g}"
    if drafter != "dspark":
        title = f"{drafter}, {title.lower() if temp == 0 else title}"
    out = [
        f"### {title}" + (" (quick)" if quick else ""),
        "",
        f"`benchmarks/results/{name}`"
        + (" (quick mode: tiny random models, a smoke test of the harness)" if quick else "")
        + f"; {data.get('slots')} slots, {data.get('max_tokens')} tokens per request, "
        f"real HTTP server on loopback, {sampling}, at most {limit:g} s per level.",
        "",
        _serving_command(data),
        "",
    ]
    if not quick:
        out += common.stale_models_note(data.get("target_weights"))
    out += serving_table(data["arms"])
    shares = {
        arm: [r["timeline"]["host_share"] for r in rows if "timeline" in r]
        for arm, rows in data["arms"].items()
    }
    if any(shares.values()):
        desc = "; ".join(f"{arm} {min(v):.1%}–{max(v):.1%}" for arm, v in shares.items() if v)
        out += [
            "",
            "Engine host share (dispatch + host processing over the engine thread's busy "
            f"time, from its round timeline; range over the levels): {desc}.",
        ]
        two_phase = any(r.get("two_phase") for r in data.get("cost_model", {}).values())
        # Runs before the plan wait was booked as device wait show Algorithm 1 near 100 %.
        if two_phase and max(shares.get("Algorithm 1") or [0.0]) > 0.5:
            out.append(
                "Algorithm 1 is synchronous (two-phase: the host reads Σ ℓ before choosing "
                "the shape); in runs before its plan wait was booked as device wait, that "
                "wait shows as dispatch time, hence its ~99 %."
            )
    # Older files counted after the cost-model profile, which compiles its own programs.
    comp = data.get("compilations_during_load")
    if comp is not None:
        out += ["", f"Compilations during the load levels (after warm-up), per arm: {comp}."]
    out += serving_goals(data["arms"])
    out.append("")
    return out


def serving(results: pathlib.Path) -> list[str]:
    names = ("serving.json", "serving_t1.json", "serving_eagle3.json", "serving_eagle3_t1.json")
    runs = [(n, common.load(results / n)) for n in names]
    runs = [(n, d) for n, d in runs if d is not None]
    if not runs:
        quick = common.load(results / "serving_quick.json")
        runs = [("serving_quick.json", quick)] if quick is not None else []
    if not runs:
        return []
    out = ["## Serving under load on CPU (Figs. 7–8 analog)", ""]
    for name, data in runs:
        out += _serving_table(name, data)
    figs = [n.removesuffix(".json") for n, _ in runs]
    out += [
        "Figures: "
        + ", ".join(
            f"[{stem}_{kind}]({common.TO_ROOT}/benchmarks/results/{stem}_{kind}.png)"
            for stem in figs
            for kind in ("throughput", "per_user", "verify_budget")
            if (results / f"{stem}_{kind}.png").is_file()
        )
        + ".",
        "",
        "Single cells are noisy (2 shared CPU cores). On CPU a verify of B tokens costs "
        "several times one token ([verify cost](round-cost.md)), a cost an accelerator does "
        "not charge at these sizes, and the drafter is a quarter of a round; the goal "
        "figures (dynamic top-K vs every arm and fixed γ, per-user vs MTP-1) should be "
        "re-measured on an accelerator. Greedy verification accepts a draft only when it is "
        "the target's argmax, while the confidence head and STS are trained and fitted for "
        "T = 1 acceptance, so the scheduler's inputs are calibrated in the T = 1 run. "
        "The EAGLE-3 runs (no confidence head) schedule on its draft-probability survivals "
        "calibrated by `sts_draft_probability.json` (fitted at T = 1; "
        "[calibration](calibration.md#survival-estimates-side-by-side)).",
        "",
    ]
    return out


def startup(results: pathlib.Path) -> list[str]:
    st = common.load(results / "startup.json")
    if st is None:
        return []
    intro = (
        "Seconds from `python serve.py` (bundled target + DSpark, dynamic top-K) until "
        "`/health` answers 200, each arm a fresh process on this machine:",
        "",
    )
    out = common.table_head(
        "## Server start-up (compilation cache)", st["command"], ["start", "seconds"], intro
    )
    for arm, sec in st["seconds_to_healthy"].items():
        out.append(f"| {arm} | {sec:.1f} |")
    return out + [
        "",
        f"The second start takes {st['second_over_cold']:.2f}x the cold one: the compiled "
        "executables come from JAX's persistent cache and the SPS profile from its cache; "
        "what remains is loading the models, tracing each shape and checking the cache.",
        "",
    ]


def soak(results: pathlib.Path) -> list[str]:
    sk = common.load(results / "soak.json")
    if sk is None:
        return []
    bad = ", ".join(
        f"{k} {v['sent']} sent / {next(n for key, n in v.items() if key != 'sent')} answered 400"
        for k, v in sk["bad_input"].items()
    )
    st, rss = sk["sigterm"], sk["rss_mb"]
    out = [
        "## Soak (loopback HTTP, bundled models)",
        "",
        f"    {sk['command']}",
        "",
        f"- {sk['sent']} requests in {sk['wall_seconds']:.1f} s; of the well-formed ones "
        f"{sk['answered_200']} answered 200 and {sk['completed']} completed with a finish "
        f"reason (**{sk['lost']} lost**); bad input: {bad}.",
        f"- After the load: {sk['leaked_slots']:.0f} busy slots, {sk['leaked_queue']:.0f} "
        f"queued, {sk['compilations_after_warmup']:.0f} compilations after warm-up; resident "
        f"memory {rss['after_warmup']:.0f} MB after warm-up, {rss['after_load']:.0f} MB after "
        f"the load ({100 * rss['growth']:+.1f} %).",
        f"- SIGTERM with {st['in_flight_at_sigterm']} requests in flight: {st['completed']} "
        f"completed, {st['lost']} lost, exit status {st['exit_status']}; a request sent after "
        f"the signal: {st['late_request']}.",
        "",
        "| kind | p50 s | p99 s |",
        "|---|---|---|",
    ]
    for kind, lat in sk["latency_seconds"].items():
        out.append(f"| {kind} | {lat['p50']:.3f} | {lat['p99']:.3f} |")
    return out + [""]


def _sim_stale_note(md: pathlib.Path) -> list[str]:
    """Flag a simulation whose inputs (acceptance traces, serving run) recorded other target
    weights than the bundled target's, or none."""
    sim = common.load(md.with_suffix(".json")) or {}
    recorded = sim.get("target_weights") or [None]
    today = common.bundled_target_weights()
    if recorded == [today]:
        return []
    other = [w for w in recorded if w != today]
    return common.stale_models_note(
        other[0] if len(other) == 1 else None, "rerun it after the acceptance and serving runs"
    )


def sim_validation(results: pathlib.Path) -> list[str]:
    out = []
    for val in sorted(results.glob("serving_sim_validation*.md")):
        command = "python benchmarks/serving_sim.py --validate"
        if val.stem != "serving_sim_validation":  # another serving run (e.g. EAGLE-3's)
            serving = val.stem.replace("serving_sim_validation_", "serving_") + "_t1.json"
            command += (
                f" --serving benchmarks/results/{serving} --out benchmarks/results/{val.stem}"
            )
        out += common.included(val, command, _sim_stale_note(val))
    return out


def sim_modelled(results: pathlib.Path) -> list[str]:
    out = []
    for path in sorted(results.glob("serving_sim_*.md")):
        if path.name.startswith("serving_sim_validation") or path.name == "serving_sim_layouts.md":
            continue  # their own entries (sim_validation, sim_layouts)
        command = "python benchmarks/serving_sim.py --roofline benchmarks/results/" + (
            path.stem.replace("serving_sim_", "roofline_")
        )
        out += common.included(path, command, _sim_stale_note(path))
        pngs = sorted(results.glob(f"{path.stem}_*.png"))
        if pngs:
            out += [
                "Figures: "
                + ", ".join(
                    f"[{p.stem}]({common.TO_ROOT}/benchmarks/results/{p.name})" for p in pngs
                )
                + ".",
                "",
            ]
    return out


def mesh_overhead(results: pathlib.Path) -> list[str]:
    path = results / "mesh_overhead.md"
    return common.included(path, common.command_of(path)) if path.is_file() else []


def lockstep_exchange(results: pathlib.Path) -> list[str]:
    path = results / "lockstep_exchange.md"
    return common.included(path, common.command_of(path)) if path.is_file() else []


def sim_layouts(results: pathlib.Path) -> list[str]:
    path = results / "serving_sim_layouts.md"
    return common.included(path, common.command_of(path)) if path.is_file() else []
