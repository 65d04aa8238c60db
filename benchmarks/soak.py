"""Soak test of the HTTP server on loopback (bounded): ``python serve.py`` with the bundled
models, ``--requests`` mixed requests at ``--concurrency``, then a SIGTERM while requests
are still in flight. Results go to ``benchmarks/results/soak.json``.

The mix, cycled: completions (greedy and T = 1, seeded and not), chat completions,
streaming completions and chat, streaming clients that disconnect after the first chunk,
malformed JSON bodies, prompts longer than the cache, unsupported fields, ``n = 2``,
completions with ``logprobs``, and prompt + ``max_tokens`` beyond the cache (a 400
``context_length_exceeded``).

Reported: requests sent / answered 200 / completed with a finish reason (a 200 whose body
or stream ends without one is *lost*), 4xx by bad-input kind (each must be the expected
400), slots and queue entries left busy after the load (from ``/metrics``; must be 0),
the server's resident memory after warm-up vs after the load, p50/p99 latency per kind,
and the SIGTERM drain: requests in flight at the signal that still completed, requests
refused with 503 afterwards, and the exit status (0).

    python benchmarks/soak.py [--requests 1000] [--concurrency 64] [--slots 16]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402

from dspark_jax.perf.results import write_result  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MODEL = "target"
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef walk(root):", "class Stack:", "for i in"]
MESSAGES = [{"role": "user", "content": "a function that reverses a list"}]
# kind -> (endpoint, body factory, expected status); bodies get a max_tokens of --tokens.
KINDS = (
    "greedy", "sampled", "seeded", "chat", "stream", "chat_stream", "disconnect",
    "malformed", "oversize", "unsupported", "n2", "logprobs", "too_long",
)  # fmt: skip
BAD = {"malformed": 400, "oversize": 400, "unsupported": 400, "too_long": 400}


def request_for(kind: str, i: int, tokens: int) -> tuple[str, object]:
    p = PROMPTS[i % len(PROMPTS)]
    base = {"model": MODEL, "max_tokens": tokens}
    if kind in ("chat", "chat_stream"):
        body = {**base, "messages": MESSAGES, "temperature": 1.0, "stream": kind == "chat_stream"}
        return "/v1/chat/completions", body
    body = {**base, "prompt": p, "temperature": 0.0 if kind == "greedy" else 1.0}
    if kind == "seeded":
        body["seed"] = i
    if kind in ("stream", "disconnect"):
        body["stream"] = True
    if kind == "malformed":
        return "/v1/completions", b'{"prompt": "x", '
    if kind == "oversize":
        body["prompt"] = "def f(x):\n    return x\n" * 400
    if kind == "unsupported":
        body["logit_bias"] = {"1": 5}
    if kind == "n2":
        body["n"] = 2
    if kind == "logprobs":
        body["logprobs"] = 5
    if kind == "too_long":  # prompt + max_tokens beyond the cache row: context_length_exceeded
        body["max_tokens"] = 10**6
    return "/v1/completions", body


async def one(client: httpx.AsyncClient, kind: str, i: int, tokens: int) -> dict:
    path, body = request_for(kind, i, tokens)
    t0 = time.perf_counter()
    out = {"kind": kind, "status": None, "completed": False}
    try:
        if isinstance(body, bytes):
            r = await client.post(path, content=body, headers={"content-type": "application/json"})
            out["status"] = r.status_code
        elif body.get("stream"):
            async with client.stream("POST", path, json=body) as r:
                out["status"] = r.status_code
                async for line in r.aiter_lines():
                    if kind == "disconnect" and line.startswith("data: {"):
                        out["completed"] = True  # the client leaves on purpose
                        break
                    if line.startswith("data: {") and '"finish_reason": "' in line:
                        out["completed"] = True
        else:
            r = await client.post(path, json=body)
            out["status"] = r.status_code
            if r.status_code == 200:
                choices = r.json()["choices"]
                out["completed"] = all(c["finish_reason"] in ("stop", "length") for c in choices)
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.perf_counter() - t0
    return out


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def load(url: str, n: int, concurrency: int, tokens: int) -> list[dict]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def task(i):
            async with sem:
                return await one(client, KINDS[i % len(KINDS)], i, tokens)

        return await asyncio.gather(*(task(i) for i in range(n)))


async def drain(url: str, proc: subprocess.Popen, concurrency: int, tokens: int) -> dict:
    """Send ``concurrency`` requests, SIGTERM once they are running, then keep sending."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        inflight = [
            asyncio.ensure_future(one(client, "greedy", i, tokens)) for i in range(concurrency)
        ]
        await asyncio.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.2)
        late = await one(client, "greedy", 0, tokens)
        done = await asyncio.gather(*inflight)
    return {
        "in_flight_at_sigterm": len(done),
        "completed": sum(d["completed"] for d in done),
        "lost": sum(d["status"] == 200 and not d["completed"] for d in done),
        "refused_503": sum(d["status"] == 503 for d in done),
        "late_request": late["status"] if late["status"] is not None else late.get("error"),
        "exit_status": proc.wait(120),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=12, help="max_tokens per request")
    ap.add_argument("--port", type=int, default=8917)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "soak.json"))
    args = ap.parse_args(argv)
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "serve.py", "--port", str(args.port), "--slots", str(args.slots),
           "--max-queue", str(4 * args.concurrency)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 900
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"serve.py did not become healthy (status {proc.poll()})")
            time.sleep(0.5)
        rss_start = rss_mb(proc.pid)
        t0 = time.perf_counter()
        results = asyncio.run(load(url, args.requests, args.concurrency, args.tokens))
        wall = time.perf_counter() - t0
        time.sleep(1.0)  # let cancelled slots free at the next round
        m = httpx.get(url + "/metrics", timeout=10).text
        rss_end = rss_mb(proc.pid)
        sigterm = asyncio.run(drain(url, proc, args.concurrency, args.tokens))
    finally:
        if proc.poll() is None:
            proc.kill()
    good = [r for r in results if r["kind"] not in BAD]
    summary = {
        "command": "python benchmarks/soak.py "
        + " ".join(
            f"--{k} {getattr(args, k)}" for k in ("requests", "concurrency", "slots", "tokens")
        ),
        "wall_seconds": round(wall, 1),
        "sent": len(results),
        "answered_200": sum(r["status"] == 200 for r in good),
        "completed": sum(r["completed"] for r in good),
        "lost": sum(r["status"] == 200 and not r["completed"] for r in good),
        "other_status": sorted({str(r["status"]) for r in good if r["status"] != 200}),
        "bad_input": {
            k: {
                "sent": sum(r["kind"] == k for r in results),
                f"answered_{BAD[k]}": sum(
                    r["kind"] == k and r["status"] == BAD[k] for r in results
                ),
            }
            for k in BAD
        },  # fmt: skip
        "leaked_slots": metric(m, "dspark_active_slots"),
        "leaked_queue": metric(m, "dspark_queue_depth"),
        "compilations_after_warmup": metric(m, "dspark_compilations_after_warmup"),
        "rss_mb": {
            "after_warmup": round(rss_start, 1),
            "after_load": round(rss_end, 1),
            "growth": round(rss_end / rss_start - 1, 4),
        },  # fmt: skip
        "latency_seconds": {
            k: {
                "p50": round(percentile([r["seconds"] for r in results if r["kind"] == k], 0.5), 3),
                "p99": round(
                    percentile([r["seconds"] for r in results if r["kind"] == k], 0.99), 3
                ),
            }
            for k in KINDS
        },  # fmt: skip
        "sigterm": sigterm,
    }
    return write_result(args.out, summary)


if __name__ == "__main__":
    main()
