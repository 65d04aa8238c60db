"""The draft-probability survival estimate (decode/plan_step.py): every drafter reports the
largest probability of its untempered draft distribution per position, the decoder turns it
into calibrated survivals for the budgeted schedulers, and it stays lossless because it is
fixed before the token it scores is drawn (the drafted token's own probability is not)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decode.plan_step import survival_logits
from dspark_jax.decode.step import SpeculativeDecoder, StepConfig
from dspark_jax.models.draft_api import DraftOutput
from dspark_jax.models.drafter_io import STS
from dspark_jax.ops.sampling import SamplingSettings, max_logprob
from tests.decode.test_decode_step import (
    SAMPLING,
    WAVES,
    V,
    _chi2_pvalue,
    _drafter,
    _sample_first3,
    _shifted,
    exact_dists,  # noqa: F401 (module fixture)
)
from tests.decode.test_decode_step import target as target  # noqa: F401 (module fixture)

R_EXACT = 256


def test_max_logprob_is_the_untempered_top_probability():
    logits = jax.random.normal(jax.random.key(0), (5, V)) * 3.0
    want = np.log(np.max(np.asarray(jax.nn.softmax(logits, axis=-1)), axis=-1))
    np.testing.assert_allclose(max_logprob(logits), want, rtol=1e-5, atol=1e-6)
    # The same whatever the sampling settings: greedy, tempered, filtered.
    for settings in (SamplingSettings(), SamplingSettings(0.7, 3, 0.9), SamplingSettings(1.3)):
        tok, p_tok, probs, top = settings.draw(jax.random.key(1), logits)
        np.testing.assert_allclose(top, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(
            p_tok, np.take_along_axis(np.asarray(probs), tok[:, None], 1)[:, 0]
        )


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3", "mtp1"])
def test_every_drafter_reports_its_top_draft_probability(target, kind):  # noqa: F811
    """Through the decoder's own draft call (paged context): at T = 1 without filters the
    processed distribution is the untempered one, so exp(max_logprobs) is its maximum."""
    model, params = target
    drafter, dparams = _drafter(kind)
    cfg = StepConfig(num_slots=3, max_len=32, scheduler="topk", sampling=True)
    dec = SpeculativeDecoder(model, params, drafter, dparams, cfg)
    assert dec.survival_estimator == (
        "confidence_head" if kind == "dspark" else "draft_probability"
    )
    state = _prefilled(dec, temperature=1.0)
    _, _, conf, out = dec._draft(dec._params, state, _keys(dec))
    g = dec.gamma
    chex.assert_shape([out.max_logprobs, conf], (3, g))
    chex.assert_type(out.max_logprobs, jnp.float32)
    top = jnp.exp(out.max_logprobs)
    chex.assert_trees_all_close(top, out.probs.max(-1), rtol=2e-5)
    if kind != "dspark":  # uncalibrated draft probability: c_k = max q_k
        chex.assert_trees_all_close(conf, top, rtol=2e-5)


def test_calibration_maps_the_draft_probability(target):  # noqa: F811
    """With an STS for the estimate, c_k = σ(logit(max q_k) / T_k + b_k); the drafter's
    confidence head is ignored when the draft probability is asked for."""
    model, params = target
    drafter, dparams = _drafter("dspark", gamma=4)
    temps, biases = np.array([0.5, 1.0, 2.0, 4.0]), np.array([0.3, -0.2, 0.0, 1.0])
    cfg = StepConfig(num_slots=3, max_len=32, scheduler="topk", sampling=True)
    dec = SpeculativeDecoder(
        model, params, drafter, dparams, cfg,
        sts=STS(temps.astype(np.float32), biases.astype(np.float32), "draft_probability"),
    )  # fmt: skip
    state = _prefilled(dec, temperature=0.0)
    _, _, conf, out = dec._draft(dec._params, state, _keys(dec))
    q = np.exp(np.asarray(out.max_logprobs, np.float64))
    want = 1 / (1 + np.exp(-(np.log(q / (1 - q)) / temps + biases)))
    np.testing.assert_allclose(np.asarray(conf), want, rtol=1e-4)
    with pytest.raises(ValueError, match="no confidence head"):
        SpeculativeDecoder(
            model, params, *_drafter("eagle3"), cfg, survival_estimator="confidence_head"
        )
    with pytest.raises(ValueError, match="STS calibrates 'draft_probability'"):
        SpeculativeDecoder(
            model, params, drafter, dparams, cfg, survival_estimator="confidence_head",
            sts=STS(np.ones(4, np.float32), np.zeros(4, np.float32), "draft_probability"),
        )  # fmt: skip


def test_a_certain_draft_saturates_like_a_recorded_survival():
    """max q = 1 (a one-hot draft distribution) gives the clipped logit ≈ 16.6, finite, as
    eval.calibration recovers it from a recorded survival of 1.0."""
    from dspark_jax.eval.calibration import logits_from_confidence

    out = DraftOutput(None, None, None, None, max_logprobs=jnp.array([[0.0, -1e-9, -0.5]]))
    z = np.asarray(survival_logits(out, "draft_probability"))
    assert np.all(np.isfinite(z))
    np.testing.assert_allclose(z[0, :2], logits_from_confidence([1.0, 1.0]), rtol=1e-3)
    np.testing.assert_allclose(z[0, 2], logits_from_confidence([np.exp(-0.5)])[0], rtol=1e-5)


@pytest.mark.parametrize("kind", ["eagle3", "mtp1"])
def test_topk_with_a_headless_drafter_is_autoregressive_when_greedy(target, kind):  # noqa: F811
    """Top-K and Algorithm 1 run with drafters that have no confidence head (they were
    refused before): greedy output equals autoregressive decoding, the admitted lengths
    vary with the draft probabilities, and the rounds compile once per bucket."""
    from dspark_jax.decode.autoregressive import generate as ar_generate
    from dspark_jax.engine.offline import Request, Runner
    from tests.decode.test_decode_step import PROMPTS

    model, params = target
    drafter, dparams = _drafter(kind)
    g = drafter.config.draft_len
    table = 1.0 / (1.0 + jnp.arange(3 * (g + 1) + 1) / 4.5)
    cfg = StepConfig(num_slots=3, max_len=40, scheduler="topk")
    dec = SpeculativeDecoder(model, params, drafter, dparams, cfg, sps_table=table)
    prompts = [PROMPTS[i % len(PROMPTS)] + [i % V] for i in range(5)]
    buckets = (1, 3, 3 * g)
    res, stats = Runner(dec, buckets=buckets, plain_rounds=False, record_details=True).generate(
        [Request(p, 10) for p in prompts]
    )
    for p, r in zip(prompts, res):
        assert r.tokens == ar_generate(model, params, [p], 10, max_len=40).tokens[0]
    survivals = np.concatenate([np.asarray(r.survival_per_round) for r in res])
    assert survivals.size and np.all((survivals > 0) & (survivals < 1)), survivals
    assert dec._round._cache_size() <= len(buckets)


# --------------------------------------------------------------------------------------
# Exactness: the estimate is fixed before the token it scores is drawn


def _peaked_drafter():
    """γ = 2 DSpark drafter whose draft distribution at position k puts ~0.7 on token 0
    after an even x_{k-1} and is flat after an odd one: max q_2 is a function of the sampled
    x_1 (what Appendix A's failure needs), and q_1(x_1) is high only when x_1 = 0."""
    module, params = _drafter("dspark", gamma=2, seed=2)
    w1 = np.zeros_like(np.asarray(params["markov_head"]["markov_w1"]))
    w1[:, 0] = np.where(np.arange(V) % 2 == 0, 1.0, 0.0)
    w2 = np.zeros_like(np.asarray(params["markov_head"]["markov_w2"]))
    w2[0, 0] = 4.0
    params["markov_head"]["markov_w1"] = jnp.asarray(w1)
    params["markov_head"]["markov_w2"] = jnp.asarray(w2)
    return module, params


class DraftedTokenProbabilityDecoder(SpeculativeDecoder):
    """WRONG (test only): c_k = q_k(x_k), the drafted token's own probability. A token
    then decides its own admission (DESIGN §5.4): the threshold admits x_1 = 0 exactly when
    it was drafted."""

    def _draft(self, params, state, key):
        tokens, probs, _, out = super()._draft(params, state, key)
        return tokens, probs, out.token_probs.astype(jnp.float32), out


def test_draft_probability_survivals_are_exact_and_the_drafted_token_variant_is_not(
    target,  # noqa: F811
    exact_dists,  # noqa: F811
):
    model, params = target
    drafter, dparams = _peaked_drafter()
    r, g = R_EXACT, 2
    table = 1.0 / (1.0 + jnp.arange(r * (g + 1) + 1) / (1.5 * r))

    def decoder(cls, mode):
        cfg = StepConfig(num_slots=r, max_len=24, scheduler=mode, sampling=True, threshold=0.5)
        return cls(
            model, params, drafter, dparams, cfg,
            sps_table=table if mode in ("prefix", "topk") else None,
            survival_estimator="draft_probability",
        )  # fmt: skip

    setting = SAMPLING[0]  # T = 1, no filter: the drafted token's probability is q(x_k)
    for mode, kwargs in (("topk", {"budget": r}), ("threshold", {})):
        counts, lengths = _sample_first3(
            decoder(SpeculativeDecoder, mode), WAVES, *setting, **kwargs
        )
        assert set(lengths) == set(range(g + 1)), (mode, lengths)
        p, chi2 = _chi2_pvalue(counts, exact_dists[setting])
        assert p > 1e-3, (mode, chi2, p)
        assert _chi2_pvalue(counts, _shifted(exact_dists[setting], 0.03))[0] < 1e-3
    broken = decoder(DraftedTokenProbabilityDecoder, "threshold")
    counts, lengths = _sample_first3(broken, WAVES, *setting)
    assert 0 in lengths and (1 in lengths or 2 in lengths), lengths
    p, chi2 = _chi2_pvalue(counts, exact_dists[setting])
    assert p < 1e-6, (chi2, p)


# --------------------------------------------------------------------------------------


def _prefilled(dec, temperature):
    r = dec.config.num_slots
    state = dec.init_state(seed=3)
    prompts = np.zeros((r, 8), np.int32)
    prompts[:, :3] = [[3, 7, 1], [5, 6, 2], [9, 9, 4]][:r]

    def full(x, dtype):
        return np.full((r,), x, dtype)

    state, _ = dec.prefill(
        state, np.arange(r, dtype=np.int32), prompts, full(3, np.int32), full(8, np.int32),
        full(temperature, np.float32), full(0, np.int32), full(1.0, np.float32),
    )  # fmt: skip
    return state


def _keys(dec):
    from dspark_jax.ops.sampling import StepKeys, split_keys

    keys = split_keys(jax.random.key(5), dec.gamma)
    return StepKeys(jnp.broadcast_to(keys[:, None], (dec.gamma, dec.config.num_slots)))


class CalibratedLogitsTest(chex.TestCase):
    """The round's calibration map (``plan_step.calibrated_logits``) traced under jit and
    op by op gives the offline map of ``eval.calibration``: affine where a position has no
    steps, the step's logit where it has (padded knots included)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_matches_the_offline_map(self):
        from dspark_jax.decode.plan_step import calibrated_logits
        from dspark_jax.eval import calibration as offline
        from dspark_jax.models.drafter_io import check_knots

        rng = np.random.default_rng(0)
        z = rng.normal(0.0, 4.0, (64, 3)).astype(np.float32)
        temps = np.array([1.0, 2.0, 1.0], np.float32)
        biases = np.array([0.0, -0.5, 0.0], np.float32)
        knots = check_knots(
            [{"edges": [-1.0, 0.0, 2.5], "logits": [-3.0, 0.0, 4.0]}, None,
             {"edges": [0.0], "logits": [1.5]}],
            3,
        )  # fmt: skip
        fn = self.variant(lambda x: calibrated_logits(x, temps, biases, knots))
        got = fn(jnp.asarray(z))
        chex.assert_shape(got, z.shape)
        want = offline.apply_sts(z, temps, biases, knots)
        chex.assert_trees_all_close(jax.nn.sigmoid(got), want, atol=1e-6, rtol=0)
        # Edges are left-closed: z equal to an edge takes that step.
        on_edge = fn(jnp.array([[0.0, 0.0, 0.0]], jnp.float32))
        chex.assert_trees_all_close(on_edge[0, 0], 0.0)
        chex.assert_trees_all_close(on_edge[0, 2], 1.5)
