"""Lower + compile time of the Qwen3 forward with abstract (unallocated) parameters.

    python benchmarks/compile_time.py [--presets tiny qwen3-4b] [--seq-len 128]

Parameters are ``jax.ShapeDtypeStruct``s from ``jax.eval_shape``, so nothing of model size
is allocated; the point is that ``nn.scan`` keeps compile time flat in depth. Writes
``benchmarks/results/compile_time.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax.models.presets import PRESETS
from dspark_jax.models.qwen3 import Qwen3

RESULTS = pathlib.Path(__file__).resolve().parent / "results" / "compile_time.json"


def measure(preset: str, seq_len: int, batch: int) -> dict:
    config = PRESETS[preset]
    model = Qwen3(config)
    dummy = jnp.zeros((1, 8), jnp.int32)
    abstract = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), dummy)["params"]))
    tokens = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    fn = jax.jit(lambda p, t: model.apply({"params": p}, t))
    t0 = time.perf_counter()
    lowered = fn.lower(abstract, tokens)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    return {
        "preset": preset,
        "params": config.num_params(),
        "layers": config.num_hidden_layers,
        "batch": batch,
        "seq_len": seq_len,
        "lower_s": round(t1 - t0, 3),
        "compile_s": round(t2 - t1, 3),
        "argument_bytes": getattr(mem, "argument_size_in_bytes", None),
        "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--presets", nargs="+", default=["tiny", "pycode-small", "qwen3-4b"])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    rows = [measure(p, args.seq_len, args.batch) for p in args.presets]
    out = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": rows}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    for r in rows:
        print(
            f"{r['preset']:>14}  layers={r['layers']:3d}  lower {r['lower_s']:.2f}s  compile {r['compile_s']:.2f}s"
        )


if __name__ == "__main__":
    main()
