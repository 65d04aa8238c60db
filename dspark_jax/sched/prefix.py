"""Algorithm 1 of the DSpark paper: the synchronous, exact prefix scheduler (DESIGN §5.3).

Given survival probabilities ``a[r, j]`` (probability that draft tokens ``0..j`` of slot ``r``
all survive verification; ``a = cumprod(c)`` so non-increasing in ``j``) and the verify
step's throughput table ``SPS(B)`` (steps/s when ``B`` tokens are verified), pick which draft
tokens to verify so as to maximise expected tokens per second ``Θ = τ* · SPS(B)``:

    candidates (r, j) sorted by a[r, j] descending, ties: smaller j first (then smaller r)
    B = R, τ* = R, Θ_best = R · SPS(R)          # every active slot verifies its anchor
    for (r, j) in order:
        B += 1; τ* += a[r, j]; Θ = τ* · SPS(B)
        if Θ <= Θ_best: stop                      # the FIRST non-improvement ends the scan
        Θ_best = Θ; admit (r, j)

Conventions used throughout ``dspark_jax.sched``:
  * ``a`` is made non-increasing along ``j`` with a running minimum before ordering (a no-op
    for a true cumulative product). With the tie rule this makes every admitted set a
    per-slot prefix, and it keeps the decision for ``(r, j)`` independent of the token
    ``x_{r,j}`` (only entries ranked after ``(r, j)`` depend on it) — the non-anticipation
    property of DESIGN §5.4.
  * Inactive slots (``active[r] == False``) contribute neither an anchor nor candidates:
    ``R`` counts active slots only, so ``B = #active + #admitted`` and
    ``τ* = #active + Σ admitted a``; their lengths are 0.
  * ``sps_table`` is indexed by ``B`` and must cover ``0 … R·(γ+1)`` (see
    ``dspark_jax.sched.sps.SPSTable.as_array``). Entries are steps/s; 0 marks a size that
    cannot run.

``algorithm1_no_early_stop`` is the WRONG variant discussed in the paper's Appendix A (it
admits up to the global argmax of Θ, looking past the first drop). It is kept only so tests
can show that it breaks losslessness; never serve with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "Schedule",
    "algorithm1",
    "algorithm1_reference",
    "algorithm1_no_early_stop",
    "candidate_order",
    "running_min",
]


class Schedule(NamedTuple):
    """A verification plan for one round (a pytree, so it can leave a jitted function).

    mask: bool ``[R, γ]``, admitted draft tokens (always a per-slot prefix).
    lengths: int32 ``[R]``, admitted draft tokens per slot (``n_verify`` for ``verify_*``).
    num_tokens: int32 scalar ``B`` = active anchors + admitted drafts.
    expected_tau: float32 scalar ``τ*`` = active anchors + Σ admitted survival
      (expected tokens produced this round, bonus tokens included).
    """

    mask: jax.Array
    lengths: jax.Array
    num_tokens: jax.Array
    expected_tau: jax.Array


def running_min(a: jax.Array) -> jax.Array:
    """Force ``a[r, :]`` non-increasing (a no-op for cumulative products)."""
    return jax.lax.cummin(jnp.asarray(a, jnp.float32), axis=1)


def _check_a(a, active):
    a = jnp.asarray(a, jnp.float32)
    if a.ndim != 2:
        raise ValueError(f"survival probabilities a must be [R, γ]; got shape {a.shape}")
    if active is None:
        active = jnp.ones(a.shape[:1], bool)
    active = jnp.asarray(active, bool)
    if active.shape != a.shape[:1]:
        raise ValueError(f"active must be [R] = [{a.shape[0]}]; got shape {active.shape}")
    return a, active


def _check_table(sps_table, a):
    table = jnp.asarray(sps_table, jnp.float32)
    r, gamma = a.shape
    need = r * (gamma + 1) + 1
    if table.ndim != 1 or table.shape[0] < need:
        raise ValueError(
            f"sps_table must be 1-D and indexable by every budget B = 0..R·(γ+1) = {need - 1} "
            f"(length >= {need}) for a of shape {a.shape}; got shape {table.shape}"
        )
    return table


def candidate_order(a: jax.Array, active: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Order the ``R·γ`` candidates: survival descending, ties by smaller ``j``, then ``r``.

    Returns ``(order, sorted_a)``: ``order`` holds flat indices ``r·γ + j`` (inactive slots
    last, their ``sorted_a`` set to 0 so they add nothing to sums).
    """
    r, gamma = a.shape
    key = jnp.where(active[:, None], running_min(a), -1.0)
    # Lay the candidates out j-major so that a stable sort breaks ties by (j, r).
    flat_jr = key.T.reshape(-1)
    order_jr = jnp.argsort(-flat_jr, stable=True)
    j_idx, r_idx = order_jr // r, order_jr % r
    sorted_a = jnp.maximum(flat_jr[order_jr], 0.0)
    return r_idx * gamma + j_idx, sorted_a


def _mask_from_order(order, n_admit, shape):
    rank_mask = jnp.arange(order.shape[0]) < n_admit
    return jnp.zeros(order.shape[0], bool).at[order].set(rank_mask).reshape(shape)


@jax.jit
def algorithm1(a: jax.Array, sps_table: jax.Array, active: jax.Array | None = None) -> Schedule:
    """Vectorised Algorithm 1 (sort + cumsum + first drop); jit-able, fixed shapes.

    Args:
      a: float ``[R, γ]`` survival probabilities.
      sps_table: float ``[>= R·(γ+1)+1]``, ``SPS(B)`` indexed by ``B``.
      active: optional bool ``[R]``.
    """
    a, active = _check_a(a, active)
    table = _check_table(sps_table, a)
    order, sorted_a = candidate_order(a, active)
    n_active = jnp.sum(active.astype(jnp.int32))
    n_cand = n_active * a.shape[1]
    i = jnp.arange(1, order.shape[0] + 1, dtype=jnp.int32)
    budget = n_active + i
    tau = n_active.astype(jnp.float32) + jnp.cumsum(sorted_a)
    theta = tau * table[budget]
    theta0 = n_active.astype(jnp.float32) * table[n_active]
    prev = jnp.concatenate([theta0[None], theta[:-1]])
    improves = (theta > prev) & (i <= n_cand)
    # Admit the leading run of improvements: everything before the first drop.
    n_admit = jnp.sum(jnp.cumprod(improves.astype(jnp.int32)))
    mask = _mask_from_order(order, n_admit, a.shape)
    expected = n_active.astype(jnp.float32) + jnp.sum(
        jnp.where(jnp.arange(i.shape[0]) < n_admit, sorted_a, 0.0)
    )
    return Schedule(
        mask=mask,
        lengths=jnp.sum(mask, axis=1, dtype=jnp.int32),
        num_tokens=(n_active + n_admit).astype(jnp.int32),
        expected_tau=expected,
    )


# ----------------------------------------------------------------------------------------
# Plain-Python versions (readable, float64), used as test oracles.

SPSLike = Callable[[int], float] | Mapping[int, float] | Sequence[float] | np.ndarray


def _sps_fn(sps: SPSLike) -> Callable[[int], float]:
    if callable(sps):
        return lambda b: float(sps(b))
    if isinstance(sps, Mapping):

        def lookup(b: int) -> float:
            if b not in sps:
                raise ValueError(f"SPS table has no entry for budget B={b}; keys: {sorted(sps)}")
            return float(sps[b])

        return lookup
    arr = np.asarray(sps, dtype=np.float64)

    def index(b: int) -> float:
        if not 0 <= b < arr.shape[0]:
            raise ValueError(f"SPS table of length {arr.shape[0]} has no entry for B={b}")
        return float(arr[b])

    return index


def _reference_prep(a, active):
    a = np.asarray(a, dtype=np.float64)
    if a.ndim != 2:
        raise ValueError(f"survival probabilities a must be [R, γ]; got shape {a.shape}")
    active = np.ones(a.shape[0], bool) if active is None else np.asarray(active, bool)
    if active.shape != a.shape[:1]:
        raise ValueError(f"active must be [R] = [{a.shape[0]}]; got shape {active.shape}")
    a = np.minimum.accumulate(a, axis=1)
    cands = [(r, j) for r in range(a.shape[0]) if active[r] for j in range(a.shape[1])]
    cands.sort(key=lambda c: (-a[c], c[1], c[0]))
    return a, int(active.sum()), cands


def _reference_result(a, admitted, n_active, tau):
    lengths = np.zeros(a.shape[0], np.int64)
    for r, _ in admitted:
        lengths[r] += 1
    return lengths, n_active + len(admitted), tau


def algorithm1_reference(a, sps: SPSLike, active=None) -> tuple[np.ndarray, int, float]:
    """Algorithm 1 exactly as written in DESIGN §5.3, in plain Python.

    ``sps`` is a callable ``B -> steps/s``, a ``{B: sps}`` mapping, or a sequence indexed by
    ``B``. Returns ``(lengths [R], B, τ*)``.
    """
    a, n_active, cands = _reference_prep(a, active)
    sps_at = _sps_fn(sps)
    budget, tau = n_active, float(n_active)
    best = tau * sps_at(budget)
    admitted = []
    for r, j in cands:
        new_tau = tau + a[r, j]
        theta = new_tau * sps_at(budget + 1)
        if theta <= best:
            break  # first non-improvement: stop (this is what keeps it lossless)
        budget, tau, best = budget + 1, new_tau, theta
        admitted.append((r, j))
    return _reference_result(a, admitted, n_active, tau)


def algorithm1_no_early_stop(a, sps: SPSLike, active=None) -> tuple[np.ndarray, int, float]:
    """WRONG variant (paper Appendix A) — for tests only.

    Admits the prefix of the sorted order that maximises Θ globally, i.e. it looks past the
    first drop. Because ``a[r, j+1]`` depends on the sampled ``x_{r,j}``, this lets ``x_{r,j}``
    influence whether it is itself verified, and the output distribution is no longer the
    target's (DESIGN §5.4). Same return convention as ``algorithm1_reference``.
    """
    a, n_active, cands = _reference_prep(a, active)
    sps_at = _sps_fn(sps)
    tau = float(n_active)
    thetas, taus = [tau * sps_at(n_active)], [tau]
    for i, (r, j) in enumerate(cands, start=1):
        tau += a[r, j]
        thetas.append(tau * sps_at(n_active + i))
        taus.append(tau)
    n_admit = int(np.argmax(thetas))  # first maximum
    return _reference_result(a, cands[:n_admit], n_active, taus[n_admit])
