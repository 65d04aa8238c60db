"""Start-up time of ``python serve.py`` on the bundled models: seconds from launch until
``/health`` answers 200, for a cold start without the compilation cache, a cold start
with it (filling it), and a second start reading it (with the SPS profile cached by the
first). Each arm is a fresh process with its own cache directories; results go to
``benchmarks/results/startup.json``.

    python benchmarks/startup.py [-- serve.py arguments; default --slots 8 --max-len 512]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dspark_jax.perf.results import write_result  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except Exception:
        return False


def time_start(port: int, cache: str | None, sps: str, extra: list[str], timeout: float) -> float:
    """Seconds until /health is 200 for one ``serve.py`` process (then stopped)."""
    cmd = [sys.executable, "serve.py", "--port", str(port), "--sps-cache", sps, *extra]
    cmd += ["--no-compile-cache"] if cache is None else ["--compile-cache", cache]
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        while not _healthy(f"http://127.0.0.1:{port}/health"):
            if proc.poll() is not None:
                raise RuntimeError(f"serve.py exited with status {proc.returncode}: {cmd}")
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"serve.py not healthy after {timeout} s")
            time.sleep(0.25)
        return time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(60)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--port", type=int, default=8913)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per start")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "startup.json"))
    ap.add_argument("serve_args", nargs="*", help="passed to serve.py (after --), e.g. --slots 16")
    args = ap.parse_args(argv)
    # The server shape the recorded figures used, unless the caller gives its own.
    extra = args.serve_args or ["--slots", "8", "--max-len", "512"]
    with tempfile.TemporaryDirectory() as tmp:
        cache, sps_cold, sps = (os.path.join(tmp, n) for n in ("jax", "sps0.json", "sps.json"))
        arms = {
            "cold, no compilation cache": time_start(
                args.port, None, sps_cold, extra, args.timeout
            ),
            "cold, filling the cache": time_start(args.port, cache, sps, extra, args.timeout),
            "second start (cache + SPS profile)": time_start(
                args.port, cache, sps, extra, args.timeout
            ),
        }
    result = {
        "command": "python benchmarks/startup.py -- " + " ".join(extra),
        "seconds_to_healthy": {k: round(v, 1) for k, v in arms.items()},
        "second_over_cold": round(
            arms["second start (cache + SPS profile)"] / arms["cold, no compilation cache"], 3
        ),
        "machine": {"cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
    }
    return write_result(args.out, result)


if __name__ == "__main__":
    main()
