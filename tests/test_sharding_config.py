"""Sharding rules, sharded forward parity, and the config loader's error messages."""

import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dspark_jax import config as cfglib
from dspark_jax import sharding as sh
from dspark_jax.models.presets import PRESETS
from dspark_jax.models.qwen3 import Qwen3


def test_eight_fake_devices():
    assert jax.device_count() == 8


def test_mesh_shapes_and_errors():
    mesh = sh.make_mesh(2, 2, 2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert dict(sh.make_mesh(-1, 1, 2).shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    with pytest.raises(ValueError, match="but 8 are available"):
        sh.make_mesh(2, 2, 1)
    with pytest.raises(ValueError, match="At most one mesh axis may be -1"):
        sh.make_mesh(-1, -1, 2)


def test_rules_table_specs():
    mesh = sh.make_mesh(2, 2, 2)
    assert sh.logical_to_spec(("embed", "mlp"), (64, 128), mesh) == P("fsdp", "tensor")
    assert sh.logical_to_spec(("vocab", "embed"), (256, 64), mesh) == P("tensor", "fsdp")
    # A dimension the mesh axis does not divide is replicated instead of failing.
    assert sh.logical_to_spec(("embed", "kv_heads", "kv"), (64, 1, 16), mesh) == P(
        "fsdp", None, None
    )
    with pytest.raises(ValueError, match="no entry in LOGICAL_RULES"):
        sh.logical_to_spec(("nonsense",))


def test_sharded_forward_equals_single_device():
    cfg = PRESETS["tiny"]
    model = Qwen3(cfg)
    tokens = jax.random.randint(jax.random.key(0), (8, 16), 0, cfg.vocab_size)
    boxed = model.init(jax.random.key(1), tokens)["params"]
    reference = model.apply({"params": nn.unbox(boxed)}, tokens)

    mesh = sh.make_mesh(2, 2, 2)
    params = sh.shard_params(boxed, mesh)
    # Parameter shardings follow the rules table.
    names = sh.logical_names_of(boxed)
    for leaf, leaf_names in zip(
        jax.tree.leaves(params), jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple))
    ):
        assert leaf.sharding.spec == sh.logical_to_spec(leaf_names, leaf.shape, mesh)
    q = params["layers"]["layer"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P(None, "tensor", None, "fsdp")

    with jax.set_mesh(mesh), sh.rules_context(mesh):
        out = jax.jit(lambda p, t: model.apply({"params": p}, t))(
            params, sh.place_batch(tokens, mesh)
        )
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference), atol=1e-5)
    with pytest.raises(ValueError, match="not divisible by the data-parallel degree"):
        sh.place_batch(np.zeros((6, 4), np.int32), mesh)


def _write_config(tmp_path):
    path = tmp_path / "cfg.py"
    path.write_text(
        textwrap.dedent(
            """
            import ml_collections

            def get_config(size="tiny"):
                c = ml_collections.ConfigDict()
                c.model = ml_collections.ConfigDict({"preset": size, "dtype": "float32"})
                c.train = ml_collections.ConfigDict({"steps": 10, "lr": 6e-4, "taps": (1, 2)})
                return c
            """
        )
    )
    return str(path)


def test_config_overrides_and_validation(tmp_path):
    path = _write_config(tmp_path)
    spec, overrides, rest = cfglib.split_config_args(
        [
            "--config",
            path + ":qwen3-0.6b",
            "--config.train.steps=3",
            "--config.train.lr",
            "1e-3",
            "--config.train.taps=[0, 4]",
            "--workdir",
            "w",
        ]
    )
    assert rest == ["--workdir", "w"]
    cfg = cfglib.load_config(spec, overrides)
    assert cfg.train.steps == 3 and cfg.train.lr == 1e-3 and cfg.train.taps == (0, 4)
    assert cfglib.model_config_from(cfg.model).hidden_size == 1024

    with pytest.raises(
        cfglib.ConfigError,
        match=r"Unknown config key 'train.stepz'.*allowed keys there: \['lr', 'steps', 'taps'\]",
    ):
        cfglib.load_config(path, [("train.stepz", "3")])
    with pytest.raises(cfglib.ConfigError, match="expected an integer"):
        cfglib.load_config(path, [("train.steps", "many")])
    with pytest.raises(cfglib.ConfigError, match=r"'model.dtype'; allowed values"):
        cfglib.load_config(path, [("model.dtype", "float64")])
    with pytest.raises(cfglib.ConfigError, match=r"'model.preset'; allowed values"):
        cfglib.load_config(path + ":qwen9")
    with pytest.raises(cfglib.ConfigError, match="Config file not found"):
        cfglib.load_config(str(tmp_path / "missing.py"))


def test_abstract_compile_of_large_forward():
    """Lowering + compiling a Qwen3-4B forward with abstract parameters allocates nothing."""
    cfg = PRESETS["qwen3-4b"]
    model = Qwen3(cfg)
    tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    abstract = jax.eval_shape(
        lambda: nn.unbox(model.init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"])
    )
    compiled = jax.jit(lambda p, t: model.apply({"params": p}, t)).lower(abstract, tokens).compile()
    assert compiled.memory_analysis() is not None
