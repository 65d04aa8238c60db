"""Parity of our Qwen3 against the ``transformers`` implementation (DESIGN §3.1, Interop).

Random tiny HF models are saved with ``save_pretrained`` and read with ``load_hf``; logits
must agree within fp32 tolerance and greedy continuations (our cached prefill/decode path
vs HF ``generate``) must be identical. In the other direction, our random params exported
with ``save_hf`` must load into ``transformers`` with no missing or unexpected keys and give
the same logits, and ``load_hf`` must give them back bit-for-bit.
"""

import functools

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.convert import load_hf, param_shapes, save_hf
from dspark_jax.models.presets import PRESETS
from dspark_jax.models.qwen3 import Qwen3, Qwen3Config, init_cache
from dspark_jax.ops.paged_attention import layout_for_rows

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TOL = 1e-4  # fp32 max-abs logit difference (conftest sets highest matmul precision)
NEW_TOKENS = 32

HF_CONFIGS = {
    # 2 query heads per KV head, untied head, non-default rope theta.
    "gqa-untied": dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=5e5
    ),
    # 3 query heads per KV head, tied embeddings, default-ish theta.
    "gqa-tied": dict(
        num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6
    ),
}


def hf_config(**kw):
    base = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        initializer_range=0.1,  # larger than 0.02 so logits are far from uniform
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    base.update(kw)
    return transformers.Qwen3Config(**base)


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()


@pytest.fixture(scope="module", params=sorted(HF_CONFIGS))
def hf_checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(hf_config(**HF_CONFIGS[request.param]))
    model = model.to(torch.float32).eval()
    with torch.no_grad():  # HF inits RMSNorm weights to one; perturb so they are tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path, model


@functools.cache
def _jitted(config: Qwen3Config):
    model = Qwen3(config)
    forward = jax.jit(lambda p, t: model.apply({"params": p}, t))
    prefill = jax.jit(
        lambda p, t, n, table, c: model.apply({"params": p}, t, n, table, c, method=Qwen3.prefill)
    )

    def decode_rows(p, t, pos, s, table, c):
        layout = layout_for_rows(s, pos[:, 0], table)
        return model.apply({"params": p}, t, pos, s, c, layout, method=Qwen3.decode)

    decode = jax.jit(decode_rows)
    return forward, prefill, decode


def test_logits_match_transformers(hf_checkpoint):
    path, model = hf_checkpoint
    config, params = load_hf(path)
    assert config.rope_theta == model.config.rope_parameters["rope_theta"]
    assert config.tie_word_embeddings == model.config.tie_word_embeddings
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 24))
    forward, _, _ = _jitted(config)
    ours = np.asarray(forward(params, jnp.asarray(tokens, jnp.int32)))
    theirs = hf_logits(model, tokens)
    diff = float(np.abs(ours - theirs).max())
    print(f"parity max-abs logit diff ({path.name}): {diff:.3g}")
    assert diff < TOL


def test_tap_convention_matches_hf_hidden_states(hf_checkpoint):
    """Tap ``l`` is the output of decoder layer ``l`` == HF ``hidden_states[l + 1]``."""
    path, model = hf_checkpoint
    config, params = load_hf(path)
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (1, 10))
    _, taps = Qwen3(config).apply({"params": params}, jnp.asarray(tokens), taps=(0, 1))
    with torch.no_grad():
        hidden = model(torch.as_tensor(tokens), output_hidden_states=True).hidden_states
    for i, layer in enumerate((0, 1)):
        np.testing.assert_allclose(np.asarray(taps[i]), hidden[layer + 1].numpy(), atol=TOL)


def test_greedy_continuation_matches_transformers(hf_checkpoint):
    path, model = hf_checkpoint
    config, params = load_hf(path)
    _, prefill, decode = _jitted(config)
    rng = np.random.default_rng(2)
    lengths = np.array([7, 11])
    width = int(lengths.max())
    prompts = [rng.integers(0, config.vocab_size, n) for n in lengths]
    tokens = np.zeros((2, width), np.int32)  # right padding, never written to the cache
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p

    # Ours: prefill into two cache slots, then decode one token per row per step.
    slots = jnp.arange(2, dtype=jnp.int32)
    pages = -(-(width + NEW_TOKENS) // 8)  # pages of 8 positions, slot 1's first
    table = jnp.asarray(1 + np.arange(2 * pages)[::-1].reshape(2, pages), jnp.int32)
    cache = init_cache(config, 2 * pages + 1, 8)
    logits, cache, _ = prefill(params, jnp.asarray(tokens), jnp.asarray(lengths), table, cache)
    step_logits = [np.asarray(logits)[np.arange(2), lengths - 1]]
    positions = lengths.copy()
    for _ in range(NEW_TOKENS - 1):
        nxt = step_logits[-1].argmax(-1).astype(np.int32)
        logits, cache, _ = decode(
            params, jnp.asarray(nxt[:, None]), jnp.asarray(positions[:, None]), slots, table,
            cache,
        )  # fmt: skip
        step_logits.append(np.asarray(logits)[:, 0])
        positions += 1
    ours = np.stack(step_logits, axis=1)  # [2, NEW_TOKENS, V]
    ours_tokens = ours.argmax(-1)

    for b, prompt in enumerate(prompts):
        out = model.generate(
            torch.as_tensor(prompt[None]),
            attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
        hf_tokens = out[0, len(prompt) :].numpy()
        np.testing.assert_array_equal(ours_tokens[b], hf_tokens)
        # The cached path's logits also match HF's full forward over the same sequence.
        full = hf_logits(model, out[:, :-1].numpy())[0, len(prompt) - 1 :]
        assert np.abs(ours[b] - full).max() < TOL
    assert len(set(ours_tokens.ravel().tolist())) > 2  # a non-degenerate continuation


@pytest.mark.parametrize(
    "tied,dtype,shard",
    [
        (False, "float32", None),
        (False, "bfloat16", 40_000),
        (True, "float32", 40_000),
        (True, "bfloat16", None),
    ],
    ids=["untied-fp32-single", "untied-bf16-sharded", "tied-fp32-sharded", "tied-bf16-single"],
)
def test_export_loads_in_transformers(tmp_path, tied, dtype, shard):
    config = PRESETS["tiny"].replace(
        vocab_size=128, intermediate_size=96, num_hidden_layers=2, rope_theta=5e5,
        max_position_embeddings=128, tie_word_embeddings=tied,
    )  # fmt: skip
    # Random values on the model's tree (param_shapes is checked against Qwen3.init in
    # test_convert); norm scales sit off one so a swapped or dropped norm would show.
    rng = np.random.default_rng(3)
    params = {}
    for path, shape in param_shapes(config).items():
        value = 0.1 * rng.standard_normal(shape).astype(np.float32)
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value + 1.0 if path[-1] == "scale" else value
    written = save_hf(tmp_path, config, params, dtype=dtype, max_shard_bytes=shard)
    assert any(w.endswith("index.json") for w in written) == (shard is not None)

    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert hf_model.config.rope_parameters["rope_theta"] == 5e5
    assert hf_model.config.tie_word_embeddings == tied

    # Reference: our model on the exported (possibly bf16-rounded) weights, in fp32.
    stored = jax.tree.map(lambda x: np.asarray(x).astype(dtype), params)
    as_f32 = jax.tree.map(lambda x: x.astype(np.float32), stored)
    ids = np.random.default_rng(5).integers(0, config.vocab_size, (2, 16))
    ours = np.asarray(_jitted(config)[0](as_f32, jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours - hf_logits(hf_model.eval(), ids)).max() < TOL

    loaded_config, loaded = load_hf(tmp_path, dtype=dtype)
    assert loaded_config == config.replace(param_dtype=dtype)
    flat_loaded = flax.traverse_util.flatten_dict(loaded)
    flat_stored = flax.traverse_util.flatten_dict(stored)
    assert flat_loaded.keys() == flat_stored.keys()
    for k in flat_stored:
        assert flat_loaded[k].dtype == flat_stored[k].dtype
        np.testing.assert_array_equal(flat_loaded[k], flat_stored[k], err_msg=str(k))
