"""Steps-per-second profiling of the verify step (DESIGN §5.3, ``SPS(B)``).

At engine start every compiled verify shape (bucket) is timed on the running hardware:
median wall time of ``repeats`` calls after ``warmup`` calls, each ending in
``jax.block_until_ready``. ``SPS = 1 / median``, then forced non-increasing in ``B`` with a
running minimum (a bigger batch is never faster; timing noise must not make the scheduler
think so). For a non-bucket ``B`` the table returns the SPS of the smallest bucket ``>= B``,
since that is the shape that actually runs; sizes above the largest bucket get 0 (cannot
run, so no scheduler ever picks them).

Tables are cached as JSON under a caller-chosen key (model / config / device description,
see ``cache_key``) so restarts reuse the measurement.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SPSTable", "cache_key", "load_or_profile", "median_seconds", "profile_sps"]


@dataclass(frozen=True)
class SPSTable:
    """Profiled verify throughput.

    buckets: strictly increasing verify sizes ``B`` that were timed.
    seconds: median wall time per bucket.
    sps: steps/s per bucket after the running minimum (non-increasing).
    plain_seconds: median wall time of a *plain* round (the target alone verifying the
      anchors, the drafter not called; ``decode.policy``'s draft-aware rounds), or None
      when it was not profiled. Its own curve, outside the running minimum: it is a
      different program, not a smaller bucket of the drafting rounds.
    """

    buckets: tuple[int, ...]
    seconds: tuple[float, ...]
    sps: tuple[float, ...]
    plain_seconds: float | None = None

    def __post_init__(self):
        if not self.buckets or len({len(self.buckets), len(self.seconds), len(self.sps)}) != 1:
            raise ValueError("SPSTable needs equally long, non-empty buckets/seconds/sps")
        if any(b < 0 for b in self.buckets) or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"SPSTable buckets must be increasing and >= 0; got {self.buckets}")
        if self.plain_seconds is not None and not (
            np.isfinite(self.plain_seconds) and self.plain_seconds > 0
        ):
            raise ValueError(f"plain_seconds must be finite and > 0; got {self.plain_seconds}")

    @property
    def plain_sps(self) -> float | None:
        """Plain rounds per second (None when not profiled)."""
        return None if self.plain_seconds is None else 1.0 / self.plain_seconds

    @classmethod
    def from_seconds(
        cls, seconds_by_bucket: Mapping[int, float], plain_seconds: float | None = None
    ) -> SPSTable:
        """Build a table from ``{B: median seconds}`` (applies the running minimum) and the
        plain round's median seconds, if profiled."""
        if not seconds_by_bucket:
            raise ValueError("need at least one bucket to build an SPS table")
        buckets = tuple(sorted(int(b) for b in seconds_by_bucket))
        secs = tuple(float(seconds_by_bucket[b]) for b in buckets)
        if any(not np.isfinite(s) or s <= 0 for s in secs):
            raise ValueError(f"step times must be finite and > 0; got {dict(zip(buckets, secs))}")
        sps = np.minimum.accumulate(1.0 / np.asarray(secs))
        plain = None if plain_seconds is None else float(plain_seconds)
        return cls(buckets, secs, tuple(float(x) for x in sps), plain)

    def __call__(self, b: int) -> float:
        """``SPS(B)``: the smallest bucket ``>= B``; 0 above the largest bucket."""
        i = int(np.searchsorted(np.asarray(self.buckets), int(b), side="left"))
        return self.sps[i] if i < len(self.buckets) else 0.0

    def as_array(self, length: int | None = None) -> jax.Array:
        """Dense float32 table indexed by ``B = 0 … length-1`` (default up to the largest
        bucket). Pass ``length = R·(γ+1) + 1`` for the schedulers."""
        length = self.buckets[-1] + 1 if length is None else int(length)
        if length < 1:
            raise ValueError(f"table length must be >= 1; got {length}")
        return jnp.asarray([self(b) for b in range(length)], jnp.float32)

    def to_json(self) -> dict[str, Any]:
        out = {"buckets": list(self.buckets), "seconds": list(self.seconds), "sps": list(self.sps)}
        if self.plain_seconds is not None:
            out["plain_seconds"] = self.plain_seconds
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> SPSTable:
        try:
            return cls(
                tuple(int(b) for b in obj["buckets"]),
                tuple(float(s) for s in obj["seconds"]),
                tuple(float(s) for s in obj["sps"]),
                None if obj.get("plain_seconds") is None else float(obj["plain_seconds"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed SPS table entry {obj!r}: {e}") from e


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` (its outputs waited for) over ``repeats`` calls, after
    ``warmup`` untimed calls (compilation, caches)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def profile_sps(
    step_fn_by_budget: Mapping[int, Callable[[], Any]],
    repeats: int = 5,
    warmup: int = 1,
    progress: Callable[[int, int, int], None] | None = None,
    plain_fn: Callable[[], Any] | None = None,
) -> SPSTable:
    """Time each ``step_fn_by_budget[B]()`` and return the SPS table.

    Each callable runs one verify step of size ``B`` (already compiled, or compiled during
    warm-up) and returns its outputs; the timer stops after ``jax.block_until_ready``.
    ``progress(budget, i, n)`` is called before the i-th of n buckets (1-based).
    ``plain_fn``: one plain round, timed the same way (``SPSTable.plain_seconds``).
    """
    if not step_fn_by_budget:
        raise ValueError("step_fn_by_budget is empty: give one callable per verify bucket B")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0; got {repeats}, {warmup}")
    seconds = {}
    items = sorted(step_fn_by_budget.items())
    for i, (b, fn) in enumerate(items, 1):
        if progress is not None:
            progress(int(b), i, len(items))
        if not callable(fn):
            raise ValueError(f"step_fn_by_budget[{b}] is not callable: {fn!r}")
        seconds[int(b)] = max(median_seconds(fn, repeats, warmup), 1e-9)
    plain = None if plain_fn is None else max(median_seconds(plain_fn, repeats, warmup), 1e-9)
    return SPSTable.from_seconds(seconds, plain)


def default_cache_path() -> str:
    """The per-user SPS cache file: ``$XDG_CACHE_HOME/dspark_jax/sps.json`` (default
    ``~/.cache``). Entries are keyed by model, shapes, device kind and JAX version."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "dspark_jax", "sps.json")


def cache_key(*parts: Any) -> str:
    """A cache key from caller parts (model, config) plus the device kind/count and JAX
    version, so a table is never reused on different hardware."""
    dev = jax.devices()[0]
    return "|".join(
        [
            *(str(p) for p in parts),
            f"{dev.platform}:{dev.device_kind}x{jax.device_count()}",
            f"jax{jax.__version__}",
        ]
    )


def _read_cache(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"SPS cache {path} is not valid JSON ({e}); delete it to re-profile"
        ) from e
    if not isinstance(data, dict):
        raise ValueError(f"SPS cache {path} must hold a JSON object keyed by cache key")
    return data


def cached_table(cache_path: str, key: str, buckets, plain: bool = False) -> SPSTable | None:
    """The table cached under ``key`` if it covers exactly ``buckets`` (and holds a plain
    round's time when ``plain``), else None."""
    data = _read_cache(cache_path)
    if key in data:
        table = SPSTable.from_json(data[key])
        if list(table.buckets) == sorted(int(b) for b in buckets) and (
            not plain or table.plain_seconds is not None
        ):
            return table
    return None


def store_table(cache_path: str, key: str, table: SPSTable) -> None:
    """Write ``table`` under ``key`` (atomically; other keys in the file are kept)."""
    data = _read_cache(cache_path)
    data[key] = table.to_json()
    directory = os.path.dirname(os.path.abspath(cache_path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, cache_path)


def load_or_profile(
    cache_path: str,
    key: str,
    step_fn_by_budget: Mapping[int, Callable[[], Any]],
    repeats: int = 5,
    warmup: int = 1,
    progress: Callable[[int, int, int], None] | None = None,
    plain_fn: Callable[[], Any] | None = None,
) -> SPSTable:
    """Return the cached table for ``key`` if it covers the same buckets (and the plain
    round, given ``plain_fn``; no step function is called then), else a fresh
    ``profile_sps`` result written back (atomically) under ``key``. Other keys in the file
    are preserved."""
    table = cached_table(cache_path, key, step_fn_by_budget, plain=plain_fn is not None)
    if table is not None:
        return table
    table = profile_sps(
        step_fn_by_budget, repeats=repeats, warmup=warmup, progress=progress, plain_fn=plain_fn
    )
    store_table(cache_path, key, table)
    return table
