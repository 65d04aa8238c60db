"""Training FLOPs from XLA's cost analysis: against a hand count, the bundled drafters'
equal-compute table, and loops that would be undercounted."""

import os

import jax
import jax.numpy as jnp
import pytest

from dspark_jax.config import load_config
from dspark_jax.perf.train_cost import model_loops, train_step_flops
from dspark_jax.train import bundled

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_lm_step_flops_match_a_hand_count():
    """3 × the forward's matmul flops (projections, MLP, LM head, QKᵀ and AV over the full
    [T, T] scores) for the bundled target's shape, within 3 %: the figure counts every
    layer, not one scan body. The tokenizer is the bundled target's (the config's default
    path is a prepared corpus, which a fresh clone does not have)."""
    tokenizer = os.path.join(ROOT, "assets", "target", "tokenizer.json")
    cfg = load_config(
        os.path.join(ROOT, "configs", "bundled", "target_pycode_v2.py"),
        [("model.scan_layers", "False"), ("model.vocab_size", "8192"),
         ("data.batch_size", "2"), ("data.seq_len", "128"), ("data.tokenizer", tokenizer)],
    )  # fmt: skip
    d, ff, layers, vocab, heads, kv, hd = 256, 768, 6, 8192, 4, 2, 64
    b, t = 2, 128
    per_layer = 2 * d * heads * hd + 2 * d * kv * hd + 3 * d * ff
    forward = 2 * b * t * (per_layer * layers + d * vocab) + 4 * b * t * t * heads * hd * layers
    flops = train_step_flops(cfg)["flops"]
    assert flops == pytest.approx(3 * forward, rel=0.03)


@pytest.mark.slow  # 62 s
def test_bundled_step_flops_table_is_current():
    """``train.bundled.BUNDLED_STEP_GFLOPS`` (which sets every bundled arm's steps) is what
    XLA reports for today's configs, and each arm's steps spend the shared budget."""
    budget = bundled.BUNDLED_STEPS * bundled.BUNDLED_STEP_GFLOPS[bundled.BUDGET_ARM]
    for arm, table_gflops in bundled.BUNDLED_STEP_GFLOPS.items():
        cfg = load_config(os.path.join(ROOT, "configs", "bundled", f"drafter_{arm}.py"))
        gflops = train_step_flops(cfg)["flops"] / 1e9
        assert gflops == pytest.approx(table_gflops, rel=0.01), arm
        steps = bundled.equal_compute_steps(arm)
        assert cfg.train.steps == steps
        assert abs(steps * gflops - budget) <= gflops, arm  # within one step of the budget
    # The equal-steps row: the same config, every arm at BUNDLED_STEPS.
    eq = load_config(os.path.join(ROOT, "configs", "bundled", "drafter_eagle3.py:steps"))
    assert eq.train.steps == bundled.BUNDLED_STEPS != bundled.equal_compute_steps("eagle3")
    with pytest.raises(ValueError, match="budget must be 'compute' or 'steps'"):
        load_config(os.path.join(ROOT, "configs", "bundled", "drafter_eagle3.py:flops"))


def test_loops_with_model_work_are_found_and_rng_loops_are_not():
    x = jnp.ones((4, 8))
    w = jnp.ones((8, 8))

    def scanned(x):
        return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)[0]

    def rng(key):
        return jax.random.uniform(key, (4, 8))

    assert len(model_loops(jax.jit(scanned).lower(x).compile().as_text())) == 1
    rng_hlo = jax.jit(rng).lower(jax.random.key(0)).compile().as_text()
    assert "while(" in rng_hlo and model_loops(rng_hlo) == []
