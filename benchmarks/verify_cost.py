"""Verify-step cost vs verify budget K, the profiled SPS table, and the anatomy of a round.

    python benchmarks/verify_cost.py [--preset pycode-small] [--slots 8] [--gamma 7]

On an accelerator, e.g. an H200 with a random-weight Qwen3-8B in bf16 (the kernels issue's
measured SPS(B) beside the roofline's modelled one):

    python benchmarks/verify_cost.py --preset qwen3-8b --dtype bfloat16 --slots 64 \
        --max-len 4096 --drafter-layers 5 --budgets 0,224,448 --contexts 1,2048,4080 \
        --modelled-chip H200 --no-feature-draft --no-anatomy \
        --out benchmarks/results/verify_cost_h200.json

(``scripts/device_gpu_check.sh`` runs that for each attention backend, after a check of the
GPU attention kernel on the device.)

A random-weight target (cost does not depend on the weights) and a random DSpark drafter.
For each K in 0…R·γ the decoder's own compiled round (draft, schedule, verify+commit of
R + K packed rows) is timed (median of repeats), with every slot holding each of
``--contexts`` committed positions (attention reads each slot's pages up to its length).
Reports time(R + K = R·(γ+1)) / time(R + K = R) — how much the verify of a full block
costs over verifying only the anchors — beside, with ``--modelled-chip``, the round the
roofline models for that chip: max(hand-counted flops / peak, floor bytes / HBM
bandwidth), the floor being every weight once and each slot's KV and drafter context up
to its length (``perf.roofline``). Unless ``--no-anatomy``, also the step anatomy: draft,
schedule, verify(+commit) and host share of a round, each timed as its own jitted
function side by side. Writes ``benchmarks/results/verify_cost.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.decode.policy import default_buckets
from dspark_jax.decode.step import SpeculativeDecoder, StepConfig
from dspark_jax.models.draft_api import DraftContext, SamplingSettings
from dspark_jax.models.drafters import DrafterConfig, init_drafter_params, make_drafter
from dspark_jax.models.presets import get_preset
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.perf.roofline import CHIPS, round_flops_hand_count
from dspark_jax.sched import sps as sps_lib

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="pycode-small")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--drafter-layers", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--dtype", default=None, help="compute and weight dtype (default: preset's)")
    ap.add_argument("--attention", default="auto", help="verify attention backend")
    ap.add_argument(
        "--budgets", default=None, help="K values to time, e.g. 0,112,448 (default: R/2 steps)"
    )
    ap.add_argument(
        "--no-feature-draft",
        action="store_true",
        help="skip the re-projected-features draft comparison (a [R, max_len, 3d] array)",
    )
    ap.add_argument(
        "--contexts",
        default="1",
        help="committed positions per slot while the rounds are timed, e.g. 1,2048,4080",
    )
    ap.add_argument(
        "--modelled-chip",
        default=None,
        help=f"put the roofline's floor-modelled round beside the measured one ({list(CHIPS)})",
    )
    ap.add_argument(
        "--no-anatomy",
        action="store_true",
        help="skip the round anatomy (its separately jitted pieces: more compiles, and "
        "copies of the decode state, which at 8B × R = 64 × 4096 is ~44 GB)",
    )
    ap.add_argument("--out", default=os.path.join(HERE, "results", "verify_cost.json"))
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    chip = None
    if args.modelled_chip:
        if args.modelled_chip not in CHIPS:
            raise SystemExit(f"--modelled-chip {args.modelled_chip!r}: known {sorted(CHIPS)}")
        chip = CHIPS[args.modelled_chip]

    cfg = get_preset(args.preset)
    if args.dtype:
        cfg = cfg.replace(dtype=args.dtype, param_dtype=args.dtype)
    r, g = args.slots, args.gamma
    target = Qwen3(cfg)
    tp = nn.unbox(target.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    dcfg = DrafterConfig(
        kind="dspark", gamma=g, num_layers=args.drafter_layers, mask_token_id=cfg.vocab_size - 1
    )
    drafter = make_drafter(dcfg, cfg)
    dp = nn.unbox(init_drafter_params(drafter, jax.random.key(1)))
    dec = SpeculativeDecoder(
        target, tp, drafter, dp,
        StepConfig(num_slots=r, max_len=args.max_len, scheduler="prefix", attention=args.attention),
    )  # fmt: skip

    # --- verify cost vs K (decoder's own plan + commit, K drafts filled) -------------
    if args.budgets:
        ks = sorted({0, r * g, *(int(k) for k in args.budgets.split(","))})
    else:
        ks = list(range(0, r * g + 1, max(1, r // 2)))
        if ks[-1] != r * g:
            ks.append(r * g)
    result = {
        "machine": f"{platform.machine()} {jax.devices()[0].device_kind} x{jax.device_count()}",
        "jax": jax.__version__,
        "preset": args.preset,
        "target_params": cfg.num_params(),
        "drafter_layers": args.drafter_layers,
        "slots_R": r,
        "gamma": g,
        "max_len": args.max_len,
        "dtype": cfg.dtype,
        "attention": dec.attention,
        "modelled_chip": None if chip is None else chip.name,
        "by_context": {},
    }
    floor = _floor_model(dec, dcfg.resolve(cfg), cfg) if chip is not None else None
    for ctx in contexts:
        # One decode state at a time (the profile keeps its own, donated round to round).
        fns = dec.profile_step_fns(ks, context_len=ctx)
        first = {}
        for b, fn in fns.items():  # the first call compiles (once: the context is data)
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            first[b] = time.perf_counter() - t0
        times = {b: sps_lib.median_seconds(fn, args.repeats, warmup=1) for b, fn in fns.items()}
        del fns
        entry = {
            "round_seconds_by_B": {str(b): t for b, t in times.items()},
            "first_call_seconds_by_B": {str(b): t for b, t in first.items()},
            "ratio_full_over_anchor_only": times[r * (g + 1)] / times[r],
        }
        if floor is not None:
            modelled = {b: floor(b - r, ctx, chip) for b in times}
            entry["modelled_seconds_by_B"] = {str(b): m["seconds"] for b, m in modelled.items()}
            entry["modelled_bound_by_B"] = {str(b): m["bound"] for b, m in modelled.items()}
            entry["modelled_ratio_full_over_anchor_only"] = (
                modelled[r * (g + 1)]["seconds"] / modelled[r]["seconds"]
            )
            entry["measured_over_modelled_by_B"] = {
                str(b): times[b] / modelled[b]["seconds"] for b in times
            }
        result["by_context"][str(ctx)] = entry
        _write_json(args.out, result)  # what is measured so far survives a later failure
        print(f"[verify_cost] context {ctx}: " + json.dumps(entry), flush=True)
    round_times = {int(b): t for b, t in result["by_context"][str(contexts[0])][
        "round_seconds_by_B"].items()}  # fmt: skip
    ratio_round = round_times[r * (g + 1)] / round_times[r]
    result["round_seconds_by_B"] = {str(b): t for b, t in round_times.items()}
    result["ratio_round_full_over_anchor_only"] = ratio_round
    _memory_stats(result)
    if args.no_anatomy:
        sps = sps_lib.SPSTable.from_seconds(round_times)
        result["sps_table"] = sps.to_json()
        _write_json(args.out, result)
        _write_md(args, result, sps, None)
        return result

    # --- anatomy at the full bucket and at K = 0 -----------------------------------------
    state = dec.init_state()
    state = state._replace(
        seq_len=jnp.full((r,), args.max_len // 2, jnp.int32),
        active=jnp.ones((r,), bool),
        remaining=jnp.full((r,), args.max_len, jnp.int32),
    )
    params = dec._params
    draft_fn = jax.jit(lambda p, s, k: dec._draft(p, s, k)[:3])
    key = jax.random.key(3)
    t_draft = sps_lib.median_seconds(lambda: draft_fn(params, state, key), args.repeats)
    tokens, _, conf = draft_fn(params, state, key)
    # Same draft from tap features re-projected over the whole context every round (what
    # the decoder did before it kept per-slot drafter K/V rows), side by side.
    t_draft_feats = None
    if not args.no_feature_draft:
        feats = jax.random.normal(
            jax.random.key(4), (r, args.max_len, len(dec.taps) * cfg.hidden_size), cfg.compute_dtype
        )

        @jax.jit
        def feature_draft_fn(p, s, k):
            out = drafter.apply(
                {"params": p[1]}, DraftContext(feats, s.seq_len), s.anchor, k, SamplingSettings(),
                dec._embed_fn(p[0]), dec._lm_head_fn(p[0]), method="draft",
            )  # fmt: skip
            return out.tokens, out.probs

        t_draft_feats = sps_lib.median_seconds(
            lambda: feature_draft_fn(params, state, key), args.repeats
        )
    survival = jnp.cumprod(conf, axis=1)
    table = jnp.ones((dec.table_len,), jnp.float32)
    sched_fn = jax.jit(lambda a, act, t: dec._schedule(a, act, r * g, t))
    t_sched = sps_lib.median_seconds(lambda: sched_fn(survival, state.active, table), args.repeats)
    # No donation in either (the decoder's own _plan/_commit donate the state): the same
    # state is reused for every timing.
    plan_fn = jax.jit(dec._plan_impl, static_argnums=(2,))
    verify_fn = jax.jit(dec._commit_impl, static_argnums=(3,))
    planned, plan = plan_fn(params, state, r * g)
    verify = {}
    for k in (0, r * g):
        p_k = plan._replace(lengths=jnp.full((r,), k // r, jnp.int32))
        verify[k] = sps_lib.median_seconds(
            lambda p_k=p_k, k=k: verify_fn(params, planned, p_k, k), args.repeats
        )
    ratio_verify = verify[r * g] / verify[0]

    # Host time of a round, measured directly (not a difference of device timings): the
    # time the host spends inside the calls that dispatch the plan and the commit, and in
    # fetching the round's outputs once they are ready. Device time is excluded by
    # blocking on the outputs before each host-side piece is timed.
    def host_round():
        t0 = time.perf_counter()
        st, pl = plan_fn(params, state, r * g)
        t1 = time.perf_counter()
        need = int(jax.device_get(pl.lengths).sum())
        t2 = time.perf_counter()
        _, out = verify_fn(params, st, pl, max(need, r * g))
        t3 = time.perf_counter()
        jax.block_until_ready(out)
        t4 = time.perf_counter()
        jax.device_get(out)
        t5 = time.perf_counter()
        return (t1 - t0) + (t3 - t2) + (t5 - t4), t5 - t0

    host_round()  # compile
    samples = [host_round() for _ in range(args.repeats)]
    t_host = statistics.median(s[0] for s in samples)
    t_round = statistics.median(s[1] for s in samples)

    # --- SPS table over the runner's default buckets --------------------------------------
    if args.budgets:
        sps = sps_lib.SPSTable.from_seconds(round_times)
    else:
        sps = sps_lib.profile_sps(dec.profile_step_fns(default_buckets(r, g)), repeats=args.repeats)
    result.update(
        verify_seconds={"B=R": verify[0], "B=R(g+1)": verify[r * g]},
        ratio_verify_full_over_anchor_only=ratio_verify,
        draft_seconds={"kv_cache": t_draft, "features_reprojected": t_draft_feats},
        anatomy_seconds={
            "draft": t_draft,
            "schedule": t_sched,
            "verify_commit": verify[r * g],
            "host": t_host,
            "round_total": t_round,
        },
        sps_table=sps.to_json(),
    )
    _write_json(args.out, result)
    _write_md(args, result, sps, result["anatomy_seconds"])
    return result


def _floor_model(dec, drafter_config, cfg):
    """``(K, context, chip) -> {"seconds", "bound"}``: the round the roofline models
    (``perf.roofline``): hand-counted flops at the chip's peak or the floor bytes at its HBM
    bandwidth, whichever is longer; the floor is every weight once plus each slot's target
    KV and drafter context up to ``context`` positions (their bytes per position read off
    the decode state's page pools)."""
    leaves = jax.tree.leaves
    weight_bytes = sum(x.nbytes for x in leaves(dec._params))
    state = jax.eval_shape(dec.init_state)
    positions = dec.num_pages * dec.config.page_size
    kv_per_pos = sum(x.size * x.dtype.itemsize for x in leaves(state.cache)) / positions
    ctx_per_pos = state.ctx_feats.size * state.ctx_feats.dtype.itemsize / positions
    r = dec.config.num_slots

    def model(k, context, chip):
        flops = round_flops_hand_count(cfg, drafter_config, slots=r, budget=k, context_len=context)[
            "total"
        ]
        nbytes = weight_bytes + r * context * (kv_per_pos + ctx_per_pos)
        compute_s = flops / (chip.bf16_tflops * 1e12)
        memory_s = nbytes / (chip.hbm_gb_per_s * 1e9)
        return {
            "seconds": max(compute_s, memory_s),
            "bound": "memory" if memory_s >= compute_s else "compute",
        }

    return model


def _memory_stats(result):
    """The device allocator's peak, where the backend reports one (GPU, TPU)."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # CPU clients may not implement it
        stats = {}
    if "peak_bytes_in_use" in stats:
        result["device_peak_bytes"] = int(stats["peak_bytes_in_use"])


def _write_json(path, result):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _write_md(args, result, sps, anatomy):
    r, g = args.slots, args.gamma
    lines = [
        f"# Verify cost ({args.preset}, R={r}, γ={g}, max_len={args.max_len}, "
        f"{result['machine']}, attention {result['attention']})",
        "",
        "Command: `python benchmarks/verify_cost.py "
        + " ".join(a for a in (args.argv or []))
        + "`",
        "",
    ]
    if anatomy is not None:
        verify, ratio = result["verify_seconds"], result["ratio_verify_full_over_anchor_only"]
        t_draft, feats = anatomy["draft"], result["draft_seconds"]["features_reprojected"]
        lines += [
            f"* verify+commit, B = R(γ+1) = {r * (g + 1)} vs B = R = {r}: "
            f"{verify['B=R(g+1)'] * 1e3:.2f} ms / {verify['B=R'] * 1e3:.2f} ms = **{ratio:.2f}×**",
            f"* whole round (draft+schedule+verify), same sizes: "
            f"**{result['ratio_round_full_over_anchor_only']:.2f}×**",
            f"* draft over the per-slot K/V cache: {t_draft * 1e3:.2f} ms"
            + (
                ""
                if feats is None
                else f" vs {feats * 1e3:.2f} ms re-projecting tap features over max_len = "
                f"{args.max_len} every round (**{feats / t_draft:.2f}×** slower)"
            ),
            "",
            "| piece | ms | share |",
            "|---|---|---|",
        ]
        tot = sum(anatomy[k] for k in ("draft", "schedule", "verify_commit", "host"))
        for name, key in (
            ("draft", "draft"),
            ("schedule", "schedule"),
            ("verify+commit", "verify_commit"),
            ("host (measured)", "host"),
        ):
            lines.append(f"| {name} | {anatomy[key] * 1e3:.2f} | {anatomy[key] / tot:.0%} |")
        lines.append("")
    chip = result.get("modelled_chip")
    head = "| context | B = R + K | round ms | first call s |"
    rule = "|---|---|---|---|"
    if chip:
        head += f" {chip} modelled ms (bound) | measured / modelled |"
        rule += "---|---|"
    lines += [
        "Whole rounds (draft + schedule + verify/commit), median of repeats; the first "
        "call includes compilation.",
        "",
        head,
        rule,
    ]
    for ctx, entry in result["by_context"].items():
        for b, t in entry["round_seconds_by_B"].items():
            row = f"| {ctx} | {b} | {t * 1e3:.2f} | {entry['first_call_seconds_by_B'][b]:.1f} |"
            if chip:
                m = entry["modelled_seconds_by_B"][b]
                row += (
                    f" {m * 1e3:.2f} ({entry['modelled_bound_by_B'][b]}) |"
                    f" {entry['measured_over_modelled_by_B'][b]:.2f} |"
                )
            lines.append(row)
    lines += ["", "SPS(R(γ+1)) / SPS(R), i.e. time(R) / time(R(γ+1)):", ""]
    for ctx, entry in result["by_context"].items():
        text = f"* context {ctx}: measured {1 / entry['ratio_full_over_anchor_only']:.2f}"
        if chip:
            text += f", {chip} modelled {1 / entry['modelled_ratio_full_over_anchor_only']:.2f}"
        lines.append(text)
    lines += [
        "",
        "SPS table (rounds/s, forced non-increasing): "
        + ", ".join(f"B={b}: {s:.1f}" for b, s in zip(sps.buckets, sps.sps)),
    ]
    if "device_peak_bytes" in result:
        lines.append(f"\nDevice peak memory: {result['device_peak_bytes'] / 2**30:.1f} GiB")
    md = args.out.rsplit(".", 1)[0] + ".md"
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
