"""STS: logit recovery, fitting on synthetic overconfident scores, sts.json round trip."""

import json

import chex
import numpy as np
import pytest

from dspark_jax.eval import calibration as cal
from dspark_jax.eval import metrics as M

GAMMA = 4


def _synthetic(n, sharpen, seed):
    """Rounds whose true conditional acceptance probability at k is σ(q_k); the "model"
    reports logits ``sharpen · q_k`` (sharpen > 1: overconfident). Returns (z, accepted)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(0.8, 1.5, (n, GAMMA))
    ok = rng.random((n, GAMMA)) < 1 / (1 + np.exp(-q))
    accepted = np.where(ok.all(1), GAMMA, np.argmin(ok, axis=1))  # first rejection
    return sharpen * q, accepted


def _ece_per_position(z, accepted, temps=None):
    return np.array([p["ece"] for p in cal.calibration_report(z, accepted, temperatures=temps)])


def test_logits_recovered_from_float32_survival():
    rng = np.random.default_rng(1)
    z = rng.uniform(-8, 8, (500, GAMMA))
    surv = np.cumprod(1 / (1 + np.exp(-z)), axis=1).astype(np.float32)
    np.testing.assert_allclose(cal.logits_from_survival(surv), z, atol=5e-3)
    # Underflowed prefix: c is undefined and reported as 1/2 (logit 0), never NaN.
    back = cal.logits_from_survival(np.array([[0.0, 0.0, 0.0, 0.0]], np.float32))
    assert np.all(np.isfinite(back))


def test_sts_lowers_ece_on_overconfident_scores_and_keeps_order():
    z, acc = _synthetic(6000, sharpen=3.0, seed=0)
    res = cal.fit_sts(z, acc)
    temps = np.array(res.temperatures)
    assert all(res.fitted)
    # The generating process is σ(z / 3): each fitted temperature should be near 3.
    assert np.all((temps > 1.8) & (temps < 4.5)), temps
    assert np.all(np.array(res.ece_after) < np.array(res.ece_before) - 0.02)
    # Held-out data from the same process: calibration improves there too.
    z2, acc2 = _synthetic(6000, sharpen=3.0, seed=1)
    before, after = _ece_per_position(z2, acc2), _ece_per_position(z2, acc2, temps)
    assert np.all(after < before - 0.02), (before, after)
    assert after.max() < 0.03
    # Monotone per position: the ranking of c_k across rounds is unchanged ...
    c_raw, c_sts = cal.apply_sts(z2, np.ones(GAMMA)), cal.apply_sts(z2, temps)
    for k in range(GAMMA):
        np.testing.assert_array_equal(
            np.argsort(c_raw[:, k], kind="stable"), np.argsort(c_sts[:, k], kind="stable")
        )
    # ... so the position-1 AUROC (a_1 = c_1) is identical.
    labels = acc2 >= 1
    assert M.auroc(c_raw[:, 0], labels) == pytest.approx(M.auroc(c_sts[:, 0], labels))


def test_sts_fit_is_sequential():
    """T_k is fitted on the product with the *calibrated* earlier positions."""
    z, acc = _synthetic(4000, sharpen=3.0, seed=2)
    res = cal.fit_sts(z, acc)
    temps = np.array(res.temperatures)
    a = cal.survival_from_logits(z, temps)
    labels, observed = M.prefix_labels(acc, GAMMA)
    for k in range(GAMMA):
        assert res.ece_after[k] == pytest.approx(M.ece(a[:, k], labels[:, k]))
        # Perturbing T_k alone cannot beat the fitted value by more than grid resolution.
        for f in (0.8, 1.25):
            t = temps.copy()
            t[k] *= f
            a_p = cal.survival_from_logits(z, t)
            assert M.ece(a_p[:, k], labels[:, k]) >= res.ece_after[k] - 1e-3


def test_sts_keeps_calibrated_scores_near_one():
    z, acc = _synthetic(6000, sharpen=1.0, seed=3)
    res = cal.fit_sts(z, acc)
    assert np.all((np.array(res.temperatures) > 0.7) & (np.array(res.temperatures) < 1.4))


def test_unobserved_positions_keep_unit_temperature():
    # Every round verified only one draft and accepted it: positions 2..4 have no labels.
    z = np.random.default_rng(0).normal(size=(50, GAMMA))
    res = cal.fit_sts(z, np.ones(50, int), np.ones(50, int))
    assert res.fitted == [True, False, False, False]
    assert res.temperatures[1:] == [1.0, 1.0, 1.0]
    assert res.num_samples == [50, 0, 0, 0]


def test_save_and_load_sts(tmp_path):
    assert cal.load_sts(tmp_path) is None  # no file: caller uses temperatures of 1
    z, acc = _synthetic(500, sharpen=2.0, seed=4)
    res = cal.fit_sts(z, acc)
    path = cal.save_sts(
        tmp_path, res, data={"prompts": "synthetic"}, arrays={"logits": z, "accepted": acc}
    )
    assert path == tmp_path / "sts.json"
    sts = cal.load_sts(tmp_path, GAMMA)
    temps, biases = sts.temperatures, sts.biases
    assert sts.estimator == "confidence_head"
    np.testing.assert_allclose(temps, res.temperatures, rtol=1e-6)
    assert temps.dtype == np.float32
    np.testing.assert_array_equal(biases, np.zeros(GAMMA))  # temperature mode: no shift
    payload = json.loads(path.read_text())
    assert payload["fit"]["num_samples"] == res.num_samples
    assert payload["data"]["arrays_file"] == "sts_data.npz"
    assert (tmp_path / "sts_data.npz").is_file()
    with pytest.raises(ValueError, match="drafts 7 tokens"):
        cal.load_sts(tmp_path, 7)


def test_each_survival_estimator_has_its_own_file(tmp_path):
    """The draft-probability fit lives beside sts.json in its own file, loads only as that
    estimate, and a file moved under the other name is refused by name."""
    z, acc = _synthetic(500, sharpen=2.0, seed=4)
    res = cal.fit_sts(z, acc)
    path = cal.save_sts(tmp_path, res, arrays={"logits": z}, estimator="draft-probability")
    assert path == tmp_path / "sts_draft_probability.json"
    assert (tmp_path / "sts_draft_probability_data.npz").is_file()
    assert cal.load_sts(tmp_path, GAMMA) is None  # the head's file is another one
    sts = cal.load_sts(tmp_path, GAMMA, "draft_probability")
    assert sts.estimator == "draft_probability"
    np.testing.assert_allclose(sts.temperatures, res.temperatures, rtol=1e-6)
    assert sts.first(2).estimator == "draft_probability"
    path.rename(tmp_path / "sts.json")
    with pytest.raises(ValueError, match="calibrates the 'draft_probability' survival"):
        cal.load_sts(tmp_path, GAMMA)
    with pytest.raises(ValueError, match="unknown survival estimator 'max-q'"):
        cal.load_sts(tmp_path, GAMMA, "max-q")


@pytest.mark.parametrize(
    "content, match",
    [
        ("{not json", "not valid JSON"),
        ('{"x": 1}', "temperatures"),
        ('{"temperatures": [1.0, -2.0, 1.0, 1.0]}', "> 0"),
        ('{"temperatures": [1.0, 1.0], "biases": [0.0]}', "need 2 STS biases"),
        ('{"temperatures": [1.0], "biases": 0.5}', "'biases' must be a list"),
        ('{"temperatures": [1.0], "biases": [NaN]}', "finite"),
    ],
)
def test_load_sts_bad_files(tmp_path, content, match):
    (tmp_path / "sts.json").write_text(content)
    with pytest.raises(ValueError, match=match):
        cal.load_sts(tmp_path)


def _uninformative(n, rate, seed):
    """Every draft is accepted with probability ``rate`` whatever the head says; the head's
    logits are noise around 0 (AUROC 0.5): the calibrated answer is the constant ``rate``."""
    rng = np.random.default_rng(seed)
    ok = rng.random((n, GAMMA)) < rate
    accepted = np.where(ok.all(1), GAMMA, np.argmin(ok, axis=1))
    return rng.normal(0.0, 1.0, (n, GAMMA)), accepted


def test_affine_sts_calibrates_what_a_temperature_cannot():
    """A weakly ranked head with acceptance far from ½: σ(z / T) can only flatten toward ½,
    while σ(z / T + b) reaches the acceptance rate (the bundled drafter's situation)."""
    z, acc = _uninformative(8000, 0.8, seed=5)
    z2, acc2 = _uninformative(8000, 0.8, seed=6)
    temp = cal.fit_sts(z, acc)
    aff = cal.fit_sts(z, acc, mode="affine")
    assert aff.mode == "affine" and temp.mode == "temperature"
    assert temp.biases == [0.0] * GAMMA
    held_temp = _ece_per_position(z2, acc2, temp.temperatures)
    held_aff = np.array(
        [
            p["ece"]
            for p in cal.calibration_report(z2, acc2, None, aff.temperatures, biases=aff.biases)
        ]
    )
    assert held_temp.mean() > 0.1, held_temp
    assert held_aff.max() < 0.02, held_aff
    # Position 1: b ≈ logit(0.8) once T has flattened the noise.
    assert aff.temperatures[0] > 3 and aff.biases[0] == pytest.approx(np.log(4), abs=0.25)
    # Still strictly increasing per position: the ranking of c_k is unchanged.
    c_raw = cal.apply_sts(z2, np.ones(GAMMA))
    c_aff = cal.apply_sts(z2, aff.temperatures, aff.biases)
    for k in range(GAMMA):
        np.testing.assert_array_equal(
            np.argsort(c_raw[:, k], kind="stable"), np.argsort(c_aff[:, k], kind="stable")
        )


def test_affine_sts_on_pure_overconfidence_stays_a_temperature():
    z, acc = _synthetic(6000, sharpen=3.0, seed=0)
    aff = cal.fit_sts(z, acc, mode="affine")
    assert np.all(np.abs(aff.biases) < 0.35), aff.biases
    # The last position's survival is small and flat in T, so only the first three pin T.
    t = np.array(aff.temperatures[:3])
    assert np.all((t > 1.8) & (t < 4.5)), aff.temperatures
    assert np.all(np.array(aff.ece_after) <= np.array(cal.fit_sts(z, acc).ece_after) + 2e-3)


def test_affine_sts_round_trip(tmp_path):
    z, acc = _uninformative(2000, 0.7, seed=7)
    res = cal.fit_sts(z, acc, mode="affine")
    cal.save_sts(tmp_path, res)
    payload = json.loads((tmp_path / "sts.json").read_text())
    assert payload["mode"] == "affine" and len(payload["biases"]) == GAMMA
    sts = cal.load_sts(tmp_path, GAMMA)
    np.testing.assert_allclose(sts.biases, res.biases, rtol=1e-6)
    np.testing.assert_allclose(
        cal.survival_from_logits(z, sts.temperatures, sts.biases),
        np.cumprod(1 / (1 + np.exp(-(z / sts.temperatures + sts.biases))), axis=1),
        rtol=1e-6,
    )
    padded = res.padded(GAMMA + 2)
    assert padded.biases[-2:] == [0.0, 0.0] and padded.temperatures[-2:] == [1.0, 1.0]


def test_fit_sts_bad_input():
    with pytest.raises(ValueError, match="non-empty"):
        cal.fit_sts(np.zeros((0, 3)), [])
    with pytest.raises(ValueError, match="NaN"):
        cal.fit_sts(np.full((2, 3), np.nan), [0, 1])
    with pytest.raises(ValueError, match="rounds"):
        cal.fit_sts(np.zeros((2, 3)), [0, 1, 2])
    with pytest.raises(ValueError, match="temperatures"):
        cal.apply_sts(np.zeros((2, 3)), [1.0, 1.0])
    with pytest.raises(ValueError, match="allowed: \\['temperature', 'affine', 'isotonic'\\]"):
        cal.fit_sts(np.zeros((2, 3)), [0, 1], mode="platt")
    with pytest.raises(ValueError, match="unknown STS mode 'platt'"):
        cal.fit_sts(np.zeros((2, 3)), [0, 1], mode="platt")


def _stepped(n, seed):
    """First-draft acceptance that jumps from 0.3 to 0.9 where the logit crosses 0 (no
    σ(z / T + b) follows a jump), later drafts σ(z) like a calibrated head."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 3.0, (n, GAMMA))
    p = 1 / (1 + np.exp(-z))
    p[:, 0] = np.where(z[:, 0] < 0, 0.3, 0.9)
    ok = rng.random((n, GAMMA)) < p
    return z, np.where(ok.all(1), GAMMA, np.argmin(ok, axis=1))


def test_isotonic_sts_follows_a_step_affine_cannot():
    z, acc = _stepped(8000, seed=11)
    z2, acc2 = _stepped(8000, seed=12)
    iso = cal.fit_sts(z, acc, mode="isotonic")
    aff = cal.fit_sts(z, acc, mode="affine")
    sts = iso.sts
    held_iso = np.array(
        [p["ece"] for p in cal.calibration_report(z2, acc2, None, sts.temperatures,
                                                  biases=sts.biases, knots=sts.knots)]
    )  # fmt: skip
    held_aff = np.array(
        [p["ece"] for p in cal.calibration_report(z2, acc2, None, aff.temperatures,
                                                  biases=aff.biases)]
    )  # fmt: skip
    assert held_iso[0] < 0.02 < held_aff[0], (held_iso, held_aff)
    # The first step map: non-decreasing, about logit(0.3) below 0 and logit(0.9) above.
    edges, logits = (np.array(iso.knots[0][key]) for key in ("edges", "logits"))
    assert np.all(np.diff(edges) > 0) and np.all(np.diff(logits) >= 0)
    below = cal.step_logits(np.array([-2.0, -0.5]), edges, logits)
    above = cal.step_logits(np.array([0.5, 2.0]), edges, logits)
    np.testing.assert_allclose(1 / (1 + np.exp(-below)), 0.3, atol=0.06)
    np.testing.assert_allclose(1 / (1 + np.exp(-above)), 0.9, atol=0.06)
    assert iso.temperatures == [1.0] * GAMMA and iso.biases == [0.0] * GAMMA


def test_isotonic_first_position_matches_observed_acceptance_per_step():
    """At k = 1 (a_0 = 1) pool-adjacent-violators makes each step's mean survival the
    observed acceptance of the rounds on it (ties at one logit never split)."""
    z, acc = _stepped(3000, seed=13)
    z = np.round(z, 1)  # many rounds share a logit
    iso = cal.fit_sts(z, acc, mode="isotonic")
    edges, logits = np.array(iso.knots[0]["edges"]), np.array(iso.knots[0]["logits"])
    step = np.searchsorted(edges, z[:, 0], side="right") - 1
    for j in range(edges.size):
        on = step == j
        observed = np.clip(np.mean(acc[on] >= 1), 1e-4, 1 - 1e-4)
        assert 1 / (1 + np.exp(-logits[j])) == pytest.approx(observed, abs=1e-9)


def test_isotonic_sts_round_trip_and_padding(tmp_path):
    z, acc = _stepped(3000, seed=14)
    res = cal.fit_sts(z, acc, mode="isotonic")
    cal.save_sts(tmp_path, res, estimator="draft_probability")
    payload = json.loads((tmp_path / "sts_draft_probability.json").read_text())
    assert payload["mode"] == "isotonic" and len(payload["knots"]) == GAMMA
    sts = cal.load_sts(tmp_path, GAMMA, "draft_probability")
    chex.assert_shape(sts.knots, (GAMMA, 2, max(len(k["edges"]) for k in res.knots)))
    np.testing.assert_allclose(
        cal.survival_from_sts(z, sts), cal.survival_from_sts(z, res.sts), rtol=1e-6
    )
    padded = res.padded(GAMMA + 2)
    assert padded.knots[-2:] == [None, None]
    knots = padded.sts.knots
    assert np.isnan(knots[-1]).all() and not np.isnan(knots[0]).any()
    # Positions without a map fall back to σ(z / T + b) with T = 1, b = 0.
    zz = np.concatenate([z, z[:, :2]], axis=1)
    c = cal.apply_sts(zz, np.ones(GAMMA + 2), None, knots)
    np.testing.assert_allclose(c[:, -2:], 1 / (1 + np.exp(-z[:, :2])), rtol=1e-12)
    assert sts.first(2).knots.shape[0] == 2


@pytest.mark.parametrize(
    "knots, match",
    [
        ([{"edges": [0.0, 1.0], "logits": [1.0, 0.0]}, None], "must not decrease"),
        ([{"edges": [1.0, 0.0], "logits": [0.0, 1.0]}, None], "edges must increase"),
        ([{"edges": [0.0], "logits": [0.0, 1.0]}, None], "as many logits"),
        ([{"edges": [0.0], "logits": [0.0]}], "need 2 knot entries"),
        ([{"edges": [0.0]}, None], "must be"),
        ([{"edges": [0.0], "logits": [float("inf")]}, None], "finite"),
    ],
)
def test_load_sts_bad_knots(tmp_path, knots, match):
    payload = {"temperatures": [1.0, 1.0], "biases": [0.0, 0.0], "knots": knots}
    (tmp_path / "sts.json").write_text(json.dumps(payload))
    with pytest.raises(ValueError, match=match):
        cal.load_sts(tmp_path)
