"""SPS profiling on the decoder's own compiled rounds (``sched.sps``): one callable per
verify bucket that runs a round of exactly that many verified drafts."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.sharding import place_host_tree

Array = jax.Array

__all__ = ["plain_step_fn", "profile_step_fns"]


def profile_step_fns(
    dec, budgets, seed: int = 0, context_len: int = 1
) -> dict[int, Callable[[], Array]]:
    """One zero-argument callable per verify budget ``K``, keyed by ``B = R + K``.

    Each call runs the decoder's own compiled round at that bucket on a state where
    every slot is active, holds ``context_len`` committed positions (attention reads
    each slot's pages up to its length, so a round's cost grows with it) and exactly
    ``K`` drafts are verified (``topk`` through the fused round, every other arm
    through ``plan`` + ``commit`` with the plan's lengths filled to ``K``), then resets
    the slots so repeated calls never run out of room.
    Feed the result to ``dspark_jax.sched.sps.profile_sps`` / ``load_or_profile``.
    """
    c, g = dec.config, dec.gamma
    ks = sorted({dec._check_budget(k) for k in budgets})
    if not ks:
        raise ValueError("profile_step_fns needs at least one budget")
    holder, fresh = _profiling_state(dec, seed, context_len)
    rl = dec.replica_slots  # B = R + K of one replica (each verifies K of its own)

    def make(k):
        # K drafts spread over each replica's slots (sizes differ by at most one).
        one = np.minimum(k // rl + (np.arange(rl) < k % rl), g).astype(np.int32)
        fill = np.tile(one, dec.replicas)
        if dec.mesh is None:
            fill = jnp.asarray(fill)
        else:
            fill = place_host_tree(fill, dec._state_shardings.seq_len)

        def step():
            st = holder[0]
            # The rounds run before any table exists (profiling makes it).
            if c.scheduler == "topk":
                st, out = dec._run_round(st, k)
            else:
                st, plan = dec._run_plan(st)
                plan = plan._replace(lengths=fill)
                st, out = dec.commit(st, plan, k)
            holder[0] = fresh(st)
            return out.tokens

        return step

    return {rl + k: make(k) for k in ks}


def plain_step_fn(dec, seed: int = 0, context_len: int = 1) -> Callable[[], Array]:
    """A zero-argument callable running the decoder's plain round (``plain_round``) on
    the same state as ``profile_step_fns``' rounds: ``sched.sps.profile_sps``' ``plain_fn``."""
    holder, fresh = _profiling_state(dec, seed, context_len)

    def step():
        st, out = dec.plain_round(holder[0])
        holder[0] = fresh(st)
        return out.tokens

    return step


def _profiling_state(dec, seed: int, context_len: int):
    """A one-element list holding a state with every slot active at ``context_len``
    positions, and the function that resets a state to it after a round."""
    c, r, g = dec.config, dec.config.num_slots, dec.gamma
    if c.max_len < g + 3:
        raise ValueError(f"max_len {c.max_len} is too small to profile γ={g} (need >= γ+3)")
    if not 1 <= context_len <= c.max_len - g - 1:
        raise ValueError(
            f"context_len must be in [1, max_len - γ - 1 = {c.max_len - g - 1}] so a "
            f"round's γ + 1 positions fit, got {context_len}"
        )
    reset = dict(
        seq_len=np.full((r,), context_len, np.int32),
        anchor=np.zeros((r,), np.int32),
        active=np.ones((r,), bool),
        remaining=np.full((r,), c.max_len, np.int32),
        temperature=np.full((r,), 1.0 if c.sampling else 0.0, np.float32),
    )

    def fresh(st):
        st = st._replace(**{name: jnp.asarray(v) for name, v in reset.items()})
        return st if dec.mesh is None else dec._relayout(st)

    return [fresh(dec.init_state(seed))], fresh
