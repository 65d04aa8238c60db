"""Verify-step cost vs verify budget K, the profiled SPS table, and the anatomy of a round.

    python benchmarks/verify_cost.py [--preset pycode-small] [--slots 8] [--gamma 7]

On an accelerator, e.g. an H200 with a random-weight Qwen3-8B in bf16 (the kernels issue's
measured SPS(B) beside the roofline's modelled one):

    python benchmarks/verify_cost.py --preset qwen3-8b --dtype bfloat16 --slots 64 \
        --max-len 4096 --drafter-layers 5 --budgets 0,112,224,336,448 --no-feature-draft \
        --out benchmarks/results/verify_cost_h200.json

A random-weight target (cost does not depend on the weights) and a random DSpark drafter.
For each K in 0…R·γ the decoder's own compiled verify+commit (R + K packed rows) is timed
(median of repeats). Reports time(R + K = R·(γ+1)) / time(R + K = R) — how much the verify
of a full block costs over verifying only the anchors — and the step anatomy: draft,
schedule, verify(+commit) and host share of a round, each timed as its own jitted function
side by side. Writes ``benchmarks/results/verify_cost.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
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
    ap.add_argument("--out", default=os.path.join(HERE, "results", "verify_cost.json"))
    args = ap.parse_args(argv)

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
    fns = dec.profile_step_fns(ks)  # whole rounds (draft+schedule+verify); split below
    round_times = {b: sps_lib.median_seconds(fn, args.repeats) for b, fn in fns.items()}
    ratio_round = round_times[r * (g + 1)] / round_times[r]

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
    buckets = ks if args.budgets else default_buckets(r, g)
    sps = sps_lib.profile_sps(dec.profile_step_fns(buckets), repeats=args.repeats)

    result = {
        "machine": f"{platform.machine()} {jax.devices()[0].device_kind} x{jax.device_count()}",
        "jax": jax.__version__,
        "preset": args.preset,
        "target_params": cfg.num_params(),
        "slots_R": r,
        "gamma": g,
        "max_len": args.max_len,
        "dtype": cfg.dtype,
        "attention": dec.attention,
        "round_seconds_by_B": {str(b): t for b, t in round_times.items()},
        "ratio_round_full_over_anchor_only": ratio_round,
        "verify_seconds": {"B=R": verify[0], "B=R(g+1)": verify[r * g]},
        "ratio_verify_full_over_anchor_only": ratio_verify,
        "draft_seconds": {"kv_cache": t_draft, "features_reprojected": t_draft_feats},
        "anatomy_seconds": {
            "draft": t_draft,
            "schedule": t_sched,
            "verify_commit": verify[r * g],
            "host": t_host,
            "round_total": t_round,
        },
        "sps_table": sps.to_json(),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    md = args.out.rsplit(".", 1)[0] + ".md"
    tot = t_draft + t_sched + verify[r * g] + t_host
    lines = [
        f"# Verify cost ({args.preset}, R={r}, γ={g}, max_len={args.max_len}, {result['machine']})",
        "",
        f"* verify+commit, B = R(γ+1) = {r * (g + 1)} vs B = R = {r}: "
        f"{verify[r * g] * 1e3:.2f} ms / {verify[0] * 1e3:.2f} ms = **{ratio_verify:.2f}×**",
        f"* whole round (draft+schedule+verify), same sizes: **{ratio_round:.2f}×**",
        f"* draft over the per-slot K/V cache: {t_draft * 1e3:.2f} ms"
        + (
            ""
            if t_draft_feats is None
            else f" vs {t_draft_feats * 1e3:.2f} ms re-projecting tap features over max_len = "
            f"{args.max_len} every round (**{t_draft_feats / t_draft:.2f}×** slower)"
        ),
        "",
        "| piece | ms | share |",
        "|---|---|---|",
        *(
            f"| {n} | {t * 1e3:.2f} | {t / tot:.0%} |"
            for n, t in (
                ("draft", t_draft),
                ("schedule", t_sched),
                ("verify+commit", verify[r * g]),
                ("host (measured)", t_host),
            )
        ),
        "",
        "| B = R + K | round ms |",
        "|---|---|",
        *(f"| {b} | {t * 1e3:.2f} |" for b, t in round_times.items()),
        "",
        "SPS table (rounds/s, forced non-increasing): "
        + ", ".join(f"B={b}: {s:.1f}" for b, s in zip(sps.buckets, sps.sps)),
    ]
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
