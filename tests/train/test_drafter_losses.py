"""Drafter losses against independent numpy computations of the DESIGN §4 formulas."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.train import drafter_losses as L


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _case(seed=0, n=3, g=3, v=5):
    rng = np.random.default_rng(seed)
    draft = rng.normal(size=(n, g, v)) * 2
    target = rng.normal(size=(n, g, v)) * 2
    conf = rng.normal(size=(n, g)) * 3
    labels = rng.integers(0, v, size=(n, g))
    mask = np.ones((n, g), bool)
    mask[1, 2] = mask[2, 1:] = False  # blocks running past the supervised region
    return draft, target, conf, labels, mask


def _numpy_dspark(draft, target, conf, labels, mask, decay, a_ce, a_tv, a_conf):
    g = draft.shape[1]
    w = np.exp(-np.arange(g) / decay)[None, :] * mask  # w_k = exp(-(k-1)/decay)
    p_d, p_t = _softmax(draft), _softmax(target)
    ce = -np.log(np.take_along_axis(p_d, labels[..., None], -1)[..., 0])
    tv = np.abs(p_d - p_t).sum(-1)
    c_star = np.clip(1 - 0.5 * tv, 0, 1)
    c = 1 / (1 + np.exp(-conf))
    bce = -(c_star * np.log(c) + (1 - c_star) * np.log(1 - c))
    mean = lambda x: (w * x).sum() / w.sum()
    return a_ce * mean(ce) + a_tv * mean(tv) + a_conf * mean(bce), mean(ce), mean(tv), mean(bce)


@pytest.mark.parametrize(
    "decay,alphas", [(4.0, (0.1, 0.9, 1.0)), (1.5, (0.3, 0.2, 0.5)), (4.0, (1.0, 0.0, 0.0))]
)
def test_dspark_loss_matches_numpy(decay, alphas):
    draft, target, conf, labels, mask = _case()
    a_ce, a_tv, a_conf = alphas
    loss, terms = L.dspark_loss(
        jnp.asarray(draft), jnp.asarray(conf), jnp.asarray(target), jnp.asarray(labels),
        jnp.asarray(mask), decay=decay, alpha_ce=a_ce, alpha_tv=a_tv, alpha_conf=a_conf,
    )  # fmt: skip
    want, ce, tv, bce = _numpy_dspark(draft, target, conf, labels, mask, decay, *alphas)
    chex.assert_shape(loss, ())
    got = {"loss": loss, **{k: terms[k] for k in ("l_ce", "l_tv", "l_conf", "accept")}}
    chex.assert_trees_all_close(
        got, {"loss": want, "l_ce": ce, "l_tv": tv, "l_conf": bce, "accept": 1 - 0.5 * tv},
        rtol=1e-5,
    )  # fmt: skip


def test_dflash_without_confidence_and_masked_positions_do_not_count():
    draft, target, _, labels, mask = _case(1)
    loss, terms = L.dspark_loss(
        jnp.asarray(draft), None, jnp.asarray(target), jnp.asarray(labels), jnp.asarray(mask),
        alpha_ce=1.0, alpha_tv=0.0, alpha_conf=0.0,
    )  # fmt: skip
    assert "l_conf" not in terms
    # Changing logits at masked positions leaves the loss unchanged.
    draft2 = draft.copy()
    draft2[~mask] += 50.0
    loss2, _ = L.dspark_loss(
        jnp.asarray(draft2), None, jnp.asarray(target), jnp.asarray(labels), jnp.asarray(mask),
        alpha_ce=1.0, alpha_tv=0.0, alpha_conf=0.0,
    )  # fmt: skip
    chex.assert_trees_all_close(loss2, loss, rtol=1e-6)
    with pytest.raises(ValueError, match="confidence"):
        L.dspark_loss(jnp.asarray(draft), None, jnp.asarray(target), jnp.asarray(labels),
                      jnp.asarray(mask), alpha_conf=1.0)  # fmt: skip


def test_confidence_target_is_detached_and_p_t_is_frozen():
    draft, target, conf, labels, mask = _case(2)

    def f(d, t, c):
        return L.dspark_loss(d, c, t, jnp.asarray(labels), jnp.asarray(mask),
                             alpha_ce=0.0, alpha_tv=0.0, alpha_conf=1.0)[0]  # fmt: skip

    gd, gt, gc = jax.grad(f, argnums=(0, 1, 2))(
        jnp.asarray(draft), jnp.asarray(target), jnp.asarray(conf)
    )
    chex.assert_trees_all_equal((gd, gt), (jnp.zeros_like(gd), jnp.zeros_like(gt)))
    assert np.any(np.asarray(gc) != 0)
    g_tv = jax.grad(
        lambda t: L.dspark_loss(
            jnp.asarray(draft), None, t, jnp.asarray(labels), jnp.asarray(mask), alpha_conf=0.0
        )[0]  # fmt: skip
    )(jnp.asarray(target))
    chex.assert_trees_all_equal(g_tv, jnp.zeros_like(g_tv))


def test_eagle3_loss_matches_numpy():
    rng = np.random.default_rng(3)
    g, s, t, v = 3, 2, 6, 5
    steps = rng.normal(size=(g, s, t, v)) * 2
    nxt = rng.normal(size=(s, t, v)) * 2
    mask = rng.random((g, s, t)) < 0.7
    for i in range(g):
        mask[i, :, t - 1 - i :] = False  # targets past the end
    loss, terms = L.eagle3_loss(jnp.asarray(steps), jnp.asarray(nxt), jnp.asarray(mask))
    num = den = acc = 0.0
    for i in range(g):
        for b in range(s):
            for u in range(t):
                if not mask[i, b, u]:
                    continue
                p_t = _softmax(nxt[b, u + 1 + i])  # target dist of token u+2+i
                p_d = _softmax(steps[i, b, u])
                w = 0.8**i
                num += w * -(p_t * np.log(p_d)).sum()
                acc += w * np.minimum(p_t, p_d).sum()
                den += w
    chex.assert_trees_all_close((loss, terms["accept"]), (num / den, acc / den), rtol=1e-5)


def test_mtp_loss_and_acceptance_identity():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, 5, 7))
    labels = rng.integers(0, 7, (2, 5))
    mask = np.ones((2, 5), bool)
    mask[1, 3:] = False
    loss, _ = L.mtp_loss(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask))
    ce = -np.log(np.take_along_axis(_softmax(logits), labels[..., None], -1)[..., 0])
    np.testing.assert_allclose(float(loss), ce[mask].mean(), rtol=1e-6)
    other = rng.normal(size=(2, 5, 7))
    acc = L.acceptance(jnp.asarray(logits), jnp.asarray(other))
    chex.assert_shape(acc, (2, 5))
    l1 = np.abs(_softmax(logits) - _softmax(other)).sum(-1)
    chex.assert_trees_all_close(acc, 1 - 0.5 * l1, rtol=1e-5)


def test_bce_is_stable_for_large_logits():
    z = jnp.array([-200.0, -30.0, 0.0, 30.0, 200.0])
    c = jnp.array([0.0, 0.3, 0.5, 0.9, 1.0])
    out = np.asarray(L.bce_with_logits(z, c))
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out[[0, 4]], [0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(out[2], np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(out[1], 0.3 * 30.0, rtol=1e-5)  # -(0.3 log σ(-30)) ≈ 0.3·30


def test_ece_from_bin_sums():
    conf = jnp.array([0.05, 0.07, 0.93, 0.5])
    target = jnp.array([0.0, 0.1, 1.0, 0.2])
    mask = jnp.array([1.0, 1.0, 1.0, 0.0])
    cnt, sc, st = L.ece_bin_sums(conf, target, mask)
    chex.assert_shape([cnt, sc, st], (20,))
    assert float(cnt.sum()) == 3.0
    ece = L.ece_from_sums(*(np.asarray(x).tolist() for x in (cnt, sc, st)))
    # bin [0.05, 0.1): |0.06 - 0.05| weight 2/3; bin [0.9, 0.95): |0.93 - 1| weight 1/3.
    np.testing.assert_allclose(ece, (2 * 0.01 + 0.07) / 3, rtol=1e-5)


def test_position_weights():
    np.testing.assert_allclose(
        np.asarray(L.position_weights(7, 4.0)), np.exp(-np.arange(7) / 4.0), rtol=1e-6
    )
    with pytest.raises(ValueError, match="decay"):
        L.position_weights(3, 0.0)


def test_eagle3_block_loss_equals_sequence_loss_on_the_same_states():
    """Scoring only states a-1 of chosen anchors gives eagle3_loss restricted to them."""
    rng = np.random.default_rng(5)
    g, s, t, v = 3, 2, 9, 6
    steps = rng.normal(size=(g, s, t, v))
    nxt = rng.normal(size=(s, t, v))
    states = [(0, 1), (0, 4), (1, 2), (1, 5)]  # (sequence, state a-1)
    mask = np.zeros((g, s, t), bool)
    for b, u in states:
        mask[:, b, u] = True
    mask[2, 1, 5] = False
    want, _ = L.eagle3_loss(jnp.asarray(steps), jnp.asarray(nxt), jnp.asarray(mask))
    blocks = np.stack([steps[:, b, u] for b, u in states])  # [N, γ, V]
    tgt = np.stack([np.stack([nxt[b, u + 1 + i] for i in range(g)]) for b, u in states])
    bmask = np.stack([mask[:, b, u] for b, u in states])
    got, _ = L.eagle3_block_loss(jnp.asarray(blocks), jnp.asarray(tgt), jnp.asarray(bmask))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
