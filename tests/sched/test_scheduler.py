"""Scheduling (DESIGN §5.3–5.4): Algorithm 1, dynamic top-K, policies, SPS profiling."""

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decode.verify import acceptance_probability, residual_distribution, verify_sampling
from dspark_jax.sched.policies import SCHEDULERS, get_scheduler, make_scheduler
from dspark_jax.sched.prefix import (
    algorithm1,
    algorithm1_no_early_stop,
    algorithm1_reference,
)
from dspark_jax.sched.sps import cache_key, load_or_profile, profile_sps
from dspark_jax.sched.topk import admit_topk, budget_index, choose_budget

# ---------------------------------------------------------------------------------------
# Algorithm 1

PAPER_A = np.array([[0.9, 0.54, 0.108], [0.8, 0.4, 0.04]])
PAPER_SPS = {2: 1.0, 3: 0.95, 4: 0.9, 5: 0.85, 6: 0.6, 7: 0.5, 8: 0.4}


def _dense(sps: dict, length: int) -> jnp.ndarray:
    """Dense table indexed by B; sizes below the smallest key use its value."""
    lo = min(sps)
    return jnp.asarray([sps.get(b, sps[lo] if b < lo else 0.0) for b in range(length)])


def test_paper_worked_example():
    # Θ: R=2 -> 2.0; +0.9 -> 2.9·0.95; +0.8 -> 3.7·0.9; +0.54 -> 4.24·0.85 = 3.604;
    # +0.4 -> 4.64·0.6 = 2.784 < 3.604: stop.
    lengths, b, tau = algorithm1_reference(PAPER_A, PAPER_SPS)
    np.testing.assert_array_equal(lengths, [2, 1])
    assert b == 5 and tau - 2 == pytest.approx(2.24)
    sched = algorithm1(PAPER_A, _dense(PAPER_SPS, 9))
    np.testing.assert_array_equal(sched.lengths, [2, 1])
    np.testing.assert_array_equal(sched.mask, [[1, 1, 0], [1, 0, 0]])
    assert int(sched.num_tokens) == 5
    assert float(sched.expected_tau) - 2 == pytest.approx(2.24, abs=1e-6)
    via_policy = make_scheduler("prefix", sps_table=_dense(PAPER_SPS, 9))(PAPER_A)
    np.testing.assert_array_equal(via_policy.lengths, [2, 1])


def _random_case(rng, r, gamma):
    """Quantised (multiples of 2^-8) survivals and SPS, so float32 and float64 agree exactly
    and exact ties in Θ occur (strict improvement is required to admit)."""
    c = rng.uniform(0.0, 1.0, size=(r, gamma)) ** rng.uniform(0.2, 2.0)
    a = np.floor(np.cumprod(c, axis=1) * 256) / 256
    steps = rng.choice([0.0, 0.0, 1 / 256, 8 / 256, 32 / 256], size=r * (gamma + 1) + 1)
    sps = np.maximum(1.0 - np.cumsum(steps), 1 / 256)
    sps = np.floor(sps * 256) / 256
    active = rng.random(r) < 0.8
    return a, sps, active


def test_vectorised_matches_reference_on_random_cases():
    rng = np.random.default_rng(0)
    n_differs_from_broken = 0
    for r, gamma in [(1, 2), (3, 4), (8, 7)]:
        for _ in range(60):
            a, sps, active = _random_case(rng, r, gamma)
            lengths, b, tau = algorithm1_reference(a, sps, active)
            got = algorithm1(a, sps, active)
            np.testing.assert_array_equal(got.lengths, lengths)
            assert int(got.num_tokens) == b
            assert float(got.expected_tau) == pytest.approx(tau, abs=1e-5)
            # Admitted sets are per-slot prefixes, and inactive slots get nothing.
            np.testing.assert_array_equal(got.mask, np.arange(gamma)[None, :] < lengths[:, None])
            assert np.all(lengths[~active] == 0)
            n_differs_from_broken += b != algorithm1_no_early_stop(a, sps, active)[1]
    assert n_differs_from_broken > 0  # the random cases do exercise the early stop


def test_inactive_slots_count_no_anchor():
    # Slot 1 inactive: same answer as the one-slot problem, B counts one anchor only.
    a = np.array([[0.9, 0.6, 0.3], [1.0, 1.0, 1.0]])
    sps = {1: 1.0, 2: 0.8, 3: 0.7, 4: 0.5}
    table = _dense(sps, 9)
    got = algorithm1(a, table, jnp.array([True, False]))
    alone = algorithm1(a[:1], table[:5])
    np.testing.assert_array_equal(got.lengths, [int(alone.lengths[0]), 0])
    assert int(got.num_tokens) == int(alone.num_tokens) == 1 + int(alone.lengths[0])
    assert algorithm1_reference(a, sps, [True, False])[1] == int(got.num_tokens)
    none_active = algorithm1(a, table, jnp.array([False, False]))
    assert int(none_active.num_tokens) == 0 and not bool(none_active.mask.any())


def test_sps_table_too_short_is_a_clear_error():
    with pytest.raises(ValueError, match="sps_table must be 1-D and indexable"):
        algorithm1(PAPER_A, jnp.ones(5))


# ---------------------------------------------------------------------------------------
# Dynamic top-K


def _topk_reference(a, k, active):
    a = np.minimum.accumulate(np.asarray(a, np.float64), axis=1)
    cands = [(r, j) for r in range(a.shape[0]) if active[r] for j in range(a.shape[1])]
    cands.sort(key=lambda c: (-a[c], c[1], c[0]))
    mask = np.zeros(a.shape, bool)
    for c in cands[:k]:
        mask[c] = True
    return mask


def test_admit_topk_is_always_a_prefix_even_with_ties():
    rng = np.random.default_rng(1)
    r, gamma = 5, 4
    for _ in range(40):
        # Coarse values force many exact ties; some rows are not even monotone.
        a = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0], size=(r, gamma))
        active = rng.random(r) < 0.8
        k = int(rng.choice([0, 3, 7, 16, 23]))  # few static K values: few compiles
        sched = admit_topk(a, k, active)
        mask = np.asarray(sched.mask)
        lengths = mask.sum(1)
        np.testing.assert_array_equal(mask, np.arange(gamma)[None, :] < lengths[:, None])
        np.testing.assert_array_equal(mask, _topk_reference(a, k, active))
        assert mask.sum() == min(k, active.sum() * gamma)
        assert int(sched.num_tokens) == active.sum() + mask.sum()


def test_choose_budget_picks_sensible_buckets():
    r, gamma = 4, 3
    buckets = [0, 2, 4, 8, 12]
    flat = _dense({b: 1.0 for b in range(1, 17)}, 17)
    steep = _dense({b: 1.0 / b for b in range(1, 17)}, 17)  # cost grows with every token
    sure = np.ones((r, gamma))
    hopeless = np.full((r, gamma), 1e-3)
    assert choose_budget(sure, flat, buckets) == 12  # free tokens that surely survive
    assert choose_budget(hopeless, steep, buckets) == 0
    # Rounding up: SPS flat up to B = R + 3 = 7, then a cliff; confidences all high, so the
    # best k is 3, which is not a bucket: round up to 4.
    cliff = _dense({b: (1.0 if b <= 7 else 0.1) for b in range(1, 17)}, 17)
    assert choose_budget(sure, cliff, buckets) == 4
    assert choose_budget(sure, cliff, [0, 2, 3, 8]) == 3
    assert int(jax.jit(budget_index, static_argnames="buckets")(sure, cliff, (0, 2, 4))) == 2
    # More optimistic confidences never ask for a smaller budget.
    mid = np.cumprod(np.full((r, gamma), 0.7), axis=1)
    assert choose_budget(hopeless, flat, buckets) <= choose_budget(mid, flat, buckets)
    with pytest.raises(ValueError, match="strictly increasing"):
        choose_budget(sure, flat, [4, 2])


def test_host_budget_equals_the_jitted_search():
    """choose_budget (NumPy, on the host) picks the same bucket as budget_index (jit) on
    random survivals, active masks and SPS tables, including the all-inactive case. A few
    fixed shapes, so the jitted twin compiles three times only."""
    rng = np.random.default_rng(0)
    for r, gamma, buckets in ((1, 3, (0, 1, 3)), (4, 7, (0, 2, 5, 9, 28)), (8, 2, (4, 16))):
        n = r * (gamma + 1) + 1
        for trial in range(40):
            a = np.cumprod(rng.uniform(0.2, 1.0, (r, gamma)), axis=1).astype(np.float32)
            active = rng.random(r) < (0.0 if trial == 0 else 0.8)
            table = np.sort(rng.uniform(0.1, 1.0, n))[::-1].astype(np.float32)
            want = buckets[int(budget_index(a, table, buckets, active))]
            assert choose_budget(a, table, buckets, active) == want, (r, gamma, trial)


# ---------------------------------------------------------------------------------------
# Policies


def test_policies_and_registry():
    a = np.array([[0.9, 0.6, 0.3], [0.4, 0.2, 0.1]])
    active = jnp.array([True, True])
    np.testing.assert_array_equal(make_scheduler("none")(a, active).lengths, [0, 0])
    np.testing.assert_array_equal(make_scheduler("fixed")(a, active).lengths, [3, 3])
    np.testing.assert_array_equal(make_scheduler("fixed", length=1)(a).lengths, [1, 1])
    thr = make_scheduler("threshold", threshold=0.5)(a)
    np.testing.assert_array_equal(thr.lengths, [2, 0])
    assert float(thr.expected_tau) == pytest.approx(2 + 0.9 + 0.6)
    np.testing.assert_array_equal(make_scheduler("topk", budget=4)(a).lengths, [3, 1])
    np.testing.assert_array_equal(
        make_scheduler("fixed")(a, jnp.array([False, True])).lengths, [0, 3]
    )
    assert set(SCHEDULERS) == {"none", "fixed", "threshold", "prefix", "topk"}
    with pytest.raises(ValueError, match="allowed: fixed, none, prefix, threshold, topk"):
        get_scheduler("greedy")
    with pytest.raises(ValueError, match="needs sps_table"):
        make_scheduler("prefix")
    with pytest.raises(ValueError, match="needs budget"):
        make_scheduler("topk")
    with pytest.raises(ValueError, match="does not take"):
        make_scheduler("fixed", budget=3)
    with pytest.raises(ValueError, match=r"threshold must be a number in \[0, 1\]"):
        make_scheduler("threshold", threshold=1.5)


# ---------------------------------------------------------------------------------------
# Appendix A: non-anticipation, computed exactly

P_T = np.array([0.7, 0.3])  # target, every position, over {A, B}
P_D = np.array([0.5, 0.5])  # draft, every position
C1 = 0.9  # confidence for x_1: a constant (it may only depend on the context)
C2 = {0: 0.9, 1: 0.1}  # confidence for x_2 given x_1 = A (0) or B (1)
SPS_A = {1: 1.0, 2: 0.5, 3: 0.45}
TABLE_A = _dense(SPS_A, 4)


def _exact_first_token_prob_a(n_verify_for):
    """P(first output token = A), enumerating the draft draws x_1, x_2 and, in closed form,
    the accept/reject events of ``verify_sampling``'s rule (the same
    ``acceptance_probability`` / ``residual_distribution`` functions it calls).

    ``n_verify_for(a [1, 2], x1)`` returns how many draft tokens the scheduler verifies.
    """
    p_t, p_d = jnp.asarray(P_T, jnp.float32), jnp.asarray(P_D, jnp.float32)
    total = np.zeros(2)
    for x1 in (0, 1):
        for x2 in (0, 1):
            a = np.array([[C1, C1 * C2[x1]]])
            n = int(n_verify_for(a, x1))
            if n == 0:  # only the bonus token, drawn from the target
                dist = P_T
            else:  # x_1 accepted, or a draw from the residual
                alpha = float(acceptance_probability(p_t[x1], p_d[x1]))
                dist = alpha * np.eye(2)[x1] + (1 - alpha) * np.asarray(
                    residual_distribution(p_t, p_d), np.float64
                )
            total += P_D[x1] * P_D[x2] * dist
    return total[0]


def test_appendix_a_counterexample_exact():
    """Paper Appendix A: target (0.7, 0.3), draft (0.5, 0.5), R = 1, γ = 2,
    SPS = (1.0, 0.5, 0.45) for B = 1, 2, 3.

    Confidences: c_1 = 0.9 (constant), c_2 = 0.9 if x_1 = A else 0.1, so a = (0.9, 0.81)
    after A and (0.9, 0.09) after B. Θ for verifying 0, 1, 2 drafts:
      x_1 = A: 1·1.0 = 1,  1.9·0.5 = 0.95,  2.71·0.45 = 1.2195
      x_1 = B: 1,          0.95,            1.99·0.45 = 0.8955
    Algorithm 1 stops at the first drop (0.95 < 1) and never verifies anything, whatever
    x_1 is. Without the early stop the global argmax verifies both drafts exactly when
    x_1 = A: x_1 then decides whether x_1 is verified, and since A is always accepted
    (min(1, 0.7/0.5) = 1), P(A) = 0.5·1 + 0.5·0.7 = 0.85 instead of 0.7.
    Fixed length, threshold and top-K with the budget taken from *older* confidences choose
    n_verify without looking at x_1, so they stay exact.
    """

    def no_early_stop(a, x1):
        return algorithm1_no_early_stop(a, SPS_A)[0][0]

    assert _exact_first_token_prob_a(no_early_stop) == pytest.approx(0.85, abs=1e-6)

    def alg1(a, x1):
        n = int(algorithm1(a, TABLE_A).lengths[0])
        assert n == algorithm1_reference(a, SPS_A)[0][0]
        return n

    shipped = {
        "algorithm1": alg1,
        "fixed": lambda a, x1: make_scheduler("fixed")(a).lengths[0],
        "threshold": lambda a, x1: make_scheduler("threshold", threshold=0.5)(a).lengths[0],
    }
    for a_old in ([[0.9, 0.81]], [[0.9, 0.09]]):  # either older round; K=2 and K=0
        k = choose_budget(np.array(a_old), TABLE_A, [0, 1, 2])
        shipped[f"topk(K={k})"] = lambda a, x1, k=k: admit_topk(a, k).lengths[0]
    assert {"topk(K=2)", "topk(K=0)"} <= set(shipped)
    for name, fn in shipped.items():
        assert _exact_first_token_prob_a(fn) == pytest.approx(0.7, abs=1e-6), name

    # Choosing K by a global search over the *current* confidences is the same bug.
    def topk_current(a, x1):
        return admit_topk(a, choose_budget(a, TABLE_A, [0, 1, 2])).lengths[0]

    assert _exact_first_token_prob_a(topk_current) == pytest.approx(0.85, abs=1e-6)


def test_appendix_a_by_simulation_with_verify_sampling():
    """The same setting run through the real ``verify_sampling`` (200k slots): the empirical
    frequency agrees with the exact enumeration above."""
    n = 200_000
    k_x1, k_x2, k_v = jax.random.split(jax.random.key(0), 3)
    x1 = jax.random.bernoulli(k_x1, 0.5, (n,)).astype(jnp.int32)  # 1 = B
    x2 = jax.random.bernoulli(k_x2, 0.5, (n,)).astype(jnp.int32)
    drafts = jnp.stack([x1, x2], 1)
    draft_probs = jnp.broadcast_to(jnp.asarray(P_D, jnp.float32), (n, 2, 2))
    target_probs = jnp.broadcast_to(jnp.asarray(P_T, jnp.float32), (n, 3, 2))
    table = {x: algorithm1_no_early_stop(np.array([[C1, C1 * C2[x]]]), SPS_A)[0][0] for x in (0, 1)}
    for n_by_x1, expected in ((jnp.asarray([table[0], table[1]]), 0.85), (jnp.zeros(2, int), 0.7)):
        n_verify = n_by_x1[x1]
        _, _, out = verify_sampling(k_v, drafts, draft_probs, target_probs, n_verify)
        freq = float(jnp.mean(out[:, 0] == 0))
        assert abs(freq - expected) < 4 * np.sqrt(expected * (1 - expected) / n), (freq, expected)


# ---------------------------------------------------------------------------------------
# SPS profiling


def _sleeper(seconds):
    def step():
        time.sleep(seconds)
        return jnp.zeros(())

    return step


def test_profile_sps_is_monotone_and_stepped():
    # B = 4 is made slower than B = 8 on purpose: the table must not believe it.
    fns = {2: _sleeper(0.002), 4: _sleeper(0.03), 8: _sleeper(0.01)}
    table = profile_sps(fns, repeats=3, warmup=1)
    assert table.buckets == (2, 4, 8)
    assert table.seconds[1] > table.seconds[2]  # raw measurement kept
    assert table.sps[0] >= table.sps[1] >= table.sps[2]
    assert table.sps[2] == table.sps[1]  # running minimum
    dense = np.asarray(table.as_array(11))
    assert np.all(np.diff(dense) <= 0)
    assert dense[3] == pytest.approx(table.sps[1]) and dense[0] == pytest.approx(table.sps[0])
    assert dense[5] == pytest.approx(table(8)) and dense[9] == 0.0  # beyond the largest
    with pytest.raises(ValueError, match="empty"):
        profile_sps({})


def test_sps_json_cache_is_reused(tmp_path):
    calls = {"n": 0}

    def step():
        calls["n"] += 1
        return jnp.ones(3) * 2

    path = tmp_path / "sps.json"
    key = cache_key("tiny-model", "R=4,gamma=3")
    first = load_or_profile(str(path), key, {4: step, 8: step}, repeats=2, warmup=1)
    assert calls["n"] == 6 and path.exists()
    again = load_or_profile(str(path), key, {4: step, 8: step}, repeats=2, warmup=1)
    assert calls["n"] == 6 and again == first  # cache hit: nothing ran
    other = load_or_profile(str(path), key + "-other", {4: step}, repeats=1, warmup=0)
    assert calls["n"] == 7 and other.buckets == (4,)
    assert set(json.loads(path.read_text())) == {key, key + "-other"}
    # Different buckets under the same key re-profile.
    load_or_profile(str(path), key, {4: step}, repeats=1, warmup=0)
    assert calls["n"] == 8
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_or_profile(str(path), key, {4: step})
