"""Decode-state memory vs the KV page pool: memory follows the tokens a server holds, not
slots × max_len.

    python benchmarks/kv_memory.py      # 16 slots × 1024 positions, pycode-small + DSpark

For pools sized to hold 1/8, 1/4, 1/2 and all of ``slots × max_len`` tokens it builds the
decoder's state and compiles its fused round (CPU, jit ``.lower().compile()``), and
reports the bytes of the target's KV pool, of the drafter's context K/V (pages of the same
table), of the rest of the state (per-slot rows: tokens, lengths), and XLA's memory plan of the round
(arguments, temporaries). Random weights: sizes do not depend on them. Writes
``benchmarks/results/kv_memory.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HERE = os.path.dirname(os.path.abspath(__file__))


def _bytes(tree) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def run(args) -> dict:
    import jax

    from dspark_jax.decode.pages import full_pool_pages
    from dspark_jax.decode.step import SpeculativeDecoder, StepConfig
    from dspark_jax.models.drafters import DrafterConfig, init_drafter_params, make_drafter
    from dspark_jax.models.presets import get_preset
    from dspark_jax.models.qwen3 import Qwen3

    tcfg = get_preset(args.preset)
    target = Qwen3(tcfg)
    abstract = jax.eval_shape(
        lambda k: target.init(k, jax.numpy.zeros((1, 8), "int32"))["params"], jax.random.key(0)
    )
    dcfg = DrafterConfig(kind="dspark", gamma=args.gamma, mask_token_id=tcfg.vocab_size - 1)
    drafter = make_drafter(dcfg.resolve(tcfg), tcfg)
    d_abstract = jax.eval_shape(lambda k: init_drafter_params(drafter, k), jax.random.key(1))
    unbox = jax.tree.map(lambda x: getattr(x, "value", x), (abstract, d_abstract),
                         is_leaf=lambda x: hasattr(x, "value"))  # fmt: skip
    # Every slot at max_len, plus the γ positions a draft block writes past it.
    full = full_pool_pages(args.slots, args.max_len + args.gamma, args.page_size)
    rows = []
    for fraction in (0.125, 0.25, 0.5, 1.0):
        pages = max(2, round((full - 1) * fraction) + 1)
        dec = SpeculativeDecoder(
            target, unbox[0], drafter, unbox[1],
            StepConfig(num_slots=args.slots, max_len=args.max_len, page_size=args.page_size,
                       num_pages=pages),
        )  # fmt: skip
        state = jax.eval_shape(dec.init_state)
        compiled = dec._round.lower(dec._params, state, dec.full_budget).compile()
        mem = compiled.memory_analysis()
        kv = _bytes(state.cache)
        ctx = _bytes(state.ctx_feats)
        rows.append({
            "pool_fraction": fraction,
            "kv_pages": pages,
            "pool_tokens": (pages - 1) * args.page_size,
            "kv_pool_bytes": kv,
            "drafter_context_bytes": ctx,
            "other_state_bytes": _bytes(state) - kv - ctx,
            "argument_bytes": int(mem.argument_size_in_bytes),
            "temp_bytes": int(mem.temp_size_in_bytes),
        })  # fmt: skip
        print(f"[kv_memory] pool {fraction:.3f}: KV {kv / 2**20:.1f} MiB, drafter context "
              f"{ctx / 2**20:.1f} MiB, temp "
              f"{mem.temp_size_in_bytes / 2**20:.1f} MiB", flush=True)  # fmt: skip
    return {
        "command": "python benchmarks/kv_memory.py " + " ".join(sys.argv[1:]),
        "preset": args.preset,
        "slots": args.slots,
        "max_len": args.max_len,
        "page_size": args.page_size,
        "gamma": args.gamma,
        "backend": jax.default_backend(),
        "rows": rows,
    }


def markdown(res: dict) -> str:
    mib = 2**20
    lines = [
        f"# Decode-state memory vs the KV page pool ({res['preset']} + DSpark γ = "
        f"{res['gamma']}, {res['slots']} slots × {res['max_len']} positions, pages of "
        f"{res['page_size']}, {res['backend']})",
        "",
        f"Produced by `{res['command']}`. The target's KV and the drafter's context K/V "
        "share one page table, so both follow the pool (the tokens in use); the rest of the "
        "state is per-slot rows (tokens, lengths, keys).",
        "",
        "| pool (share of slots × (max_len + γ)) | pool tokens | KV pool MiB | drafter context "
        "MiB | rest of state MiB | round arguments MiB | round temporaries MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['pool_fraction']:.3f} | {r['pool_tokens']} | {r['kv_pool_bytes'] / mib:.1f} | "
            f"{r.get('drafter_context_bytes', 0) / mib:.1f} | "
            f"{r['other_state_bytes'] / mib:.1f} | {r['argument_bytes'] / mib:.1f} | "
            f"{r['temp_bytes'] / mib:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from dspark_jax.cli import run_main

    def cli(args):
        res = run(args)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(res, f, indent=2)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(res))
        print(f"wrote {args.out}.json and .md")

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="pycode-small")
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--out", default=os.path.join(HERE, "results", "kv_memory"))
    return run_main(lambda: cli(p.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
