"""A Hugging Face Qwen3 checkpoint read straight into a device mesh.

``hf_qwen3.load_hf`` assembles every tensor in host memory before any device sees it: a
Qwen3-14B in bfloat16 is 29 GB on one host, and on a multi-host slice every host would read
all of it. Here each leaf of the parameter tree is built, device by device, under the sharding the one
logical-axis rules table gives it (``sharding.param_shardings``, as training places the
frozen target): for each of the process's own devices the block that device holds is read
from the safetensors files (``safetensors`` slices the file, so a tensor's other rows and
columns are never read), sent to the device, and dropped. A process therefore touches only
its own devices' blocks, and its host memory while loading is about one block (the largest
a device holds of one tensor), not the model.

Our layout differs from the checkpoint's (``hf_qwen3``'s module docstring), so a block of
ours maps to a block of the file per ``LayerTensor.layout``: transposed kernels read the
transposed block; q/k/v kernels ``[heads, head_dim, d]`` read a range of the file's rows
(heads × head_dim of them) and o's a range of its columns. Decoder layers, stacked under a
leading layer axis here, are read layer by layer into the block.

The weights' fingerprint (``models.fingerprint``) is read from the files too (1024 strided
embedding rows and the final norm), so checking a drafter against the target never needs
the whole model on one host either.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from dspark_jax.convert.hf_qwen3 import (
    Params,
    _get_path,
    _mappings,
    _np_dtype,
    open_checked,
)
from dspark_jax.models.fingerprint import fingerprint_from_sample, sample_stride
from dspark_jax.models.qwen3 import Qwen3, Qwen3Config
from dspark_jax.sharding import array_from_blocks, param_shardings

__all__ = ["hf_dir_fingerprint", "load_hf_to_mesh", "read_block"]

# Rows compared at a time when a tied checkpoint also stores lm_head (bounded memory).
_TIE_CHECK_ROWS = 4096


def _bounds(index: tuple, shape: tuple[int, ...]) -> list[slice]:
    out = []
    for i, n in enumerate(shape):
        s = index[i] if i < len(index) else slice(None)
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"strided shard index {s} is not a block")
        out.append(slice(start, stop))
    return out


def read_block(tensor, layout: str, block: list[slice], head_dim: int) -> np.ndarray:
    """The block ``block`` (one slice per axis of *our* layout, without a layer axis) of a
    checkpoint tensor, read through ``tensor`` (a safetensors slice, or any array that
    supports 2-D slicing) and converted to our layout per ``layout``."""
    if layout == "same":
        return np.asarray(tensor[tuple(block)])
    if layout == "transpose":  # ours [a, b] = file [b, a].T
        a, b = block
        return np.asarray(tensor[b, a]).T
    h, k, d = block  # ours [heads, head_dim, d]
    rows = slice(h.start * head_dim, h.stop * head_dim)
    n = h.stop - h.start
    if layout == "split_rows":  # file [heads·head_dim, d]
        x = np.asarray(tensor[rows, d]).reshape(n, head_dim, -1)
    elif layout == "split_cols_t":  # file [d, heads·head_dim]
        x = np.asarray(tensor[d, rows]).T.reshape(n, head_dim, -1)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return x[:, k, :]


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def target_shardings(config: Qwen3Config, mesh: Mesh):
    """The ``NamedSharding`` of every target parameter on ``mesh`` (the logical-axis rules
    table, as training places the frozen target)."""
    boxed = jax.eval_shape(
        lambda: Qwen3(config).init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))["params"]
    )
    return param_shardings(boxed, mesh)


def load_hf_to_mesh(path: str | os.PathLike, mesh: Mesh, dtype=None) -> tuple[Qwen3Config, Params]:
    """Read a local Hugging Face Qwen3 directory onto ``mesh``: ``(config, params)`` with
    every leaf a ``jax.Array`` sharded by the logical-axis rules, in ``dtype`` (default:
    the config's ``param_dtype``). Each process reads only the blocks its own devices hold.
    The same checks as ``hf_qwen3.load_hf`` (names, shapes, dtypes, a tied head that
    differs from the embedding) with the same errors."""
    path = os.fspath(path)
    with open_checked(path, dtype) as (config, read):
        out_dtype = _np_dtype(config.param_dtype)
        shardings = target_shardings(config, mesh)
        hd = config.head_dim
        params: Params = {}
        for m in _mappings(config):
            shape = m.our_shape(config)

            def block(index, m=m, shape=shape):
                bounds = _bounds(index, shape)
                if not m.per_layer:
                    x = read_block(read(m.hf_name), m.layout, bounds, hd)
                    return np.ascontiguousarray(x, dtype=out_dtype)
                layers, rest = bounds[0], bounds[1:]
                out = np.empty(
                    (layers.stop - layers.start, *(s.stop - s.start for s in rest)), out_dtype
                )
                for j, i in enumerate(range(layers.start, layers.stop)):
                    out[j] = read_block(read(m.hf_name.format(i=i)), m.layout, rest, hd)
                return out

            _set(params, m.path, array_from_blocks(shape, _get_path(shardings, m.path), block))
        if config.tie_word_embeddings and "lm_head.weight" in read.names:
            _check_tied_head(read, config.vocab_size, path)
    return config, params


def _check_tied_head(read, vocab: int, path: str) -> None:
    embed, head = read("model.embed_tokens.weight"), read("lm_head.weight")
    for start in range(0, vocab, _TIE_CHECK_ROWS):
        rows = slice(start, min(vocab, start + _TIE_CHECK_ROWS))
        if not np.array_equal(embed[rows], head[rows]):
            raise ValueError(
                f"{path} has tie_word_embeddings=true but its 'lm_head.weight' differs from "
                "'model.embed_tokens.weight'; set tie_word_embeddings=false in config.json if "
                "the head is meant to be separate"
            )


def hf_dir_fingerprint(path: str | os.PathLike) -> str:
    """``models.fingerprint.weights_fingerprint`` of the checkpoint in ``path``, read from
    its files (the strided embedding rows and the final norm only). Equal to the
    fingerprint of the loaded parameters in float32 or bfloat16."""
    with open_checked(path) as (config, read):
        shape = (config.vocab_size, config.hidden_size)
        rows = read("model.embed_tokens.weight")[:: sample_stride(config.vocab_size)]
        return fingerprint_from_sample(shape, rows, read("model.norm.weight")[:])
