"""Logit processing and lossless verification (DESIGN §5.1)."""

from functools import partial

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax.decode.verify import (
    PAD_TOKEN,
    acceptance_probability,
    residual_distribution,
    verify_coupled,
    verify_greedy,
    verify_sampling,
)
from dspark_jax.ops.sampling import gumbel_max, position_keys, process_logits, sample

# ---------------------------------------------------------------------------------------
# process_logits


class ProcessLogitsTest(chex.TestCase):
    """Logit processing gives the same distributions traced under jit (as the decode step
    runs it) and op by op (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_process_logits_temperature_matches_softmax(self):
        process = self.variant(process_logits)
        logits = jnp.array([[1.0, 2.0, 0.5, -1.0], [0.0, 0.0, 3.0, 1.0]])
        for t in (0.5, 1.0, 2.0):
            probs = process(logits, t)
            chex.assert_shape(probs, logits.shape)
            chex.assert_trees_all_close(probs, jax.nn.softmax(logits / t, -1), rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_process_logits_greedy_is_point_mass_on_argmax(self):
        logits = jnp.array([[1.0, 3.0, 3.0, 0.0], [5.0, 0.0, 1.0, 2.0]])
        probs = self.variant(process_logits)(logits, jnp.array([0.0, 1.0]))
        # first index on ties
        chex.assert_trees_all_equal(probs[0], jnp.array([0.0, 1.0, 0.0, 0.0]))
        chex.assert_trees_all_close(probs[1], jax.nn.softmax(logits[1]), rtol=1e-6)


def test_process_logits_top_k_and_top_p():
    logits = jnp.log(jnp.array([0.1, 0.4, 0.05, 0.3, 0.15]))
    top2 = process_logits(logits, 1.0, top_k=2)
    np.testing.assert_allclose(top2, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0], rtol=1e-6)
    # Smallest set with mass >= 0.7 is {0.4, 0.3}; >= 0.71 needs 0.15 too.
    np.testing.assert_allclose(process_logits(logits, 1.0, top_p=0.7), top2, rtol=1e-6)
    p71 = process_logits(logits, 1.0, top_p=0.71)
    np.testing.assert_allclose(p71, np.array([0, 0.4, 0, 0.3, 0.15]) / 0.85, rtol=1e-6)
    # The argmax survives even a tiny top_p; top-p is applied after top-k renormalisation.
    np.testing.assert_allclose(process_logits(logits, 1.0, top_p=1e-4), [0, 1, 0, 0, 0])
    # top_p = 0.8 alone needs three tokens (0.4 + 0.3 < 0.8); after top-3 renormalisation
    # the first two already hold 0.7 / 0.85 = 0.82 >= 0.8.
    np.testing.assert_allclose(process_logits(logits, 1.0, top_p=0.8), p71, rtol=1e-6)
    np.testing.assert_allclose(process_logits(logits, 1.0, top_k=3, top_p=0.8), top2, rtol=1e-6)


def test_process_logits_per_row_params_under_jit():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(3, 2, 7)), jnp.float32)
    temp, k, p = jnp.array([1.0, 0.5, 2.0]), jnp.array([0, 3, 1]), jnp.array([1.0, 1.0, 0.9])
    out = jax.jit(process_logits)(logits, temp, k, p)
    chex.assert_shape(out, logits.shape)
    for r in range(3):
        row = process_logits(logits[r], float(temp[r]), int(k[r]), float(p[r]))
        chex.assert_trees_all_close(out[r], row, rtol=1e-6)
    np.testing.assert_array_equal(np.sum(np.asarray(out[1]) > 0, -1), [3, 3])
    np.testing.assert_array_equal(np.sum(np.asarray(out[2]) > 0, -1), [1, 1])
    np.testing.assert_allclose(np.sum(np.asarray(out), -1), 1.0, rtol=1e-6)


def test_process_logits_bad_params_raise_clearly():
    logits = jnp.zeros((2, 5))
    with pytest.raises(ValueError, match="top_p"):
        process_logits(logits, 1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        process_logits(logits, 1.0, top_k=-1)
    with pytest.raises(ValueError, match="temperature"):
        process_logits(logits, -0.5)
    with pytest.raises(ValueError, match="prefix of the logits' batch shape"):
        process_logits(logits, jnp.ones(3))


# ---------------------------------------------------------------------------------------
# verify_greedy


def _onehot_logits(tokens, v):
    return jax.nn.one_hot(jnp.asarray(tokens), v) * 5.0


class VerifyGreedyTest(chex.TestCase):
    """Greedy verification traced under jit (as the decode step runs it) and op by op
    (chex variants of the function ``verify_greedy`` jits): the same verdicts."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_verify_greedy_accepts_matching_prefix_then_target_token(self):
        verify = self.variant(verify_greedy.__wrapped__)
        target = jnp.array([[3, 4, 5, 6], [3, 9, 5, 6], [7, 4, 5, 6]])  # [R, γ+1]
        drafts = jnp.array([[3, 4, 5], [3, 4, 5], [3, 4, 5]])
        logits = _onehot_logits(target, 10)
        got = verify(drafts, logits, jnp.array([3, 3, 3]))
        want = (
            np.array([3, 1, 0], np.int32),
            np.array([6, 9, 7], np.int32),  # bonus / correction / correction
            np.array(
                [[3, 4, 5, 6], [3, 9, PAD_TOKEN, PAD_TOKEN], [7, PAD_TOKEN, PAD_TOKEN, PAD_TOKEN]],
                np.int32,
            ),
        )
        chex.assert_trees_all_equal(tuple(got), want, strict=True)
        # Already-argmaxed target tokens give the same answer.
        chex.assert_trees_all_equal(tuple(verify(drafts, target, jnp.array([3, 3, 3]))), want)

    @chex.variants(with_jit=True, without_jit=True)
    def test_verify_greedy_pruned_positions_never_accepted(self):
        target = jnp.tile(jnp.array([[1, 2, 3, 4]]), (4, 1))
        drafts = jnp.tile(jnp.array([[1, 2, 3]]), (4, 1))  # all would match
        logits = _onehot_logits(target, 6)
        # Garbage (NaN) in rows past n_verify must not matter: they were never computed.
        pos = jnp.arange(4)[None, :, None]
        n = jnp.array([0, 1, 2, 3])
        logits = jnp.where(pos > n[:, None, None], jnp.nan, logits)
        acc, nxt, out = self.variant(verify_greedy.__wrapped__)(drafts, logits, n)
        chex.assert_shape(out, (4, 4))
        chex.assert_trees_all_equal(
            (acc, nxt, out[1]),
            (
                np.array([0, 1, 2, 3]),
                np.array([1, 2, 3, 4]),
                np.array([1, 2, PAD_TOKEN, PAD_TOKEN]),
            ),
        )  # the bonus token at position n_verify

    @chex.variants(with_jit=True, without_jit=True)
    def test_verify_greedy_inactive_slots(self):
        target = jnp.array([[1, 2, 3], [1, 2, 3]])
        drafts = jnp.array([[1, 2], [1, 2]])
        verify = self.variant(verify_greedy.__wrapped__)
        acc, nxt, out = verify(drafts, target, jnp.array([2, 2]), jnp.array([True, False]))
        chex.assert_trees_all_equal(
            (acc, nxt, out[1]),
            (np.array([2, 0]), np.array([3, PAD_TOKEN]), np.array([PAD_TOKEN] * 3)),
        )


def test_verify_shape_errors_are_clear():
    with pytest.raises(ValueError, match=r"target_logits must be \[R, γ\+1, V\]"):
        verify_greedy(jnp.zeros((2, 3), int), jnp.zeros((2, 3, 5)), jnp.zeros(2, int))
    with pytest.raises(ValueError, match="n_verify must be"):
        verify_greedy(jnp.zeros((2, 3), int), jnp.zeros((2, 4, 5)), jnp.zeros(3, int))
    with pytest.raises(ValueError, match="draft_probs must be"):
        verify_sampling(
            jax.random.key(0),
            jnp.zeros((2, 3), int),
            jnp.zeros((2, 3, 4)),
            jnp.zeros((2, 4, 5)),
            jnp.zeros(2, int),
        )


# ---------------------------------------------------------------------------------------
# verify_sampling: unit behaviour


class AcceptanceRuleTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_residual_and_acceptance_formulas(self):
        accept, residual = self.variant(acceptance_probability), self.variant(residual_distribution)
        p_t = jnp.array([0.7, 0.3, 0.0])
        p_d = jnp.array([0.5, 0.25, 0.25])
        chex.assert_trees_all_close(accept(p_t, p_d), jnp.array([1.0, 1.0, 0.0]), rtol=1e-7)
        chex.assert_trees_all_close(residual(p_t, p_d), jnp.array([0.8, 0.2, 0.0]), rtol=1e-6)
        # No residual mass (p_t == p_d): fall back to p_t.
        chex.assert_trees_all_close(residual(p_t, p_t), p_t, rtol=1e-7)


def test_verify_sampling_identical_distributions_accept_all_verified():
    r, g, v = 6, 3, 5
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(1), (r, g + 1, v)), -1)
    drafts = sample(jax.random.key(2), probs[:, :g])
    n = jnp.array([0, 1, 2, 3, 3, 2])
    # Pruned target rows hold NaN; they must never be read.
    tp = jnp.where(jnp.arange(g + 1)[None, :, None] > n[:, None, None], jnp.nan, probs)
    active = jnp.array([True] * 5 + [False])
    acc, nxt, out = verify_sampling(jax.random.key(3), drafts, probs[:, :g], tp, n, active)
    chex.assert_shape([acc, nxt], (r,))
    chex.assert_shape(out, (r, g + 1))
    np.testing.assert_array_equal(acc, [0, 1, 2, 3, 3, 0])
    assert np.all(np.asarray(nxt[:5]) >= 0) and int(nxt[5]) == PAD_TOKEN
    np.testing.assert_array_equal(out[3, :3], drafts[3])
    np.testing.assert_array_equal(out[5], [PAD_TOKEN] * (g + 1))


def test_verify_sampling_with_greedy_processing_equals_verify_greedy():
    r, g, v = 64, 4, 6
    k1, k2 = jax.random.split(jax.random.key(4))
    t_logits = jax.random.normal(k1, (r, g + 1, v))
    d_logits = t_logits + 0.8 * jax.random.normal(k2, (r, g + 1, v))
    drafts = jnp.argmax(d_logits[:, :g], -1)
    n = jnp.arange(r) % (g + 1)
    greedy = verify_greedy(drafts, t_logits, n)
    sampled = verify_sampling(
        jax.random.key(5),
        drafts,
        process_logits(d_logits[:, :g], 0.0),
        process_logits(t_logits, 0.0),
        n,
    )
    assert int(jnp.sum(greedy[0])) > 0  # the case is not trivial
    for x, y in zip(sampled, greedy):
        np.testing.assert_array_equal(x, y)


# ---------------------------------------------------------------------------------------
# verify_sampling: the output distribution is exactly the target's (chi-square)

V, GAMMA, R = 5, 3, 200_000
ALPHA = 1e-4


def _markov_tables(seed, temperature, top_k, top_p):
    """Target/draft as Markov chains over V tokens (row = previous token), processed the
    same way, so the target conditional at every drafted position is known in closed form."""
    rng = np.random.default_rng(seed)
    t_logits = rng.normal(size=(V, V)) * 1.5
    d_logits = t_logits + rng.normal(size=(V, V))
    return (
        process_logits(t_logits, temperature, top_k, top_p),
        process_logits(d_logits, temperature, top_k, top_p),
    )


@partial(jax.jit, static_argnames="verify_fn")
def _round(key, ctx, p_t, p_d, n_verify, verify_fn):
    """One speculative round per slot from context token ``ctx [R]``."""
    k_draft, k_verify = jax.random.split(key)
    toks, dps, tps, prev = [], [], [p_t[ctx]], ctx
    for k_pos in jax.random.split(k_draft, GAMMA):
        dist = p_d[prev]
        x = sample(k_pos, dist)
        toks.append(x)
        dps.append(dist)
        tps.append(p_t[x])
        prev = x
    return verify_fn(k_verify, jnp.stack(toks, 1), jnp.stack(dps, 1), jnp.stack(tps, 1), n_verify)


def _first_two_tokens(key, p_t, p_d, n_verify, verify_fn):
    ctx = jnp.zeros(R, jnp.int32)
    k1, k2 = jax.random.split(key)
    acc, _, out = _round(k1, ctx, p_t, p_d, n_verify, verify_fn)
    y1 = out[:, 0]
    # A round that produced one token continues with a fresh round from y1.
    _, _, out2 = _round(k2, y1, p_t, p_d, n_verify, verify_fn)
    y2 = jnp.where(acc >= 1, out[:, 1], out2[:, 0])
    return np.asarray(y1), np.asarray(y2)


def _chi2_pvalue(samples, probs):
    """Goodness of fit; cells with zero probability must be empty (else p = 0); cells with
    expected count < 5 are pooled."""
    probs = np.asarray(probs, np.float64).ravel()
    probs = probs / probs.sum()
    counts = np.bincount(samples, minlength=probs.size).astype(np.float64)
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    small = (expected < 5) & (probs > 0)
    obs = np.append(counts[expected >= 5], counts[small].sum())
    exp = np.append(expected[expected >= 5], expected[small].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = np.sum((obs - exp) ** 2 / exp)
    return float(stats.chi2.sf(stat, obs.size - 1))


def _pvalues(p_t, p_d, verify_fn, seed=0):
    """p-values of first token and first pair, per n_verify group."""
    n_verify = jnp.arange(R, dtype=jnp.int32) % (GAMMA + 1)
    y1, y2 = _first_two_tokens(jax.random.key(seed), p_t, p_d, n_verify, verify_fn)
    pt = np.asarray(p_t, np.float64)
    first, pair = pt[0], pt[0][:, None] * pt
    out = []
    for g in range(GAMMA + 1):
        sel = np.asarray(n_verify) == g
        out.append((g, _chi2_pvalue(y1[sel], first), _chi2_pvalue(y1[sel] * V + y2[sel], pair)))
    return out


PROCESSING = [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (1.0, 4, 0.9)]


@pytest.mark.parametrize("temperature,top_k,top_p", PROCESSING)
def test_verify_sampling_matches_target_distribution(temperature, top_k, top_p):
    p_t, p_d = _markov_tables(7, temperature, top_k, top_p)
    assert float(jnp.abs(p_t - p_d).sum(-1).max()) > 0.2  # draft really differs
    for g, p_first, p_pair in _pvalues(p_t, p_d, verify_sampling):
        assert p_first > ALPHA, (g, p_first)
        assert p_pair > ALPHA, (g, p_pair)


def _assemble_wrong(draft_tokens, accepted_len, nxt):
    pos = jnp.arange(GAMMA + 1)[None, :]
    drafts = jnp.pad(draft_tokens, ((0, 0), (0, 1)))
    out = jnp.where(pos < accepted_len[:, None], drafts, PAD_TOKEN)
    return accepted_len, nxt, jnp.where(pos == accepted_len[:, None], nxt[:, None], out)


def _wrong_always_accept(rng, draft_tokens, draft_probs, target_probs, n_verify):
    """Deliberately wrong: accept every verified draft, then a target bonus token."""
    rows = target_probs[jnp.arange(draft_tokens.shape[0]), n_verify]
    return _assemble_wrong(draft_tokens, n_verify, sample(rng, rows))


def _wrong_target_on_reject(rng, draft_tokens, draft_probs, target_probs, n_verify):
    """Deliberately wrong: correct accept test, but resample from p_t (not the residual)."""
    acc, _, _ = verify_sampling(rng, draft_tokens, draft_probs, target_probs, n_verify)
    rows = target_probs[jnp.arange(draft_tokens.shape[0]), acc]
    return _assemble_wrong(draft_tokens, acc, sample(jax.random.fold_in(rng, 1), rows))


@pytest.mark.parametrize("wrong_fn", [_wrong_always_accept, _wrong_target_on_reject])
def test_chi_square_check_detects_wrong_acceptance_rules(wrong_fn):
    p_t, p_d = _markov_tables(7, 1.0, 0, 1.0)
    results = _pvalues(p_t, p_d, wrong_fn)
    # n_verify = 0 verifies nothing, so even a wrong rule is exact there.
    assert min(p for g, p, _ in results if g == 0) > ALPHA
    assert min(min(pf, pp) for g, pf, pp in results if g > 0) < ALPHA


def test_chi_square_check_detects_two_percent_shift():
    p_t, _ = _markov_tables(7, 1.0, 0, 1.0)
    first = np.asarray(p_t[0], np.float64)
    lo, hi = np.argsort(first)[-2:]  # move 2 % of mass between two likely tokens
    shifted = first.copy()
    shifted[hi] -= 0.02
    shifted[lo] += 0.02
    rng = np.random.default_rng(0)
    n = R // (GAMMA + 1)  # the per-group sample size used above
    assert _chi2_pvalue(rng.choice(V, size=n, p=first / first.sum()), first) > ALPHA
    assert _chi2_pvalue(rng.choice(V, size=n, p=shifted / shifted.sum()), first) < ALPHA


def test_verify_compiles_once_per_shape():
    r, g, v = 4, 3, 5
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(8), (r, g + 1, v)), -1)
    drafts = sample(jax.random.key(9), probs[:, :g])
    active = jnp.ones(r, bool)
    verify_sampling(jax.random.key(0), drafts, probs[:, :g], probs, jnp.zeros(r, int), active)
    before = verify_sampling._cache_size()
    # The same function under a jit of its own that fails on a second trace.
    chex.clear_trace_counter()
    once = jax.jit(chex.assert_max_traces(verify_sampling.__wrapped__, n=1))
    for i in range(4):  # new values (lengths, masks, keys) must not retrace
        n = (jnp.arange(r) + i) % (g + 1)
        args = (jax.random.key(i), drafts, probs[:, :g], probs, n, active.at[i].set(False))
        chex.assert_trees_all_equal(once(*args), verify_sampling(*args))
    assert verify_sampling._cache_size() == before


# ---------------------------------------------------------------------------------------
# verify_coupled: position-keyed Gumbel-max, exact and independent of what was drafted


def test_gumbel_max_draws_what_categorical_draws():
    """``sample`` with per-row keys is written as Gumbel-max; it must draw exactly the
    tokens ``jax.random.categorical`` draws (the random streams did not change)."""
    keys = jax.random.split(jax.random.key(3), 64)
    logp = jax.nn.log_softmax(jax.random.normal(jax.random.key(1), (64, 300)))
    logp = logp.at[:, :40].set(-jnp.inf)  # filtered tokens
    want = jax.vmap(jax.random.categorical)(keys, logp)
    np.testing.assert_array_equal(jax.vmap(gumbel_max)(keys, logp), want)
    np.testing.assert_array_equal(sample(keys, jnp.exp(logp)), want)


@partial(jax.jit, static_argnames="coupled")
def _coupled_round(base, start, ctx, p_t, p_d, n_verify, coupled=True):
    """One round from token ``ctx [R]`` at position ``start``: draft ``k`` is drawn with the
    key of its position ``start + 1 + k`` (``coupled=False``: with unrelated keys)."""
    keys = position_keys(base, start[:, None] + 1 + jnp.arange(GAMMA + 1)[None, :])
    draft_keys = (
        keys
        if coupled
        else jax.vmap(lambda k: jax.random.split(k, GAMMA + 1))(
            jax.vmap(lambda k: jax.random.fold_in(k, 99))(base)
        )
    )
    toks, tps, prev = [], [p_t[ctx]], ctx
    for k in range(GAMMA):
        x = sample(draft_keys[:, k], p_d[prev])
        toks.append(x)
        tps.append(p_t[x])
        prev = x
    return verify_coupled(keys, jnp.stack(toks, 1), jnp.stack(tps, 1), n_verify)


def _coupled_first_two(p_t, p_d, n_verify, coupled=True, seed=0):
    base = jax.random.split(jax.random.key(seed), R)
    ctx, zero = jnp.zeros(R, jnp.int32), jnp.zeros(R, jnp.int32)
    acc, _, out = _coupled_round(base, zero, ctx, p_t, p_d, n_verify, coupled)
    y1 = out[:, 0]
    _, _, out2 = _coupled_round(base, zero + 1, y1, p_t, p_d, n_verify, coupled)
    y2 = jnp.where(acc >= 1, out[:, 1], out2[:, 0])
    return np.asarray(y1), np.asarray(y2), np.asarray(acc)


@pytest.mark.parametrize("temperature,top_k,top_p", PROCESSING[::3])
def test_verify_coupled_matches_target_and_ignores_the_drafts(temperature, top_k, top_p):
    """The emitted tokens are the target's Gumbel-max draws: the same tokens whatever
    number of drafts is verified (0 = plain target sampling) and distributed exactly as the
    target (chi-square of the first token and the first pair)."""
    p_t, p_d = _markov_tables(7, temperature, top_k, top_p)
    none = _coupled_first_two(p_t, p_d, jnp.zeros(R, jnp.int32))
    every = _coupled_first_two(p_t, p_d, jnp.full(R, GAMMA, jnp.int32))
    mixed = _coupled_first_two(p_t, p_d, jnp.arange(R, dtype=jnp.int32) % (GAMMA + 1))
    for run in (every, mixed):
        np.testing.assert_array_equal(run[0], none[0])
        np.testing.assert_array_equal(run[1], none[1])
    assert every[2].mean() > 0.5  # drafts were accepted, yet changed nothing
    pt = np.asarray(p_t, np.float64)
    y1, y2, _ = none
    assert _chi2_pvalue(y1, pt[0]) > ALPHA
    assert _chi2_pvalue(y1 * V + y2, pt[0][:, None] * pt) > ALPHA


def test_verify_coupled_acceptance_between_independent_and_speculative_sampling():
    """Sharing the position's noise is what makes coupled drafts acceptable: the first
    draft is accepted far more often than with unrelated noise (Σ p_t·p_d), and no more
    often than speculative sampling's 1 − TV (the best any coupling can do)."""
    p_t, p_d = _markov_tables(7, 1.0, 0, 1.0)
    n = jnp.full(R, GAMMA, jnp.int32)
    coupled = (_coupled_first_two(p_t, p_d, n)[2] >= 1).mean()
    unrelated = (_coupled_first_two(p_t, p_d, n, coupled=False)[2] >= 1).mean()
    pt, pd = np.asarray(p_t[0], np.float64), np.asarray(p_d[0], np.float64)
    one_minus_tv = np.minimum(pt, pd).sum()
    assert abs(unrelated - (pt * pd).sum()) < 0.01, (unrelated, (pt * pd).sum())
    assert coupled > unrelated + 0.1, (coupled, unrelated)
    assert coupled <= one_minus_tv + 0.01, (coupled, one_minus_tv)
