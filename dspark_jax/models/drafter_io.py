"""Save / load a trained drafter as a directory (used by ``dspark_jax.generate``).

Layout of ``<dir>``:

* ``drafter_config.json``: ``{"format": 1, "drafter": DrafterConfig fields, "target":
  {"vocab_size", "hidden_size", "num_hidden_layers"}}``. The target fingerprint is what the
  drafter's embedding / LM-head / tap shapes were built for; loading against another target
  is an error that names both values.
* ``model.safetensors``: the flattened (unboxed) parameter tree, keys joined with ``/``
  (e.g. ``backbone/layer/attn/q_proj/kernel``), float32 or bfloat16.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import flax.linen as nn
import jax
import numpy as np

from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.drafters import init_drafter_params, make_drafter
from dspark_jax.models.qwen3 import Qwen3Config

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "save_drafter", "load_drafter"]

CONFIG_NAME = "drafter_config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 1
_FINGERPRINT = ("vocab_size", "hidden_size", "num_hidden_layers")


def _flatten(tree: Mapping, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}/{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(_flatten(v, name))
        else:
            out[name] = v
    return out


def _unflatten(flat: Mapping[str, np.ndarray]) -> dict:
    tree: dict = {}
    for name, v in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return tree


def _np_dtype(dtype: str):
    import ml_dtypes

    table = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
    if dtype not in table:
        raise ValueError(f"drafter weights dtype must be one of {sorted(table)}, got {dtype!r}")
    return table[dtype]


def save_drafter(
    path: str | os.PathLike,
    drafter_config: DrafterConfig,
    target_config: Qwen3Config,
    params,
    dtype: str = "float32",
) -> list[str]:
    """Write ``drafter_config.json`` and ``model.safetensors`` under ``path`` (created).

    ``params`` may be boxed (``nn.Partitioned``) or plain. Returns the written paths.
    """
    from safetensors.numpy import save_file

    if not isinstance(drafter_config, DrafterConfig):
        raise ValueError(f"save_drafter needs a DrafterConfig, got {type(drafter_config).__name__}")
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"Cannot save a drafter to {path}: it exists and is not a directory")
    os.makedirs(path, exist_ok=True)
    out_dtype = _np_dtype(dtype)
    flat = _flatten(jax.device_get(nn.unbox(params)))
    tensors = {k: np.ascontiguousarray(np.asarray(v).astype(out_dtype)) for k, v in flat.items()}
    config_path = os.path.join(path, CONFIG_NAME)
    meta = {
        "format": FORMAT_VERSION,
        "drafter": drafter_config.to_dict(),
        "target": {k: getattr(target_config, k) for k in _FINGERPRINT},
        "dtype": dtype,
    }
    with open(config_path, "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    weights_path = os.path.join(path, WEIGHTS_NAME)
    save_file(tensors, weights_path, metadata={"format": "np"})
    return [config_path, weights_path]


def load_drafter(path: str | os.PathLike, target_config: Qwen3Config):
    """Load a drafter directory for ``target_config``: returns ``(module, params)``.

    Params come back as a plain tree of float32 arrays. Raises ``FileNotFoundError`` for a
    missing directory / file and ``ValueError`` for a drafter built for another target or a
    weights file that does not match its config.
    """
    from safetensors.numpy import load_file

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Drafter directory {path} does not exist")
    config_path = os.path.join(path, CONFIG_NAME)
    weights_path = os.path.join(path, WEIGHTS_NAME)
    if not os.path.isfile(config_path) and os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(
            f"{path} looks like a Hugging Face model directory (it has config.json, no "
            f"{CONFIG_NAME}): pass it as the target (--target); a drafter directory is "
            "written by train.py / dspark_jax.export"
        )
    for p in (config_path, weights_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"Drafter directory {path} has no {os.path.basename(p)}")
    try:
        with open(config_path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or "drafter" not in meta or "target" not in meta:
        raise ValueError(f"{config_path} must hold 'drafter' and 'target' entries")
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{config_path} has format {meta.get('format')!r}; this version reads {FORMAT_VERSION}"
        )
    for key in _FINGERPRINT:
        want, have = meta["target"].get(key), getattr(target_config, key)
        if want != have:
            raise ValueError(
                f"Drafter {path} was trained for a different target: its {key} is {want}, "
                f"the target's is {have}"
            )
    dcfg = DrafterConfig.from_dict(meta["drafter"])
    module = make_drafter(dcfg, target_config)
    expected = _flatten(
        nn.unbox(jax.eval_shape(lambda: init_drafter_params(module, jax.random.key(0))))
    )
    loaded = load_file(weights_path)
    missing = sorted(set(expected) - set(loaded))
    extra = sorted(set(loaded) - set(expected))
    if missing or extra:
        raise ValueError(
            f"{weights_path} does not match its config: missing {missing[:5]}"
            f"{' …' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
            f"{' …' if len(extra) > 5 else ''}"
        )
    params = {}
    for name, spec in expected.items():
        arr = loaded[name]
        if tuple(arr.shape) != tuple(spec.shape):
            raise ValueError(
                f"{weights_path}: tensor {name!r} has shape {tuple(arr.shape)}, expected "
                f"{tuple(spec.shape)}"
            )
        params[name] = np.asarray(arr, np.float32).astype(spec.dtype)
    return module, _unflatten(params)
