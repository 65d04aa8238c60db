"""DeepSpec DSpark/DFlash drafter import: key layout, numerical parity, round trips, errors.

The hand-written checkpoints below use the tensor names and torch shapes of DeepSpec's
``Qwen3DSparkModel`` state dict (``deepspec/modeling/dspark/qwen3/modeling.py``,
``markov_head.py``, ``common.py``) written out literally, independent of our save function,
and are checked against a small float64 torch re-implementation of DeepSpec's draft math.
"""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from dspark_jax.convert.deepspec import (
    deepspec_tensor_shapes,
    load_deepspec_drafter,
    main,
    save_deepspec_drafter,
)
from dspark_jax.convert.hf_qwen3 import param_shapes, save_hf
from dspark_jax.models.draft_api import DraftContext, SamplingSettings
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.drafter_io import load_drafter
from dspark_jax.models.drafters import init_drafter_params, make_drafter
from dspark_jax.models.qwen3 import Qwen3Config

V, D, F, H, KV, HD, L = 64, 32, 48, 4, 2, 8, 6
TGT = Qwen3Config(
    vocab_size=V,
    hidden_size=D,
    intermediate_size=F,
    num_hidden_layers=L,
    num_attention_heads=H,
    num_key_value_heads=KV,
    head_dim=HD,
    rope_theta=10_000.0,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
TAPS = [1, 2, 4]
GAMMA, MASK, NLAYERS, RANK = 4, 60, 2, 8


# ----------------------------------------------------------------------------------------
# DeepSpec layout, written by hand
# ----------------------------------------------------------------------------------------


def ds_config(rank, head_type=None, confidence=False, with_markov=None):
    """What DeepSpec's build_draft_config + save_pretrained put in config.json."""
    cfg = {
        "architectures": ["Qwen3DSparkModel"],
        "model_type": "qwen3",
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": F,
        "num_hidden_layers": NLAYERS,
        "num_target_layers": L,
        "num_attention_heads": H,
        "num_key_value_heads": KV,
        "head_dim": HD,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10_000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * NLAYERS,
        "block_size": GAMMA,
        "mask_token_id": MASK,
        "target_layer_ids": TAPS,
        "num_anchors": 512,
        "enable_confidence_head": confidence,
        "markov_rank": rank,
        "torch_dtype": "bfloat16",
    }
    if confidence:
        cfg["confidence_head_with_markov"] = with_markov
    if rank > 0:
        cfg["markov_head_type"] = head_type
    return cfg


def ds_shapes(rank, head_type=None, confidence=False, with_markov=False):
    m = len(TAPS)
    s = {
        "embed_tokens.weight": (V, D),
        "lm_head.weight": (V, D),
        "fc.weight": (D, m * D),
        "hidden_norm.weight": (D,),
        "norm.weight": (D,),
    }
    for i in range(NLAYERS):
        p = f"layers.{i}."
        s[p + "input_layernorm.weight"] = (D,)
        s[p + "post_attention_layernorm.weight"] = (D,)
        s[p + "self_attn.q_proj.weight"] = (H * HD, D)
        s[p + "self_attn.k_proj.weight"] = (KV * HD, D)
        s[p + "self_attn.v_proj.weight"] = (KV * HD, D)
        s[p + "self_attn.o_proj.weight"] = (D, H * HD)
        s[p + "self_attn.q_norm.weight"] = (HD,)
        s[p + "self_attn.k_norm.weight"] = (HD,)
        s[p + "mlp.gate_proj.weight"] = (F, D)
        s[p + "mlp.up_proj.weight"] = (F, D)
        s[p + "mlp.down_proj.weight"] = (D, F)
    if rank > 0:
        s["markov_head.markov_w1.weight"] = (V, rank)  # nn.Embedding(V, r)
        s["markov_head.markov_w2.weight"] = (V, rank)  # nn.Linear(r, V, bias=False)
    if head_type == "gated":
        s["markov_head.gate_proj.weight"] = (rank, D + rank)
        s["markov_head.gate_proj.bias"] = (rank,)
    if head_type == "rnn":
        s["markov_head.joint_proj.weight"] = (3 * rank, 2 * rank + D)
        s["markov_head.joint_proj.bias"] = (3 * rank,)
    if confidence:
        n_in = D + (rank if with_markov else 0)
        s["confidence_head.proj.weight"] = (1, n_in)
        s["confidence_head.proj.bias"] = (1,)
    return s


def ds_state(shapes, seed=0, embed=None, lm_head=None):
    rng = np.random.default_rng(seed)
    state = {}
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        if name.endswith("norm.weight"):
            x = 1.0 + 0.1 * x
        elif name not in ("embed_tokens.weight", "markov_head.markov_w1.weight"):
            x = x * 0.2
        state[name] = x
    if embed is not None:
        state["embed_tokens.weight"] = embed
    if lm_head is not None:
        state["lm_head.weight"] = lm_head
    return state


def write_ds(path, config, state):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)


VARIANTS = {
    # (rank, markov_head_type, enable_confidence_head, confidence_head_with_markov)
    "dspark_vanilla": (RANK, "vanilla", True, True),
    "dspark_gated_conf_hidden_only": (RANK, "gated", True, False),
    "dspark_rnn": (RANK, "rnn", True, True),
    "dflash": (0, None, False, False),
    "rank0_with_confidence": (0, None, True, False),
}


# ----------------------------------------------------------------------------------------
# Independent float64 reference of DeepSpec's drafting math (one slot, one block)
# ----------------------------------------------------------------------------------------


def reference(sd, cfg, feats, anchor, prev):
    """Corrected draft logits [γ, V] and confidence logits [γ] (or None) given x_{k-1}.
    Needs torch (the `parity` extra): only the parity test calls it; the layout, round-trip
    and error tests run without it."""
    torch = pytest.importorskip("torch")
    sd = {k: torch.tensor(v, dtype=torch.float64) for k, v in sd.items()}
    feats = torch.tensor(feats, dtype=torch.float64)
    eps, g, t = cfg["rms_norm_eps"], cfg["block_size"], feats.shape[0]

    def rms(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w

    def lin(x, name):
        y = x @ sd[name + ".weight"].T
        return y + sd[name + ".bias"] if name + ".bias" in sd else y

    hctx = rms(lin(feats, "fc"), sd["hidden_norm.weight"])
    x = sd["embed_tokens.weight"][[anchor] + [cfg["mask_token_id"]] * (g - 1)]
    pos = torch.arange(t + g, dtype=torch.float64)
    inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    ang = torch.cat([pos[:, None] * inv] * 2, -1)
    cos, sin = torch.cos(ang)[:, None], torch.sin(ang)[:, None]

    def rope(z, c, s):
        rot = torch.cat([-z[..., HD // 2 :], z[..., : HD // 2]], -1)
        return z * c + rot * s

    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        hn = rms(x, sd[p + "input_layernorm.weight"])
        q = rms(lin(hn, p + "self_attn.q_proj").view(g, H, HD), sd[p + "self_attn.q_norm.weight"])
        kin = torch.cat([hctx, hn])  # context K/V share the layer's k/v projections
        k = rms(
            lin(kin, p + "self_attn.k_proj").view(t + g, KV, HD), sd[p + "self_attn.k_norm.weight"]
        )
        v = lin(kin, p + "self_attn.v_proj").view(t + g, KV, HD)
        q, k = rope(q, cos[t:], sin[t:]), rope(k, cos, sin)
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * HD**-0.5, -1)
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(g, H * HD)
        x = x + lin(o, p + "self_attn.o_proj")
        hn = rms(x, sd[p + "post_attention_layernorm.weight"])
        x = x + lin(
            torch.nn.functional.silu(lin(hn, p + "mlp.gate_proj")) * lin(hn, p + "mlp.up_proj"),
            p + "mlp.down_proj",
        )
    h = rms(x, sd["norm.weight"])
    logits = h @ sd["lm_head.weight"].T
    prev = torch.tensor(prev)
    e = sd["markov_head.markov_w1.weight"][prev] if "markov_head.markov_w1.weight" in sd else None
    w2 = sd.get("markov_head.markov_w2.weight")
    head = cfg.get("markov_head_type") if cfg["markov_rank"] > 0 else None
    if head == "vanilla":
        logits = logits + e @ w2.T
    elif head == "gated":
        gate = torch.sigmoid(lin(torch.cat([h, e], -1), "markov_head.gate_proj"))
        logits = logits + (gate * e) @ w2.T
    elif head == "rnn":
        r = cfg["markov_rank"]
        state = torch.zeros(r, dtype=torch.float64)
        rows = []
        for k_ in range(g):
            z = lin(torch.cat([state, e[k_], h[k_]]), "markov_head.joint_proj")
            gg, cc, oo = torch.sigmoid(z[:r]), torch.tanh(z[r : 2 * r]), z[2 * r :]
            state = gg * state + (1 - gg) * cc
            rows.append(torch.tanh(oo) @ w2.T)
        logits = logits + torch.stack(rows)
    conf = None
    if cfg["enable_confidence_head"]:
        fin = torch.cat([h, e], -1) if cfg.get("confidence_head_with_markov") else h
        conf = lin(fin, "confidence_head.proj")[:, 0]
    return logits.numpy(), None if conf is None else conf.numpy()


def draft_fn(cfg, embed, lm_head):
    module = make_drafter(cfg, TGT)
    fn = jax.jit(
        lambda p, f, c, a, key, temp: module.apply(
            {"params": p},
            DraftContext(f, c),
            a,
            key,
            SamplingSettings(temp),
            embed,
            lm_head,
            method="draft",
        )
    )
    # temperature is traced ([R]) so greedy and sampled runs share one compile
    return lambda p, f, c, a, t: fn(p, f, c, a, jax.random.key(3), jnp.full((1,), t))


def feats_and_anchor(seed=5, t=7, pad=3):
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((1, t + pad, len(TAPS) * D)).astype(np.float32)
    feats[:, t:] = 1e3  # rows past ctx_len must be ignored
    return jnp.asarray(feats), jnp.array([t], jnp.int32), jnp.array([11], jnp.int32)


# ----------------------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_handwritten_checkpoint_matches_reference(tmp_path, variant):
    rank, head_type, conf, with_markov = VARIANTS[variant]
    config = ds_config(rank, head_type, conf, with_markov)
    shapes = ds_shapes(rank, head_type, conf, with_markov)
    state = ds_state(shapes)
    path = write_ds(tmp_path / "ds", config, state)

    cfg, params = load_deepspec_drafter(path, TGT)
    assert deepspec_tensor_shapes(cfg, TGT) == shapes
    assert (cfg.gamma, cfg.resolved_num_layers, list(cfg.taps), cfg.mask_token_id) == (
        GAMMA,
        NLAYERS,
        TAPS,
        MASK,
    )
    assert cfg.kind == ("dflash" if variant == "dflash" else "dspark")
    assert cfg.head_rank == rank and cfg.has_confidence == conf
    assert params["backbone"]["fc"]["kernel"].dtype == np.float32

    feats, ctx_len, anchor = feats_and_anchor()
    embed, lm_head = state["embed_tokens.weight"], state["lm_head.weight"]
    run = draft_fn(cfg, embed, lm_head)
    out = run(params, feats, ctx_len, anchor, 1.0)
    toks = np.asarray(out.tokens[0])
    prev = [int(anchor[0])] + toks[:-1].tolist()  # x_{k-1}: anchor, then sampled drafts
    t = int(ctx_len[0])
    logits, conf_ref = reference(state, config, np.asarray(feats[0, :t]), int(anchor[0]), prev)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(out.probs[0]), probs, atol=2e-5)
    if conf:
        np.testing.assert_allclose(np.asarray(out.confidence_logits[0]), conf_ref, atol=1e-4)
    else:
        assert out.confidence_logits is None

    greedy = run(params, feats, ctx_len, anchor, 0.0)
    gt = np.asarray(greedy.tokens[0])
    g_logits, _ = reference(
        state, config, np.asarray(feats[0, :t]), int(anchor[0]), [int(anchor[0])] + gt[:-1].tolist()
    )
    np.testing.assert_array_equal(gt, g_logits.argmax(-1))


@pytest.mark.parametrize(
    "dcfg",
    [
        DrafterConfig(
            kind="dspark",
            gamma=GAMMA,
            num_layers=NLAYERS,
            taps=tuple(TAPS),
            markov_rank=RANK,
            mask_token_id=MASK,
        ),
        DrafterConfig(
            kind="dflash", gamma=GAMMA, num_layers=NLAYERS, taps=tuple(TAPS), mask_token_id=MASK
        ),
    ],
    ids=["dspark", "dflash"],
)
def test_save_load_round_trip(tmp_path, dcfg):
    module = make_drafter(dcfg, TGT)
    params = jax.device_get(nn.unbox(init_drafter_params(module, jax.random.key(1))))
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((V, D)).astype(np.float32)
    head = rng.standard_normal((V, D)).astype(np.float32)
    save_deepspec_drafter(tmp_path, dcfg, TGT, params, embed=embed, lm_head=head)

    with open(tmp_path / "config.json") as fh:
        written = json.load(fh)
    from safetensors.numpy import load_file

    keys = set(load_file(str(tmp_path / "model.safetensors")))
    if dcfg.kind == "dspark":
        assert keys == set(ds_shapes(RANK, "vanilla", True, True))
        assert written["markov_head_type"] == "vanilla"
        assert written["confidence_head_with_markov"] is True
    else:
        assert keys == set(ds_shapes(0))
        assert written["markov_rank"] == 0 and written["enable_confidence_head"] is False

    cfg, loaded = load_deepspec_drafter(tmp_path, TGT)
    assert cfg == dcfg.resolve(TGT)
    fa, fb = (
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree_util.tree_leaves_with_path(loaded),
    )
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (p, a), (_, b) in zip(fa, fb):
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=jax.tree_util.keystr(p))

    feats, ctx_len, anchor = feats_and_anchor()
    run = draft_fn(cfg, embed, head)
    o1 = run(params, feats, ctx_len, anchor, 1.0)
    o2 = run(loaded, feats, ctx_len, anchor, 1.0)
    np.testing.assert_array_equal(np.asarray(o1.tokens), np.asarray(o2.tokens))
    np.testing.assert_array_equal(np.asarray(o1.probs), np.asarray(o2.probs))


def test_sharded_checkpoint_and_bf16(tmp_path):
    config = ds_config(0)
    state = ds_state(ds_shapes(0))
    os.makedirs(tmp_path, exist_ok=True)
    with open(tmp_path / "config.json", "w") as fh:
        json.dump(config, fh)
    names = sorted(state)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: state[n] for n in part}, str(tmp_path / fname))
        weight_map.update({n: fname for n in part})
    with open(tmp_path / "model.safetensors.index.json", "w") as fh:
        json.dump({"metadata": {}, "weight_map": weight_map}, fh)
    cfg, params = load_deepspec_drafter(tmp_path, TGT, dtype="bfloat16")
    assert cfg.kind == "dflash"
    q = params["backbone"]["layers_1"]["self_attn"]["q_proj"]["kernel"]
    assert q.shape == (H, HD, D) and q.dtype.name == "bfloat16"
    want = state["layers.1.self_attn.q_proj.weight"].reshape(H, HD, D)
    np.testing.assert_allclose(q.astype(np.float32), want, rtol=1e-2, atol=1e-2)


def test_missing_and_unexpected_keys_are_all_listed(tmp_path):
    shapes = ds_shapes(RANK, "vanilla", True, True)
    state = ds_state(shapes)
    for name in ("fc.weight", "layers.1.mlp.up_proj.weight", "confidence_head.proj.bias"):
        del state[name]
    state["markov_head.gate_proj.weight"] = np.zeros((RANK, D + RANK), np.float32)
    state["layers.2.input_layernorm.weight"] = np.ones((D,), np.float32)
    path = write_ds(tmp_path, ds_config(RANK, "vanilla", True, True), state)
    with pytest.raises(ValueError) as err:
        load_deepspec_drafter(path, TGT)
    msg = str(err.value)
    for name in (
        "fc.weight",
        "layers.1.mlp.up_proj.weight",
        "confidence_head.proj.bias",
        "markov_head.gate_proj.weight",
        "layers.2.input_layernorm.weight",
    ):
        assert name in msg
    assert "missing 3" in msg and "unexpected 2" in msg


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    shapes = ds_shapes(RANK, "vanilla", True, True)
    state = ds_state(shapes)
    state["markov_head.markov_w2.weight"] = np.zeros((RANK, V), np.float32)  # our layout
    state["layers.0.self_attn.k_proj.weight"] = np.zeros((H * HD, D), np.float32)
    path = write_ds(tmp_path, ds_config(RANK, "vanilla", True, True), state)
    with pytest.raises(ValueError) as err:
        load_deepspec_drafter(path, TGT)
    msg = str(err.value)
    assert f"'markov_head.markov_w2.weight': expected {(V, RANK)}, got {(RANK, V)}" in msg
    assert f"'layers.0.self_attn.k_proj.weight': expected {(KV * HD, D)}, got {(H * HD, D)}" in msg


def test_config_errors(tmp_path):
    state = ds_state(ds_shapes(0))
    bad = ds_config(0)
    bad.update(hidden_size=48, num_target_layers=36, target_layer_ids=[-1, 2])
    with pytest.raises(ValueError) as err:
        load_deepspec_drafter(write_ds(tmp_path / "a", bad, state), TGT)
    msg = str(err.value)
    assert "hidden_size is 48 in the drafter but 32 in the target" in msg
    assert "36-layer target" in msg and "-1" in msg

    missing = ds_config(RANK, "vanilla")
    del missing["block_size"], missing["markov_head_type"]
    with pytest.raises(ValueError, match=r"block_size.*markov_head_type"):
        load_deepspec_drafter(write_ds(tmp_path / "b", missing, state), TGT)

    gemma = dict(ds_config(0), architectures=["Gemma4DSparkModel"])
    with pytest.raises(ValueError, match="Gemma4DSparkModel"):
        load_deepspec_drafter(write_ds(tmp_path / "c", gemma, state), TGT)
    with pytest.raises(FileNotFoundError):
        load_deepspec_drafter(tmp_path / "nope", TGT)


def _target_dir(tmp_path):
    """A random untied Hugging Face Qwen3 target (bf16) and its embedding / LM head."""
    rng = np.random.default_rng(7)
    tparams = {}
    for path, shape in param_shapes(TGT).items():
        node = tparams
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    save_hf(tmp_path / "target", TGT, tparams, dtype="bfloat16")
    return (
        str(tmp_path / "target"),
        tparams["embed_tokens"]["embedding"],
        np.ascontiguousarray(tparams["lm_head"]["kernel"].T),  # safetensors wants C order
    )


def test_cli_converts_and_checks_frozen_copies(tmp_path, capsys):
    target, embed, head = _target_dir(tmp_path)
    import ml_dtypes

    bf = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    config = ds_config(RANK, "vanilla", True, True)
    state = ds_state(ds_shapes(RANK, "vanilla", True, True), embed=bf(embed), lm_head=bf(head))
    drafter = write_ds(tmp_path / "ds", config, state)
    out = tmp_path / "ours"
    assert main(["--drafter", drafter, "--target", target, "--out", str(out)]) == 0
    assert "dspark drafter" in capsys.readouterr().out
    _, ref_params = load_deepspec_drafter(drafter, TGT)
    module, params = load_drafter(out, TGT)
    assert module.config.markov_rank == RANK
    for (p, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(ref_params), jax.tree_util.tree_leaves_with_path(params)
    ):
        np.testing.assert_array_equal(a, np.asarray(b), err_msg=jax.tree_util.keystr(p))

    state["lm_head.weight"] = bf(head) + 0.5  # trained against another target
    other = write_ds(tmp_path / "other", config, state)
    with pytest.raises(ValueError, match=r"'lm_head.weight' differs from the target's"):
        load_deepspec_drafter(other, TGT, target_dir=target)
    assert main(["--drafter", other, "--target", target, "--out", str(tmp_path / "x")]) == 2
    assert "lm_head.weight" in capsys.readouterr().err
    rc = main(
        [
            "--drafter",
            other,
            "--target",
            target,
            "--out",
            str(tmp_path / "y"),
            "--skip-target-check",
        ]
    )
    assert rc == 0


def test_frozen_copies_are_compared_a_chunk_of_rows_at_a_time(tmp_path, monkeypatch):
    """The frozen embedding / LM head are compared with the target's a few rows at a time
    (never a whole [V, d] table in host memory): a difference in the last chunk's last
    row alone is still found, with its size."""
    import ml_dtypes

    from dspark_jax.convert import deepspec

    monkeypatch.setattr(deepspec, "_FROZEN_CHECK_ROWS", 7)  # several chunks, a short last one
    assert TGT.vocab_size % 7 != 0
    target, embed, head = _target_dir(tmp_path)
    bf = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
    config = ds_config(RANK, "vanilla", True, True)
    state = ds_state(ds_shapes(RANK, "vanilla", True, True), embed=bf(embed), lm_head=bf(head))
    load_deepspec_drafter(write_ds(tmp_path / "same", config, state), TGT, target_dir=target)
    state["embed_tokens.weight"] = bf(embed)
    state["embed_tokens.weight"][-1, 3] += 0.5
    other = write_ds(tmp_path / "other", config, state)
    with pytest.raises(ValueError, match=r"'embed_tokens.weight' differs .* \(max \|diff\| 0\.5"):
        load_deepspec_drafter(other, TGT, target_dir=target)
