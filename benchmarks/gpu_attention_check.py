"""The verify attention backends on the machine at hand: the Pallas GPU kernel
(``pallas_gpu``) against the XLA backend and jax's dense reference of the paged kernel,
then both timed on the serving round's verify shape.

    python benchmarks/gpu_attention_check.py --out benchmarks/results/gpu_attention_h200.json
    python benchmarks/gpu_attention_check.py --quick     # CPU, kernel interpreted (a check)

Correctness: Qwen3-8B's attention shape (32 query heads over 8 KV heads, head_dim 128,
pages of 16), ``--check-slots`` sequences with ragged query rows (0 to γ + 1, some empty) and
ragged lengths (0 to the whole table, one full), pages handed out in shuffled order, in
float32 and bfloat16; the largest absolute error of each backend against the reference.
Timing (bfloat16): R sequences × (γ + 1) query rows at each of ``--contexts`` positions,
median of repeats, ``pallas_gpu`` vs ``xla``. ``pallas_gpu_ok`` in the result says whether
the kernel ran and matched (``scripts/device_gpu_check.sh`` skips its pallas_gpu round if not).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.ops import paged_attention as pa
from dspark_jax.sched.sps import median_seconds

HERE = os.path.dirname(os.path.abspath(__file__))
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}  # XLA:GPU runs float32 dots in TF32


def make_case(rng, dtype, seqs, max_len, heads, kv_heads, d, page_size, gamma, kv_len=None):
    """Ragged query rows and lengths over a shuffled page pool (``kv_len``: every
    sequence at that length with γ + 1 rows, the serving round's verify)."""
    pages_per_seq = -(-max_len // page_size)
    total = 1 + seqs * pages_per_seq  # the null page + every sequence's pages
    if kv_len is None:
        q_lens = rng.integers(0, gamma + 2, seqs)
        q_lens[0] = 0
        kv_lens = np.maximum(q_lens, rng.integers(0, max_len + 1, seqs))
        kv_lens[-1] = max_len
        q_lens[-1] = gamma + 1
    else:
        q_lens = np.full(seqs, gamma + 1)
        kv_lens = np.full(seqs, kv_len)
    table = np.zeros((seqs, pages_per_seq), np.int32)
    shuffled = 1 + rng.permutation(total - 1)
    for s in range(seqs):
        n = -(-int(kv_lens[s]) // page_size)
        table[s, :n] = shuffled[s * pages_per_seq : s * pages_per_seq + n]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.normal(size=(int(cu[-1]), heads, d)).astype(np.float32)
    kv = rng.normal(size=(total, page_size, 2 * kv_heads, d)).astype(np.float32)
    layout = pa.RaggedLayout(
        jnp.asarray(cu), jnp.asarray(kv_lens.astype(np.int32)), jnp.asarray(table)
    )
    return jnp.asarray(q, dtype), jnp.asarray(kv, dtype), layout


def reference(q, kv, layout):
    """jax's dense reference of the paged kernel (pure jnp), or the XLA backend where this
    jax does not ship it."""
    try:
        from jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel import (
            ref_ragged_paged_attention,
        )
    except ImportError:
        return pa.ragged_attention(q, kv, layout, backend="xla"), "xla"
    num_seqs = jnp.array([layout.kv_lens.shape[0]], jnp.int32)
    out = ref_ragged_paged_attention(
        q, kv, layout.kv_lens, layout.page_table, layout.cu_q_lens, num_seqs,
        sm_scale=q.shape[-1] ** -0.5,
    )  # fmt: skip
    return out, "ref_ragged_paged_attention"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slots", type=int, default=64, help="sequences in the timed verify")
    ap.add_argument("--check-slots", type=int, default=16, help="sequences in the check")
    ap.add_argument("--gamma", type=int, default=7)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--contexts", default="2048,4080")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU, interpreted)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu_attention_check.json"))
    args = ap.parse_args(argv)
    heads, kv_heads, d, page_size = 32, 8, 128, 16
    if args.quick:
        heads, kv_heads, d, page_size = 4, 2, 16, 4
        args.slots, args.check_slots, args.max_len = 4, 4, 24
        args.contexts, args.repeats = "16", 2
    rng = np.random.default_rng(0)
    dev = jax.devices()[0]
    result = {
        "device": f"{dev.platform} {dev.device_kind}",
        "jax": jax.__version__,
        "shape": {"heads": heads, "kv_heads": kv_heads, "head_dim": d, "page_size": page_size},
        "slots": args.slots,
        "gamma": args.gamma,
        "max_len": args.max_len,
        "errors": {},
        "tolerance": TOLERANCE,
    }
    ok = True
    for dtype in ("float32", "bfloat16"):
        q, kv, layout = make_case(
            rng, jnp.dtype(dtype), args.check_slots, args.max_len, heads, kv_heads, d,
            page_size, args.gamma,
        )  # fmt: skip
        ref, ref_name = reference(q, kv, layout)
        result["reference"] = ref_name
        n = int(layout.cu_q_lens[-1])
        errs = {}
        for backend in ("xla", "pallas_gpu"):
            try:
                out = pa.ragged_attention(q, kv, layout, backend=backend)
                err = float(jnp.max(jnp.abs(out[:n].astype(jnp.float32) - ref.astype(jnp.float32))))
                errs[backend] = err
                if backend == "pallas_gpu" and not err <= TOLERANCE[dtype]:
                    ok = False
            except Exception as e:  # the kernel failing to compile or run is a result here
                errs[backend] = f"{type(e).__name__}: {e}"[:2000]
                traceback.print_exc()
                if backend == "pallas_gpu":
                    ok = False
        result["errors"][dtype] = errs
        print(f"[gpu_attention_check] {dtype}: max |error| vs {ref_name}: {errs}", flush=True)
    result["pallas_gpu_ok"] = ok
    _write(args.out, result)

    result["verify_ms"] = {}
    for ctx in (int(c) for c in args.contexts.split(",")):
        q, kv, layout = make_case(
            rng, jnp.bfloat16, args.slots, args.max_len, heads, kv_heads, d, page_size,
            args.gamma, kv_len=ctx,
        )  # fmt: skip
        row = {}
        for backend in ("xla", "pallas_gpu") if ok else ("xla",):
            fn = jax.jit(lambda q, kv, lay, b=backend: pa.ragged_attention(q, kv, lay, backend=b))
            t0 = time.perf_counter()
            jax.block_until_ready(fn(q, kv, layout))
            row[f"{backend}_first_call_s"] = time.perf_counter() - t0
            call = functools.partial(fn, q, kv, layout)
            row[backend] = 1e3 * median_seconds(call, args.repeats)
        # The bytes a pass must read: each sequence's K and V up to its length, once.
        row["kv_bytes"] = args.slots * ctx * 2 * kv_heads * d * 2
        result["verify_ms"][str(ctx)] = row
        print(f"[gpu_attention_check] context {ctx}: {row}", flush=True)
        _write(args.out, result)
    return result


def _write(path, result):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
