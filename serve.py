"""Serve the bundled (or any) target + drafter over an OpenAI-compatible HTTP API.

    python serve.py                       # assets/target + assets/drafters/dspark, 127.0.0.1:8000
    python serve.py --drafter none        # no speculation
    python serve.py --scheduler prefix --slots 16 --port 8080
    python serve.py --demo                # no speculation vs DSpark, greedy and T = 1
    python serve.py --api-key KEY         # /v1/* needs "Authorization: Bearer KEY"
                                          # (or set DSPARK_API_KEY)

Endpoints: POST /v1/completions and /v1/chat/completions (the target's chat template;
stream=true for SSE), GET /v1/models, GET /health (503
"starting" while the engine compiles at start-up), GET /metrics. SIGTERM/Ctrl-C drains
in-flight requests, then exits (status 0 after a SIGTERM drain). Bad arguments (a busy
port too) print "error: ..." and exit with status 2. The context length (--max-len)
defaults to the target's max_position_embeddings, capped by memory; start-up says which.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import sys
import time

from dspark_jax.cli import add_survival_estimator_argument
from dspark_jax.decode.mesh import add_mesh_arguments, mesh_from_args

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TARGET = os.path.join(HERE, "assets", "target")
DEFAULT_DRAFTER = os.path.join(HERE, "assets", "drafters", "dspark")
HUMANEVAL = os.path.join(HERE, "..", "shared", "eval_datasets", "humaneval.jsonl")
# Spelled out here so --help imports no jax (tests/serve/test_serve_cli.py checks they agree with
# dspark_jax.serve.server).
API_KEY_ENV = "DSPARK_API_KEY"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_REQUEST_TOKENS = 65536
# --max-len default: the share of free device memory the KV caches may take, and the cap
# on a CPU (where a long cache makes every round slow, not only big).
KV_MEMORY_FRACTION = 0.5
CPU_MAX_LEN = 2048
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
    add_survival_estimator_argument(p)
    p.add_argument(
        "--scheduler",
        default="topk",
        choices=["none", "fixed", "threshold", "prefix", "topk"],
        help="verification scheduler; default: dynamic top-K (the load-aware production "
        "scheduler; python -m dspark_jax.generate defaults to fixed, every draft verified)",
    )
    p.add_argument("--threshold", type=float, default=0.5, help="static-threshold arm")
    p.add_argument(
        "--plain-rounds",
        choices=("auto", "on", "off"),
        default="auto",
        help="run a plain round (the target alone, no draft) when drafting would not pay on "
        "the newest confidences; probes keep speculation alive (auto: on for topk and "
        "prefix; off: every round drafts, as in the paper)",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=None,
        help="decode slots (max concurrent requests); default 8, and 1 for --demo",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=None,
        help="cache positions per request (prompt + completion; the context length). "
        "Default: the target's max_position_embeddings, capped so every slot's KV cache "
        f"fits in {int(100 * KV_MEMORY_FRACTION)}%% of the device memory left after the "
        f"weights (and at {CPU_MAX_LEN} on a CPU); start-up says the value chosen and why",
    )
    p.add_argument("--max-queue", type=int, default=256, help="admission queue bound (429)")
    p.add_argument("--page-size", type=int, default=16, help="KV cache positions per page")
    p.add_argument(
        "--kv-pages",
        type=int,
        default=None,
        help="KV page pool size incl. the null page (default: every slot at --max-len); "
        "requests wait in the queue while it is full",
    )
    p.add_argument(
        "--attention",
        # ops.paged_attention.ATTENTION_BACKENDS, spelled out so --help imports no jax
        # (tests/serve/test_serve_cli.py checks they agree)
        choices=("auto", "xla", "pallas_tpu", "pallas_gpu"),
        default="auto",
        help="verify attention backend (auto: the TPU kernel on TPU, the Pallas GPU kernel "
        "on GPU, XLA elsewhere)",
    )
    p.add_argument(
        "--prefill-batch", type=int, default=4, help="requests prefilled together in one call"
    )
    p.add_argument(
        "--seeded-verification",
        default=None,
        choices=["coupled", "standard"],
        help="requests with a seed: coupled (the server's default; output identical whatever "
        "the load and scheduler) or standard rejection sampling (accepts more drafts; the "
        "--demo default: its seeded requests run one at a time on an idle engine)",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=20,
        help="most logprobs alternatives a request may ask for (0: each token's own only)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="weights and compute dtype of target and drafter (default: float32, as the "
        "loaders read them)",
    )
    add_mesh_arguments(p)
    p.add_argument(
        "--verify-buckets",
        default=None,
        metavar="K1,K2,...",
        help="compiled verify budgets (draft tokens verified per round over all slots; the "
        "full budget R·γ is always added). Default: a ladder up to R·γ; fewer compile faster",
    )
    p.add_argument(
        "--peer-timeout",
        type=float,
        default=30.0,
        help="several processes: seconds without another process's heartbeat before this "
        "one gives up (the leader answers 503, reports the failure on /health and exits "
        "with status 3; a follower exits with status 3)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer <key>' on every /v1/* route (401 otherwise; "
        f"/health and /metrics stay open). Default: ${API_KEY_ENV} if set, else no key",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    p.add_argument(
        "--max-request-tokens",
        type=int,
        default=DEFAULT_MAX_REQUEST_TOKENS,
        help="most tokens one request may ask to generate, n x max_tokens (over every "
        f"prompt of a list); more is a 400 naming the bound (default "
        f"{DEFAULT_MAX_REQUEST_TOKENS})",
    )
    p.add_argument("--model-name", default=None, help="name reported by /v1/models")
    p.add_argument(
        "--sps-cache",
        default=None,
        help="SPS profile cache (JSON; default ~/.cache/dspark_jax/sps.json)",
    )
    p.add_argument(
        "--compile-cache",
        default=None,
        help="JAX persistent compilation cache directory, so a restart does not compile "
        "again (default ~/.cache/dspark_jax/jax_cache)",
    )
    p.add_argument(
        "--no-compile-cache", action="store_true", help="compile every shape at every start"
    )
    p.add_argument("--demo", action="store_true", help="side-by-side demo, then exit")
    p.add_argument("--demo-prompts", type=int, default=4, help="number of demo prompts")
    p.add_argument("--demo-tokens", type=int, default=96, help="new tokens per demo prompt")
    p.add_argument(
        "--demo-prompts-file",
        default=None,
        help="JSONL prompts for --demo ('turns' lists; default: a humaneval.jsonl in "
        "../shared/eval_datasets beside the checkout if present, else built-in prompts)",
    )
    args = p.parse_args(argv)
    if args.slots is None:
        args.slots = 1 if args.demo else 8
    if args.seeded_verification is None:
        args.seeded_verification = "standard" if args.demo else "coupled"
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    if args.api_key is not None and not args.api_key.strip():
        p.error("--api-key is empty")
    if not 0 < args.port < 65536:
        p.error(f"--port must be in [1, 65535], got {args.port}")
    checks = (
        ("slots", 1),
        ("max_len", 4),
        ("max_body_bytes", 1),
        ("max_request_tokens", 1),
        ("max_queue", 1),
        ("prefill_batch", 1),
        ("max_logprobs", 0),
        ("demo_prompts", 1),
        ("demo_tokens", 1),
    )
    for flag, low in checks:
        if getattr(args, flag) is not None and getattr(args, flag) < low:
            p.error(f"--{flag.replace('_', '-')} must be >= {low}, got {getattr(args, flag)}")
    return args


def _check_paths(args) -> str | None:
    """The drafter directory (None: no speculation); raises a user error naming what is
    wrong with ``--target`` / ``--drafter``."""
    if not os.path.isdir(args.target):
        bundled = "" if args.target == DEFAULT_TARGET else f" (the bundled one is {DEFAULT_TARGET})"
        raise FileNotFoundError(
            f"--target {args.target}: no such directory. Pass a Hugging Face Qwen3 directory "
            f"(config.json, model.safetensors, tokenizer.json){bundled}."
        )
    from dspark_jax.models.drafter_io import drafter_dir_error, is_drafter_dir

    if is_drafter_dir(args.target):
        raise drafter_dir_error(args.target)
    if args.drafter in (None, "", "none"):
        return None
    if not os.path.isdir(args.drafter):
        raise FileNotFoundError(
            f"--drafter {args.drafter}: no such directory. Pass a drafter directory "
            f"(drafter_config.json + model.safetensors; bundled ones are under "
            f"{os.path.dirname(DEFAULT_DRAFTER)}), or --drafter none to serve without "
            "speculation."
        )
    return args.drafter


def build_engine(args, drafter_dir, scheduler, models=None):
    """An engine for these arguments, not yet started (``engine.start()`` warms it up)."""
    from dspark_jax.sched.sps import default_cache_path
    from dspark_jax.serve.engine import Engine, EngineConfig, load_models

    mesh = mesh_from_args(args)
    models = models or load_models(
        args.target,
        drafter_dir,
        dtype=getattr(args, "dtype", None),
        mesh=mesh,
        survival_estimator=getattr(args, "survival_estimator", None),
    )
    if args.max_len is None:
        choose_max_len(args, models)
    target, tp, tok, drafter, dp, sts = models
    if drafter is None:
        scheduler = "none"
    elif scheduler == "none":
        drafter = dp = sts = None  # no drafter: its STS temperatures go with it
    name = args.model_name or os.path.basename(os.path.normpath(args.target))
    cfg = EngineConfig(
        num_slots=args.slots,
        max_len=args.max_len,
        scheduler=scheduler,
        max_queue=args.max_queue,
        prefill_batch=args.prefill_batch,
        seeded_verification=args.seeded_verification,
        max_logprobs=args.max_logprobs,
        threshold=args.threshold,
        page_size=args.page_size,
        kv_pages=args.kv_pages,
        attention=args.attention,
        sps_cache=args.sps_cache or default_cache_path(),
        model_name=name,
        verify_buckets=_buckets(getattr(args, "verify_buckets", None)),
        plain_rounds=_plain_rounds(getattr(args, "plain_rounds", "auto"), scheduler),
    )
    return Engine(target, tp, tok, drafter, dp, cfg, sts=sts, mesh=mesh)


def _plain_rounds(choice: str, scheduler: str) -> bool | None:
    """``--plain-rounds`` as ``EngineConfig.plain_rounds``: ``on`` needs a scheduler with
    confidences to decide on (topk, prefix), ``auto`` is the policy's default."""
    if choice == "auto":
        return None
    if choice == "on" and scheduler not in ("topk", "prefix"):
        raise ValueError(
            f"--plain-rounds on decides from the drafter's confidences: it needs --scheduler "
            f"topk or prefix and a DSpark drafter (the scheduler here is {scheduler!r})"
        )
    return choice == "on"


def _buckets(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise ValueError(
            f"--verify-buckets must be comma-separated integers (e.g. 8,16,32), got {text!r}"
        ) from None


def find_demo_prompts(path: str | None) -> str | None:
    """The demo's prompt file: ``path``, else a HumanEval JSONL in the development layout
    (``../shared/eval_datasets`` beside the checkout) if present, else None (built-in)."""
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--demo-prompts-file {path}: no such file")
        return path
    return HUMANEVAL if os.path.isfile(HUMANEVAL) else None


def demo_prompts(path: str | None, n: int) -> tuple[list[str], str]:
    """``(prompts, description)``: the first ``n`` records of a JSONL prompt file rendered
    for a base code model (a fenced code block is extracted, as ``dspark_jax.eval`` does),
    or the built-in code prompts when there is no file."""
    from dspark_jax.eval.prompts import load_prompts

    if path is None:
        return FALLBACK_PROMPTS[:n], f"{min(n, len(FALLBACK_PROMPTS))} built-in code prompts"
    prompts = [p.formatted for p in load_prompts(path, n)]
    return prompts, f"the first {len(prompts)} prompts of {os.path.normpath(path)}"


def _readable(text: str, max_lines: int = 12) -> str:
    """A continuation as a reader can take it in: a run of 4+ newlines (blank lines) shown
    as one ``[N newlines]`` marker, at most ``max_lines`` lines."""
    text = re.sub(
        r"(?:[ \t]*\n){4,}", lambda m: f"\n    [{m.group(0).count(chr(10))} newlines]\n", text
    )
    lines = text.strip("\n").split("\n")
    more = len(lines) - max_lines
    return "\n".join(lines[:max_lines]) + (f"\n    [... {more} more lines]" if more > 0 else "")


def demo_explanations(rows: dict, sps, kinds: dict | None = None) -> list[str]:
    """What the demo says under its table, each line only where the measurement shows it:
    why an arm was slower than no speculation (``rows[label, T] = (scheduler, τ, tok/s,
    results)``; ``kinds[T]``: DSpark's rounds by kind, as ``round_kinds_line`` takes them),
    and what verifying more tokens costs here (``sps``: the SPS profile)."""
    out = []
    slower = [
        (temp, row[1])
        for (label, temp), row in sorted(rows.items(), key=lambda kv: kv[0][1])
        if label == "DSpark" and row[2] < rows["no speculation", temp][2]
    ]
    kinds = kinds or {}

    def mostly_plain(temp):
        counts = kinds.get(temp, ({}, False, ""))[0]
        return counts.get("plain", 0) > sum(counts.values()) / 2

    plain = [(temp, tau) for temp, tau in slower if mostly_plain(temp)]
    slower = [(temp, tau) for temp, tau in slower if not mostly_plain(temp)]
    if plain:
        temps = " and ".join(f"T = {temp:g}" for temp, _ in plain)
        out.append(
            f"DSpark ran most rounds plain at {temps} (drafting does not pay on this CPU), "
            "so it decoded as no speculation does, plus keeping the drafter's context current "
            "(a few %) and a few drafting probes; the rest is the run-to-run noise of timing "
            "two arms one after the other"
        )
    if slower:
        taus = " and ".join(f"tau {tau:.2f} at T = {temp:g}" for temp, tau in slower)
        out.append(
            f"DSpark is slower than no speculation here ({taus}): the extra tokens per "
            "round do not pay for drafting and verifying gamma tokens on a CPU"
        )
    if sps is not None and len(sps.buckets) > 1:
        lo, hi = sps.buckets[0], sps.buckets[-1]
        out.append(
            f"on this machine a round verifying {hi} tokens costs {sps(lo) / sps(hi):.1f}x one "
            f"verifying {lo} (the SPS profile); on an accelerator such rounds cost nearly the "
            "same, which is the regime speculative decoding is built for"
        )
    return out


def round_kinds_line(temp: float, counts: dict, plain_rounds: bool, last_reason: str) -> str:
    """The demo's one line on which DSpark rounds drafted and why (``decode.policy``)."""
    total = sum(counts.values())
    if not plain_rounds:
        return f"DSpark rounds at T = {temp:g}: all {total} drafted (plain rounds off)"
    return (
        f"DSpark rounds at T = {temp:g}: {counts['draft']} drafted, {counts['plain']} plain "
        f"(the target alone: drafting would not pay on the newest confidences), "
        f"{counts['probe']} probes (drafting rounds that refresh them); last: {last_reason}"
    )


def demo(args) -> int:
    from dspark_jax.eval.metrics import ends_in_loop
    from dspark_jax.serve.engine import SamplingParams

    drafter_dir = _check_paths(args)
    use_compile_cache(args)
    if drafter_dir is None:
        raise ValueError("--demo compares no speculation with DSpark; give a --drafter directory")
    prompt_file = find_demo_prompts(args.demo_prompts_file)
    if prompt_file is None:
        print(
            f"note: no --demo-prompts-file and no {os.path.normpath(HUMANEVAL)}: using "
            "built-in code prompts"
        )
    prompts, source = demo_prompts(prompt_file, args.demo_prompts)
    print(
        f"demo: {source}, {args.demo_tokens} new tokens each, one request at a time "
        f"({args.slots} slot), target {args.target}, drafter {drafter_dir}",
        file=sys.stderr,
    )
    models = load_for_serving(args, drafter_dir)
    # Greedy shows losslessness (identical outputs); T = 1 is the regime the drafters were
    # trained for.
    temps = (0.0, 1.0)
    rows, sps, kinds = {}, None, {}
    for label, sched in (("no speculation", "none"), ("DSpark", args.scheduler)):
        print(f"demo: warming up the {label} engine (compiling)", file=sys.stderr)
        engine = build_engine(args, drafter_dir, sched, models).start()
        sps = engine.sps_table or sps
        for temp in temps:
            before = dict(engine.policy.kind_counts)
            t0 = time.perf_counter()
            results = []
            for i, p in enumerate(prompts):
                # One request at a time on an idle engine, seeded: each T = 1 sample (and
                # so τ) is reproducible run to run.
                engine.wait_idle()
                params = SamplingParams(max_tokens=args.demo_tokens, temperature=temp, seed=i)
                results.append(engine.generate(p, params))
            wall = time.perf_counter() - t0
            tokens = sum(r.completion_tokens for r in results)
            rounds = sum(r.rounds for r in results)
            # τ: tokens the decode rounds emitted per round (the prefill's first token is
            # not a round's), so no speculation is exactly 1.
            emitted = sum(r.mean_accepted_length * r.rounds for r in results)
            rows[label, temp] = (engine.scheduler, emitted / max(rounds, 1), tokens / wall, results)
            if label == "DSpark":
                counts = engine.policy.kind_counts
                kinds[temp] = ({k: counts[k] - before.get(k, 0) for k in counts},
                               engine.policy.plain_rounds, engine.policy.last_reason)  # fmt: skip
        engine.shutdown()
    n_tok = sum(r.completion_tokens for r in rows["DSpark", 0.0][3])
    print(
        f"\n{source} x {args.demo_tokens} new tokens ({n_tok} generated greedy), one request "
        "at a time, on this machine"
    )
    print(f"\n{'arm':<16}{'scheduler':<11}{'T':>4}{'tau':>7}{'tok/s':>10}{'speedup':>9}")
    for temp in temps:
        base = rows["no speculation", temp][2]
        for label in ("no speculation", "DSpark"):
            sched, tau, tps, _ = rows[label, temp]
            print(f"{label:<16}{sched:<11}{temp:>4g}{tau:>7.2f}{tps:>10.1f}{tps / base:>8.2f}x")
    print(
        "\ntau: tokens per decode round (accepted draft tokens + the target's own token); "
        "1 without speculation"
    )
    greedy = [rows[label, 0.0][3] for label in ("no speculation", "DSpark")]
    same = sum(a.token_ids == b.token_ids for a, b in zip(*greedy))
    verdict = "passed" if same == len(prompts) else "FAILED"
    print(
        f"lossless check (greedy DSpark output == no speculation, token for token): "
        f"{verdict}, {same} of {len(prompts)} prompts"
    )
    for temp in temps:
        print(round_kinds_line(temp, *kinds[temp]))
    for line in demo_explanations(rows, sps, kinds):
        print(line)
    last = "\n".join(prompts[0].rstrip("\n").split("\n")[-6:])
    print(f"\n--- prompt 1 (its last lines) ---\n{last}")
    print(f"--- greedy continuation (DSpark, = no speculation) ---\n{_readable(greedy[1][0].text)}")
    if ends_in_loop(greedy[1][0].token_ids):
        print(
            "    (greedy decoding of this small bundled target often ends in a repeated loop, "
            "as this one does (its model card gives the share); the sampled text below shows "
            "more of what it has learnt)"
        )
    t1 = rows["DSpark", 1.0][3][0].text
    print(f"--- sampled continuation (DSpark, T = 1) ---\n{_readable(t1)}")
    return 0 if same == len(prompts) else 1


def use_compile_cache(args) -> None:
    """JAX's persistent compilation cache, unless ``--no-compile-cache``."""
    if args.no_compile_cache:
        return
    from dspark_jax.compile_cache import enable_compile_cache

    path = enable_compile_cache(args.compile_cache)
    if path is None:  # compile_cache.unsafe_reason: a multi-process CPU run
        print("compilation cache: off (a multi-process CPU run)", file=sys.stderr)
        return
    print(f"compilation cache: {path} (--no-compile-cache to disable)", file=sys.stderr)


def bind_port(host: str, port: int):
    """A socket bound to ``host:port`` for the server, before anything slow happens; a
    port in use (or a host this machine does not have) is a user error naming it."""
    import socket

    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        hint = " (another process is listening there; pass another --port)"
        raise ValueError(
            f"cannot listen on {host}:{port}: {e.strerror or e}"
            f"{hint if e.errno == errno.EADDRINUSE else ''}"
        ) from None
    return sock


def kv_bytes_per_position(target_config, drafter=None) -> int:
    """Bytes of KV cache one cache position of one slot takes: the target's layers (K
    and V) plus, with a drafter, as many again per drafter layer (an upper bound)."""
    import numpy as np

    layers = target_config.num_hidden_layers
    if drafter is not None:
        layers += int(getattr(drafter.config, "num_layers", 0) or 0)
    width = target_config.num_key_value_heads * target_config.head_dim
    return 2 * layers * width * np.dtype(target_config.compute_dtype).itemsize


def default_max_len(
    model_max: int,
    slots: int,
    per_position: int,
    free_bytes: int | None,
    platform: str,
    page_size: int = 16,
) -> tuple[int, str]:
    """``(max_len, why)``: the target's ``max_position_embeddings``, lowered so every
    slot's KV cache fits in ``KV_MEMORY_FRACTION`` of ``free_bytes`` (the device memory
    left after the weights; None: unknown) and capped at ``CPU_MAX_LEN`` on a CPU."""
    value, why = model_max, f"the target's max_position_embeddings ({model_max})"
    if free_bytes is not None:
        fits = int(free_bytes * KV_MEMORY_FRACTION) // max(1, slots * per_position)
        fits -= fits % page_size
        if fits < value:
            value = max(fits, 4)
            why = (
                f"the target allows {model_max}, but {slots} slots' KV caches at more would "
                f"take over {int(100 * KV_MEMORY_FRACTION)}% of the "
                f"{free_bytes / 2**30:.1f} GiB free on the device"
            )
    if platform == "cpu" and value > CPU_MAX_LEN:
        why = (
            f"the target allows {model_max}; capped at {CPU_MAX_LEN} on a CPU, where every "
            "round reads the whole cache"
        )
        value = CPU_MAX_LEN
    return value, why


def free_device_memory() -> tuple[int | None, str]:
    """``(bytes free on the first device or None when it does not say, its platform)``."""
    import jax

    dev = jax.local_devices()[0]  # another process's devices do not report theirs
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # some backends do not implement it
        stats = {}
    limit = stats.get("bytes_limit")
    free = None if limit is None else max(0, int(limit) - int(stats.get("bytes_in_use", 0)))
    return free, dev.platform


def choose_max_len(args, models) -> None:
    """Set ``args.max_len`` when not given, and say the value and why on stderr."""
    target, _, _, drafter, _, _ = models
    if args.max_len is not None:
        print(f"context length: {args.max_len} positions (--max-len)", file=sys.stderr)
        return
    free, platform = free_device_memory()
    per_position = kv_bytes_per_position(target.config, drafter)
    args.max_len, why = default_max_len(
        target.config.max_position_embeddings,
        args.slots,
        per_position,
        free,
        platform,
        args.page_size,
    )
    print(
        f"context length: {args.max_len} positions per request, {why}; --max-len to change",
        file=sys.stderr,
    )


def load_for_serving(args, drafter_dir):
    """The models (``engine.load_models`` order), saying what is loaded and how long it
    took, and the context length chosen."""
    from dspark_jax.serve.engine import load_models

    what = f"target {args.target}" + (f", drafter {drafter_dir}" if drafter_dir else "")
    dtype = args.dtype or "float32"
    mesh = mesh_from_args(args)
    where = ""
    if mesh is not None:
        layout = f"tensor {mesh.shape['tensor']}"
        if mesh.shape["data"] > 1:
            layout = f"data {mesh.shape['data']} × {layout}"
        where = f" onto {mesh.size} devices ({layout})"
    from dspark_jax import distributed

    if distributed.process_count() > 1:  # each host reads its own copy of the weights
        from dspark_jax.models.fingerprint import checkpoint_files_fingerprint as files

        distributed.check_same(
            "checkpoints",
            {
                "target files": files(args.target),
                "drafter files": drafter_dir and files(drafter_dir),
            },
        )
    say(f"loading {what} ({dtype}){where}")
    t0 = time.perf_counter()
    models = load_models(
        args.target,
        drafter_dir,
        dtype=args.dtype,
        mesh=mesh,
        survival_estimator=args.survival_estimator,
    )
    say(f"loaded in {time.perf_counter() - t0:.1f}s")
    choose_max_len(args, models)

    # Chosen from free device memory, which the processes may see differently: process
    # 0's choice holds for all of them.
    args.max_len = distributed.broadcast_json("serve-max-len", args.max_len)
    return models


def say(message: str) -> None:
    """A start-up line on stderr, flushed at once."""
    print(f"serve.py: {message}", file=sys.stderr, flush=True)


def serve(args) -> int:
    # Said before the imports below, which take seconds (JAX, FastAPI).
    say("starting: checking the arguments and the port, then loading the models")
    from dspark_jax.serve.chat import load_chat_template
    from dspark_jax.serve.server import ServerLimits, create_app, make_server

    drafter_dir = _check_paths(args)
    limits = ServerLimits(args.api_key, args.max_body_bytes, args.max_request_tokens)
    if _process_id(args) != 0:  # a follower: no port, no clients (see follow())
        return follow(args, drafter_dir)
    sock = bind_port(args.host, args.port)  # before anything slow: a busy port fails now
    use_compile_cache(args)
    models = load_for_serving(args, drafter_dir)
    engine = build_engine(args, drafter_dir, args.scheduler, models)
    watchdog = watch_peers(engine, args.peer_timeout)
    template = load_chat_template(args.target)
    app = create_app(engine, chat_template=template, limits=limits)
    server = make_server(app, args.host, args.port)
    sps = ""
    if engine.scheduler in ("topk", "prefix"):
        sps = (
            f"profiling SPS (rounds per second) at {len(engine.verify_buckets)} verify sizes, "
            f"or reading it from {engine.config.sps_cache}, then "
        )
    key = "API key required on /v1/*" if limits.api_key else "no API key (--api-key)"
    print(
        f"serving {engine.config.model_name} on http://{args.host}:{args.port} ({key}): "
        f"warming up first ({sps}compiling "
        f"{len(engine.prompt_buckets) * len(engine.prefill_rows)} prefill and "
        f"{len(engine.verify_buckets)} verify shapes); /health answers 503 'starting' until "
        "ready",
        file=sys.stderr,
        flush=True,
    )
    engine.start(background=True)
    server.run(sockets=[sock])
    if engine.failure:
        return 1
    # Several processes: the followers got the last turn when the engine stopped (drained);
    # every process stops its heartbeat, then all leave the distributed runtime together.
    from dspark_jax.distributed import finalize_if_started

    if watchdog is not None:
        watchdog.stop()
    finalize_if_started()
    return 0


EXIT_PEER_LOST = 3  # another process of a multi-process server stopped answering


def _process_id(args) -> int:
    """This process's index in a multi-process run (0 without one). Starts the runtime:
    the flags or the environment may ask for it (``decode.mesh.mesh_from_args``)."""
    import jax

    mesh_from_args(args)
    return jax.process_index()


def follow(args, drafter_dir) -> int:
    """A follower process of a multi-process server: the same models and engine as process
    0, warmed up with it, then its turns replayed (``engine.lockstep``) until it stops."""
    from dspark_jax.distributed import finalize_if_started, process_index

    use_compile_cache(args)
    models = load_for_serving(args, drafter_dir)
    engine = build_engine(args, drafter_dir, args.scheduler, models)
    watchdog = watch_peers(engine, args.peer_timeout)
    say(f"process {process_index()}: following process 0 (it serves the clients)")
    code = engine.follow()
    if code == 0:
        watchdog.stop()
        finalize_if_started()
    say(f"process {process_index()}: the leader stopped; exiting with status {code}")
    return code


def watch_peers(engine, timeout: float, grace: float = 1.0):
    """Several processes: end this one within ``timeout`` (+ ``grace``) seconds of losing
    another (``engine.lockstep.Watchdog``), or of the leader's engine failing (a collective
    that broke when a peer died). The leader first fails every request (503 to new ones,
    /health 'failed') and gives the HTTP layer ``grace`` seconds to answer them; then the
    process exits with status 3, without waiting on collectives that cannot complete.
    Returns the started ``Watchdog`` (None with one process): stop it before leaving the
    distributed runtime."""
    if engine.exchange is None:
        return None
    import threading

    from dspark_jax.engine.lockstep import Watchdog

    if timeout <= 0:
        raise ValueError(f"--peer-timeout must be > 0 seconds, got {timeout}")

    def give_up(process: int, seconds: float, why: str) -> None:
        message = (
            f"process {process} of this multi-process server stopped answering "
            f"({why}; {seconds:.1f} s): serving cannot continue"
        )
        say(message)
        engine.fail(message)
        time.sleep(grace)
        os._exit(EXIT_PEER_LOST)

    watchdog = Watchdog(engine.exchange, timeout, give_up).start()

    def engine_failed() -> None:  # the leader's loop failed (e.g. a collective broke)
        while engine.failure is None:
            time.sleep(0.2)
        say(f"the engine failed: {engine.failure}; exiting")
        time.sleep(grace)
        os._exit(EXIT_PEER_LOST)

    if not engine.is_follower:
        threading.Thread(target=engine_failed, name="dspark-failure-exit", daemon=True).start()
    return watchdog


def main(argv=None) -> int:
    from dspark_jax.cli import run_main

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    return run_main(demo if args.demo else serve, args)


if __name__ == "__main__":
    sys.exit(main())
