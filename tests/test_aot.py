"""Ahead-of-time compilation with memory reports (train/aot.py) and the remat flag.

The drafter step is the full DSpark recipe on the real Qwen3-0.6B shape (28 target layers,
vocabulary 151936, 5 draft layers, Markov rank 256, γ = 7) with a short sequence and small
batch, compiled for 8 fake devices from ShapeDtypeStructs (nothing of model size is
allocated).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import sharding as shd
from dspark_jax.config import load_config
from dspark_jax.models.presets import get_preset
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.train import aot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = os.path.join(REPO, "configs", "drafter_dspark_qwen3_0_6b.py")
SMALL = [
    ("data.seq_len", "128"),
    ("data.batch_size", "8"),
    ("drafter.anchors_per_seq", "4"),
    ("drafter.eval_anchors_per_seq", "4"),
]


@pytest.fixture(scope="module")
def reports():
    cfg = load_config(CFG, SMALL)
    out = {}
    for fsdp in (1, 8):
        mesh = shd.make_mesh(8 // fsdp, fsdp, 1)
        out[fsdp], _ = aot.compile_train_step(cfg, mesh, device_memory_gb=95)
    return out


def test_memory_report_present_and_consistent(reports):
    r = reports[8]
    assert r["task"] == "drafter" and r["num_devices"] == 8
    assert r["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    # The real Qwen3-0.6B target (~0.6B parameters, bf16) and a ~0.2B-parameter drafter.
    assert 0.55e9 < r["frozen_params"] < 0.65e9
    assert r["trainable_params"] > 0.1e9
    mem, pd = r["memory"], r["per_device"]
    for key in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes"):
        assert mem[key] > 0, key
    # Inputs of the executable = the per-device shards of state + frozen target + batch
    # (memory_analysis is per device).
    inputs = pd["params_bytes"] + pd["opt_state_bytes"] + pd["frozen_bytes"] + pd["batch_bytes"]
    assert abs(mem["argument_bytes"] - inputs) <= 0.01 * inputs
    # The donated training state is updated in place: aliased, not counted twice.
    state = pd["params_bytes"] + pd["opt_state_bytes"]
    assert abs(mem["alias_bytes"] - state) <= 0.01 * state
    # fp32 master weights and fp32 AdamW moments (2 per parameter); bf16 frozen target.
    assert r["global"]["opt_state_bytes"] >= 2 * r["global"]["params_bytes"]
    assert r["global"]["params_bytes"] == 4 * r["trainable_params"]
    assert r["global"]["frozen_bytes"] == 2 * r["frozen_params"]
    assert r["fits"] is True and r["device_memory_gb"] == 95
    assert r["compile_s"] > 0


def test_per_device_bytes_shrink_with_fsdp(reports):
    one, eight = reports[1]["per_device"], reports[8]["per_device"]
    # The frozen target is sharded over fsdp (embed axis), not replicated: ~8x smaller.
    assert eight["frozen_bytes"] * 7 < one["frozen_bytes"]
    assert eight["params_bytes"] < one["params_bytes"]
    assert eight["opt_state_bytes"] < one["opt_state_bytes"]
    assert reports[8]["memory"]["argument_bytes"] < reports[1]["memory"]["argument_bytes"]
    # With fsdp = 1 every device holds the whole model.
    assert one["frozen_bytes"] == reports[1]["global"]["frozen_bytes"]


def test_remat_flag_same_gradients_less_memory():
    cfg = get_preset("tiny").replace(num_hidden_layers=2)
    tokens = jax.random.randint(jax.random.PRNGKey(0), (2, 64), 0, cfg.vocab_size)
    params = Qwen3(cfg).init(jax.random.PRNGKey(1), tokens[:, :8])["params"]

    def loss(p, c):
        logits = Qwen3(c).apply({"params": p}, tokens)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 0])

    grads, temps = {}, {}
    for remat in ("none", "dots", "full"):
        c = cfg.replace(remat=remat)
        fn = jax.jit(jax.grad(loss), static_argnums=1)
        grads[remat] = fn(params, c)
        temps[remat] = fn.lower(params, c).compile().memory_analysis().temp_size_in_bytes
    for remat in ("dots", "full"):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
            grads[remat],
            grads["none"],
        )
    assert temps["full"] < temps["none"]
    with pytest.raises(ValueError, match="remat must be one of"):
        cfg.replace(remat="sometimes")


def test_bad_aot_arguments_fail_clearly():
    with pytest.raises(ValueError, match="three integers data,fsdp,tensor"):
        aot.parse_mesh("1,8")
    cfg = load_config(CFG, SMALL + [("target.preset", "")])
    with pytest.raises(FileNotFoundError, match="target.preset"):
        aot.compile_train_step(cfg, shd.make_mesh(1, 8, 1))
    cfg = load_config(CFG, [("data.batch_size", "4")])
    with pytest.raises(ValueError, match="not divisible by the data-parallel degree"):
        aot.compile_train_step(cfg, shd.make_mesh(1, 8, 1))
