"""Ahead-of-time compilation with memory reports (dspark_jax/aot/) and the remat flag.

The drafter step is the full DSpark recipe on the real Qwen3-0.6B shape (28 target layers,
vocabulary 151936, 5 draft layers, Markov rank 256, γ = 7) with a short sequence and small
batch, compiled for 8 fake devices from ShapeDtypeStructs (nothing of model size is
allocated).
"""

from __future__ import annotations

import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import aot
from dspark_jax import sharding as shd
from dspark_jax.config import ConfigError, load_config
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.drafters import init_drafter_params, make_drafter
from dspark_jax.models.presets import get_preset
from dspark_jax.models.qwen3 import Qwen3

P = jax.sharding.PartitionSpec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = os.path.join(REPO, "configs", "recipes", "drafter_dspark_qwen3_0_6b.py")
SMALL = [
    ("data.seq_len", "128"),
    ("data.batch_size", "8"),
    ("drafter.anchors_per_seq", "4"),
    ("drafter.eval_anchors_per_seq", "4"),
]


@pytest.fixture(scope="module")
def compiled_steps():
    cfg = load_config(CFG, SMALL)
    out = {}
    for fsdp in (1, 8):
        mesh = shd.make_mesh(8 // fsdp, fsdp, 1)
        out[fsdp] = aot.compile_train_step(cfg, mesh, device_memory_gb=95)
    return out


@pytest.fixture(scope="module")
def reports(compiled_steps):
    return {k: v[0] for k, v in compiled_steps.items()}


@pytest.mark.slow  # 61 s
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


def _vocab_buffers(hlo_text: str, vocab: int) -> set[tuple[int, ...]]:
    """Shapes of every f32/bf16 buffer of the executable with a vocabulary-sized axis."""
    out = set()
    for dims in re.findall(r"(?:f32|bf16)\[([\d,]+)\]", hlo_text):
        shape = tuple(int(d) for d in dims.split(","))
        if vocab in shape:
            out.add(shape)
    return out


def test_drafter_activations_split_over_batch_axes(compiled_steps):
    """fsdp = 8: each device holds the logits of its own B·N·γ/8 block tokens, never the
    global [B·N·γ, V] (the partitioner used to contract the fsdp-split weights instead and
    all-reduce global-batch activations, ~40 GB/device on the 8B config)."""
    cfg = load_config(CFG, SMALL)
    vocab = get_preset("qwen3-0.6b").vocab_size
    rows = cfg.data.batch_size * cfg.drafter.anchors_per_seq * cfg.drafter.gamma  # 224
    shapes = _vocab_buffers(compiled_steps[8][1].as_text(), vocab)
    local = [s for s in shapes if np.prod(s) // vocab == rows // 8]
    assert local, f"no per-device logits buffer among {sorted(shapes)}"
    full = [s for s in shapes if np.prod(s) // vocab == rows]  # weights: d, rank or d/8
    assert not full, f"global-batch vocabulary-sized buffers on every device: {full}"


def test_markov_factors_split_over_fsdp():
    v, r = 151936, 256
    fsdp = shd.make_mesh(1, 8, 1)  # (the size-1 tensor axis in a spec splits nothing)
    assert shd.logical_to_spec(("vocab", "rank"), (v, r), fsdp) == P("tensor", "fsdp")
    assert shd.logical_to_spec(("rank", "vocab"), (r, v), fsdp) == P("fsdp", "tensor")
    cube = shd.make_mesh(2, 2, 2)
    assert shd.logical_to_spec(("vocab", "rank"), (v, r), cube) == P("tensor", "fsdp")
    # A rank the fsdp axis does not divide stays replicated.
    assert shd.logical_to_spec(("rank", "vocab"), (6, v), fsdp) == P(None, "tensor")


@pytest.mark.parametrize("remat", ["full", pytest.param("dots", marks=pytest.mark.slow)])
def test_drafter_remat_same_loss_and_grads(remat):
    """drafter.remat wraps each draft layer in nn.remat: the same loss and gradients."""
    tgt = get_preset("tiny")
    dc = DrafterConfig(kind="dspark", gamma=4, num_layers=2, mask_token_id=1, markov_rank=8)
    embed = jax.random.normal(jax.random.PRNGKey(0), (tgt.vocab_size, tgt.hidden_size))
    s, t, n = 2, 16, 6
    drafters = {m: make_drafter(dc, tgt.replace(remat=m)) for m in ("none", remat)}
    params = nn.unbox(init_drafter_params(drafters["none"], jax.random.PRNGKey(1)))
    nf = len(drafters["none"].config.taps) * tgt.hidden_size
    feats = jax.random.normal(jax.random.PRNGKey(2), (s, t, nf))
    toks = jax.random.randint(jax.random.PRNGKey(3), (n, 4), 0, tgt.vocab_size)
    seq = jnp.array([0, 0, 0, 1, 1, 1])
    anchor = jnp.array([1, 5, 9, 2, 7, 11])

    def loss(p, m):
        logits, conf = drafters[m].apply(
            {"params": p}, feats, jnp.ones((s, t), bool), toks, seq, anchor, embed, embed,
            method="train_forward",
        )  # fmt: skip
        return jnp.mean(jax.nn.log_softmax(logits)[..., 3]) + jnp.mean(conf**2)

    fn = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    (l0, g0), (l1, g1) = fn(params, "none"), fn(params, remat)
    # Remat recomputes the layer inside the backward pass, where XLA may fuse and reorder
    # the fp32 reductions differently: equal up to reassociation (~1e-7 relative seen with
    # jax 0.10.2), so compare at 1e-6 relative rather than bit for bit.
    np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
    assert jax.tree.structure(g0) == jax.tree.structure(g1)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), g0, g1)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss), static_argnums=1)(params, remat))
    assert "checkpoint" in jaxpr or "remat" in jaxpr


def test_drafter_remat_config_key():
    task = aot.aot_task(load_config(CFG, SMALL + [("drafter.remat", "full")]))
    assert task.model_config().remat == "full"
    assert task.module().target.remat == "full"
    with pytest.raises(ConfigError, match="drafter.remat"):
        load_config(CFG, SMALL + [("drafter.remat", "sometimes")])


@pytest.mark.slow  # 30 s; the drafter's remat is tested beside it
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


def test_decode_state_layout_on_a_mesh():
    """The decoder's own state layout (``state_shardings``, which the AOT serving round
    uses: tests/aot/test_aot_tpu.py): the page pools split over KV heads on the tensor axis,
    every per-slot field over the batch axes."""
    from jax.sharding import PartitionSpec as P

    from dspark_jax.decode.step import SpeculativeDecoder, StepConfig

    mesh = shd.make_mesh(data=2, tensor=2, devices=jax.devices()[:4])  # tiny: 2 KV heads
    tgt = get_preset("tiny")
    dc = DrafterConfig(kind="dspark", gamma=3, num_layers=1, markov_rank=16, mask_token_id=1)
    drafter = make_drafter(dc.resolve(tgt), tgt)
    target = Qwen3(tgt)
    tp = nn.unbox(target.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    dp = nn.unbox(init_drafter_params(drafter, jax.random.key(1)))
    dec = SpeculativeDecoder(target, tp, drafter, dp, StepConfig(num_slots=4, max_len=64))
    layout = dec.state_shardings(mesh)
    pool = P(None, None, None, "tensor", None)
    assert all(s.spec == pool for s in jax.tree.leaves(layout.cache))
    assert layout.ctx_feats.spec == pool  # DSpark's paged context shares the pool's layout
    # Over the batch axes of size > 1 (fsdp is 1 here): the specs a round returns its
    # state in, so the next call meets the same layout.
    assert layout.seq_len.spec == P("data")
    assert layout.slot_keys.spec == P("data", None)
    # Placed by it, the state the decoder builds runs its round unchanged.
    state = jax.device_put(dec.init_state(), layout)
    state, out = dec.round(state)
    assert out.tokens.shape[0] == 4
