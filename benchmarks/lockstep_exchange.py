"""What serving on several processes costs the leader: the per-turn exchange with the
followers (engine/lockstep.py), beside the same server on one process.

    python benchmarks/lockstep_exchange.py     # writes benchmarks/results/lockstep_exchange.{json,md}

1. The same load (greedy requests, two at a time) on ``serve.py --tensor 8`` run as one
   process with 8 fake CPU devices and as two processes × 4 (gloo collectives), one after
   the other. From the leader's ``/metrics``: turns published, their bytes, the largest
   turn, and the seconds spent publishing, as a share of the rounds' wall time; the load's
   wall time on two processes over one (fake devices share this machine's 2 cores, so
   that ratio bounds the cost of the collectives over TCP, not what a slice pays).
2. Turn sizes at R = 64 slots: a turn without admissions, and turns admitting 64
   requests of 128 and 1,024 prompt tokens, encoded as the leader sends them, and the
   time to publish each into JAX's coordination service (a one-process runtime here:
   the gRPC round trip to the coordinator in the same process).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, REPO)


def _serve_cmd(port: int, slots: int) -> list[str]:
    return [sys.executable, os.path.join(REPO, "serve.py"), "--tensor", "8", "--scheduler",
            "fixed", "--slots", str(slots), "--max-len", "128", "--prefill-batch", "1",
            "--verify-buckets", str(7 * slots), "--no-compile-cache", "--port", str(port)]  # fmt: skip


def _metrics(url: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _load(url: str, requests: int, tokens: int) -> float:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: client.completions.create(
            model="target", prompt=f"def function_{i}(x, y):\n", max_tokens=tokens,
            temperature=0), range(requests)))  # fmt: skip
    return time.perf_counter() - t0


def _run_server(procs_cmd, env, url, requests, tokens) -> dict:
    from dspark_jax.testing import wait_until_healthy

    procs = procs_cmd()
    try:
        wait_until_healthy(url, procs, timeout=900)
        _load(url, 2, tokens)  # first requests after warm-up, untimed
        before = _metrics(url)
        wall = _load(url, requests, tokens)
        after = _metrics(url)
    finally:
        import signal

        procs[0].send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    rounds = d["dspark_rounds_total"]
    round_seconds = d["dspark_round_seconds_sum"]
    return {
        "wall_seconds": wall,
        "rounds": rounds,
        "mean_round_ms": 1000 * round_seconds / max(rounds, 1),
        "turns": d.get('dspark_lockstep{quantity="turns"}', 0.0),
        "bytes": d.get('dspark_lockstep{quantity="bytes"}', 0.0),
        "publish_seconds": d.get('dspark_lockstep{quantity="seconds"}', 0.0),
        "largest_turn_bytes": after.get('dspark_lockstep{quantity="largest_turn_bytes"}', 0.0),
        "round_seconds": round_seconds,
    }


def serving_arms(slots: int, requests: int, tokens: int) -> dict:
    from dspark_jax.testing import free_port, launch_processes, multiprocess_env

    arms = {}
    port = free_port()
    env1 = dict(os.environ, JAX_PLATFORMS="cpu")
    env1["XLA_FLAGS"] = " ".join(
        [f for f in env1.get("XLA_FLAGS", "").split() if "device_count" not in f]
        + ["--xla_force_host_platform_device_count=8"]
    )
    arms["1 process x 8 devices"] = _run_server(
        lambda: [subprocess.Popen(_serve_cmd(port, slots), env=env1, stderr=subprocess.DEVNULL)],
        env1, f"http://127.0.0.1:{port}", requests, tokens,
    )  # fmt: skip
    port = free_port()
    env2 = multiprocess_env(4)
    arms["2 processes x 4 devices"] = _run_server(
        lambda: launch_processes(_serve_cmd(port, slots), 2, free_port(), env2,
                                 stderr=subprocess.DEVNULL),
        env2, f"http://127.0.0.1:{port}", requests, tokens,
    )  # fmt: skip
    return arms


def turn_sizes(slots: int = 64, repeats: int = 20) -> dict:
    """Encoded sizes and publish times of turns at ``slots`` slots (see the docstring)."""
    import jax
    import numpy as np

    from dspark_jax.decode.step import request_key_data
    from dspark_jax.engine.core import CoreRequest
    from dspark_jax.engine.lockstep import Exchange, admission, encode
    from dspark_jax.testing import free_port

    jax.distributed.initialize(f"127.0.0.1:{free_port()}", num_processes=1, process_id=0)
    ex = Exchange()
    rng = np.random.default_rng(0)
    out = {}
    shapes = {"no admission": 0, "64 admissions x 128 tokens": 128,
              "64 admissions x 1024 tokens": 1024}  # fmt: skip
    turn = 0
    for name, length in shapes.items():
        ops = []
        if length:
            for i in range(slots):
                prompt = rng.integers(0, 151_936, length).tolist()  # Qwen3's vocabulary
                r = CoreRequest(prompt, 256, 0.7, 20, 0.95, request_key_data(0, i, 2))
                ops.append(admission(i, r))
        ops.append(["s"])
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            ex.publish(turn, ops)
            times.append(time.perf_counter() - t0)
            turn += 1
        out[name] = {"bytes": len(encode(ops)), "publish_ms": 1000 * statistics.median(times)}
    jax.distributed.shutdown()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--out", default=os.path.join(RESULTS, "lockstep_exchange"))
    p.add_argument(
        "--reuse-serving",
        action="store_true",
        help="keep the serving arms of the existing JSON (rerun the turn sizes only)",
    )
    args = p.parse_args(argv)
    if args.reuse_serving:
        with open(args.out + ".json") as f:
            arms = json.load(f)["serving"]
    else:
        arms = serving_arms(args.slots, args.requests, args.tokens)
    sizes = turn_sizes()
    one, two = arms["1 process x 8 devices"], arms["2 processes x 4 devices"]
    result = {
        "command": "python benchmarks/lockstep_exchange.py",
        "settings": vars(args),
        "serving": arms,
        "exchange_share_of_round": two["publish_seconds"] / max(two["round_seconds"], 1e-9),
        "publish_ms_per_turn": 1000 * two["publish_seconds"] / max(two["turns"], 1),
        "bytes_per_turn": two["bytes"] / max(two["turns"], 1),
        "wall_ratio_two_over_one": two["wall_seconds"] / one["wall_seconds"],
        "turn_sizes_64_slots": sizes,
    }
    # The modelled TPU round (Qwen3-8B + DSpark, R = 64, v5p tensor 4; roofline.py):
    # a turn's publish time as a share of it.
    roof_path = os.path.join(RESULTS, "roofline_v5p_2x2x1_tp4.json")
    if os.path.isfile(roof_path):
        with open(roof_path) as f:
            roof = json.load(f)
        modelled = {int(r["budget"]): float(r["modelled_ms"]) for r in roof["rows"]}
        result["modelled_tpu_round"] = {
            "source": "benchmarks/results/roofline_v5p_2x2x1_tp4.json",
            "slots": roof["slots"],
            "round_ms_by_budget": modelled,
            "no_admission_turn_share": sizes["no admission"]["publish_ms"] / min(modelled.values()),
        }
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=2)
    lines = [
        "# Serving on two processes: the leader's exchange",
        "",
        f"`{result['command']}` (bundled target + DSpark drafter, greedy, {args.requests} "
        f"requests of {args.tokens} tokens two at a time, {args.slots} slots, tensor 8 on "
        "fake CPU devices).",
        "",
        "| arm | wall s | rounds | mean round ms | turns | bytes / turn | publish ms / turn |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, a in arms.items():
        per = a["bytes"] / a["turns"] if a["turns"] else 0
        pub = 1000 * a["publish_seconds"] / a["turns"] if a["turns"] else 0
        lines.append(
            f"| {name} | {a['wall_seconds']:.2f} | {a['rounds']:.0f} | "
            f"{a['mean_round_ms']:.1f} | {a['turns']:.0f} | {per:.0f} | {pub:.3f} |"
        )
    lines += [
        "",
        f"Publishing the turns took {100 * result['exchange_share_of_round']:.2f} % of the "
        f"two-process rounds' wall time; the load took "
        f"{result['wall_ratio_two_over_one']:.2f}× as long on two processes as on one "
        "(both on this machine's cores: collectives over local TCP).",
        "",
        "Turns at 64 slots, encoded as sent, and the median time to publish one:",
        "",
        "| turn | bytes | publish ms |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {v['bytes']:,} | {v['publish_ms']:.2f} |" for k, v in sizes.items()]
    if "modelled_tpu_round" in result:
        m = result["modelled_tpu_round"]
        lines += [
            "",
            f"Against the modelled TPU round ({m['source']}, R = {m['slots']}: "
            f"{min(m['round_ms_by_budget'].values()):.2f} to "
            f"{max(m['round_ms_by_budget'].values()):.2f} ms by verify budget), a turn "
            f"without admission costs the leader {100 * m['no_admission_turn_share']:.1f} % "
            "of the shortest round: host time on the leader's engine thread before each "
            "dispatch, measured on this CPU host, not on a TPU host. A turn admitting 64 long "
            "prompts at once costs several rounds' worth, and only when those prompts arrive.",
        ]
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
