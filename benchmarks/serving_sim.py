"""Serving simulation on modelled hardware (Figs. 7–8 analog where the paper runs them),
with the bundled drafters' recorded rounds replayed through the project's schedulers
(``dspark_jax/perf/serving_sim.py``).

    python benchmarks/serving_sim.py                  # modelled v5p (roofline SPS tables)
    python benchmarks/serving_sim.py --validate       # against the CPU serving benchmark
    python benchmarks/serving_sim.py --layouts benchmarks/results/layouts_4b/roofline_tp8,...

Default mode: every arm (no speculation, MTP-1, fixed γ, static threshold, Algorithm 1,
dynamic top-K) at concurrency 1–256 on an engine of ``R`` slots whose round takes
``1 / SPS(R + K)`` from the roofline's modelled tables (``benchmarks/roofline.py``, one per
drafter: ``--drafter dspark|mtp1|none``; the compiled round includes drafting), twice:
with today's compiled round and at its byte/flop floor (what the kernels issue aims for).
Prefill is modelled from a hand count (max(flops / peak, weight bytes / HBM bandwidth)), the
host's work per round is the CPU engine's measured one. Requests replay the T = 1
acceptance runs' per-round records (``benchmarks/results/acceptance*.rounds.npz``: every
draft verified, so each round's confidences and all-drafts acceptance are known) of the
serving benchmark's prompt sets.

``--validate``: the same simulator with the CPU serving benchmark's own settings, SPS
tables and prefill times (``serving_t1.json``'s ``cost_model``), compared level by level
with what that benchmark measured: ordering of arms and throughput ratio.
``--layouts``: one DSpark roofline per mesh layout of the same slice (``roofline.py
--data d --tensor t``, R per replica), simulated with the engine's data replicas
(``perf.serving_sim.simulate(replicas=d)``) at every concurrency: aggregate and per-user
throughput per layout, and which layout wins where.
Writes ``<out>.json`` and ``<out>.md`` (and PNGs for the modelled run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
RESULTS = os.path.join(REPO, "benchmarks", "results")
# The serving benchmark's prompt mix (benchmarks/serving.py load_prompts), in its order.
SERVING_SETS = ("humaneval", "mbpp", "gsm8k", "mt-bench")
ACCEPTANCE_FILES = ("acceptance.json", "acceptance_other_sets.json")
ARMS = (  # (arm name, scheduler, drafter, plain rounds) as benchmarks/serving.py builds them
    ("no speculation", "none", None, False),
    ("MTP-1", "fixed", "mtp1", False),
    ("fixed γ", "fixed", "dspark", False),
    ("static threshold", "threshold", "dspark", False),
    ("Algorithm 1", "prefix", "dspark", True),
    ("dynamic top-K", "topk", "dspark", True),
    ("top-K, always drafting", "topk", "dspark", False),
)


def input_target_weights(serving: str, results_dir: str = RESULTS) -> list:
    """The target fingerprints recorded by the files a simulation replays (the acceptance
    traces and the serving benchmark; ``None`` where a file recorded none), for
    ``summarize.py`` to flag a simulation of other models than the bundled ones."""
    found = set()
    for fname in ACCEPTANCE_FILES:
        path = os.path.join(results_dir, fname)
        if os.path.isfile(path):
            with open(path) as f:
                found.add(json.load(f)["config"].get("target", {}).get("weights"))
    with open(serving) as f:
        found.add(json.load(f).get("target_weights"))
    return sorted(found, key=str)


def load_traces(drafter: str, temperature: float = 1.0, results_dir: str = RESULTS):
    """Per-prompt traces of one bundled drafter at ``temperature`` over the serving sets,
    calibrated with the drafter's shipped STS (as the server applies it)."""
    from dspark_jax.eval.calibration import load_sts
    from dspark_jax.perf.serving_sim import traces_from_records

    by_set = {}
    for fname in ACCEPTANCE_FILES:
        path = os.path.join(results_dir, fname)
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            res = json.load(f)
        rounds = np.load(path.replace(".json", ".rounds.npz"))
        for i, e in enumerate(res["results"]):
            if e["drafter"] != drafter or e["temperature"] != temperature:
                continue
            if e["prompt_set"] not in SERVING_SETS:
                continue
            gamma = 1 if e["kind"] == "mtp1" else e["gamma"]
            # Records written before every drafter had a survival estimate name none.
            estimator = e.get("survival_estimator", "confidence_head")
            sts = load_sts(os.path.join(REPO, e["drafter_path"]), gamma, estimator)
            z = rounds[f"{i}/confidence_logits"] if f"{i}/confidence_logits" in rounds else None
            by_set[e["prompt_set"]] = traces_from_records(
                rounds[f"{i}/prompt_index"],
                rounds[f"{i}/accepted"],
                gamma,
                z,
                None if sts is None or z is None else sts.temperatures,
                None if sts is None or z is None else sts.biases,
                None if sts is None or z is None else sts.knots,
            )
    missing = [s for s in SERVING_SETS if s not in by_set]
    if missing:
        raise SystemExit(
            f"no T = {temperature:g} acceptance records of {drafter!r} for {missing} in "
            f"{results_dir}: run `python -m dspark_jax.eval acceptance` (see BENCHMARKS.md)"
        )
    return [t for s in SERVING_SETS for t in by_set[s]]


def no_speculation_traces(traces):
    """One token per round, ending where the drafter's trace ended (its EOS or length)."""
    from dspark_jax.perf.serving_sim import Trace

    out = []
    for t in traces:
        n = int(np.sum(t.accepted + 1))
        out.append(Trace(np.zeros(n, np.int64), np.ones((n, 1), np.float32)))
    return out


def _bucket_lookup(entries):
    """``f(rows, tokens)`` from measured ``[{rows, bucket, seconds}]`` (next bucket up)."""
    table = {}
    for e in entries:
        table.setdefault(e["rows"], []).append((e["bucket"], e["seconds"]))
    for v in table.values():
        v.sort()

    def f(rows, tokens):
        cands = table[min(r for r in table if r >= rows)]
        return next((s for b, s in cands if b >= tokens), cands[-1][1])

    return f


def host_seconds_per_round(levels, two_phase: bool) -> float:
    """The engine thread's host time per round over a benchmark arm's levels: dispatching
    and processing (the timeline's dispatch + host seconds). A two-phase arm's dispatch
    also holds its wait for the plan (device time, which the simulator models itself), so
    only its processing counts."""
    tl = [r["timeline"] for r in levels if r.get("timeline", {}).get("rounds")]
    if not tl:
        raise SystemExit("the serving benchmark recorded no round timeline: re-run it")
    host = sum(x["host_seconds"] + (0.0 if two_phase else x["dispatch_seconds"]) for x in tl)
    return host / sum(x["rounds"] for x in tl)


# ------------------------------------------------------------------------------------------
# validation against the CPU serving benchmark
# ------------------------------------------------------------------------------------------
def validate(args) -> dict:
    from dspark_jax.perf.serving_sim import Arm, Workload, simulate
    from dspark_jax.sched.sps import SPSTable

    with open(args.serving) as f:
        bench = json.load(f)
    if "cost_model" not in bench:
        raise SystemExit(
            f"{args.serving} has no cost_model: re-run benchmarks/serving.py (it records the "
            "SPS and prefill tables the simulator replays)"
        )
    temperature = bench.get("temperature", 0.0)
    # The benchmark's --drafter runs the arms ARMS names "dspark" (e.g. EAGLE-3's own run:
    # serving.py --drafter assets/drafters/eagle3 --stem serving_eagle3_t1).
    main_drafter = os.path.basename(os.path.normpath(bench.get("drafter") or "dspark"))
    traces = {"dspark": load_traces(main_drafter, temperature)}
    if "MTP-1" in bench["arms"]:
        traces["mtp1"] = load_traces("mtp1", temperature)
    traces[None] = no_speculation_traces(traces["dspark"])
    out = {
        "serving": os.path.relpath(args.serving, REPO),
        "drafter": main_drafter,
        "arms": {},
        "measured": {},
    }
    for name, _, drafter, _ in ARMS:
        if name not in bench["arms"]:
            continue
        cm = bench["cost_model"][name]
        arm = Arm(
            name,
            cm["scheduler"],
            cm["gamma"],
            SPSTable.from_json(cm["sps"]),
            tuple(cm["verify_buckets"]),
            threshold=cm["threshold"],
            two_phase=cm["two_phase"],
            plain_rounds=cm.get("plain_rounds", False),
        )
        measured = bench["arms"][name]
        host = host_seconds_per_round(measured, cm["two_phase"])
        prefill = _bucket_lookup(cm["prefill_seconds"])
        rows = []
        for r in measured:
            wl = Workload(
                r["concurrency"],
                bench["requests_per_client"],
                bench["max_tokens"],
                tuple(bench["prompt_tokens"]),
                time_limit=bench.get("time_limit", math.inf),
            )
            sim = simulate(
                arm,
                traces[drafter],
                wl,
                slots=cm["slots"],
                prefill_seconds=prefill,
                prefill_batch=cm["prefill_batch"],
                host_seconds=host,
            )
            sim.pop("budgets")
            sim["measured_aggregate_tokens_per_second"] = r["aggregate_tokens_per_second"]
            sim["sim_over_measured"] = (
                sim["aggregate_tokens_per_second"] / r["aggregate_tokens_per_second"]
            )
            rows.append(sim)
        out["arms"][name] = {"host_seconds_per_round": host, "rows": rows}
    levels = sorted({r["concurrency"] for a in out["arms"].values() for r in a["rows"]})
    order = []
    for c in levels:
        sim = {n: r["aggregate_tokens_per_second"] for n, a in out["arms"].items()
               for r in a["rows"] if r["concurrency"] == c}  # fmt: skip
        meas = {n: r["measured_aggregate_tokens_per_second"] for n, a in out["arms"].items()
                for r in a["rows"] if r["concurrency"] == c}  # fmt: skip
        order.append(
            {
                "concurrency": c,
                "simulated": sorted(sim, key=sim.get, reverse=True),
                "measured": sorted(meas, key=meas.get, reverse=True),
            }
        )
    out["order"] = order
    # Arms whose measured throughputs differ by more than the 15 % tolerance: does the
    # simulator rank them the same way? (Closer arms are within this machine's noise.)
    pairs = agree = 0
    for c in levels:
        cells = {n: r for n, a in out["arms"].items() for r in a["rows"] if r["concurrency"] == c}
        names = sorted(cells)
        for i, x in enumerate(names):
            for y in names[i + 1 :]:
                mx = cells[x]["measured_aggregate_tokens_per_second"]
                my = cells[y]["measured_aggregate_tokens_per_second"]
                if max(mx, my) <= 1.15 * min(mx, my):
                    continue
                pairs += 1
                sx, sy = (cells[n]["aggregate_tokens_per_second"] for n in (x, y))
                agree += (mx > my) == (sx > sy)
    out["separated_pairs"] = {"pairs": pairs, "same_order": agree}
    ratios = [r["sim_over_measured"] for a in out["arms"].values() for r in a["rows"]]
    out["within_15pct"] = sum(abs(1 - x) <= 0.15 for x in ratios)
    out["cells"] = len(ratios)
    out["max_abs_error"] = max(abs(1 - x) for x in ratios)
    out["mean_abs_error"] = float(np.mean([abs(1 - x) for x in ratios]))
    return out


def validation_markdown(res: dict) -> str:
    lines = [
        "# Serving simulator vs the CPU serving benchmark"
        + ("" if res.get("drafter", "dspark") == "dspark" else f" ({res['drafter']})"),
        "",
        f"Produced by `python benchmarks/serving_sim.py --validate --serving {res['serving']}` "
        "(its SPS tables, measured prefill times, settings and host time per round) and the "
        "T = 1 acceptance records of the same drafters"
        + (
            ""
            if res.get("drafter", "dspark") == "dspark"
            else f" (the {res['drafter']} drafter runs every drafting arm but MTP-1)"
        )
        + ". Aggregate tokens/s.",
        "",
        "| arm | concurrency | measured | simulated | simulated / measured | sim τ | "
        "sim verify / round |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, a in res["arms"].items():
        for r in a["rows"]:
            lines.append(
                f"| {name} | {r['concurrency']} | {r['measured_aggregate_tokens_per_second']:.1f}"
                f" | {r['aggregate_tokens_per_second']:.1f} | {r['sim_over_measured']:.2f} | "
                f"{r['mean_tau']:.2f} | {r['mean_verify_budget_per_request']:.2f} |"
            )
    lines += [
        "",
        f"Mean |simulated / measured − 1| = {res['mean_abs_error']:.1%}, largest "
        f"{res['max_abs_error']:.1%}; {res['within_15pct']} of {res['cells']} cells within "
        f"15 %. Pairs of arms at one concurrency whose measured throughputs differ by more "
        f"than 15 %: the simulator orders {res['separated_pairs']['same_order']} of "
        f"{res['separated_pairs']['pairs']} the same way (closer pairs are within this "
        "machine's run-to-run noise, so the full order below need not match).",
        "",
        "Arm order by aggregate throughput (best first):",
        "",
    ]
    for o in res["order"]:
        same = "same" if o["simulated"] == o["measured"] else "differs"
        lines.append(
            f"- c = {o['concurrency']} ({same}): measured {' > '.join(o['measured'])}; "
            f"simulated {' > '.join(o['simulated'])}"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------
# modelled TPU
# ------------------------------------------------------------------------------------------
def _roofline(prefix: str, drafter: str) -> dict:
    path = prefix + ("" if drafter == "dspark" else f"_{drafter}") + ".json"
    if not os.path.isfile(path):
        flag = "" if drafter == "dspark" else f" --drafter {drafter}"
        raise SystemExit(
            f"{path} not found: run `python benchmarks/roofline.py --topology ... --tensor ..."
            f"{flag}` first"
        )
    with open(path) as f:
        return json.load(f)


def modelled_prefill(roof: dict):
    """Prefill seconds from a hand count on the roofline's chip: max(flops / peak, target
    weight bytes / HBM bandwidth), per chip (a derived figure, not a compiled one)."""
    from dspark_jax.models.presets import get_preset
    from dspark_jax.perf.roofline import target_forward_flops

    target = get_preset(roof["target"])
    chip = roof["chip"]
    # One replica's chips run a prefill (each data replica prefills its own rows).
    n_chips = math.prod(roof["mesh"].values()) // roof.get("data", 1)
    weights = roof["rows"][0]["floor_parts"]["target_weights"]

    def f(rows, tokens):
        flops = target_forward_flops(target, rows * tokens, max(tokens // 2, 1)) / n_chips
        return max(flops / (chip["bf16_tflops"] * 1e12), weights / (chip["hbm_gb_per_s"] * 1e9))

    return f


def floor_tables(roofs: dict, slots: int):
    """Round time at the floor for ``slots`` slots, derived without compiling: per chip,
    max(hand-counted flops / peak, floor bytes / HBM bandwidth), the floor's KV cache and
    drafter context scaled from the roofline's R to ``slots`` (same max_len, sharding,
    chip). Budgets: ``default_buckets(slots, γ)``. A derived figure, labelled as such."""
    from dspark_jax.decode.policy import default_buckets
    from dspark_jax.models.drafter_config import DrafterConfig
    from dspark_jax.models.presets import get_preset
    from dspark_jax.perf.roofline import round_flops_hand_count
    from dspark_jax.sched.sps import SPSTable

    tables, buckets = {}, {}
    for kind, roof in roofs.items():
        target = get_preset(roof["target"])
        drafter = None if roof["drafter"] is None else DrafterConfig(**roof["drafter"])
        chip, n_chips = roof["chip"], math.prod(roof["mesh"].values())
        parts = roof["rows"][0]["floor_parts"]
        scale = slots / roof["slots"]
        floor_bytes = (parts["target_weights"] + parts["drafter_weights"]
                       + scale * (parts["kv_cache"] + parts["drafter_context"]))  # fmt: skip
        g = 0 if drafter is None else drafter.draft_len
        ks = (0,) if g == 0 else tuple(default_buckets(slots, g))
        context = max(1, round(roof["context_fraction"] * roof["max_len"]))
        secs = {}
        for k in sorted({0, *ks}):
            flops = (
                round_flops_hand_count(target, drafter, slots=slots, budget=k, context_len=context)[
                    "total"
                ]
                / n_chips
            )
            secs[slots + k] = max(flops / (chip["bf16_tflops"] * 1e12),
                                  floor_bytes / (chip["hbm_gb_per_s"] * 1e9))  # fmt: skip
        tables[kind], buckets[kind] = SPSTable.from_seconds(secs), ks
    return tables, buckets


def modelled(args) -> dict:
    from dspark_jax.perf.serving_report import serving_goals
    from dspark_jax.perf.serving_sim import Arm, Workload, simulate
    from dspark_jax.sched.sps import SPSTable

    roofs = {d: _roofline(args.roofline, d) for d in ("dspark", "mtp1", "none")}
    slots = roofs["dspark"]["slots"]
    gamma = roofs["dspark"]["drafter"]["gamma"]
    for d, r in roofs.items():
        if r["slots"] != slots or r["max_len"] != roofs["dspark"]["max_len"]:
            raise SystemExit(f"the {d} roofline has other slots/max_len than the DSpark one")
    with open(args.serving) as f:
        bench = json.load(f)
    temperature = bench.get("temperature", 1.0)
    host = host_seconds_per_round(bench["arms"]["dynamic top-K"], two_phase=False)
    traces = {
        "dspark": load_traces("dspark", temperature),
        "mtp1": load_traces("mtp1", temperature),
    }
    traces[None] = no_speculation_traces(traces["dspark"])
    prompt_tokens = tuple(bench["prompt_tokens"])
    prefill = modelled_prefill(roofs["dspark"])
    levels = [int(c) for c in args.concurrency.split(",")]
    out = {
        "roofline": os.path.relpath(args.roofline, REPO),
        "topology": roofs["dspark"]["topology"],
        "tensor": roofs["dspark"]["tensor"],
        "slots": slots,
        "gamma": gamma,
        "temperature": temperature,
        "host_seconds_per_round": host,
        "max_tokens": args.max_tokens,
        "requests_per_client": args.requests_per_client,
        "curves": {},
    }
    curves = []
    for curve, field in (("compiled", "modelled_ms"), ("floor", "floor_ms")):
        tables, buckets = {}, {}
        for d, r in roofs.items():
            tables[d] = SPSTable.from_seconds({x["B"]: x[field] / 1e3 for x in r["rows"]})
            # The budgets the roofline compiled (its SPS is known only there).
            buckets[d] = tuple(sorted(x["budget"] for x in r["rows"] if x["budget"] > 0)) or (0,)
        curves.append((curve, slots, tables, buckets))
    if args.floor_slots:
        n = args.floor_slots
        tables, buckets = floor_tables(roofs, n)
        curves.append((f"floor, R = {n}", n, tables, buckets))
    out["curve_slots"] = {}
    for curve, r_slots, tables, buckets in curves:
        arms = {}
        # The plain round (the target alone at R rows, no drafter call) is modelled as the
        # no-speculation round at B = R: a derived figure, without the drafter's context
        # projection for the R committed rows (one draft layer's K/V per row).
        plain = dataclasses.replace(tables["dspark"], plain_seconds=1.0 / tables["none"](r_slots))
        for name, scheduler, drafter, plain_rounds in ARMS:
            kind = drafter or "none"
            g = {"dspark": gamma, "mtp1": 1, "none": 0}[kind]
            b = (0,) if g == 0 else buckets[kind]
            arm = Arm(name, scheduler, g, plain if plain_rounds else tables[kind], b,
                      two_phase=scheduler == "prefix" and len(b) > 1,
                      plain_rounds=plain_rounds)  # fmt: skip
            rows = []
            for c in levels:
                wl = Workload(c, args.requests_per_client, args.max_tokens, prompt_tokens)
                r = simulate(arm, traces[drafter], wl, slots=r_slots, prefill_seconds=prefill,
                             host_seconds=host)  # fmt: skip
                r.pop("budgets")
                rows.append(r)
                print(
                    f"[sim {curve}] {name:<17} c={c:<4} agg {r['aggregate_tokens_per_second']:9.0f}"
                    f" tok/s  user {r['per_user_tokens_per_second']:7.1f}  τ {r['mean_tau']:.2f}"
                    f"  K {r['mean_round_budget']:.0f}",
                    flush=True,
                )
            arms[name] = rows
        t = tables["dspark"]
        flatness = t.sps[-1] / t(r_slots)  # SPS(R·(γ+1)) / SPS(R): how free verifying is
        out["curves"][curve] = {"arms": arms, "goals": serving_goals(arms),
                                "sps_full_over_anchor": flatness}  # fmt: skip
        out["curve_slots"][curve] = r_slots
    return out


def modelled_markdown(res: dict) -> str:
    from dspark_jax.perf.serving_report import serving_table

    lines = [
        f"# Simulated serving on modelled {res['topology']} (tensor = {res['tensor']})",
        "",
        f"Produced by `python benchmarks/serving_sim.py` from `{res['roofline']}*.json` (the "
        "roofline's modelled round time per B = R + K for DSpark, MTP-1 and no speculation) and "
        f"the bundled drafters' T = {res['temperature']:g} acceptance records; R = "
        f"{res['slots']} slots, γ = {res['gamma']}, {res['requests_per_client']} requests per "
        f"client of at most {res['max_tokens']} tokens (traces end at the drafter run's own "
        f"EOS/64 tokens), prefill from a hand count, host {1e3 * res['host_seconds_per_round']:.2f}"
        " ms per round (the CPU engine's measured). Above R clients requests queue. "
        "`compiled`: today's round as XLA:TPU compiles it; `floor`: the same round if it moved "
        "only the bytes it must (the kernels issue's target); `floor, R = N`: the floor "
        "derived from hand counts for N slots (no compile; KV cache and drafter context "
        "scaled). Modelled, not measured.",
        "",
    ]
    for curve, data in res["curves"].items():
        lines += [
            f"## Round cost: {curve} ({res.get('curve_slots', {}).get(curve, res['slots'])} slots)",
            "",
            f"DSpark round SPS(R·(γ+1)) / SPS(R) = {data['sps_full_over_anchor']:.2f} "
            "(1 = verifying every draft is free; the lower, the more a scheduler that prunes "
            "drafts can gain over fixed γ).",
            "",
            *serving_table(data["arms"], agg_digits=0, round_budget=True),
        ]
        lines += data["goals"] + [""]
    return "\n".join(lines) + "\n"


LAYOUT_ARMS = (("fixed γ", "fixed"), ("dynamic top-K", "topk"))


def layouts(args) -> dict:
    """Each roofline of ``args.layouts`` (one mesh layout each) through the simulator with
    its data replicas, DSpark fixed γ and dynamic top-K, at every concurrency."""
    from dspark_jax.perf.serving_sim import Arm, Workload, simulate
    from dspark_jax.sched.sps import SPSTable

    with open(args.serving) as f:
        bench = json.load(f)
    temperature = bench.get("temperature", 1.0)
    host = host_seconds_per_round(bench["arms"]["dynamic top-K"], two_phase=False)
    traces = load_traces("dspark", temperature)
    prompt_tokens = tuple(bench["prompt_tokens"])
    levels = [int(c) for c in args.concurrency.split(",")]
    out = {"temperature": temperature, "host_seconds_per_round": host,
           "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
           "layouts": {}}  # fmt: skip
    for prefix in args.layouts.split(","):
        roof = _roofline(prefix, "dspark")
        data, tensor = roof.get("data", 1), roof["tensor"]
        name = f"tensor {tensor}" if data == 1 else f"data {data} × tensor {tensor}"
        gamma = roof["drafter"]["gamma"]
        table = SPSTable.from_seconds({x["B"]: x["modelled_ms"] / 1e3 for x in roof["rows"]})
        buckets = tuple(sorted(x["budget"] for x in roof["rows"] if x["budget"] > 0))
        prefill = modelled_prefill(roof)
        slots = roof["slots"] * data
        arms = {}
        for arm_name, scheduler in LAYOUT_ARMS:
            arm = Arm(arm_name, scheduler, gamma, table, buckets)
            rows = []
            for c in levels:
                wl = Workload(c, args.requests_per_client, args.max_tokens, prompt_tokens)
                r = simulate(arm, traces, wl, slots=slots, replicas=data,
                             prefill_seconds=prefill, host_seconds=host)  # fmt: skip
                r.pop("budgets")
                rows.append(r)
                print(f"[sim {name}] {arm_name:<14} c={c:<4} agg "
                      f"{r['aggregate_tokens_per_second']:9.0f} tok/s  user "
                      f"{r['per_user_tokens_per_second']:7.1f}", flush=True)  # fmt: skip
            arms[arm_name] = rows
        out["layouts"][name] = {
            "roofline": os.path.relpath(prefix, REPO), "topology": roof["topology"],
            "target": roof["target"], "data": data, "tensor": tensor, "slots": slots,
            "slots_per_replica": roof["slots"], "gamma": gamma, "buckets": list(buckets),
            "arms": arms,
        }  # fmt: skip
    return out


def layouts_markdown(res: dict) -> str:
    names = list(res["layouts"])
    first = res["layouts"][names[0]]
    lines = [
        f"# Simulated serving by mesh layout: {first['target']} + DSpark on {first['topology']}",
        "",
        f"Produced by `{res['command']}`: each layout's roofline (the engine's own round "
        "compiled by XLA:TPU, modelled time per B = R + K of one replica) through the "
        "serving simulator with the engine's data replicas (least-loaded admission, each "
        "replica's own budget, the round in the largest), the bundled DSpark drafter's "
        f"T = {res['temperature']:g} acceptance records, {res['requests_per_client']} "
        f"requests per client of at most {res['max_tokens']} tokens, prefill from a hand "
        "count, host time per round the CPU engine's. Layouts: "
        + "; ".join(
            f"{n}: R = {v['slots']} ({v['slots_per_replica']} per replica), buckets "
            f"K = {v['buckets']}"
            for n, v in res["layouts"].items()
        )
        + ". Modelled, not measured: a round's time is the roofline's max(flops / peak, "
        "bytes / HBM bandwidth) per chip, which leaves out the collectives over the "
        "inter-chip links; a wider tensor split runs more of them per round (two all-reduces "
        "per layer), so read its lead here as an upper bound.",
        "",
    ]
    for arm_name, _ in LAYOUT_ARMS:
        lines += [
            f"## {arm_name}: aggregate / per-user tokens/s",
            "",
            "| concurrency | " + " | ".join(names) + " | best aggregate | best per-user |",
            "|---|" + "---|" * len(names) + "---|---|",
        ]
        levels = [r["concurrency"] for r in first["arms"][arm_name]]
        for i, c in enumerate(levels):
            cells = {n: res["layouts"][n]["arms"][arm_name][i] for n in names}
            agg = {n: r["aggregate_tokens_per_second"] for n, r in cells.items()}
            user = {n: r["per_user_tokens_per_second"] for n, r in cells.items()}
            lines.append(
                f"| {c} | "
                + " | ".join(f"{agg[n]:.0f} / {user[n]:.0f}" for n in names)
                + f" | {max(agg, key=agg.get)} | {max(user, key=user.get)} |"
            )
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(res: dict, prefix: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for curve, data in res["curves"].items():
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, rows in data["arms"].items():
            c = [r["concurrency"] for r in rows]
            agg = [r["aggregate_tokens_per_second"] for r in rows]
            axes[0].plot(c, agg, marker="o", label=name)
            axes[1].plot(
                agg, [r["per_user_tokens_per_second"] for r in rows], marker="o", label=name
            )
        axes[0].set_xscale("log", base=2)
        axes[0].set_xlabel("concurrency")
        axes[0].set_ylabel("aggregate tokens/s")
        axes[1].set_xlabel("aggregate tokens/s")
        axes[1].set_ylabel("per-user tokens/s")
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"simulated serving, {res['topology']} tensor {res['tensor']}, round {curve}")
        fig.tight_layout()
        tag = curve.replace(", R = ", "_R").replace(" ", "_")
        fig.savefig(f"{prefix}_{tag}.png", dpi=110)
        plt.close(fig)


def main(argv=None) -> int:
    from dspark_jax.cli import run_main

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--validate", action="store_true", help="compare with the CPU benchmark")
    p.add_argument("--serving", default=os.path.join(RESULTS, "serving_t1.json"),
                   help="serving benchmark JSON (settings, cost model, host time)")  # fmt: skip
    p.add_argument("--roofline", default=os.path.join(RESULTS, "roofline_v5p_2x2x1_tp4"),
                   help="roofline output prefix; _mtp1 and _none files beside it")  # fmt: skip
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--floor-slots",
        type=int,
        default=256,
        help="also simulate the floor round at this many slots (derived from hand counts, "
        "no compile; 0 = off)",
    )
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument(
        "--layouts",
        default=None,
        help="comma-separated DSpark roofline prefixes, one per mesh layout of one slice",
    )
    p.add_argument("--out", default=None, help="output prefix")
    args = p.parse_args(argv)

    def cli(args):
        if args.validate:
            res = validate(args)
            out = args.out or os.path.join(RESULTS, "serving_sim_validation")
            text = validation_markdown(res)
        elif args.layouts:
            res = layouts(args)
            given = argv if argv is not None else sys.argv[1:]
            res["command"] = "python benchmarks/serving_sim.py " + " ".join(given)
            out = args.out or os.path.join(RESULTS, "serving_sim_layouts")
            text = layouts_markdown(res)
        else:
            res = modelled(args)
            tag = os.path.basename(args.roofline).removeprefix("roofline_")
            out = args.out or os.path.join(RESULTS, f"serving_sim_{tag}")
            text = modelled_markdown(res)
            plot(res, out)
        res["target_weights"] = input_target_weights(args.serving)
        with open(out + ".json", "w") as f:
            json.dump(res, f, indent=1)
        with open(out + ".md", "w") as f:
            f.write(text)
        print(f"wrote {out}.json and .md")

    return run_main(cli, args)


if __name__ == "__main__":
    sys.exit(main())
