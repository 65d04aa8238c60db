"""Serving benchmark (DESIGN §7, Figs. 7-8 analog): the real HTTP server on loopback,
N concurrent streaming clients, one arm at a time.

Arms: no speculation, MTP-1, fixed γ, static threshold, Algorithm 1 (prefix), dynamic
top-K (both with draft-aware rounds, the engine's default: a plain round when drafting
would not pay, ``sched.plain_rounds``), and dynamic top-K drafting every round (the
paper's scheduler as published). For every concurrency level each client sends requests back to back (bounded by
--requests-per-client and --time-limit); per request we record streamed tokens and wall
time, and the server's per-request statistics (τ, drafts verified per round).

Outputs in --out (default benchmarks/results/): serving.json (serving_t1.json with
--temperature 1) and three PNGs:
aggregate throughput vs concurrency, per-user tokens/s vs aggregate throughput, mean
verify budget per request vs concurrency. Absolute numbers only mean something on an
accelerator with the bundled models; on CPU compare arms by ratio.

    python benchmarks/serving.py --target assets/target --drafter assets/drafters/dspark \
        --mtp-drafter assets/drafters/mtp1
    python benchmarks/serving.py --quick        # tiny random models: proves the pipeline
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DATASETS = os.path.join(HERE, "..", "..", "shared", "eval_datasets")


def load_prompts(n: int) -> list[str]:
    """First turns of the eval sets, code blocks for code prompts (DESIGN §7)."""
    out = []
    for name in ("humaneval", "mbpp", "gsm8k", "mt-bench"):
        path = os.path.join(DATASETS, f"{name}.jsonl")
        if not os.path.isfile(path):
            continue
        with open(path) as f:
            for i, line in enumerate(f):
                if i >= n:
                    break
                turn = json.loads(line)["turns"][0]
                m = re.search(r"```(?:python)?\n(.*?)```", turn, re.S)
                out.append(m.group(1) if m else turn)
    if not out:
        raise SystemExit(
            f"no prompts found under {DATASETS} (humaneval/mbpp/gsm8k/mt-bench .jsonl, "
            "`turns[0]` the prompt; --quick runs without them)"
        )
    return out


def stdlib_prompts(n: int) -> list[str]:
    """``n`` code prompts cut from the running Python's standard library (each ``def``
    line and the two lines after it): --quick's prompts and tokenizer text where the eval
    sets are not beside the checkout (the tiny random models make any text as good)."""
    root = os.path.dirname(os.__file__)
    out = []
    for name in sorted(os.listdir(root)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("def ") and len(out) < n:
                out.append("\n".join(lines[i : i + 3]) + "\n")
        if len(out) >= n:
            break
    return out


async def run_level(
    url, model, prompts, concurrency, per_client, max_tokens, time_limit, temperature=0.0
):
    deadline = time.perf_counter() + time_limit
    records = []

    async def client_loop(cid, client):
        for j in range(per_client):
            if time.perf_counter() > deadline:
                return
            prompt = prompts[(cid * per_client + j) % len(prompts)]
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "stream": True,
            }
            t0 = time.perf_counter()
            final = None
            async with client.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    records.append({"status": r.status_code})
                    continue
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        obj = json.loads(line[6:])
                        if obj.get("choices") and obj["choices"][0]["finish_reason"]:
                            final = obj
            wall = time.perf_counter() - t0
            if final is None:
                records.append({"status": "no_final_chunk"})
                continue
            records.append(
                {
                    "status": 200,
                    "tokens": final["usage"]["completion_tokens"],
                    "seconds": wall,
                    "tau": final["dspark"]["accepted_length"],
                    "verified_per_round": final["dspark"]["verified_per_round"],
                }
            )

    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*(client_loop(c, client) for c in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in records if r["status"] == 200]
    tokens = sum(r["tokens"] for r in ok)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "ok": len(ok),
        "wall_seconds": wall,
        "aggregate_tokens_per_second": tokens / wall,
        "per_user_tokens_per_second": mean([r["tokens"] / r["seconds"] for r in ok]),
        "mean_tau": mean([r["tau"] for r in ok]),
        "mean_verify_budget_per_request": mean([r["verified_per_round"] for r in ok]),
    }


def build_arms(args):
    """``[(arm name, scheduler, models loader, plain rounds)]`` (plain rounds: None for
    the engine's default, False: every round drafts)."""
    from dspark_jax.serve.engine import load_models
    from dspark_jax.testing import tiny_random_models

    if args.quick:
        from dspark_jax.data.tokenizer_train import train_bpe_tokenizer

        texts = load_prompts(50) if os.path.isdir(DATASETS) else stdlib_prompts(200)
        tok = train_bpe_tokenizer(texts, vocab_size=320, out_path="/tmp/dspark_bench_tok")

        def models(kind):
            t, tp, d, dp = tiny_random_models(tok, kind, gamma=3, max_len=args.max_len)
            return t, tp, tok, d, dp, None

        ds = lambda: models("dspark")
        mtp = lambda: models("mtp1")
        base = lambda: models(None)
    else:
        cache = {}

        def load(drafter_dir):
            if drafter_dir not in cache:
                cache.clear()  # keep one model set in memory
                cache[drafter_dir] = load_models(args.target, drafter_dir)
            return cache[drafter_dir]

        ds = lambda: load(args.drafter)
        mtp = (lambda: load(args.mtp_drafter)) if args.mtp_drafter else None
        base = lambda: load(None)
    arms = [("no speculation", "none", base, None)]
    if mtp is not None:
        arms.append(("MTP-1", "fixed", mtp, None))
    arms += [
        ("fixed γ", "fixed", ds, None),
        ("static threshold", "threshold", ds, None),
        ("Algorithm 1", "prefix", ds, None),
        ("dynamic top-K", "topk", ds, None),
        ("top-K, always drafting", "topk", ds, False),
    ]
    if args.arms:
        keep = set(args.arms.split(","))
        arms = [a for a in arms if a[1] in keep or a[0] in keep]
    return arms


def cost_model(engine, per_round_repeats: int) -> dict:
    """What the serving simulator (``benchmarks/serving_sim.py --validate``) needs to replay
    this arm: the engine's shapes, the SPS table its scheduler used (profiled now, after the
    levels, for arms that do not profile at warm-up) and measured prefill seconds per
    compiled (rows, prompt bucket)."""
    from dspark_jax.engine.offline import profile_decoder_sps

    table = engine.sps_table
    if table is None:
        table = profile_decoder_sps(
            engine.decoder, engine.verify_buckets, repeats=per_round_repeats
        )
    return {
        "scheduler": engine.scheduler,
        "slots": engine.config.num_slots,
        "gamma": engine.gamma,
        "threshold": engine.config.threshold,
        "verify_buckets": list(engine.verify_buckets),
        "two_phase": engine.two_phase,
        "plain_rounds": engine.policy.plain_rounds,
        "prefill_batch": max(engine.prefill_rows),
        "sps": table.to_json(),
        "prefill_seconds": [
            {"rows": b, "bucket": t, "seconds": sec}
            for (b, t), sec in engine.profile_prefill(repeats=per_round_repeats).items()
        ],
    }


def results_stem(quick: bool, temperature: float) -> str:
    """``serving`` (greedy), ``serving_t1`` (T = 1), ``serving_quick``...: one file set per
    run kind, so a sampling run does not overwrite the greedy one."""
    stem = "serving_quick" if quick else "serving"
    return stem if temperature == 0 else f"{stem}_t{temperature:g}".replace(".", "p")


def plot(results, out_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {
        "serving_throughput.png": ("concurrency", "aggregate_tokens_per_second"),
        "serving_per_user.png": ("aggregate_tokens_per_second", "per_user_tokens_per_second"),
        "serving_verify_budget.png": ("concurrency", "mean_verify_budget_per_request"),
    }
    stem = results.get("stem") or results_stem(results["quick"], results.get("temperature", 0.0))
    prefix = stem + "_"
    for fname, (x, y) in figs.items():
        fname = fname.replace("serving_", prefix, 1)
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm, levels in results["arms"].items():
            ax.plot([lv[x] for lv in levels], [lv[y] for lv in levels], marker="o", label=arm)
        if x == "concurrency":
            ax.set_xscale("log", base=2)
        ax.set_xlabel(x.replace("_", " "))
        ax.set_ylabel(y.replace("_", " "))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        kind = "quick, random tiny models" if results["quick"] else "bundled"
        ax.set_title(f"serving ({kind}, T = {results.get('temperature', 0.0):g})")
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, fname), dpi=120)
        plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default=os.path.join(HERE, "..", "assets", "target"))
    p.add_argument("--drafter", default=os.path.join(HERE, "..", "assets", "drafters", "dspark"))
    p.add_argument("--mtp-drafter", default=None, help="MTP-1 drafter dir (arm skipped if unset)")
    p.add_argument("--quick", action="store_true", help="tiny random models, small levels")
    p.add_argument("--concurrency", default=None, help="comma list (default 1..64)")
    p.add_argument("--slots", type=int, default=None)
    p.add_argument("--max-len", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--requests-per-client", type=int, default=None)
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds per level")
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every request (0 = greedy; the drafters' confidences "
        "and STS are trained and fitted at T = 1)",
    )
    p.add_argument("--arms", default=None, help="comma list of schedulers/arm names to run")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument(
        "--stem",
        default=None,
        help="result file stem (default serving / serving_t1 / serving_quick...); e.g. "
        "serving_eagle3_t1 for a run of --drafter assets/drafters/eagle3",
    )
    args = p.parse_args(argv)
    q = args.quick
    levels = [
        int(c) for c in (args.concurrency or ("1,2,4" if q else "1,2,4,8,16,32,64")).split(",")
    ]
    args.slots = args.slots or (2 if q else 32)
    args.max_len = args.max_len or (64 if q else 1024)
    max_tokens = args.max_tokens or (8 if q else 128)
    per_client = args.requests_per_client or (2 if q else 4)
    if not q:
        for path in (args.target, args.drafter):
            if not os.path.isdir(path):
                raise SystemExit(f"{path} not found: pass --target/--drafter or use --quick")

    import jax

    from dspark_jax.models.fingerprint import weights_fingerprint
    from dspark_jax.perf.results import write_result
    from dspark_jax.serve.engine import Engine, EngineConfig
    from dspark_jax.serve.server import BackgroundServer, create_app

    prompts = load_prompts(40) if not q or os.path.isdir(DATASETS) else stdlib_prompts(160)
    if args.temperature < 0:
        raise SystemExit(f"--temperature must be >= 0, got {args.temperature}")
    results = {
        "quick": q,
        "slots": args.slots,
        "max_tokens": max_tokens,
        "temperature": args.temperature,
        "time_limit": args.time_limit,
        "requests_per_client": per_client,
        "arms": {},
    }
    stem = args.stem or results_stem(q, args.temperature)
    results["stem"] = stem
    results["drafter"] = None if q else os.path.relpath(args.drafter, os.path.dirname(HERE))
    fname = f"{stem}.json"
    for name, scheduler, loader, plain_rounds in build_arms(args):
        target, tp, tok, drafter, dp, sts = loader()
        if not q and "target_weights" not in results:  # summarize checks which models
            results["target_weights"] = weights_fingerprint(tp)
        if scheduler == "none":
            drafter = dp = None
        cfg = EngineConfig(
            num_slots=args.slots,
            max_len=args.max_len,
            scheduler=scheduler,
            max_queue=max(levels) * 2,
            verify_buckets=(args.slots,) if q else None,
            sps_repeats=2 if q else 5,
            model_name="bench",
            plain_rounds=plain_rounds,
        )
        t0 = time.perf_counter()
        engine = Engine(target, tp, tok, drafter, dp, cfg, sts=sts).start()
        warm = time.perf_counter() - t0
        # Prompts that fit the cache with room for the output.
        fit = [x for x in prompts if len(tok.encode(x)) <= args.max_len - max_tokens - 2]
        fit = fit or [x[: args.max_len // 4] for x in prompts]
        server = BackgroundServer(create_app(engine)).start()
        rows = []
        try:
            for c in levels:
                before = engine.stats.timeline()
                rounds_before = engine.stats.rounds
                kinds_before = dict(engine.policy.kind_counts)
                row = asyncio.run(
                    run_level(
                        server.url,
                        "bench",
                        fit,
                        c,
                        per_client,
                        max_tokens,
                        args.time_limit,
                        args.temperature,
                    )  # fmt: skip
                )
                # The engine thread's time in this level, by phase (engine.EngineStats).
                after = engine.stats.timeline()
                phases = ("dispatch_seconds", "device_wait_seconds", "host_seconds")
                spent = {k: after[k] - before[k] for k in phases + ("idle_seconds",)}
                busy = sum(spent[k] for k in phases)
                spent["host_share"] = (
                    (spent["dispatch_seconds"] + spent["host_seconds"]) / busy if busy else 0.0
                )
                spent["rounds"] = engine.stats.rounds - rounds_before
                # Rounds by kind: drafting, plain (the target alone), probes (sched.plain_rounds).
                row["round_kinds"] = {
                    k: v - kinds_before.get(k, 0) for k, v in engine.policy.kind_counts.items()
                }
                row["timeline"] = spent
                rows.append(row)
                print(
                    f"{name:<18} c={c:<3} agg {row['aggregate_tokens_per_second']:8.1f} tok/s  "
                    f"user {row['per_user_tokens_per_second']:7.1f} tok/s  τ {row['mean_tau']:.2f}"
                    f"  verify/round {row['mean_verify_budget_per_request']:.2f}  "
                    f"host {spent['host_share']:.1%}  ok {row['ok']}/{row['requests']}",
                    flush=True,
                )
        finally:
            server.stop()
            engine.shutdown()
        results["arms"][name] = rows
        # Read before cost_model, whose SPS profile compiles programs of its own.
        results.setdefault("compilations_during_load", {})[name] = engine.compilations_after_warmup
        results.setdefault("cost_model", {})[name] = cost_model(
            engine, per_round_repeats=2 if q else 5
        )
        results["prompt_tokens"] = [len(tok.encode(x)) for x in fit]
        results.setdefault("warmup_seconds", {})[name] = warm
        # Written after every arm, so a crash keeps the arms already measured; and each
        # engine's executables are dropped before the next arm compiles its own (six
        # engines' worth of JIT code in one process ran out of mappable memory once).
        write_result(os.path.join(args.out, fname), results, indent=1)
        del engine, server
        jax.clear_caches()
        gc.collect()
    plot(results, args.out)
    print(f"wrote {args.out}/{fname} and the PNGs next to it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
