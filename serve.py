"""Serve the bundled (or any) target + drafter over an OpenAI-compatible HTTP API.

    python serve.py                       # assets/target + assets/drafters/dspark, 127.0.0.1:8000
    python serve.py --drafter none        # no speculation
    python serve.py --scheduler prefix --slots 16 --port 8080
    python serve.py --demo                # no speculation vs DSpark on HumanEval prompts

Endpoints: POST /v1/completions (stream=true for SSE), GET /v1/models, GET /health,
GET /metrics. SIGTERM/Ctrl-C drains in-flight requests, then exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TARGET = os.path.join(HERE, "assets", "target")
DEFAULT_DRAFTER = os.path.join(HERE, "assets", "drafters", "dspark")
HUMANEVAL = os.path.join(HERE, "..", "shared", "eval_datasets", "humaneval.jsonl")
FALLBACK_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n",
    'def parse_header(line):\n    """Split an HTTP header line into name and value."""\n',
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--target", default=DEFAULT_TARGET, help="Hugging Face Qwen3 directory")
    p.add_argument(
        "--drafter", default=DEFAULT_DRAFTER, help="drafter directory, or 'none' (no speculation)"
    )
    p.add_argument(
        "--scheduler",
        default="topk",
        choices=["none", "fixed", "threshold", "prefix", "topk"],
        help="verification scheduler (DESIGN §5.3); default: dynamic top-K",
    )
    p.add_argument("--threshold", type=float, default=0.5, help="static-threshold arm")
    p.add_argument("--slots", type=int, default=8, help="decode slots (max concurrent requests)")
    p.add_argument("--max-len", type=int, default=512, help="cache positions per request")
    p.add_argument("--max-queue", type=int, default=256, help="admission queue bound (429)")
    p.add_argument(
        "--prefill-batch", type=int, default=4, help="requests prefilled together in one call"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="name reported by /v1/models")
    p.add_argument(
        "--sps-cache",
        default=os.path.join(os.path.expanduser("~"), ".cache", "dspark_jax", "sps.json"),
        help="SPS profile cache (JSON)",
    )
    p.add_argument("--demo", action="store_true", help="side-by-side demo, then exit")
    p.add_argument("--demo-prompts", type=int, default=4)
    p.add_argument("--demo-tokens", type=int, default=96)
    args = p.parse_args(argv)
    for flag, low in (("slots", 1), ("max_len", 4), ("max_queue", 1), ("prefill_batch", 1)):
        if getattr(args, flag) < low:
            p.error(f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}")
    return args


def _check_paths(args) -> str | None:
    if not os.path.isdir(args.target):
        raise SystemExit(
            f"error: target model directory {args.target} not found. The bundled models are "
            "built by train.py (see README); or pass --target DIR (a Hugging Face Qwen3 "
            "directory with tokenizer.json)."
        )
    if args.drafter in (None, "", "none"):
        return None
    if not os.path.isdir(args.drafter):
        raise SystemExit(
            f"error: drafter directory {args.drafter} not found. Pass --drafter DIR, or "
            "--drafter none to serve without speculation."
        )
    return args.drafter


def build_engine(args, drafter_dir, scheduler, models=None):
    from dspark_jax.serve.engine import Engine, EngineConfig, load_models

    target, tp, tok, drafter, dp, sts = models or load_models(args.target, drafter_dir)
    if drafter is None:
        scheduler = "none"
    elif scheduler == "none":
        drafter = dp = sts = None  # no drafter: its STS temperatures go with it
    elif drafter.config.kind != "dspark" and scheduler in ("threshold", "prefix", "topk"):
        scheduler = "fixed"  # schedulers need a confidence head
    name = args.model_name or os.path.basename(os.path.normpath(args.target))
    cfg = EngineConfig(
        num_slots=args.slots,
        max_len=args.max_len,
        scheduler=scheduler,
        max_queue=args.max_queue,
        prefill_batch=args.prefill_batch,
        threshold=args.threshold,
        sps_cache=args.sps_cache,
        model_name=name,
    )
    return Engine(target, tp, tok, drafter, dp, cfg, sts=sts).start()


def humaneval_prompts(path: str, n: int) -> list[str]:
    """First turn of each record, formatted as code: the fenced code block (DESIGN §7)."""
    if not os.path.isfile(path):
        # Checkouts without ../shared still get a demo: a few code prompts of our own.
        print(f"note: {path} not found; using built-in code prompts", file=sys.stderr)
        return FALLBACK_PROMPTS[:n]
    out = []
    with open(path) as f:
        for line in f:
            turn = json.loads(line)["turns"][0]
            m = re.search(r"```(?:python)?\n(.*?)```", turn, re.S)
            out.append(m.group(1) if m else turn)
            if len(out) == n:
                break
    return out


def demo(args) -> int:
    from dspark_jax.serve.engine import SamplingParams, load_models

    drafter_dir = _check_paths(args)
    if drafter_dir is None:
        raise SystemExit("error: --demo compares against DSpark; give a --drafter directory")
    models = load_models(args.target, drafter_dir)
    prompts = humaneval_prompts(HUMANEVAL, args.demo_prompts)
    # Greedy shows losslessness (identical outputs); T = 1 is the regime the drafters were
    # trained for (the small bundled target's greedy text falls into loops, see BENCHMARKS.md).
    temps = (0.0, 1.0)
    rows = {}
    for label, sched in (("no speculation", "none"), ("DSpark", args.scheduler)):
        engine = build_engine(args, drafter_dir, sched, models)
        for temp in temps:
            t0 = time.perf_counter()
            results = [  # one request at a time; seeded, so each T = 1 sample is reproducible
                engine.generate(p, SamplingParams(max_tokens=args.demo_tokens, temperature=temp,
                                                  seed=i))
                for i, p in enumerate(prompts)
            ]  # fmt: skip
            wall = time.perf_counter() - t0
            tokens = sum(r.completion_tokens for r in results)
            rounds = sum(r.rounds for r in results)
            rows[label, temp] = (sched, tokens / max(rounds, 1), tokens / wall, results)
        engine.shutdown()
    print(f"\n{'arm':<16}{'scheduler':<11}{'T':>4}{'tau':>7}{'tok/s':>10}{'speedup':>9}")
    for temp in temps:
        base = rows["no speculation", temp][2]
        for label in ("no speculation", "DSpark"):
            sched, tau, tps, _ = rows[label, temp]
            print(f"{label:<16}{sched:<11}{temp:>4g}{tau:>7.2f}{tps:>10.1f}{tps / base:>8.2f}x")
    greedy = [rows[label, 0.0][3] for label in ("no speculation", "DSpark")]
    same = all(a.token_ids == b.token_ids for a, b in zip(*greedy))
    print(f"\ngreedy outputs identical: {same}")
    sample = rows["DSpark", 1.0][3][0].text
    print(f"\n--- first prompt ---\n{prompts[0]}--- DSpark output (T = 1) ---\n{sample}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.demo:
        return demo(args)
    drafter_dir = _check_paths(args)
    from dspark_jax.serve.server import create_app, make_server

    engine = build_engine(args, drafter_dir, args.scheduler)
    app = create_app(engine)
    print(f"serving {engine.config.model_name} on http://{args.host}:{args.port}", flush=True)
    make_server(app, args.host, args.port).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
