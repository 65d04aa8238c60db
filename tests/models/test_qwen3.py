"""Qwen3 model: cached decoding equals the full forward, taps, scan, and error paths."""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.models.presets import PRESETS
from dspark_jax.models.qwen3 import Qwen3, Qwen3Config, init_cache
from dspark_jax.ops.paged_attention import layout_for_rows

CFG = PRESETS["tiny"]


@functools.cache
def _model_and_params():
    model = Qwen3(CFG)
    tokens = jnp.zeros((1, 8), jnp.int32)
    params = nn.unbox(model.init(jax.random.key(0), tokens)["params"])
    return model, params


@pytest.fixture(scope="module")
def model_and_params():
    return _model_and_params()


# Jitted apply: eager op-by-op dispatch of a scanned model is slow on CPU.
_apply = jax.jit(Qwen3(CFG).apply, static_argnames=("method", "taps"))


def _tokens(batch, length, seed=1):
    return jax.random.randint(jax.random.key(seed), (batch, length), 0, CFG.vocab_size)


def test_layers_are_stacked(model_and_params):
    _, params = model_and_params
    kernel = params["layers"]["layer"]["mlp"]["gate_proj"]["kernel"]
    chex.assert_shape(kernel, (CFG.num_hidden_layers, CFG.hidden_size, CFG.intermediate_size))


PAGE = 4  # small pages: every sequence spans several, handed out in shuffled order


def _paged(num_slots, max_len, seed=0):
    """A page pool and a page table giving each slot its own pages, out of order."""
    per = -(-max_len // PAGE)
    order = 1 + np.random.default_rng(seed).permutation(num_slots * per)
    return init_cache(CFG, num_slots * per + 1, PAGE), jnp.asarray(order.reshape(num_slots, per))


def _decode(params, cache, table, tokens, positions, slots, valid=None):
    """Decode rows ``[N]`` (sorted by slot, consecutive positions per slot)."""
    tokens, positions, slots = (jnp.asarray(x, jnp.int32) for x in (tokens, positions, slots))
    layout = layout_for_rows(slots, positions, table)
    valid = None if valid is None else jnp.asarray(valid)[:, None]
    return _apply(
        {"params": params},
        tokens[:, None],
        positions[:, None],
        slots,
        cache,
        layout,
        valid,
        method=Qwen3.decode,
    )


def test_token_by_token_cache_matches_full_forward(model_and_params):
    model, params = model_and_params
    tokens = _tokens(2, 12)
    full = _apply({"params": params}, tokens)
    cache, table = _paged(3, 16)
    table = table[jnp.array([2, 0])]  # the two rows use slots 2 and 0's pages
    for t in range(12):
        logits, cache, _ = _decode(params, cache, table, tokens[:, t], [t, t], [0, 1])
        chex.assert_trees_all_close(logits[:, 0], full[:, t], atol=1e-5, rtol=1e-5)


def test_chunked_decode_with_slots_at_different_lengths(model_and_params):
    model, params = model_and_params
    tokens = _tokens(3, 14, seed=2)
    full = _apply({"params": params}, tokens)
    cache, table = _paged(3, 16, seed=1)
    # Prefill different prompt lengths into the three slots.
    lengths = jnp.array([3, 6, 1])
    logits, cache, _ = _apply(
        {"params": params}, tokens, lengths, table, cache, method=Qwen3.prefill
    )
    for b in range(3):
        n = int(lengths[b])
        chex.assert_trees_all_close(logits[b, :n], full[b, :n], atol=1e-5, rtol=1e-5)
    # Then chunks of 4 rows per slot (one token each), each slot continuing from its own
    # length; the last chunk is partly invalid (past the 14 tokens we have).
    pos = np.array(lengths)
    while (pos < 14).any():
        chunk_pos = pos[:, None] + np.arange(4)[None, :]
        valid = chunk_pos < 14
        chunk = np.take_along_axis(np.asarray(tokens), np.minimum(chunk_pos, 13), axis=1)
        slots = np.repeat(np.arange(3), 4)
        logits, cache, _ = _decode(
            params, cache, table, chunk.reshape(-1), chunk_pos.reshape(-1), slots,
            valid.reshape(-1),
        )  # fmt: skip
        logits = logits.reshape(3, 4, -1)
        for b in range(3):
            for j in range(4):
                if valid[b, j]:
                    chex.assert_trees_all_close(
                        logits[b, j], full[b, chunk_pos[b, j]], atol=1e-5, rtol=1e-5
                    )
        pos = np.minimum(pos + 4, 14)


def test_packed_rows_of_one_slot(model_and_params):
    """The packed verify layout: several [1]-token rows of the same slot in one call."""
    model, params = model_and_params
    tokens = _tokens(1, 10, seed=3)
    full = _apply({"params": params}, tokens)
    cache, table = _paged(2, 16, seed=2)
    _, cache, _ = _apply(
        {"params": params}, tokens[:, :6], jnp.array([6]), table[1:], cache, method=Qwen3.prefill
    )
    # Four rows of slot 1 after an empty slot 0.
    logits, _, _ = _decode(params, cache, table, tokens[0, 6:10], np.arange(6, 10), [1] * 4)
    chex.assert_trees_all_close(logits[:, 0], full[0, 6:10], atol=1e-5, rtol=1e-5)


def test_rolled_back_entries_are_ignored(model_and_params):
    """Stale cache entries past a slot's length never affect later tokens."""
    model, params = model_and_params
    tokens = _tokens(1, 8, seed=4)
    full = _apply({"params": params}, tokens)
    cache, table = _paged(1, 16, seed=3)
    junk = _tokens(1, 8, seed=5)
    _, cache, _ = _apply(
        {"params": params}, junk, jnp.array([8]), table, cache, method=Qwen3.prefill
    )
    # Overwrite only the first 5 positions with the real prompt; 5..7 hold junk.
    _, cache, _ = _apply(
        {"params": params}, tokens[:, :5], jnp.array([5]), table, cache, method=Qwen3.prefill
    )
    logits, _, _ = _decode(params, cache, table, tokens[0, 5:8], np.arange(5, 8), [0] * 3)
    chex.assert_trees_all_close(logits[:, 0], full[0, 5:8], atol=1e-5, rtol=1e-5)


class ForwardTest(chex.TestCase):
    """The full forward, traced under jit and run op by op (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_segments_isolate_packed_documents(self):
        model, params = _model_and_params()
        apply = self.variant(model.apply)
        a, b = _tokens(1, 5, seed=6), _tokens(1, 7, seed=7)
        packed = jnp.concatenate([a, b], axis=1)
        seg = jnp.array([[1] * 5 + [2] * 7])
        pos = jnp.array([list(range(5)) + list(range(7))])
        out = apply({"params": params}, packed, pos, seg)
        chex.assert_shape(out, (1, 12, CFG.vocab_size))
        alone = (apply({"params": params}, a), apply({"params": params}, b))
        chex.assert_trees_all_close((out[:, :5], out[:, 5:]), alone, atol=1e-5, rtol=0)
        # The same logits as the module's jitted forward the other tests use.
        chex.assert_trees_all_close(
            out, _apply({"params": params}, packed, pos, seg), atol=1e-5, rtol=0
        )


def test_taps_are_layer_outputs(model_and_params):
    model, params = model_and_params
    tokens = _tokens(2, 6, seed=8)
    logits, taps = _apply({"params": params}, tokens, taps=(0, 2))
    chex.assert_shape(taps, (2, 2, 6, CFG.hidden_size))
    # Tap 2 of a 4-layer model run with 3 layers equals that model's (un-normed) output.
    short = CFG.replace(num_hidden_layers=3)
    short_params = jax.tree.map(lambda x: x, params)
    short_params["layers"] = jax.tree.map(lambda x: x[:3], params["layers"])
    _, short_taps = Qwen3(short).apply({"params": short_params}, tokens, taps=(0,))
    chex.assert_trees_all_close(short_taps[0], taps[0], atol=1e-6, rtol=0)
    chex.assert_trees_all_close(logits, _apply({"params": params}, tokens), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="last layer may not be tapped"):
        _apply({"params": params}, tokens, taps=(3,))


def test_config_errors():
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        Qwen3Config(num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(ValueError, match="dtype must be one of"):
        Qwen3Config(dtype="float8")
    with pytest.raises(ValueError, match="Unknown Qwen3Config key"):
        Qwen3Config.from_dict({"hidden_sise": 3})
    with pytest.raises(ValueError, match="Unsupported architecture"):
        Qwen3Config.from_hf_dict({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="page 0 is the null page"):
        init_cache(CFG, 1, 16)
    model, params = Qwen3(CFG), {}
    with pytest.raises(ValueError, match=r"decode takes token rows \[N, 1\]"):
        cache, table = _paged(1, 8)
        model.apply(
            {"params": params}, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1, 2), jnp.int32),
            jnp.zeros((1,), jnp.int32), cache, layout_for_rows(jnp.zeros(1, jnp.int32),
            jnp.zeros(1, jnp.int32), table), method=Qwen3.decode,
        )  # fmt: skip


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling 'yarn'"),
        ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e6}}, "RoPE scaling 'linear'"),
        ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_hf_config_features_we_lack_are_refused(extra, match):
    """A checkpoint using RoPE scaling, sliding windows or another activation must not load
    silently into plain Qwen3 (it would give wrong logits), while the defaults load."""
    hf = dict(CFG.to_hf_dict(), rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    assert Qwen3Config.from_hf_dict(hf).num_hidden_layers == CFG.num_hidden_layers
    with pytest.raises(ValueError, match=match):
        Qwen3Config.from_hf_dict(dict(hf, **extra))


def test_real_family_sizes():
    """Parameter counts of the presets match the published Qwen3 sizes."""
    expected_millions = {
        "qwen3-0.6b": 596,
        "qwen3-1.7b": 1721,
        "qwen3-4b": 4022,
        "qwen3-8b": 8191,
        "qwen3-14b": 14768,
    }
    for name, millions in expected_millions.items():
        assert round(PRESETS[name].num_params() / 1e6) == millions, name


def test_abstract_init_of_a_large_config_allocates_nothing():
    model = Qwen3(PRESETS["qwen3-4b"])
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    )
    n = sum(
        int(np.prod(x.value.shape))
        for x in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    )
    assert n == PRESETS["qwen3-4b"].num_params()


def test_out_first_kernel_holds_the_input_major_values_and_computes_the_same():
    """A projection stored output first (q/k/v: [heads, head_dim, d]) starts from the same
    values as an input-major one ([d, heads, head_dim]) with the same seed, transposed,
    and maps inputs identically: the storage layout is not a different model."""
    from dspark_jax.models.qwen3 import Projection

    kw = dict(features=(4, 8), in_axes=("embed",), out_axes=("q_heads", "kv"))
    x = jax.random.normal(jax.random.key(1), (3, 16))
    ours = Projection(out_first=True, **kw)
    ref = Projection(**kw)
    p = nn.unbox(ours.init(jax.random.key(0), x))
    q = nn.unbox(ref.init(jax.random.key(0), x))
    chex.assert_shape(p["params"]["kernel"], (4, 8, 16))
    chex.assert_shape(q["params"]["kernel"], (16, 4, 8))
    chex.assert_trees_all_equal(
        p["params"]["kernel"], np.transpose(q["params"]["kernel"], (1, 2, 0))
    )
    chex.assert_trees_all_close(ours.apply(p, x), ref.apply(q, x), rtol=1e-6, atol=1e-6)
    # The formulation traced for an accelerator (one dot over the 3-D kernel; on CPU a 2-D
    # x @ W.T, which XLA:CPU multiplies without copying the kernel) computes the same.
    from dspark_jax.ops.flash_attention import compile_platform

    with compile_platform("tpu"):
        chex.assert_trees_all_close(ours.apply(p, x), ref.apply(q, x), rtol=1e-6, atol=1e-6)
