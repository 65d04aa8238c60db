"""Dynamic top-K scheduling, the asynchronous production mode (DESIGN §5.3).

The verify budget ``K`` (draft tokens per round, summed over slots) selects which compiled
shape runs, so the host must know it before the round starts. It is therefore chosen from
*older* survival probabilities (two rounds back): for every ``k`` the expected throughput
``Θ(k) = (R + Σ top-k a_old) · SPS(R + k)`` is evaluated, the global argmax is taken, and it
is rounded UP to the nearest compiled bucket. Rounding up never loses throughput under the
stepped SPS table (``SPS(B)`` of a non-bucket size is that of the next bucket, which is what
actually runs), since admitting more tokens in the same shape only raises τ*; rounding down
could cut tokens the search wanted. A global search is safe here only because ``a_old`` does
not depend on the current round's drafts.

The current round then admits the top-``K`` entries of the *current* ``a`` (ordered by
survival, ties by smaller ``j`` then ``r``, after a running minimum along ``j``), which is
always a per-slot prefix and never lets a token decide its own admission (DESIGN §5.4).
Slot/anchor accounting matches ``dspark_jax.sched.prefix`` (active slots only).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.sched.prefix import (
    Schedule,
    _check_a,
    _check_table,
    _mask_from_order,
    candidate_order,
)

__all__ = ["admit_topk", "best_budget", "budget_index", "choose_budget", "expected_throughput"]


def _check_buckets(buckets) -> tuple[int, ...]:
    b = tuple(int(x) for x in buckets)
    if not b or any(x < 0 for x in b) or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(
            f"buckets must be a non-empty, strictly increasing list of budgets >= 0; got {b}"
        )
    return b


def expected_throughput(a, sps_table, active=None) -> jax.Array:
    """``Θ(k)`` for ``k = 0 … R·γ``: expected tokens/s when the top-``k`` survivals are
    verified. Returns float32 ``[R·γ + 1]``."""
    a, active = _check_a(a, active)
    table = _check_table(sps_table, a)
    _, sorted_a = candidate_order(a, active)
    n_active = jnp.sum(active.astype(jnp.int32))
    k = jnp.arange(sorted_a.shape[0] + 1)
    tau = n_active + jnp.concatenate([jnp.zeros(1), jnp.cumsum(sorted_a)])
    theta = tau * table[n_active + k]
    # Only n_active·γ real candidates exist; larger k is not a choice.
    return jnp.where(k <= n_active * a.shape[1], theta, -jnp.inf)


@partial(jax.jit, static_argnames="buckets")
def budget_index(a_old, sps_table, buckets: tuple[int, ...], active=None) -> jax.Array:
    """On-device twin of ``choose_budget``: int32 index into ``buckets`` (for jitted
    callers; the serving host uses the NumPy ``choose_budget``, which never waits)."""
    theta = expected_throughput(a_old, sps_table, active)
    buckets_arr = jnp.asarray(buckets, jnp.int32)
    theta = jnp.where(jnp.arange(theta.shape[0]) <= buckets[-1], theta, -jnp.inf)
    k_star = jnp.argmax(theta)  # first maximum: the smallest best budget
    return jnp.minimum(jnp.searchsorted(buckets_arr, k_star, side="left"), len(buckets) - 1)


def choose_budget(a_old, sps_table, buckets: Sequence[int], active=None) -> int:
    """Pick the compiled budget ``K`` for the next round from old survivals, in NumPy.

    This runs on the host while the device executes the round in flight, so it must not
    touch the device: a jitted call (``budget_index``) would be queued behind that round
    and the host would wait for it (DESIGN §9). Same result as ``budget_index``: only the
    *sorted values* of the running-min survivals enter ``Θ``, so no tie-breaking is needed.

    Args:
      a_old: float ``[R, γ]`` survival probabilities from an earlier round (host arrays).
      sps_table: ``SPS(B)`` indexed by ``B``, length ``>= R·(γ+1)+1``.
      buckets: strictly increasing compiled budgets (draft tokens per round).
      active: optional bool ``[R]``.

    Returns:
      The smallest bucket ``>= argmax_k Θ(k)`` (the largest bucket if none is).
    """
    return best_budget(a_old, sps_table, buckets, active)[0]


def best_budget(a_old, sps_table, buckets: Sequence[int], active=None) -> tuple[int, float]:
    """``choose_budget``'s bucket and ``max_k Θ(k)``, the expected tokens/s of the best
    drafting round on these survivals (what the draft-aware policy, ``decode.policy``,
    compares with a plain round's)."""
    b = _check_buckets(buckets)
    a = np.asarray(a_old, np.float32)
    if a.ndim != 2:
        raise ValueError(f"survival probabilities a must be [R, γ]; got shape {a.shape}")
    r, gamma = a.shape
    act = np.ones(r, bool) if active is None else np.asarray(active, bool)
    if act.shape != (r,):
        raise ValueError(f"active must be [R] = [{r}]; got shape {act.shape}")
    table = np.asarray(sps_table, np.float32)
    if table.ndim != 1 or table.shape[0] < r * (gamma + 1) + 1:
        raise ValueError(
            f"sps_table must be 1-D with length >= R·(γ+1)+1 = {r * (gamma + 1) + 1}; got "
            f"shape {table.shape}"
        )
    n_active = int(act.sum())
    # Running minimum along j makes the admitted set a per-slot prefix (as candidate_order).
    cands = np.maximum(np.minimum.accumulate(a[act], axis=1).reshape(-1), 0.0)
    sorted_a = -np.sort(-cands)
    k_max = min(n_active * gamma, b[-1])  # candidates that exist and fit the largest bucket
    tau = n_active + np.concatenate([[0.0], np.cumsum(sorted_a, dtype=np.float32)])[: k_max + 1]
    theta = tau * table[n_active : n_active + k_max + 1]
    k_star = int(np.argmax(theta))  # first maximum: the smallest best budget
    return b[min(int(np.searchsorted(b, k_star, side="left")), len(b) - 1)], float(theta[k_star])


@partial(jax.jit, static_argnames="k")
def admit_topk(a_current, k: int, active=None, limit=None) -> Schedule:
    """Admit the top-``k`` current survival probabilities (``k`` static = the bucket size).

    Returns a ``Schedule``; fewer than ``k`` tokens are admitted only when fewer candidates
    exist (``#active · γ``) or ``limit`` (a traced budget ``<= k``: a data replica's own,
    ``decode.replicas``) is smaller.
    """
    if not isinstance(k, int | np.integer) or k < 0:
        raise ValueError(f"top-K budget k must be a non-negative int; got {k!r}")
    a, active = _check_a(a_current, active)
    order, sorted_a = candidate_order(a, active)
    n_active = jnp.sum(active.astype(jnp.int32))
    n_admit = jnp.minimum(k, n_active * a.shape[1])
    if limit is not None:
        n_admit = jnp.minimum(n_admit, limit)
    mask = _mask_from_order(order, n_admit, a.shape)
    ranks = jnp.arange(sorted_a.shape[0])
    return Schedule(
        mask=mask,
        lengths=jnp.sum(mask, axis=1, dtype=jnp.int32),
        num_tokens=(n_active + n_admit).astype(jnp.int32),
        expected_tau=n_active + jnp.sum(jnp.where(ranks < n_admit, sorted_a, 0.0)),
    )
