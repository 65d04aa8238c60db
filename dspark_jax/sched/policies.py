"""Verification policies (the serving arms of DESIGN §7) behind one interface.

Every policy maps survival probabilities ``a [R, γ]`` (and an optional ``active [R]`` mask)
to a ``Schedule`` whose ``lengths`` are the ``n_verify`` argument of
``dspark_jax.decode.verify``. All are jit-able with fixed shapes and admit per-slot prefixes
chosen without looking at the tokens they admit (DESIGN §5.4).

    none       ℓ = 0: no speculation, only the anchor is verified.
    fixed      ℓ = γ (or ``length``): verify every draft token.
    threshold  admit j while a[r, j] >= ``threshold`` (static confidence threshold).
    prefix     Algorithm 1 with an SPS table (``sps_table``).
    topk       admit the top-``budget`` current survivals (dynamic top-K; the budget itself
               comes from ``dspark_jax.sched.topk.choose_budget`` on older confidences).

Use ``make_scheduler(name, **params)`` to get ``fn(a, active=None) -> Schedule``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.sched.prefix import Schedule, _check_a, algorithm1, running_min
from dspark_jax.sched.topk import admit_topk

__all__ = [
    "SCHEDULERS",
    "Schedule",
    "fixed",
    "make_scheduler",
    "no_speculation",
    "prefix",
    "threshold",
    "topk",
]


def _from_mask(a, mask, active) -> Schedule:
    n_active = jnp.sum(active.astype(jnp.int32))
    mask = mask & active[:, None]
    return Schedule(
        mask=mask,
        lengths=jnp.sum(mask, axis=1, dtype=jnp.int32),
        num_tokens=(n_active + jnp.sum(mask, dtype=jnp.int32)).astype(jnp.int32),
        expected_tau=n_active + jnp.sum(jnp.where(mask, running_min(a), 0.0)),
    )


def no_speculation(a, active=None) -> Schedule:
    """Verify nothing but the anchor (ℓ = 0)."""
    a, active = _check_a(a, active)
    return _from_mask(a, jnp.zeros(a.shape, bool), active)


def fixed(a, active=None, length: int | None = None) -> Schedule:
    """Verify the first ``length`` drafts of every active slot (default all γ)."""
    a, active = _check_a(a, active)
    gamma = a.shape[1]
    length = gamma if length is None else length
    if not isinstance(length, int | np.integer) or not 0 <= length <= gamma:
        raise ValueError(f"fixed length must be an int in [0, γ={gamma}]; got {length!r}")
    mask = jnp.broadcast_to(jnp.arange(gamma) < length, a.shape)
    return _from_mask(a, mask, active)


def threshold(a, active=None, threshold: float = 0.5) -> Schedule:
    """Admit ``j`` while ``a[r, j] >= threshold`` (a prefix, thanks to the running min)."""
    a, active = _check_a(a, active)
    return _from_mask(a, running_min(a) >= threshold, active)


def prefix(a, active=None, sps_table=None) -> Schedule:
    """Algorithm 1 (``dspark_jax.sched.prefix.algorithm1``)."""
    if sps_table is None:
        raise ValueError("the 'prefix' scheduler needs sps_table (SPSTable.as_array(...))")
    return algorithm1(a, sps_table, active)


def topk(a, active=None, budget: int | None = None) -> Schedule:
    """Admit the top-``budget`` current survivals (``budget`` = the compiled bucket)."""
    if budget is None:
        raise ValueError("the 'topk' scheduler needs budget=K (a compiled bucket size)")
    return admit_topk(a, budget, active)


SCHEDULERS: dict[str, Callable[..., Schedule]] = {
    "none": no_speculation,
    "fixed": fixed,
    "threshold": threshold,
    "prefix": prefix,
    "topk": topk,
}

_PARAMS = {
    "none": set(),
    "fixed": {"length"},
    "threshold": {"threshold"},
    "prefix": {"sps_table"},
    "topk": {"budget"},
}


def get_scheduler(name: str) -> Callable[..., Schedule]:
    """Look up a policy by name; unknown names list the allowed ones."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; allowed: {', '.join(sorted(SCHEDULERS))}")
    return SCHEDULERS[name]


def make_scheduler(name: str, **params) -> Callable[..., Schedule]:
    """Bind a policy's parameters: returns a jitted ``fn(a, active=None) -> Schedule``.

    Parameters: ``fixed(length=None)``, ``threshold(threshold=0.5)``,
    ``prefix(sps_table=...)``, ``topk(budget=K)``; ``none`` takes none.
    """
    fn = get_scheduler(name)
    unknown = set(params) - _PARAMS[name]
    if unknown:
        raise ValueError(
            f"scheduler {name!r} does not take {sorted(unknown)}; "
            f"its parameters: {sorted(_PARAMS[name]) or 'none'}"
        )
    if name == "threshold" and "threshold" in params:
        t = params["threshold"]
        if not isinstance(t, int | float) or not 0.0 <= t <= 1.0:
            raise ValueError(f"threshold must be a number in [0, 1]; got {t!r}")
    if name == "prefix":
        sps_table = params.get("sps_table")
        if sps_table is None:
            raise ValueError("the 'prefix' scheduler needs sps_table (SPSTable.as_array(...))")
        table = jnp.asarray(sps_table, jnp.float32)
        return jax.jit(lambda a, active=None: algorithm1(a, table, active))
    if name == "topk":
        budget = params.get("budget")
        if not isinstance(budget, int | np.integer) or budget < 0:
            raise ValueError(f"the 'topk' scheduler needs budget=K, an int >= 0; got {budget!r}")
    return jax.jit(partial(fn, **params))
