"""Evaluation metrics on hand-computed examples (τ, conditional acceptance, ECE, AUROC...)."""

import itertools
import math

import numpy as np
import pytest

from dspark_jax.eval import metrics as M


def test_tau_counts_bonus_token():
    acc = [0, 3, 7]
    np.testing.assert_array_equal(M.tau_per_round(acc), [1, 4, 8])
    assert M.mean_tau(acc) == pytest.approx(13 / 3)
    assert math.isnan(M.mean_tau([]))


def test_conditional_acceptance_hand_example():
    # k=1: 4 of 5 rounds accept; k=2: 3 of the 4 that reached it; k=3: 1 of 3.
    got = M.conditional_acceptance([0, 1, 2, 2, 3], gamma=3)
    np.testing.assert_allclose(got, [4 / 5, 3 / 4, 1 / 3])
    # Nobody passes position 1: later positions were never reached -> NaN.
    got = M.conditional_acceptance([0, 0], gamma=2)
    assert got[0] == 0.0 and math.isnan(got[1])


def test_conditional_acceptance_ignores_unverified_positions():
    # Round 3 verified only one draft (end of request) and accepted it: it counts for k=1
    # but must not count as a rejection at k=2.
    acc, ver = [2, 1, 1], [3, 3, 1]
    got = M.conditional_acceptance(acc, 3, ver)
    np.testing.assert_allclose(got[:2], [1.0, 1 / 2])
    assert got[2] == 0.0  # round 1 reached k=3 (acc>=2, verified 3) and was rejected


def test_prefix_labels_and_censoring():
    labels, observed = M.prefix_labels([0, 2, 1], 3, [3, 3, 1])
    np.testing.assert_array_equal(labels, [[0, 0, 0], [1, 1, 0], [1, 0, 0]])
    # Round 3 accepted everything it verified (1 of 1): positions 2, 3 are unknown.
    np.testing.assert_array_equal(observed, [[1, 1, 1], [1, 1, 1], [1, 0, 0]])
    # A rejection inside a short verify still decides every later prefix.
    _, observed = M.prefix_labels([0], 3, [1])
    np.testing.assert_array_equal(observed, [[1, 1, 1]])


def test_ece_hand_example():
    conf = [0.1, 0.12, 0.9, 0.95]
    labels = [0, 1, 1, 1]
    # bin 2: mean conf 0.11, acc 0.5 (2 samples); bin 18: 0.9 vs 1; bin 19: 0.95 vs 1.
    expected = 0.5 * 0.39 + 0.25 * 0.1 + 0.25 * 0.05
    assert M.ece(conf, labels) == pytest.approx(expected)
    # Two bins: [0, .5) holds 0.1, 0.12; [.5, 1] holds 0.9, 0.95.
    assert M.ece(conf, labels, n_bins=2) == pytest.approx(0.5 * 0.39 + 0.5 * 0.075)
    assert M.ece([1.0, 0.0], [1, 0]) == 0.0  # 1.0 lands in the last bin, 0.0 in the first


def test_reliability_bins():
    rel = M.reliability_bins([0.1, 0.12, 0.9, 1.0], [0, 1, 1, 0], n_bins=4)
    assert rel["count"] == [2, 0, 0, 2]
    np.testing.assert_allclose(rel["mean_confidence"][0], 0.11)
    np.testing.assert_allclose(rel["accuracy"][0], 0.5)
    assert math.isnan(rel["accuracy"][1])
    np.testing.assert_allclose([rel["mean_confidence"][3], rel["accuracy"][3]], [0.95, 0.5])
    np.testing.assert_allclose(rel["lower"], [0, 0.25, 0.5, 0.75])


def _auroc_pairs(s, y):
    pos = [a for a, lab in zip(s, y) if lab]
    neg = [a for a, lab in zip(s, y) if not lab]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (len(pos) * len(neg))


def test_auroc_hand_examples_and_ties():
    assert M.auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    # Ties between classes count one half.
    assert M.auroc([0.5, 0.5, 0.5, 0.9], [0, 1, 0, 1]) == pytest.approx(0.75)
    assert M.auroc([0.3] * 4, [0, 1, 0, 1]) == pytest.approx(0.5)
    assert M.auroc([0.2, 0.9], [1, 0]) == 0.0
    assert math.isnan(M.auroc([0.1, 0.2], [1, 1]))
    rng = np.random.default_rng(0)
    s = rng.integers(0, 6, 200) / 5.0  # many ties
    y = rng.random(200) < s * 0.8
    assert M.auroc(s, y) == pytest.approx(_auroc_pairs(s, y))


def test_brier():
    assert M.brier([0.8, 0.3], [1, 0]) == pytest.approx((0.04 + 0.09) / 2)


def test_position_calibration_uses_prefix_products():
    surv = np.array([[0.9, 0.6], [0.5, 0.1], [0.8, 0.4]])
    out = M.position_calibration(surv, accepted=[2, 0, 1], verified=[2, 2, 2])
    assert [o["n"] for o in out] == [3, 3]
    assert out[0]["accept_rate"] == pytest.approx(2 / 3)
    assert out[1]["accept_rate"] == pytest.approx(1 / 3)
    assert out[0]["auroc"] == 1.0 and out[1]["auroc"] == 1.0
    assert out[1]["brier"] == pytest.approx((0.16 + 0.01 + 0.16) / 3)


def test_threshold_sweep_hand_example():
    surv = [[0.9, 0.5, 0.2], [0.6, 0.3, 0.1]]
    sw = M.threshold_sweep(surv, accepted=[2, 0], thresholds=[0.0, 0.55, 1.0])
    # t=0: everything verified; t=.55: one draft each; t=1: nothing verified.
    np.testing.assert_allclose(sw["acceptance_rate"][:2], [2 / 6, 1 / 2])
    assert math.isnan(sw["acceptance_rate"][2])
    np.testing.assert_allclose(sw["pruned_share"], [0.0, 1 - 2 / 6, 1.0])
    np.testing.assert_allclose(sw["tau"], [2.0, 1.5, 1.0])
    np.testing.assert_allclose(sw["verified_per_round"], [3.0, 1.0, 0.0])


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: M.conditional_acceptance([4], 3), "accepted counts"),
        (lambda: M.conditional_acceptance([2], 3, [1]), "accepted <= verified"),
        (lambda: M.ece([1.2], [1]), r"\[0, 1\]"),
        (lambda: M.ece([0.2, 0.3], [1]), "shape"),
        (lambda: M.auroc([[0.1]], [1]), "1-D"),
        (lambda: M.position_calibration([0.1, 0.2], [0, 1]), "rounds, gamma"),
    ],
)
def test_bad_input_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_ece_noise_floor_matches_sampling_error_and_shrinks_with_n():
    """A perfectly calibrated predictor still shows a positive binned ECE on a finite
    sample; the floor estimates it. One bin at c = 0.5 with n labels: E|mean(y) − 0.5| =
    sqrt(0.25/n)·sqrt(2/π) for large n."""
    for n in (100, 1600):
        c = np.full(n, 0.5)
        expected = math.sqrt(0.25 / n) * math.sqrt(2 / math.pi)
        assert M.ece_noise_floor(c, draws=2000) == pytest.approx(expected, rel=0.1)
    c = np.random.default_rng(0).uniform(0.05, 0.95, 4000)
    assert M.ece_noise_floor(c[:400]) > 2 * M.ece_noise_floor(c)
    # The calibration report carries it per position.
    surv = np.tile([[0.9, 0.6]], (50, 1))
    rep = M.position_calibration(surv, np.full(50, 2), np.full(50, 2))
    assert all(r["ece_floor"] > 0 for r in rep)


def test_ends_in_loop_finds_repetitive_tails_only():
    from dspark_jax.eval.metrics import ends_in_loop

    assert ends_in_loop([5, 6, 7] + [1, 2] * 16)  # period 2 over the last 32 tokens
    assert ends_in_loop(list(range(40)) + [3, 4, 5, 6, 7, 8, 9, 10] * 4)  # period 8
    # ' the' x k then a comment marker, with k varying: no fixed period, still a loop.
    assert ends_in_loop(sum(([7] * k + [3, 9] for k in (11, 12, 10, 13)), []))
    assert not ends_in_loop(list(range(40)))
    assert not ends_in_loop(list(range(100, 120)) + [1, 2] * 3)  # mostly fresh tokens
    assert not ends_in_loop([4] * 8)  # too short to judge
