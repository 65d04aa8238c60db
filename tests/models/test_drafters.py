"""Drafters: config, shapes, visibility, packing, sampling, heads, baselines."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models.backbone import apply_lm_head
from dspark_jax.models.draft_api import DraftContext, SamplingSettings, next_tokens
from dspark_jax.models.drafter_config import DrafterConfig, default_taps, eagle3_default_taps
from dspark_jax.models.drafters import feature_dim, init_drafter_params, make_drafter
from dspark_jax.models.presets import PRESETS
from dspark_jax.ops.sampling import process_logits, sample
from dspark_jax.sharding import LOGICAL_RULES, make_mesh

TGT = PRESETS["tiny"].replace(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, head_dim=8,
    max_position_embeddings=128,
)  # fmt: skip
GAMMA = 4
MASK = 5


def _drafter(**kw):
    d, boxed = _drafter_boxed(**kw)
    return d, nn.unbox(boxed)


def _drafter_boxed(**kw):
    return _drafter_cached(tuple(sorted(kw.items())))


@functools.cache
def _drafter_cached(items):
    base = dict(kind="dspark", gamma=GAMMA, num_layers=1, mask_token_id=MASK, markov_rank=8)
    base.update(dict(items))
    d = make_drafter(DrafterConfig(**base), TGT)
    return d, init_drafter_params(d, jax.random.key(0))


_process = jax.jit(process_logits, static_argnames=("top_k",))
_sample = jax.jit(sample)


@functools.cache
def _target_io():
    k1, k2 = jax.random.split(jax.random.key(7))
    embed = jax.random.normal(k1, (TGT.vocab_size, TGT.hidden_size))
    lm_head = jax.random.normal(k2, (TGT.hidden_size, TGT.vocab_size)) * 0.3
    return embed, lm_head


_JITS = {}


def _cached_jit(kind):
    """One jitted function per (drafter, entry point): compiles are the slow part on CPU."""

    def deco(builder):
        def get(d):
            key = (kind, id(d))
            if key not in _JITS:
                _JITS[key] = builder(d)
            return _JITS[key]

        return get

    return deco


@_cached_jit("train")
def _train_fn(d):
    embed, lm = _target_io()

    @jax.jit
    def f(p, feats, valid, toks, seq, anchor):
        return d.apply(
            {"params": p},
            feats,
            valid,
            toks,
            seq,
            anchor,
            embed,
            lm,
            return_hidden=True,
            method="train_forward",
        )

    return f


@_cached_jit("draft")
def _draft_fn(d):
    embed, lm = _target_io()

    @functools.partial(jax.jit, static_argnames=("top_k",))
    def f(p, feats, ctx_len, anchors, rng, temperature, top_k=0, context_tokens=None):
        return d.apply(
            {"params": p},
            DraftContext(feats, ctx_len, context_tokens),
            anchors,
            rng,
            SamplingSettings(temperature, top_k, 1.0),
            embed,
            lm,
            method="draft",
        )

    return f


def _packed_batch(f_dim, s=2, t=12, n=5, seed=1):
    ks = jax.random.split(jax.random.key(seed), 3)
    feats = jax.random.normal(ks[0], (s, t, f_dim))
    valid = jnp.ones((s, t), bool).at[1, t - 2 :].set(False)
    toks = jax.random.randint(ks[1], (n, GAMMA), 0, TGT.vocab_size)
    seq = jnp.array([0, 1, 0, 1, 1][:n], jnp.int32)
    anchor = jnp.array([3, 4, 7, 0, 9][:n], jnp.int32)
    return feats, valid, toks, seq, anchor


# -- config --------------------------------------------------------------------------------


def test_default_taps():
    assert default_taps(36) == [1, 9, 17, 25, 33]
    assert default_taps(40) == [1, 10, 19, 28, 37]
    assert default_taps(6) == [1, 2, 3]
    assert default_taps(3) == [0, 1]
    assert eagle3_default_taps(36) == [2, 18, 33]
    with pytest.raises(ValueError, match="no tappable layer"):
        default_taps(1)


def test_config_json_roundtrip_and_resolve(tmp_path):
    cfg = DrafterConfig(kind="dspark", mask_token_id=MASK, head="rnn", rnn_rank=16)
    path = tmp_path / "drafter.json"
    cfg.save(path)
    assert DrafterConfig.load(path) == cfg
    r = cfg.resolve(TGT)
    assert r.taps == (1, 2, 3) and r.num_layers == 5 and r.head == "rnn" and r.confidence
    assert DrafterConfig.from_json(r.to_json()) == r
    assert DrafterConfig(kind="dflash", mask_token_id=1).resolve(TGT).head == "none"
    assert DrafterConfig(kind="dspark", markov_rank=0, mask_token_id=1).resolve(TGT).head == "none"


def test_qkv_kernels_are_out_first_and_older_drafter_files_still_load(tmp_path):
    """q/k/v kernels are stored [heads, head_dim, d] (Projection.out_first); drafter
    directories of format 1 ([d, heads, head_dim]) and format 2 ([heads, d, head_dim])
    load to the same values, and a tensor of any other shape or an unknown format is
    refused by name."""
    import json

    from safetensors.numpy import load_file, save_file

    from dspark_jax.models.drafter_io import load_drafter, save_drafter

    cfg = DrafterConfig(kind="dspark", gamma=GAMMA, num_layers=1, mask_token_id=MASK,
                        markov_rank=8)  # fmt: skip
    d = make_drafter(cfg.resolve(TGT), TGT)
    params = nn.unbox(init_drafter_params(d, jax.random.key(0)))
    attn = params["backbone"]["layers_0"]["self_attn"]
    D, hd, H, KV = TGT.hidden_size, TGT.head_dim, TGT.num_attention_heads, TGT.num_key_value_heads
    assert D != hd  # so a swapped layout cannot pass for the right one
    chex.assert_shape([attn["q_proj"]["kernel"], attn["o_proj"]["kernel"]], (H, hd, D))
    chex.assert_shape([attn["k_proj"]["kernel"], attn["v_proj"]["kernel"]], (KV, hd, D))

    out = tmp_path / "drafter"
    save_drafter(out, cfg, TGT, params)
    meta = json.loads((out / "drafter_config.json").read_text())
    assert meta["format"] == 3
    current = load_file(str(out / "model.safetensors"))
    # Rewrite it as formats 1 and 2 wrote it: q/k/v [d, heads, head_dim], [heads, d, head_dim].
    for fmt, axes in ((1, (2, 0, 1)), (2, (0, 2, 1))):
        tensors = dict(current)
        for proj in ("q_proj", "k_proj", "v_proj"):
            name = f"backbone/layers_0/self_attn/{proj}/kernel"
            tensors[name] = np.ascontiguousarray(np.transpose(current[name], axes))
        save_file(tensors, str(out / "model.safetensors"))
        (out / "drafter_config.json").write_text(json.dumps({**meta, "format": fmt}))
        _, loaded = load_drafter(out, TGT)
        chex.assert_trees_all_equal(loaded, params, strict=True)
        # Read block by block onto a mesh: the file's axes are sliced, then moved.
        _, placed = load_drafter(out, TGT, mesh=make_mesh(data=2, tensor=4))
        chex.assert_trees_all_equal(placed, params, strict=True)

    tensors["backbone/layers_0/self_attn/k_proj/kernel"] = np.zeros((KV, 3, hd), np.float32)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'backbone/layers_0/self_attn/k_proj/kernel' has shape"):
        load_drafter(out, TGT)
    (out / "drafter_config.json").write_text(json.dumps({**meta, "format": 7}))
    with pytest.raises(ValueError, match=r"has format 7; this version reads formats 1, 2, 3"):
        load_drafter(out, TGT)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(kind="medusa"), "kind must be one of"),
        (dict(gamma=0), "gamma must be a positive integer"),
        (dict(head="lstm"), "head must be one of"),
        (dict(taps=[3, 1]), "strictly increasing"),
        (dict(kind="mtp1", gamma=3), "gamma must be 1"),
        (dict(kind="dflash", confidence=True), "no confidence head"),
        (dict(markov_rank=-1), "markov_rank must be an integer >= 0"),
        (dict(head_init="xavier"), "head_init must be one of"),
    ],
)
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        DrafterConfig(**kw)


def test_config_resolve_errors(tmp_path):
    with pytest.raises(ValueError, match="needs mask_token_id"):
        DrafterConfig(kind="dspark").resolve(TGT)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        DrafterConfig(kind="dspark", mask_token_id=64).resolve(TGT)
    with pytest.raises(ValueError, match="out of range"):
        DrafterConfig(kind="dspark", mask_token_id=1, taps=(1, 5)).resolve(TGT)
    with pytest.raises(ValueError, match="Unknown DrafterConfig key"):
        DrafterConfig.from_dict({"kind": "dspark", "block": 7})
    with pytest.raises(FileNotFoundError):
        DrafterConfig.load(tmp_path / "missing.json")


def test_params_have_logical_names():
    rules = dict(LOGICAL_RULES)
    # Same configs as the other tests (cached), covering every parameter kind.
    for kw in (
        dict(head="rnn", rnn_rank=8),
        dict(head="gated", rnn_rank=8),
        dict(kind="eagle3", num_layers=1, mask_token_id=None),
        dict(kind="mtp1", gamma=1, num_layers=1, mask_token_id=None),
    ):
        _, boxed = _drafter_boxed(**kw)
        leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
        for leaf in leaves:
            assert isinstance(leaf, nn.Partitioned), f"unnamed parameter {leaf}"
            chex.assert_rank(leaf.value, len(leaf.names))
            assert all(n in rules for n in leaf.names), leaf.names


# -- DSpark / DFlash -----------------------------------------------------------------------


def test_dspark_shapes_and_bad_input():
    d, p = _drafter()
    f_dim = feature_dim(d.config, TGT)
    feats, valid, toks, seq, anchor = _packed_batch(f_dim)
    logits, conf, h = _train_fn(d)(p, feats, valid, toks, seq, anchor)
    chex.assert_shape(logits, (5, GAMMA, TGT.vocab_size))
    chex.assert_type(logits, jnp.float32)
    chex.assert_shape(conf, (5, GAMMA))
    chex.assert_shape(h, (5, GAMMA, TGT.hidden_size))
    out = _draft_fn(d)(p, feats, jnp.array([3, 7]), jnp.array([1, 2]), jax.random.key(0), 1.0)
    chex.assert_shape([out.tokens, out.confidence], (2, GAMMA))
    chex.assert_shape(out.probs, (2, GAMMA, TGT.vocab_size))
    np.testing.assert_allclose(np.asarray(out.probs.sum(-1)), 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="expected 3 taps"):
        _train_fn(d)(p, feats[..., :-1], valid, toks, seq, anchor)
    with pytest.raises(ValueError, match="block_tokens must be"):
        _train_fn(d)(p, feats, valid, toks[:, :2], seq, anchor)


_PAGED_KINDS = {
    "dspark": dict(num_layers=2),
    "eagle3": dict(kind="eagle3", num_layers=1, mask_token_id=None),
    "mtp1": dict(kind="mtp1", gamma=1, num_layers=1, mask_token_id=None),
}


@pytest.mark.parametrize("kind", list(_PAGED_KINDS))
def test_paged_context_drafts_like_features_and_writes_only_its_block(kind):
    """``context_cache`` K/V scattered into pages (out of order, a pool full of garbage)
    draft what the features (and, for EAGLE-3/MTP-1, the tokens) do; the draft writes each
    writable slot's block K/V right after its context (DSpark: the block at ``c…c+γ-1``;
    EAGLE-3: chain step i at ``c-1+i``; MTP-1: nothing) and touches nothing else (a slot
    that may not write leaves its pages as they were); a cached context in another layout
    is refused with the layout named."""
    d, p = _drafter(**_PAGED_KINDS[kind])
    cfg = d.config
    embed, lm = _target_io()
    r, m, ps = 3, 12, 4
    gamma = cfg.gamma
    layers, kvh, hd = cfg.resolved_num_layers, TGT.num_key_value_heads, TGT.head_dim
    feats = jax.random.normal(jax.random.key(4), (r, m, feature_dim(cfg, TGT)))
    tokens = jax.random.randint(jax.random.key(8), (r, m), 0, TGT.vocab_size)
    ctx_len, anchors = jnp.array([3, 9, 12]), jnp.array([1, 2, 3])
    writable = jnp.array([True, True, False])
    positions = jnp.broadcast_to(jnp.arange(m), (r, m))
    next_ids = next_tokens(tokens, anchors, ctx_len)
    kv, states = d.apply(
        {"params": p}, feats, positions, next_ids, embed, method="context_cache"
    )  # fmt: skip
    chex.assert_shape(kv, (r, m, layers, 2 * kvh, hd))
    query = None
    if cfg.next_token_states:
        chex.assert_shape(states, (r, m, TGT.hidden_size))
        query = states[jnp.arange(r), ctx_len - 1]
    else:
        assert states is None
    pps = -(-(m + gamma) // ps)  # the table covers the context and the block
    num_pages = 1 + r * pps + 3
    order = np.random.default_rng(0).permutation(np.arange(1, num_pages))[: r * pps]
    table = jnp.asarray(order.reshape(r, pps), jnp.int32)
    pool = jax.random.normal(jax.random.key(6), (layers, num_pages, ps, 2 * kvh, hd))
    slot, pos = np.nonzero(np.arange(m)[None, :] < np.asarray(ctx_len)[:, None])
    pages = pool.at[:, table[slot, pos // ps], pos % ps].set(jnp.moveaxis(kv[slot, pos], 1, 0))

    def draft(ctx):
        return d.apply(
            {"params": p}, ctx, anchors, jax.random.key(5), SamplingSettings(1.0, 0, 1.0),
            embed, lm, method="draft",
        )  # fmt: skip

    ref = draft(DraftContext(feats, ctx_len, tokens))

    def cached(rows, **kw):
        kw = {"page_table": table, "query": query, **kw}
        return DraftContext(rows, ctx_len, cached=True, **kw)

    out = draft(cached(pages, writable=writable))
    # Writable slots draft exactly; slot 2 reads its block positions as they are (a slot
    # that may not write is a finished one, whose drafts are never used).
    chex.assert_trees_all_close(out.probs[:2], ref.probs[:2], atol=2e-5, rtol=0)
    chex.assert_trees_all_equal(out.tokens[:2], ref.tokens[:2])
    # Only the writable slots' block positions changed.
    new_pages = pages if out.context is None else out.context
    changed = np.any(np.asarray(new_pages != pages), axis=(0, 3, 4))  # [pages, offsets]
    written = {"dspark": range(0, gamma), "eagle3": range(0, gamma - 1), "mtp1": range(0)}
    want = np.zeros_like(changed)
    for s_ in range(r):
        if writable[s_]:
            for t in (int(ctx_len[s_]) + i for i in written[kind]):
                want[int(table[s_, t // ps]), t % ps] = True
    np.testing.assert_array_equal(changed, want)
    with pytest.raises(ValueError, match=r"cached context must be paged"):
        draft(cached(kv.reshape(r, m, -1)))
    with pytest.raises(ValueError, match=r"needs its page table"):
        draft(cached(pages, page_table=None))
    # Keys and values split (a [layers, 2, ...] buffer) is refused, not misread.
    split = pages.reshape(layers, num_pages, ps, kvh, 2, hd)[..., 0, :]
    with pytest.raises(ValueError, match=r"expected \[layers, num_pages, page_size, 2\*kv"):
        draft(cached(split))
    if cfg.next_token_states:
        with pytest.raises(ValueError, match=r"needs the last states"):
            draft(cached(pages, query=None))


def test_block_visibility():
    """A block sees only its own sequence's context strictly before its anchor + its block."""
    d, p = _drafter(head="rnn", rnn_rank=8)
    f = _train_fn(d)
    feats, valid, toks, seq, anchor = _packed_batch(feature_dim(d.config, TGT))
    base, conf0, _ = f(p, feats, valid, toks, seq, anchor)
    n = 2  # sequence 0, anchor 7
    noise = 5.0 * jnp.ones_like(feats[0, 0])
    # Forbidden: own sequence at/after the anchor, the other sequence, other blocks' tokens.
    for s_, t_ in [(0, 7), (0, 11), (1, 2)]:
        out, c, _ = f(p, feats.at[s_, t_].add(noise), valid, toks, seq, anchor)
        chex.assert_trees_all_close((out[n], c[n]), (base[n], conf0[n]), atol=1e-5, rtol=0)
    out, _, _ = f(p, feats, valid, toks.at[0].set((toks[0] + 1) % 64), seq, anchor)
    chex.assert_trees_all_close(out[n], base[n], atol=1e-5, rtol=0)
    # Allowed: own sequence before the anchor; the anchor token itself.
    out, _, _ = f(p, feats.at[0, 6].add(noise), valid, toks, seq, anchor)
    assert np.abs(np.asarray(out[n] - base[n])).max() > 1e-3
    out, _, _ = f(p, feats.at[0, 0].add(noise), valid, toks, seq, anchor)
    assert np.abs(np.asarray(out[n] - base[n])).max() > 1e-3
    out, _, _ = f(p, feats, valid, toks.at[n, 0].set((toks[n, 0] + 1) % 64), seq, anchor)
    assert np.abs(np.asarray(out[n] - base[n])).max() > 1e-3
    # Padding columns are never visible (block 4: sequence 1, anchor 9 > invalid 10, 11).
    out, _, _ = f(p, feats, valid.at[1, 10].set(True), toks, seq, anchor)
    chex.assert_trees_all_close(out[4], base[4], atol=1e-5, rtol=0)


def test_packed_equals_unpacked():
    d, p = _drafter()
    f = _train_fn(d)
    feats, valid, toks, seq, anchor = _packed_batch(feature_dim(d.config, TGT))
    packed, conf, _ = f(p, feats, valid, toks, seq, anchor)
    for n in range(toks.shape[0]):
        s_ = int(seq[n])
        one, c1, _ = f(
            p,
            feats[s_ : s_ + 1],
            valid[s_ : s_ + 1],
            toks[n : n + 1],
            jnp.zeros((1,), jnp.int32),
            anchor[n : n + 1],
        )
        chex.assert_trees_all_close((one[0], c1[0]), (packed[n], conf[n]), atol=2e-5, rtol=0)


@pytest.mark.parametrize("head", ["markov", "rnn", "gated"])
def test_scan_sampling_matches_stepwise_reference(head):
    """The jitted scan equals a Python loop that re-runs the teacher-forced forward on its
    own samples with the same keys: same tokens, same p_d, same confidences."""
    d, p = _drafter(head=head, rnn_rank=8)
    f_dim = feature_dim(d.config, TGT)
    feats, valid, _, _, _ = _packed_batch(f_dim, s=3)
    ctx_len = jnp.array([3, 9, 10], jnp.int32)
    anchors = jnp.array([11, 12, 13], jnp.int32)
    rng = jax.random.key(42)
    temperature = jnp.array([1.0, 0.7, 0.0])
    out = _draft_fn(d)(p, feats, ctx_len, anchors, rng, temperature, top_k=8)
    keys = jax.random.split(rng, GAMMA)
    train = _train_fn(d)
    block = jnp.zeros((3, GAMMA), jnp.int32).at[:, 0].set(anchors)
    valid_all = jnp.ones(feats.shape[:2], bool)
    for k in range(GAMMA):
        logits, conf, _ = train(p, feats, valid_all, block, jnp.arange(3), ctx_len)
        probs = _process(logits[:, k], temperature, top_k=8)
        tok = _sample(keys[k], probs)
        chex.assert_trees_all_equal(out.tokens[:, k], tok)
        chex.assert_trees_all_close(out.probs[:, k], probs, atol=1e-5, rtol=0)
        chex.assert_trees_all_close(out.confidence_logits[:, k], conf[:, k], atol=1e-4, rtol=0)
        if k + 1 < GAMMA:
            block = block.at[:, k + 1].set(tok)
    picked = jnp.take_along_axis(out.probs, out.tokens[..., None], -1)[..., 0]
    chex.assert_trees_all_close(out.token_probs, picked, atol=1e-6, rtol=0)
    # Greedy row: every draft is the argmax of its distribution.
    assert bool(jnp.all(out.tokens[2] == jnp.argmax(out.probs[2], -1)))


def test_markov_rank0_is_backbone():
    d8, p8 = _drafter(markov_rank=8)
    d0, _ = _drafter(markov_rank=0, confidence=False)
    dfl, _ = _drafter(kind="dflash")
    p0 = {"backbone": p8["backbone"]}
    feats, valid, toks, seq, anchor = _packed_batch(feature_dim(d8.config, TGT))
    l8, _, h8 = _train_fn(d8)(p8, feats, valid, toks, seq, anchor)
    l0, c0, _ = _train_fn(d0)(p0, feats, valid, toks, seq, anchor)
    lf, cf, _ = _train_fn(dfl)(p0, feats, valid, toks, seq, anchor)
    backbone_logits = apply_lm_head(_target_io()[1], h8, TGT.vocab_size)
    assert c0 is None and cf is None
    chex.assert_trees_all_close((l0, lf), (backbone_logits, backbone_logits), atol=1e-5, rtol=0)
    assert np.abs(np.asarray(l8 - backbone_logits)).max() > 1e-4  # the head does something
    # Without a head the draft distribution at each position ignores earlier samples.
    out = _draft_fn(dfl)(p0, feats, jnp.array([4, 6]), jnp.array([1, 2]), jax.random.key(3), 1.0)
    ref = jax.nn.softmax(_dflash_ref(dfl, p0, feats), -1)
    chex.assert_trees_all_close(out.probs, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "head, factor", [pytest.param("markov", 10.0, marks=pytest.mark.slow), ("rnn", 2.0)]
)
def test_zero_bias_head_init_starts_as_backbone_and_learns_fast(head, factor):
    """``head_init="zero_bias"``: W2 = 0 so the drafter starts exactly at its backbone's
    logits, W1 has unit scale, and W2's first gradient is orders of magnitude larger than
    under the DeepSpec N(0, 0.02) init (the reason short budgets use it)."""
    d, p = _drafter(head=head, head_init="zero_bias", rnn_rank=8)
    dd, pd = _drafter(head=head, rnn_rank=8)
    w1 = np.asarray(p["markov_head"]["markov_w1"])
    assert np.all(np.asarray(p["markov_head"]["markov_w2"]) == 0)
    assert 0.8 < w1.std() < 1.2 and np.asarray(pd["markov_head"]["markov_w1"]).std() < 0.05
    feats, valid, toks, seq, anchor = _packed_batch(feature_dim(d.config, TGT))
    logits, _, h = _train_fn(d)(p, feats, valid, toks, seq, anchor)
    base = apply_lm_head(_target_io()[1], h, TGT.vocab_size)
    chex.assert_trees_all_equal(logits, base)
    embed, lm = _target_io()
    labels = jnp.roll(toks, -1, axis=1)

    def w2_grad_norm(mod, params):
        def loss(w2):
            q = dict(params, markov_head=dict(params["markov_head"], markov_w2=w2))
            lg, _ = mod.apply({"params": q}, feats, valid, toks, seq, anchor, embed, lm,
                              method="train_forward")  # fmt: skip
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(lg), labels[..., None], -1))

        return float(jnp.linalg.norm(jax.grad(loss)(params["markov_head"]["markov_w2"])))

    assert w2_grad_norm(d, p) > factor * w2_grad_norm(dd, pd)


def _dflash_ref(d, p, feats):
    # Teacher-forced logits of blocks at anchors 4 and 6 with arbitrary later tokens.
    toks = jnp.array([[1, 9, 9, 9], [2, 8, 8, 8]], jnp.int32)
    logits, _, _ = _train_fn(d)(
        p, feats, jnp.ones(feats.shape[:2], bool), toks, jnp.arange(2), jnp.array([4, 6])
    )
    return logits


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_confidence_non_anticipation(head):
    d, p = _drafter(head=head, rnn_rank=8)
    feats, valid, toks, seq, anchor = _packed_batch(feature_dim(d.config, TGT))
    f = _train_fn(d)
    _, base, _ = f(p, feats, valid, toks, seq, anchor)
    for k in range(1, GAMMA):  # change the token that output k-1 predicts (= x_{k-1} of k)
        _, c, _ = f(p, feats, valid, toks.at[:, k].set((toks[:, k] + 7) % 64), seq, anchor)
        chex.assert_trees_all_close(c[:, :k], base[:, :k], atol=1e-6, rtol=0)
        assert np.abs(np.asarray(c[:, k] - base[:, k])).min() > 1e-6


# -- EAGLE-3 and MTP-1 ---------------------------------------------------------------------


def _seq_case(d, seed=5):
    s, t = 2, 10
    ks = jax.random.split(jax.random.key(seed), 2)
    feats = jax.random.normal(ks[0], (s, t, feature_dim(d.config, TGT)))
    tokens = jax.random.randint(ks[1], (s, t), 0, TGT.vocab_size)
    return feats, tokens


def test_eagle3_train_and_draft_consistency():
    d, p = _drafter(kind="eagle3", num_layers=1, mask_token_id=None)
    embed, lm = _target_io()
    feats, tokens = _seq_case(d)
    c = jnp.array([3, 5], jnp.int32)
    anchors = tokens[jnp.arange(2), c]
    out = _draft_fn(d)(p, feats, c, anchors, jax.random.key(1), 1.0, context_tokens=tokens)
    chex.assert_shape(out.tokens, (2, GAMMA))
    assert out.confidence_logits is None
    # Teacher-force the sampled drafts after the anchor: step i at t = c-1 must reproduce
    # the distribution the drafter sampled token i from.
    seq = tokens
    for r in range(2):
        seq = seq.at[r, int(c[r]) + 1 : int(c[r]) + 1 + GAMMA].set(out.tokens[r])
    train = jax.jit(
        lambda p_, f_, t_, v_: d.apply(
            {"params": p_}, f_, t_, v_, embed, lm, method="train_forward"
        )
    )
    logits = train(p, feats, seq, jnp.ones(seq.shape, bool))
    chex.assert_shape(logits, (GAMMA, 2, 10, TGT.vocab_size))
    for r in range(2):
        ref = jax.nn.softmax(logits[:, r, int(c[r]) - 1], -1)
        chex.assert_trees_all_close(out.probs[r], ref, atol=1e-5, rtol=0)
    # Context features at/after the anchor position are invisible to the draft.
    out2 = _draft_fn(d)(
        p, feats.at[:, 5:].add(3.0), c, anchors, jax.random.key(1), 1.0, context_tokens=tokens
    )
    chex.assert_trees_all_close(out2.probs, out.probs, atol=1e-6, rtol=0)
    # Step i of training does not see tokens beyond t + 1 + i.
    l2 = train(p, feats, seq.at[:, 8:].set(0), jnp.ones(seq.shape, bool))
    chex.assert_trees_all_close(l2[0, :, :6], logits[0, :, :6], atol=1e-5, rtol=0)


def test_mtp1_train_and_draft_consistency():
    d, p = _drafter(kind="mtp1", gamma=1, num_layers=1, mask_token_id=None)
    embed, lm = _target_io()
    feats, tokens = _seq_case(d)
    chex.assert_axis_dimension(feats, -1, TGT.hidden_size)
    c = jnp.array([4, 9], jnp.int32)
    anchors = tokens[jnp.arange(2), c]
    out = _draft_fn(d)(p, feats, c, anchors, jax.random.key(2), 0.0, context_tokens=tokens)
    chex.assert_shape(out.tokens, (2, 1))
    chex.assert_shape(out.probs, (2, 1, TGT.vocab_size))
    logits = d.apply(
        {"params": p},
        feats,
        tokens,
        jnp.ones(tokens.shape, bool),
        embed,
        lm,
        method="train_forward",
    )
    chex.assert_shape(logits, (2, 10, TGT.vocab_size))
    for r in range(2):
        assert int(out.tokens[r, 0]) == int(jnp.argmax(logits[r, int(c[r]) - 1]))
    with pytest.raises(ValueError, match="needs context_tokens"):
        _draft_fn(d)(p, feats, c, anchors, jax.random.key(2), 0.0)
