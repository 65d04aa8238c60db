"""HF <-> dspark_jax conversion without torch: layout, round trips, sharding, error messages."""

import json
import os

import chex
import flax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from dspark_jax.convert import (
    hf_state_dict_to_params,
    hf_tensor_shapes,
    load_hf,
    param_shapes,
    params_to_hf_state_dict,
    save_hf,
)
from dspark_jax.models.presets import PRESETS
from dspark_jax.models.qwen3 import Qwen3, Qwen3Config

UNTIED = PRESETS["tiny"].replace(
    vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, head_dim=8,
    rope_theta=500_000.0, max_position_embeddings=64,
)  # fmt: skip
TIED = UNTIED.replace(tie_word_embeddings=True, num_attention_heads=6)


def random_params(cfg: Qwen3Config, seed: int = 0):
    """A full random tree with the model's own structure (norm scales perturbed off 1)."""
    shapes = param_shapes(cfg)
    rng = np.random.default_rng(seed)
    tree = {}
    for path, shape in shapes.items():
        value = rng.standard_normal(shape).astype(np.float32) * 0.1
        if path[-1] == "scale":
            value += 1.0
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def flat(tree):
    return flax.traverse_util.flatten_dict(tree)


def assert_trees_equal(a, b):
    """Same keys, and per leaf the same shape, dtype and values (a failure names the path)."""
    chex.assert_trees_all_equal(a, b, strict=True)


def write_checkpoint(path, hf_config: dict, state: dict):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(hf_config, fh)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("cfg", [UNTIED, TIED], ids=["untied", "tied"])
def test_param_shapes_match_model_tree(cfg):
    tokens = jnp.zeros((1, 4), jnp.int32)
    abstract = jax.eval_shape(lambda: Qwen3(cfg).init(jax.random.key(0), tokens))
    model_shapes = {k: v.shape for k, v in flat(flax.linen.meta.unbox(abstract["params"])).items()}
    assert model_shapes == param_shapes(cfg)
    n_hf = sum(int(np.prod(s)) for s in hf_tensor_shapes(cfg).values())
    assert n_hf == cfg.num_params()


def test_layout_matches_torch_linear_convention():
    """HF Linear weights are [out, in]; check individual entries, not just shapes."""
    cfg = UNTIED
    params = random_params(cfg)
    sd = params_to_hf_state_dict(cfg, params)
    layer = params["layers"]["layer"]
    d, hd = cfg.hidden_size, cfg.head_dim
    i, h, j, layer_idx = 5, 3, 6, 1
    q = sd[f"model.layers.{layer_idx}.self_attn.q_proj.weight"]
    chex.assert_shape(q, (cfg.num_attention_heads * hd, d))
    assert q[h * hd + j, i] == layer["self_attn"]["q_proj"]["kernel"][layer_idx, h, j, i]
    k = sd[f"model.layers.{layer_idx}.self_attn.k_proj.weight"]
    assert k[1 * hd + j, i] == layer["self_attn"]["k_proj"]["kernel"][layer_idx, 1, j, i]
    o = sd[f"model.layers.{layer_idx}.self_attn.o_proj.weight"]
    assert o[i, h * hd + j] == layer["self_attn"]["o_proj"]["kernel"][layer_idx, h, j, i]
    down = sd[f"model.layers.{layer_idx}.mlp.down_proj.weight"]
    chex.assert_shape(down, (d, cfg.intermediate_size))
    assert down[i, 7] == layer["mlp"]["down_proj"]["kernel"][layer_idx, 7, i]
    assert sd["lm_head.weight"][11, i] == params["lm_head"]["kernel"][i, 11]
    np.testing.assert_array_equal(
        sd["model.layers.0.self_attn.q_norm.weight"], layer["self_attn"]["q_norm"]["scale"][0]
    )
    assert all(v.flags["C_CONTIGUOUS"] for v in sd.values())


@pytest.mark.parametrize("cfg", [UNTIED, TIED], ids=["untied", "tied"])
def test_state_dict_round_trip_is_exact(cfg):
    params = random_params(cfg)
    sd = params_to_hf_state_dict(cfg, params)
    assert set(sd) == set(hf_tensor_shapes(cfg))
    assert_trees_equal(hf_state_dict_to_params(cfg, sd), params)
    # Flax partition-boxed trees and {"params": ...} wrappers are accepted too.
    boxed = jax.tree.map(lambda x: flax.linen.LogicallyPartitioned(x, (None,) * x.ndim), params)
    assert_trees_equal(hf_state_dict_to_params(cfg, params_to_hf_state_dict(cfg, boxed)), params)
    assert params_to_hf_state_dict(cfg, {"params": params}).keys() == sd.keys()


@pytest.mark.parametrize(
    "cfg,dtype,shard",
    [(UNTIED, "float32", None), (UNTIED, "bfloat16", 6000), (TIED, "float32", 1)],
    ids=["untied-fp32-single", "untied-bf16-sharded", "tied-fp32-one-tensor-per-shard"],
)
def test_save_load_round_trip(tmp_path, cfg, dtype, shard):
    params = random_params(cfg)
    written = save_hf(tmp_path, cfg, params, dtype=dtype, max_shard_bytes=shard)
    files = sorted(os.listdir(tmp_path))
    assert sorted(os.path.basename(w) for w in written) == files
    n_tensors = len(hf_tensor_shapes(cfg))
    if shard is None:
        assert "model.safetensors" in files
    else:
        with open(tmp_path / "model.safetensors.index.json") as fh:
            index = json.load(fh)
        shards = sorted(f for f in files if f.startswith("model-"))
        assert len(shards) > 1 and shards[-1].endswith(f"of-{len(shards):05d}.safetensors")
        assert set(index["weight_map"]) == set(hf_tensor_shapes(cfg))
        if shard == 1:
            assert len(shards) == n_tensors
        itemsize = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32).itemsize
        assert index["metadata"]["total_size"] == cfg.num_params() * itemsize
    with open(tmp_path / "config.json") as fh:
        hf_config = json.load(fh)
    assert Qwen3Config.from_hf_dict(hf_config) == cfg

    loaded_cfg, loaded = load_hf(tmp_path, dtype=dtype)
    assert loaded_cfg == cfg.replace(param_dtype=dtype)
    expected = jax.tree.map(lambda x: x.astype(np.dtype(loaded_cfg.weight_dtype)), params)
    assert_trees_equal(loaded, expected)
    # Default dtype: the config's float32, upcast exactly from bf16.
    _, loaded32 = load_hf(tmp_path)
    assert_trees_equal(loaded32, jax.tree.map(lambda x: x.astype(np.float32), expected))


def test_save_replaces_previous_export_and_writes_generation_config(tmp_path):
    cfg = UNTIED.replace(bos_token_id=1, eos_token_id=2)
    save_hf(tmp_path, cfg, random_params(cfg, 0), dtype="float32", max_shard_bytes=4000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    new = random_params(cfg, 1)
    save_hf(tmp_path, cfg, new, dtype="float32")
    assert sorted(os.listdir(tmp_path)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    with open(tmp_path / "generation_config.json") as fh:
        assert json.load(fh) == {"bos_token_id": 1, "eos_token_id": 2}
    assert_trees_equal(load_hf(tmp_path)[1], new)


def test_tied_checkpoint_with_equal_lm_head_is_accepted(tmp_path):
    params = random_params(TIED)
    sd = params_to_hf_state_dict(TIED, params)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].copy()
    write_checkpoint(tmp_path, TIED.to_hf_dict(), sd)
    assert_trees_equal(load_hf(tmp_path)[1], params)


def test_sharded_without_index_is_read(tmp_path):
    save_hf(tmp_path, UNTIED, random_params(UNTIED), dtype="float32", max_shard_bytes=6000)
    os.remove(tmp_path / "model.safetensors.index.json")
    assert_trees_equal(load_hf(tmp_path)[1], random_params(UNTIED))


# ----------------------------------------------------------------------------------------
# Error paths
# ----------------------------------------------------------------------------------------


@pytest.fixture
def good_checkpoint(tmp_path):
    sd = params_to_hf_state_dict(UNTIED, random_params(UNTIED))
    return tmp_path / "ckpt", UNTIED.to_hf_dict(), sd


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"directory .*nope does not exist"):
        load_hf(tmp_path / "nope")


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No config.json in .*looked for .*config.json"):
        load_hf(tmp_path)


def test_missing_weights(tmp_path):
    with open(tmp_path / "config.json", "w") as fh:
        json.dump(UNTIED.to_hf_dict(), fh)
    with pytest.raises(FileNotFoundError, match=r"No weights found in .*model.safetensors"):
        load_hf(tmp_path)


def test_missing_shard_named(tmp_path):
    save_hf(tmp_path, UNTIED, random_params(UNTIED), dtype="float32", max_shard_bytes=6000)
    shards = sorted(f for f in os.listdir(tmp_path) if f.startswith("model-0"))
    assert len(shards) > 2
    os.remove(tmp_path / shards[1])
    with pytest.raises(FileNotFoundError, match=rf"{shards[1]} listed in .*index.json"):
        load_hf(tmp_path)


def test_unsupported_architecture(good_checkpoint):
    path, hf, sd = good_checkpoint
    hf = dict(hf, model_type="llama", architectures=["LlamaForCausalLM"])
    write_checkpoint(path, hf, sd)
    with pytest.raises(ValueError, match=r"Unsupported architecture.*llama"):
        load_hf(path)


def test_shape_mismatch_names_tensor_and_shapes(good_checkpoint):
    path, hf, sd = good_checkpoint
    sd["model.layers.1.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    write_checkpoint(path, hf, sd)
    with pytest.raises(
        ValueError,
        match=r"'model.layers.1.self_attn.k_proj.weight'.*shape \(8, 32\).*expects \(16, 32\)",
    ):
        load_hf(path)


def test_missing_tensors_listed(good_checkpoint):
    path, hf, sd = good_checkpoint
    del sd["lm_head.weight"]
    del sd["model.layers.0.mlp.up_proj.weight"]
    write_checkpoint(path, hf, sd)
    with pytest.raises(
        ValueError,
        match=r"missing tensors 2: \[lm_head.weight, model.layers.0.mlp.up_proj.weight\]",
    ):
        load_hf(path)


def test_unexpected_tensors_listed(good_checkpoint):
    path, hf, sd = good_checkpoint
    sd["model.layers.2.mlp.up_proj.weight"] = np.zeros((48, 32), np.float32)
    sd["model.layers.0.self_attn.q_proj.bias"] = np.zeros((32,), np.float32)
    write_checkpoint(path, hf, sd)
    with pytest.raises(
        ValueError,
        match=r"unexpected tensors 2: \[model.layers.0.self_attn.q_proj.bias, "
        r"model.layers.2.mlp.up_proj.weight\]",
    ):
        load_hf(path)


def test_tied_checkpoint_with_different_lm_head_rejected(tmp_path):
    sd = params_to_hf_state_dict(TIED, random_params(TIED))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1.0
    write_checkpoint(tmp_path, TIED.to_hf_dict(), sd)
    with pytest.raises(ValueError, match=r"tie_word_embeddings=true but its 'lm_head.weight'"):
        load_hf(tmp_path)


def test_bad_dtype_and_bad_params_tree(tmp_path):
    params = random_params(UNTIED)
    with pytest.raises(ValueError, match=r"Unsupported dtype 'int8'"):
        save_hf(tmp_path, UNTIED, params, dtype="int8")
    with pytest.raises(ValueError, match=r"Unsupported dtype"):
        load_hf(tmp_path, dtype="not-a-dtype")
    with pytest.raises(ValueError, match=r"max_shard_bytes must be a positive integer"):
        save_hf(tmp_path, UNTIED, params, max_shard_bytes=0)
    # Untied params exported under a tied config: the extra head is reported.
    with pytest.raises(ValueError, match=r"not part of a Qwen3 model.*lm_head/kernel"):
        params_to_hf_state_dict(UNTIED.replace(tie_word_embeddings=True), params)
    with pytest.raises(
        ValueError,
        match=r"'layers/layer/mlp/gate_proj/kernel' has shape \(2, 32, 48\), expected \(2, 32, 40\)",
    ):
        params_to_hf_state_dict(UNTIED.replace(intermediate_size=40), params)
    del params["norm"]
    with pytest.raises(ValueError, match=r"params is missing the leaf 'norm'"):
        params_to_hf_state_dict(UNTIED, params)
