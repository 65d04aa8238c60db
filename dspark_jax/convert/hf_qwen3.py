"""Hugging Face <-> dspark_jax conversion for the Qwen3 target (DESIGN §3.1, "Interop").

A Hugging Face Qwen3 directory holds ``config.json`` and either one ``model.safetensors``
or shards ``model-0000i-of-0000n.safetensors`` listed in ``model.safetensors.index.json``.
Our parameter tree differs from the HF state dict in three ways:

* decoder layers are stacked under ``params["layers"]["layer"]`` with a leading layer axis
  (the model scans over layers);
* projections are stored input-major (``x @ kernel``) where torch ``nn.Linear`` stores
  ``[out, in]``, and attention projections keep the head axis separate. The exception is
  q/k/v: their kernels are ``[heads, head_dim, d]``, torch's ``[out, in]`` with the head
  axis split off (the layout XLA:TPU multiplies in place, ``models.qwen3.Projection``);
  the o kernel is ``[heads, head_dim, d]``;
* RMSNorm weights are called ``scale`` and the embedding table ``embedding``.

Everything here works on host numpy arrays (bf16 through ``ml_dtypes``, which jax ships),
so loading a checkpoint never needs an accelerator and sharding is left to the caller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from dspark_jax.models.drafter_io import drafter_dir_error, is_drafter_dir
from dspark_jax.models.qwen3 import Qwen3Config

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SINGLE_WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

# Floating dtypes we read and write (safetensors dtype tag -> numpy dtype).
_NP_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
# HF buffers that old checkpoints sometimes persist and that carry no learned state.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_MAX_LISTED = 20

Params = dict[str, Any]


# ----------------------------------------------------------------------------------------
# Name / layout mapping
# ----------------------------------------------------------------------------------------


class _Mapping:
    """One HF tensor kind <-> one leaf of our tree, with the layout change between them."""

    def __init__(
        self,
        hf_name: str,
        path: tuple[str, ...],
        hf_shape: Callable[[Qwen3Config], tuple[int, ...]],
        to_ours: Callable[[np.ndarray, Qwen3Config], np.ndarray],
        to_hf: Callable[[np.ndarray, Qwen3Config], np.ndarray],
        per_layer: bool,
        layout: str = "same",
    ):
        self.hf_name = hf_name  # contains "{i}" when per_layer
        self.path = path
        self.hf_shape = hf_shape
        self.to_ours = to_ours
        self.to_hf = to_hf
        self.per_layer = per_layer
        self.layout = layout  # LayerTensor.layout, without the layer axis

    def names(self, cfg: Qwen3Config) -> list[str]:
        if self.per_layer:
            return [self.hf_name.format(i=i) for i in range(cfg.num_hidden_layers)]
        return [self.hf_name]

    def our_shape(self, cfg: Qwen3Config) -> tuple[int, ...]:
        one = self.to_ours(np.empty(self.hf_shape(cfg), np.int8), cfg).shape
        return ((cfg.num_hidden_layers,) + one) if self.per_layer else one


def _identity(w, cfg):
    return w


def _transpose(w, cfg):
    return w.T


@dataclasses.dataclass(frozen=True)
class LayerTensor:
    """One tensor of a Qwen3 decoder layer in both layouts. The one table of the layer's
    tensors: the HF target converter stacks it over ``model.layers.{i}.``, the DeepSpec
    drafter converter uses it for ``layers.{i}.``."""

    hf_suffix: str  # after the layer's prefix, e.g. "self_attn.q_proj.weight"
    path: tuple[str, ...]  # under the layer's module in our tree
    hf_shape: tuple[int, ...]  # torch layout
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_hf: Callable[[np.ndarray], np.ndarray]
    # The same change of layout by name, for reading a block of our layout straight from
    # the file (``convert/hf_mesh.py``): "same", "transpose" ([a, b] <- [b, a]),
    # "split_rows" ([h, hd, d] <- [h·hd, d]) or "split_cols_t" ([h, hd, d] <- [d, h·hd]).
    layout: str = "same"


def decoder_layer_tensors(cfg: Qwen3Config) -> list[LayerTensor]:
    """The tensors of one decoder layer of width/heads ``cfg`` (the layout changes are in
    the module docstring: input-major kernels but q/k/v, a separate head axis, ``scale``
    norms)."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    same, t = (lambda w: w), (lambda w: w.T)
    out = [
        # HF [heads*head_dim, d] <-> ours [heads, head_dim, d]
        LayerTensor(
            f"self_attn.{proj}.weight",
            ("self_attn", proj, "kernel"),
            (heads * hd, d),
            lambda w, h=heads: w.reshape(h, hd, d),
            lambda k: k.reshape(-1, d),
            "split_rows",
        )
        for proj, heads in (("q_proj", nh), ("k_proj", nkv), ("v_proj", nkv))
    ]
    # HF [d, heads*head_dim] <-> ours [heads, head_dim, d]
    out.append(
        LayerTensor(
            "self_attn.o_proj.weight",
            ("self_attn", "o_proj", "kernel"),
            (d, nh * hd),
            lambda w: w.T.reshape(nh, hd, d),
            lambda k: k.reshape(-1, d).T,
            "split_cols_t",
        )
    )
    for norm in ("q_norm", "k_norm"):
        out.append(
            LayerTensor(f"self_attn.{norm}.weight", ("self_attn", norm, "scale"), (hd,), same, same)
        )
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out.append(LayerTensor(f"{norm}.weight", (norm, "scale"), (d,), same, same))
    for proj, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
        out.append(
            LayerTensor(f"mlp.{proj}.weight", ("mlp", proj, "kernel"), shape, t, t, "transpose")
        )
    return out


def _mappings(cfg: Qwen3Config) -> list[_Mapping]:
    d, v = cfg.hidden_size, cfg.vocab_size
    stack = ("layers", "layer")
    out = [
        _Mapping(
            "model.embed_tokens.weight",
            ("embed_tokens", "embedding"),
            lambda c: (v, d),
            _identity,
            _identity,
            False,
        ),
        _Mapping(
            "model.norm.weight", ("norm", "scale"), lambda c: (d,), _identity, _identity, False
        ),
    ]
    for lt in decoder_layer_tensors(cfg):
        out.append(
            _Mapping(
                "model.layers.{i}." + lt.hf_suffix,
                stack + lt.path,
                lambda c, s=lt.hf_shape: s,
                lambda w, c, f=lt.to_ours: f(w),
                lambda k, c, f=lt.to_hf: f(k),
                True,
                lt.layout,
            )
        )
    if not cfg.tie_word_embeddings:
        out.append(
            _Mapping(
                "lm_head.weight",
                ("lm_head", "kernel"),
                lambda c: (v, d),
                _transpose,
                _transpose,
                False,
                "transpose",
            )
        )
    return out


def hf_tensor_shapes(config: Qwen3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor name a Hugging Face Qwen3 checkpoint of ``config`` holds, with its shape."""
    shapes = {}
    for m in _mappings(config):
        for name in m.names(config):
            shapes[name] = tuple(m.hf_shape(config))
    return shapes


def param_shapes(config: Qwen3Config) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Flattened shapes of our parameter tree for ``config`` (path tuple -> shape)."""
    return {m.path: m.our_shape(config) for m in _mappings(config)}


# ----------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------


def _np_dtype(dtype) -> np.dtype:
    """Normalise a dtype given as a name, numpy/jnp dtype or type to one we support."""
    try:
        dt = np.dtype(dtype)
    except TypeError as err:
        raise ValueError(
            f"Unsupported dtype {dtype!r}; allowed dtypes: {sorted(_NP_DTYPES)}"
        ) from err
    if dt.name not in _NP_DTYPES:
        raise ValueError(f"Unsupported dtype {dt.name!r}; allowed dtypes: {sorted(_NP_DTYPES)}")
    return dt


def _listing(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:_MAX_LISTED])
    if len(names) > _MAX_LISTED:
        shown += f", ... ({len(names) - _MAX_LISTED} more)"
    return f"{len(names)}: [{shown}]"


def _unbox_tree(params: Mapping) -> Mapping:
    """Accept ``{"params": tree}`` and Flax partition-boxed leaves as well as plain trees."""
    if set(params) == {"params"}:
        params = params["params"]
    try:
        import flax.linen as nn

        params = nn.meta.unbox(params)
    except ImportError:  # pragma: no cover - flax is a hard dependency of the package
        pass
    return params


def _get_path(tree: Mapping, path: tuple[str, ...]):
    node = tree
    for i, key in enumerate(path):
        if not isinstance(node, Mapping) or key not in node:
            raise ValueError(f"params is missing the leaf {'/'.join(path[: i + 1])!r}")
        node = node[key]
    return node


def _flat_leaves(tree: Mapping, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.extend(_flat_leaves(value, prefix + (key,)))
        else:
            out.append(prefix + (key,))
    return out


def _to_numpy(x) -> np.ndarray:
    return np.asarray(x)  # jax.Array -> host copy; keeps bf16 as ml_dtypes.bfloat16


# ----------------------------------------------------------------------------------------
# State-dict conversion (in memory)
# ----------------------------------------------------------------------------------------


def params_to_hf_state_dict(
    config: Qwen3Config, params: Mapping, dtype=None
) -> dict[str, np.ndarray]:
    """Our parameter tree -> ``{hf_name: numpy array}`` in HF layout.

    ``params`` may be the bare tree, ``{"params": tree}``, or have Flax partition boxes.
    ``dtype`` (default: each leaf's own dtype) casts every tensor. Arrays are C-contiguous.
    """
    tree = _unbox_tree(params)
    out_dtype = None if dtype is None else _np_dtype(dtype)
    expected = param_shapes(config)
    unexpected = sorted("/".join(p) for p in _flat_leaves(tree) if p not in expected)
    if unexpected:
        raise ValueError(
            f"params has leaves that are not part of a Qwen3 model with this config "
            f"(tie_word_embeddings={config.tie_word_embeddings}) {_listing(unexpected)}"
        )
    state = {}
    for m in _mappings(config):
        leaf = _to_numpy(_get_path(tree, m.path))
        if leaf.shape != expected[m.path]:
            raise ValueError(
                f"params leaf {'/'.join(m.path)!r} has shape {leaf.shape}, expected "
                f"{expected[m.path]} for this config"
            )
        if out_dtype is not None:
            leaf = leaf.astype(out_dtype)
        if m.per_layer:
            for i, name in enumerate(m.names(config)):
                state[name] = np.ascontiguousarray(m.to_hf(leaf[i], config))
        else:
            state[m.hf_name] = np.ascontiguousarray(m.to_hf(leaf, config))
    return state


def _check_names(config: Qwen3Config, names: Iterable[str], source: str) -> None:
    names = {n for n in names if not n.endswith(_IGNORED_SUFFIXES)}
    expected = hf_tensor_shapes(config)
    allowed = set(expected)
    if config.tie_word_embeddings:
        allowed.add("lm_head.weight")  # some tied checkpoints still store a copy
    missing = set(expected) - names
    unexpected = names - allowed
    problems = []
    if missing:
        problems.append(f"missing tensors {_listing(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors {_listing(unexpected)}")
    if problems:
        raise ValueError(
            f"{source} does not match a Qwen3 model with {config.num_hidden_layers} layers "
            f"(tie_word_embeddings={config.tie_word_embeddings}): " + "; ".join(problems)
        )


def _check_shape(config: Qwen3Config, name: str, shape: tuple[int, ...], source: str) -> None:
    expected = hf_tensor_shapes(config).get(name)
    if name == "lm_head.weight" and expected is None:
        expected = (config.vocab_size, config.hidden_size)
    if expected is not None and tuple(shape) != expected:
        raise ValueError(
            f"Tensor {name!r} in {source} has shape {tuple(shape)}, but the config expects "
            f"{expected}"
        )


def _assemble(
    config: Qwen3Config,
    names: Iterable[str],
    get: Callable[[str], np.ndarray],
    dtype: np.dtype,
    source: str,
) -> Params:
    """Build our tree from tensors fetched one at a time by ``get`` (keeps peak memory low)."""
    names = set(names)
    params: Params = {}
    for m in _mappings(config):
        if m.per_layer:
            leaf = np.empty(m.our_shape(config), dtype)
            for i, name in enumerate(m.names(config)):
                leaf[i] = m.to_ours(get(name), config)
        else:
            leaf = np.ascontiguousarray(m.to_ours(get(m.hf_name), config).astype(dtype))
        node = params
        for key in m.path[:-1]:
            node = node.setdefault(key, {})
        node[m.path[-1]] = leaf
    if config.tie_word_embeddings and "lm_head.weight" in names:
        embed, head = get("model.embed_tokens.weight"), get("lm_head.weight")
        if not np.array_equal(embed, head):
            raise ValueError(
                f"{source} has tie_word_embeddings=true but its 'lm_head.weight' differs from "
                "'model.embed_tokens.weight'; set tie_word_embeddings=false in config.json if "
                "the head is meant to be separate"
            )
    return params


def hf_state_dict_to_params(
    config: Qwen3Config, state_dict: Mapping[str, Any], dtype=None
) -> Params:
    """``{hf_name: array}`` -> our (unboxed, numpy) parameter tree, cast to ``dtype``
    (default ``config.param_dtype``). Validates names and shapes against ``config``."""
    out_dtype = _np_dtype(config.param_dtype if dtype is None else dtype)
    source = "state dict"
    _check_names(config, state_dict, source)
    for name, value in state_dict.items():
        _check_shape(config, name, np.shape(value), source)
    return _assemble(config, state_dict, lambda n: _to_numpy(state_dict[n]), out_dtype, source)


# ----------------------------------------------------------------------------------------
# Directory I/O
# ----------------------------------------------------------------------------------------


def _weight_files(path: str) -> dict[str, str]:
    """Map every tensor name to the safetensors file holding it."""
    from safetensors import safe_open

    index_path = os.path.join(path, INDEX_NAME)
    single = os.path.join(path, SINGLE_WEIGHTS_NAME)
    if os.path.isfile(index_path):
        with open(index_path) as fh:
            try:
                weight_map = json.load(fh)["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{index_path} is not a valid safetensors index (needs a 'weight_map')"
                ) from err
        files = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise FileNotFoundError(
                    f"Weights shard {shard_path} listed in {index_path} does not exist"
                )
            files[shard] = shard_path
        located = {name: files[shard] for name, shard in weight_map.items()}
        # The index must agree with what the shards actually contain.
        for shard_path in files.values():
            with safe_open(shard_path, framework="numpy") as fh:
                for name in fh.keys():
                    if located.get(name) != shard_path:
                        raise ValueError(
                            f"Tensor {name!r} is stored in {shard_path} but {index_path} "
                            f"maps it to {located.get(name)}"
                        )
        return located
    if os.path.isfile(single):
        with safe_open(single, framework="numpy") as fh:
            return {name: single for name in fh.keys()}
    shards = sorted(f for f in os.listdir(path) if _SHARD_RE.match(f))
    if shards:  # shards without an index: read them all
        located = {}
        for shard in shards:
            with safe_open(os.path.join(path, shard), framework="numpy") as fh:
                for name in fh.keys():
                    located[name] = os.path.join(path, shard)
        return located
    raise FileNotFoundError(
        f"No weights found in {path}: expected {single} or sharded "
        f"model-XXXXX-of-YYYYY.safetensors files with {index_path}"
    )


def read_hf_config(path: str | os.PathLike) -> Qwen3Config:
    """``Qwen3Config`` from ``<path>/config.json`` (raises for non-Qwen3 architectures)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"Hugging Face model directory {path} does not exist")
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        if is_drafter_dir(path):
            raise drafter_dir_error(path, None, None)
        raise FileNotFoundError(f"No {CONFIG_NAME} in {path} (looked for {config_path})")
    with open(config_path) as fh:
        try:
            hf = json.load(fh)
        except json.JSONDecodeError as err:
            raise ValueError(f"{config_path} is not valid JSON: {err}") from err
    return Qwen3Config.from_hf_dict(hf)


@contextlib.contextmanager
def open_checked(path: str | os.PathLike, dtype=None):
    """Open a Hugging Face Qwen3 directory for reading, every tensor's name, shape and
    dtype checked against its ``config.json`` before any data is read. Yields
    ``(config, read)``: the config with ``param_dtype`` set to ``dtype`` (default: the
    config's), and ``read(name)``, the ``safetensors`` slice of tensor ``name`` (index it
    to read part of the tensor, ``[:]`` for all of it)."""
    from safetensors import safe_open

    path = os.fspath(path)
    requested = None if dtype is None else _np_dtype(dtype)  # fail fast on a bad dtype
    config = read_hf_config(path)
    out_dtype = _np_dtype(config.param_dtype) if requested is None else requested
    config = config.replace(param_dtype=out_dtype.name)
    located = _weight_files(path)
    _check_names(config, located, path)

    handles = {}
    try:
        for file in sorted(set(located.values())):
            handles[file] = safe_open(file, framework="numpy")
        for name, file in located.items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            sl = handles[file].get_slice(name)
            _check_shape(config, name, tuple(sl.get_shape()), file)
            if sl.get_dtype() not in ("F32", "BF16", "F16", "F64"):
                raise ValueError(
                    f"Tensor {name!r} in {file} has unsupported dtype {sl.get_dtype()} "
                    "(quantized checkpoints are not supported; expected F32, BF16 or F16)"
                )

        def read(name: str):
            if name not in located:
                raise KeyError(f"{path} has no tensor {name!r}")
            return handles[located[name]].get_slice(name)

        read.names = frozenset(located)
        yield config, read
    finally:
        for fh in handles.values():
            fh.__exit__(None, None, None)


def load_hf(path: str | os.PathLike, dtype=None) -> tuple[Qwen3Config, Params]:
    """Read a local Hugging Face Qwen3 directory into ``(config, params)``.

    ``params`` is our plain (unboxed) tree of host numpy arrays in ``dtype`` (a name such as
    ``"bfloat16"`` or a dtype; default: the config's ``param_dtype``, float32), ready for
    ``Qwen3(config).apply({"params": params}, ...)`` or ``jax.device_put`` with shardings.
    The returned config's ``param_dtype`` is set to ``dtype``. The whole model passes
    through host memory; ``convert.hf_mesh.load_hf_to_mesh`` reads each device's slices
    only.
    """
    path = os.fspath(path)
    with open_checked(path, dtype) as (config, read):
        params = _assemble(
            config, read.names, lambda n: read(n)[:], _np_dtype(config.param_dtype), path
        )
    return config, params


def _shard(names: list[str], sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Greedy in-order packing; a tensor larger than ``max_bytes`` gets a shard of its own."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        if shards[-1] and used + sizes[name] > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def save_hf(
    path: str | os.PathLike,
    config: Qwen3Config,
    params: Mapping,
    dtype="bfloat16",
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Write ``params`` as a Hugging Face Qwen3 directory that ``transformers`` loads.

    Writes ``config.json``, ``generation_config.json`` (when bos/eos ids are set) and
    ``model.safetensors``, or, when ``max_shard_bytes`` is given and the weights exceed it,
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.
    Weight files left from an earlier export in ``path`` are removed first so the directory
    is never ambiguous. Returns the paths of the written files.
    """
    from safetensors.numpy import save_file

    out_dtype = _np_dtype(dtype)
    if max_shard_bytes is not None and (
        not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0
    ):
        raise ValueError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    state = params_to_hf_state_dict(config, params, dtype=out_dtype)

    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"Cannot export to {path}: it exists and is not a directory")
    os.makedirs(path, exist_ok=True)
    for f in os.listdir(path):
        if f in (SINGLE_WEIGHTS_NAME, INDEX_NAME) or _SHARD_RE.match(f):
            os.remove(os.path.join(path, f))

    written = []
    hf_config = config.to_hf_dict(torch_dtype=out_dtype.name)
    # transformers >= 5 reads rope settings from "rope_parameters"; older versions ignore it.
    hf_config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.rope_theta}
    hf_config["dtype"] = out_dtype.name
    config_path = os.path.join(path, CONFIG_NAME)
    with open(config_path, "w") as fh:
        json.dump(hf_config, fh, indent=2)
    written.append(config_path)
    if config.bos_token_id is not None or config.eos_token_id is not None:
        gen_path = os.path.join(path, GENERATION_CONFIG_NAME)
        gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
        with open(gen_path, "w") as fh:
            json.dump({k: v for k, v in gen.items() if v is not None}, fh, indent=2)
        written.append(gen_path)

    metadata = {"format": "pt"}  # transformers 4.x rejects safetensors files without it
    names = list(state)
    sizes = {n: state[n].nbytes for n in names}
    shards = [names] if max_shard_bytes is None else _shard(names, sizes, max_shard_bytes)
    if len(shards) == 1:
        file = os.path.join(path, SINGLE_WEIGHTS_NAME)
        save_file(state, file, metadata=metadata)
        written.append(file)
        return written
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        file = os.path.join(path, fname)
        save_file({n: state[n] for n in shard}, file, metadata=metadata)
        written.append(file)
        weight_map.update({n: fname for n in shard})
    index_path = os.path.join(path, INDEX_NAME)
    with open(index_path, "w") as fh:
        json.dump(
            {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map},
            fh,
            indent=2,
        )
    written.append(index_path)
    return written
