"""A Hugging Face Qwen3 checkpoint read straight into a mesh (``convert.hf_mesh``): the
same values as the whole-model loader on every mesh layout, the rules table's shardings,
the fingerprint read from the files, the loader's errors, and the host memory it needs."""

from __future__ import annotations

import json
import os
import tracemalloc

import chex
import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dspark_jax.convert.hf_mesh import (
    hf_dir_fingerprint,
    load_hf_to_mesh,
    read_block,
    target_shardings,
)
from dspark_jax.convert.hf_qwen3 import load_hf, save_hf
from dspark_jax.models.fingerprint import weights_fingerprint
from dspark_jax.models.qwen3 import Qwen3Config
from dspark_jax.sharding import make_mesh


def _config(**kw) -> Qwen3Config:
    base = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=4, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    base.update(kw)
    return Qwen3Config(**base)


def _random_params(cfg: Qwen3Config, seed: int = 0):
    from dspark_jax.convert.hf_qwen3 import param_shapes

    rng = np.random.default_rng(seed)
    tree: dict = {}
    for path, shape in param_shapes(cfg).items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = rng.normal(size=shape).astype(np.float32)
    return tree


def _peak(load):
    """``(peak, still held)`` host bytes traced (tracemalloc) while ``load()`` runs."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    out = load()
    jax.block_until_ready(out)
    current, top = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del out
    return top, current


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cfg = _config()
    path = tmp_path_factory.mktemp("qwen3")
    # Several shards: a tensor's blocks come from whichever file holds it.
    save_hf(path, cfg, _random_params(cfg), dtype="float32", max_shard_bytes=200_000)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    return cfg, str(path)


MESHES = [
    dict(tensor=8),  # KV heads (4) do not divide 8: those leaves are replicated
    dict(data=2, tensor=4),
    dict(fsdp=2, tensor=4),
    dict(fsdp=8, tensor=1),
    dict(data=8),
]


@pytest.mark.parametrize(
    "mesh_axes", MESHES, ids=lambda m: "x".join(f"{k}{v}" for k, v in m.items())
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mesh_load_equals_the_whole_model_load(checkpoint, mesh_axes, dtype):
    _, path = checkpoint
    mesh = make_mesh(**{"data": 1, **mesh_axes})
    config, params = load_hf_to_mesh(path, mesh, dtype=dtype)
    ref_config, ref = load_hf(path, dtype=dtype)
    assert config == ref_config
    chex.assert_trees_all_equal_shapes_and_dtypes(params, ref)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, params), ref)
    # Every leaf under the sharding the rules table gives it (as training places the target).
    want = target_shardings(config, mesh)
    jax.tree.map(lambda a, s: assert_sharding(a, s), params, want)


def assert_sharding(array, sharding):
    assert array.sharding.is_equivalent_to(sharding, array.ndim), (array.sharding, sharding)


def test_blocks_follow_the_layouts():
    """Each layout reads the file block that holds our block (against the whole-tensor
    conversion), including blocks that cut the head_dim axis."""
    rng = np.random.default_rng(1)
    heads, hd, d = 4, 3, 5
    rows_first = rng.normal(size=(heads * hd, d))  # q/k/v: [heads·head_dim, d]
    cols_first = rng.normal(size=(d, heads * hd))  # o: [d, heads·head_dim]
    ours_rows = rows_first.reshape(heads, hd, d)
    ours_cols = cols_first.T.reshape(heads, hd, d)
    block = [slice(1, 3), slice(0, 2), slice(2, 5)]
    np.testing.assert_array_equal(
        read_block(rows_first, "split_rows", block, hd), ours_rows[1:3, 0:2, 2:5]
    )
    np.testing.assert_array_equal(
        read_block(cols_first, "split_cols_t", block, hd), ours_cols[1:3, 0:2, 2:5]
    )
    w = rng.normal(size=(6, 7))
    np.testing.assert_array_equal(
        read_block(w, "transpose", [slice(2, 5), slice(1, 4)], hd), w.T[2:5, 1:4]
    )
    np.testing.assert_array_equal(read_block(w, "same", [slice(0, 3), slice(5, 7)], hd), w[:3, 5:])
    with pytest.raises(ValueError, match="unknown layout"):
        read_block(rows_first, "diagonal", block, hd)


def test_fingerprint_from_the_files(checkpoint):
    _, path = checkpoint
    expected = hf_dir_fingerprint(path)
    for dtype in ("float32", "bfloat16"):
        _, params = load_hf(path, dtype=dtype)
        assert weights_fingerprint(params) == expected
    mesh = make_mesh(data=1, tensor=8)
    _, sharded = load_hf_to_mesh(path, mesh)
    assert weights_fingerprint(sharded) == expected  # sliced on the devices


def test_errors_name_the_problem(checkpoint, tmp_path):
    cfg, path = checkpoint
    mesh = make_mesh(data=1, tensor=8)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_to_mesh(tmp_path / "missing", mesh)
    # A tensor of the wrong shape is named with both shapes before anything is read.
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(path):
        src = os.path.join(path, name)
        if name.endswith(".safetensors"):
            tensors = load_file(src)
            if "model.norm.weight" in tensors:
                tensors["model.norm.weight"] = np.ones(cfg.hidden_size + 1, np.float32)
            save_file(tensors, str(bad / name))
        elif os.path.isfile(src):
            with open(src, "rb") as fh, open(bad / name, "wb") as out:
                out.write(fh.read())
    with pytest.raises(ValueError, match=r"'model.norm.weight'.*shape \(65,\).*\(64,\)"):
        load_hf_to_mesh(bad, mesh)
    # A tied head that differs from the embedding, as the whole-model loader says it.
    tied = tmp_path / "tied"
    tcfg = _config(tie_word_embeddings=True)
    save_hf(tied, tcfg, _random_params(tcfg), dtype="float32")
    tensors = load_file(str(tied / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    save_file(tensors, str(tied / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight' differs"):
        load_hf_to_mesh(tied, mesh)
    with pytest.raises(ValueError, match="dtype"):
        load_hf_to_mesh(path, mesh, dtype="int8")


def test_host_memory_is_bounded_by_a_block_not_the_model(tmp_path):
    """Peak host allocations (tracemalloc) while loading onto tensor 8: a few of the
    largest per-device blocks (the model is 32 blocks), against the whole model for the
    host loader."""
    cfg = _config(vocab_size=8192, hidden_size=256, intermediate_size=1024,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                  head_dim=32)  # fmt: skip
    path = tmp_path / "model"
    save_hf(path, cfg, _random_params(cfg, seed=2), dtype="float32")
    with open(path / "config.json") as fh:
        assert json.load(fh)["vocab_size"] == 8192
    model_bytes = sum(os.path.getsize(path / f) for f in os.listdir(path) if "safetensors" in f)
    mesh = make_mesh(data=1, tensor=8)

    whole_peak, _ = _peak(lambda: jax.device_put(load_hf(path)[1]))
    mesh_peak, mesh_kept = _peak(lambda: load_hf_to_mesh(path, mesh)[1])
    # The largest block one device holds: the embedding (or the untied head) split 8 ways
    # over the vocabulary, 8192 / 8 x 256 float32 = 1 MiB.
    block = cfg.vocab_size // 8 * cfg.hidden_size * 4
    print(f"model {model_bytes / 2**20:.1f} MiB; host peak whole {whole_peak / 2**20:.1f} MiB, "
          f"mesh {(mesh_peak - mesh_kept) / 2**20:.2f} MiB above what stays; block "
          f"{block / 2**20:.1f} MiB")  # fmt: skip
    assert whole_peak >= 0.9 * model_bytes
    # What the loader holds while reading (above the device buffers it leaves behind, which
    # on fake CPU devices live in host memory too): a few blocks, not the model.
    # (3-4 blocks measured: a transposed block is read, then copied into our layout.)
    assert mesh_peak - mesh_kept <= 6 * block < model_bytes / 4


def test_bfloat16_checkpoint_loads_without_a_float32_copy(tmp_path):
    cfg = _config()
    params = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), _random_params(cfg, seed=3))
    save_hf(tmp_path, cfg, params, dtype="bfloat16")
    mesh = make_mesh(data=1, tensor=4, devices=jax.devices()[:4])
    config, loaded = load_hf_to_mesh(tmp_path, mesh, dtype="bfloat16")
    assert config.param_dtype == "bfloat16"
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, loaded), params)


def test_load_target_onto_a_mesh():
    """The shared loader every entry point uses takes the mesh; the bundled drafter loads
    against it, checked by the fingerprint read from the files."""
    from dspark_jax.convert.loading import load_drafter_dir, load_target

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    target_dir = os.path.join(repo, "assets", "target")
    alone = load_target(target_dir)
    mesh = make_mesh(data=2, tensor=4)
    sharded = load_target(target_dir, mesh=mesh)
    assert sharded.fingerprint == alone.fingerprint
    assert sharded.config == alone.config
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, sharded.params), alone.params)
    leaves = jax.tree.leaves(sharded.params)
    assert all(set(x.sharding.device_set) == set(mesh.devices.flat) for x in leaves)
    drafter = load_drafter_dir(os.path.join(repo, "assets", "drafters", "dspark"), sharded)
    assert drafter.has_confidence


@pytest.mark.parametrize("kind", ["dspark", "dspark-rnn", "dflash", "eagle3", "mtp1"])
def test_drafters_load_onto_the_targets_mesh(kind):
    """A drafter loaded for a target on a mesh is read onto the same mesh, block by block,
    with the rules table's shardings and the same values as the host load."""
    from dspark_jax.convert.loading import load_drafter_dir, load_target
    from dspark_jax.models.drafters import init_drafter_params
    from dspark_jax.sharding import param_shardings

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    target_dir = os.path.join(repo, "assets", "target")
    drafter_dir = os.path.join(repo, "assets", "drafters", kind)
    alone = load_drafter_dir(drafter_dir, load_target(target_dir))
    mesh = make_mesh(data=2, tensor=4)
    sharded = load_drafter_dir(drafter_dir, load_target(target_dir, mesh=mesh))
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, sharded.params), alone.params)
    boxed = jax.eval_shape(lambda: init_drafter_params(sharded.module, jax.random.key(0)))
    want = jax.tree.leaves(param_shardings(boxed, mesh))
    have = [x.sharding for x in jax.tree.leaves(sharded.params)]
    assert len(want) == len(have)
    for w, h in zip(want, have):
        assert h.is_equivalent_to(w, 2)


def test_drafter_host_memory_is_bounded_by_a_block(tmp_path):
    """Peak host allocations while reading a drafter onto tensor 8: a few of its largest
    per-device blocks, against the whole drafter for the host load."""
    from dspark_jax.models.drafter_config import DrafterConfig
    from dspark_jax.models.drafter_io import load_drafter, save_drafter
    from dspark_jax.models.drafters import init_drafter_params, make_drafter

    tcfg = _config(vocab_size=8192, hidden_size=256, intermediate_size=1024,
                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                   head_dim=32)  # fmt: skip
    cfg = DrafterConfig(kind="dspark", gamma=4, num_layers=2, mask_token_id=1, markov_rank=64)
    module = make_drafter(cfg.resolve(tcfg), tcfg)
    import flax.linen as nn

    params = nn.unbox(init_drafter_params(module, jax.random.key(0)))
    save_drafter(tmp_path, cfg, tcfg, params)
    drafter_bytes = os.path.getsize(tmp_path / "model.safetensors")
    largest = max(x.size * 4 for x in jax.tree.leaves(params))
    mesh = make_mesh(data=1, tensor=8)

    whole_peak, _ = _peak(lambda: jax.device_put(load_drafter(tmp_path, tcfg)[1]))
    mesh_peak, mesh_kept = _peak(lambda: load_drafter(tmp_path, tcfg, mesh=mesh)[1])
    print(f"drafter {drafter_bytes / 2**20:.1f} MiB, largest tensor {largest / 2**20:.2f} "
          f"MiB; host peak whole {whole_peak / 2**20:.1f} MiB, mesh "
          f"{(mesh_peak - mesh_kept) / 2**20:.2f} MiB above what stays")  # fmt: skip
    assert whole_peak >= 0.9 * drafter_bytes
    # Replicated leaves are read once per process (one block is the whole tensor), so the
    # bound is a few of the largest tensor, still well under the drafter.
    assert mesh_peak - mesh_kept <= 3 * largest < drafter_bytes
