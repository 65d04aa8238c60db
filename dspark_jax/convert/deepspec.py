"""DeepSpec DSpark / DFlash drafter checkpoints <-> dspark_jax drafter parameters.

DeepSpec (github.com/deepseek-ai/DeepSpec) saves its Qwen3 drafter (``Qwen3DSparkModel``)
with ``save_pretrained``: a ``config.json`` that is the target's Qwen3 config with the
drafter's depth and extra fields, and ``model.safetensors`` (or shards plus an index) with
the module's state dict. DeepSpec's "DFlash" is the same model with ``markov_rank = 0`` and
no confidence head, so one importer covers both (DESIGN §3.2–3.5).

config.json fields read (besides the Qwen3 shape fields checked against the target):
``block_size`` -> γ, ``target_layer_ids`` -> taps, ``num_hidden_layers`` -> drafter
layers, ``mask_token_id``, ``markov_rank`` / ``markov_head_type`` (``vanilla`` = our
``markov``, ``gated``, ``rnn``), ``enable_confidence_head``,
``confidence_head_with_markov``. ``num_anchors`` is a training-only setting (ignored).

Tensor mapping (torch ``nn.Linear`` stores ``[out, in]``; we store input-major kernels and
keep attention heads as a separate axis)::

  fc.weight [d, m·d]                          -> backbone/fc/kernel [m·d, d]       (T)
  hidden_norm.weight, norm.weight [d]         -> backbone/{hidden_norm,norm}/scale
  layers.{i}.input_layernorm.weight           -> backbone/layers_{i}/input_layernorm/scale
  layers.{i}.post_attention_layernorm.weight  -> .../post_attention_layernorm/scale
  layers.{i}.self_attn.{q,k}_norm.weight [hd] -> .../self_attn/{q,k}_norm/scale
  layers.{i}.self_attn.q_proj.weight [H·hd,d] -> .../self_attn/q_proj/kernel [H, d, hd]
  layers.{i}.self_attn.{k,v}_proj.weight      -> .../self_attn/{k,v}_proj/kernel [KV, d, hd]
  layers.{i}.self_attn.o_proj.weight [d,H·hd] -> .../self_attn/o_proj/kernel [H, hd, d]
  layers.{i}.mlp.{gate,up,down}_proj.weight   -> .../mlp/{gate,up,down}_proj/kernel  (T)
  markov_head.markov_w1.weight [V, r]         -> markov_head/markov_w1 [V, r]   (Embedding)
  markov_head.markov_w2.weight [V, r]         -> markov_head/markov_w2 [r, V]      (T)
  markov_head.gate_proj.{weight [r, d+r], bias} -> markov_head/gate_{kernel (T), bias}
  markov_head.joint_proj.{weight [3r, 2r+d], bias} -> markov_head/joint_{kernel (T), bias}
  confidence_head.proj.weight [1, in], .bias [1] -> confidence_head/kernel [in], bias [1]
  embed_tokens.weight, lm_head.weight [V, d]  -> not drafter params: frozen copies of the
                                                 target's (optionally checked against it)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from dspark_jax.convert.hf_qwen3 import (
    _np_dtype,
    _unbox_tree,
    _weight_files,
    decoder_layer_tensors,
    read_hf_config,
)
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.qwen3 import Qwen3Config

__all__ = [
    "ARCHITECTURE",
    "deepspec_config_to_drafter",
    "deepspec_tensor_shapes",
    "drafter_to_deepspec_config",
    "load_deepspec_drafter",
    "main",
    "save_deepspec_drafter",
]

ARCHITECTURE = "Qwen3DSparkModel"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
# DeepSpec's names for the sequential head <-> ours (DrafterConfig.head).
_HEAD_FROM_DS = {"vanilla": "markov", "gated": "gated", "rnn": "rnn"}
_HEAD_TO_DS = {v: k for k, v in _HEAD_FROM_DS.items()}
# Frozen copies of the target's embedding / LM head that DeepSpec stores with the drafter.
FROZEN = ("embed_tokens.weight", "lm_head.weight")
# Raw state dicts of a torch.compile'd module carry this prefix (DeepSpec strips it too).
_COMPILE_PREFIX = "_orig_mod."
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# The target shape fields the drafter copies (DeepSpec deep-copies the target config).
_SHAPE_FIELDS = (
    "hidden_size",
    "vocab_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
)
_REQUIRED_CONFIG = (
    "hidden_size",
    "vocab_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "block_size",
    "target_layer_ids",
    "mask_token_id",
    "markov_rank",
    "enable_confidence_head",
)

Params = dict[str, Any]


# ----------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------


def _rope_theta(ds: Mapping) -> float | None:
    theta = ds.get("rope_theta")
    if theta is None:  # transformers >= 5 nests it under rope_parameters
        theta = (ds.get("rope_parameters") or {}).get("rope_theta")
    return None if theta is None else float(theta)


def _config_problems(ds: Mapping, target: Qwen3Config) -> list[str]:
    """Every reason the DeepSpec config cannot be run by our drafter against ``target``."""
    problems = []
    missing = [k for k in _REQUIRED_CONFIG if k not in ds]
    rank = ds.get("markov_rank")
    if isinstance(rank, int) and rank > 0 and "markov_head_type" not in ds:
        missing.append("markov_head_type")
    if missing:
        return [f"config.json lacks required key(s) {missing}"]
    archs = ds.get("architectures") or []
    if archs and ARCHITECTURE not in archs:
        problems.append(
            f"architectures is {archs}; only {ARCHITECTURE!r} (DeepSpec's Qwen3 DSpark/DFlash "
            "drafter) is supported"
        )
    if ds.get("model_type", "qwen3") != "qwen3":
        problems.append(f"model_type is {ds.get('model_type')!r}, expected 'qwen3'")
    ds_shape = dict(ds)
    if ds_shape.get("head_dim") is None:
        ds_shape["head_dim"] = ds["hidden_size"] // ds["num_attention_heads"]
    for name in _SHAPE_FIELDS:
        if ds_shape[name] != getattr(target, name):
            problems.append(
                f"{name} is {ds_shape[name]} in the drafter but {getattr(target, name)} in the "
                "target"
            )
    if "num_target_layers" in ds and ds["num_target_layers"] != target.num_hidden_layers:
        problems.append(
            f"the drafter was built for a {ds['num_target_layers']}-layer target; this target "
            f"has {target.num_hidden_layers} layers"
        )
    eps = ds.get("rms_norm_eps")
    if eps is not None and not math.isclose(float(eps), target.rms_norm_eps, rel_tol=1e-9):
        problems.append(f"rms_norm_eps is {eps} in the drafter but {target.rms_norm_eps} in target")
    theta = _rope_theta(ds)
    if theta is not None and not math.isclose(theta, target.rope_theta, rel_tol=1e-9):
        problems.append(f"rope_theta is {theta} in the drafter but {target.rope_theta} in target")
    scaling = ds.get("rope_scaling") or (ds.get("rope_parameters") or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in (None, "default"):
        problems.append(f"rope scaling {rope_type!r} is not supported (plain RoPE only)")
    if ds.get("attention_bias"):
        problems.append("attention_bias=true is not supported (Qwen3 has no attention biases)")
    if ds.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {ds['hidden_act']!r} is not supported (SwiGLU/silu only)")
    bad_types = sorted({t for t in ds.get("layer_types") or [] if t != "full_attention"})
    if bad_types:
        problems.append(f"layer_types {bad_types} are not supported (full attention only)")
    rank = ds["markov_rank"]
    if not isinstance(rank, int) or rank < 0:
        problems.append(f"markov_rank must be an integer >= 0, got {rank!r}")
    elif rank > 0 and str(ds["markov_head_type"]).lower() not in _HEAD_FROM_DS:
        problems.append(
            f"markov_head_type {ds['markov_head_type']!r} is not one of {list(_HEAD_FROM_DS)}"
        )
    if -1 in list(ds["target_layer_ids"]):
        problems.append(
            "target_layer_ids contains -1 (the embedding output); our target taps decoder "
            "layer outputs only"
        )
    if ds["enable_confidence_head"] and rank == 0 and ds.get("confidence_head_with_markov"):
        problems.append("confidence_head_with_markov=true needs markov_rank > 0")
    return problems


def deepspec_config_to_drafter(ds: Mapping, target_config: Qwen3Config) -> DrafterConfig:
    """A DeepSpec drafter ``config.json`` dict -> our resolved ``DrafterConfig``.

    Raises ``ValueError`` listing every problem (missing keys, unsupported variants, and
    every shape field that disagrees with ``target_config``).
    """
    problems = _config_problems(ds, target_config)
    if problems:
        raise ValueError("DeepSpec drafter config is not usable: " + "; ".join(problems))
    rank = int(ds["markov_rank"])
    confidence = bool(ds["enable_confidence_head"])
    common = dict(
        gamma=int(ds["block_size"]),
        num_layers=int(ds["num_hidden_layers"]),
        taps=tuple(int(t) for t in ds["target_layer_ids"]),
        mask_token_id=int(ds["mask_token_id"]),
    )
    if rank == 0 and not confidence:
        cfg = DrafterConfig(kind="dflash", head="none", confidence=False, **common)
    elif rank == 0:
        cfg = DrafterConfig(
            kind="dspark",
            head="none",
            confidence=True,
            confidence_with_prev=False,
            **common,
        )
    else:
        head = _HEAD_FROM_DS[str(ds["markov_head_type"]).lower()]
        # DeepSpec's RNN head uses markov_rank as its state size and W1 rank (our rnn_rank).
        ranks = {"rnn_rank": rank} if head == "rnn" else {"markov_rank": rank}
        cfg = DrafterConfig(
            kind="dspark",
            head=head,
            **ranks,
            confidence=confidence,
            confidence_with_prev=bool(confidence and ds.get("confidence_head_with_markov")),
            **common,
        )
    return cfg.resolve(target_config)


def drafter_to_deepspec_config(
    drafter_config: DrafterConfig, target_config: Qwen3Config, num_anchors: int = 512
) -> dict[str, Any]:
    """Our ``DrafterConfig`` -> a DeepSpec ``config.json`` dict (target fields + drafter).

    ``num_anchors`` only matters to DeepSpec's trainer (512 in its released configs).
    """
    cfg = drafter_config.resolve(target_config)
    if not cfg.parallel_block:
        raise ValueError(f"DeepSpec stores dspark/dflash drafters only, got kind {cfg.kind!r}")
    n = cfg.resolved_num_layers
    ds = target_config.to_hf_dict(torch_dtype="float32")
    ds["rope_parameters"] = {"rope_type": "default", "rope_theta": target_config.rope_theta}
    ds.update(
        architectures=[ARCHITECTURE],
        num_target_layers=target_config.num_hidden_layers,
        num_hidden_layers=n,
        max_window_layers=n,
        layer_types=["full_attention"] * n,
        block_size=cfg.gamma,
        tie_word_embeddings=False,
        mask_token_id=cfg.mask_token_id,
        target_layer_ids=list(cfg.taps),
        num_anchors=int(num_anchors),
        enable_confidence_head=cfg.has_confidence,
        markov_rank=cfg.head_rank,
    )
    if cfg.has_confidence:
        ds["confidence_head_with_markov"] = bool(
            cfg.confidence_with_prev and cfg.resolved_head != "none"
        )
    if cfg.head_rank > 0:
        ds["markov_head_type"] = _HEAD_TO_DS[cfg.resolved_head]
    return ds


# ----------------------------------------------------------------------------------------
# Tensor mapping
# ----------------------------------------------------------------------------------------


class _Entry:
    """One DeepSpec tensor <-> one leaf of our drafter tree, with the layout change."""

    def __init__(self, name, path, ds_shape, to_ours: Callable, to_ds: Callable):
        self.name, self.path, self.ds_shape = name, path, tuple(ds_shape)
        self.to_ours, self.to_ds = to_ours, to_ds


def _same(w):
    return w


def _t(w):
    return w.T


def _entries(cfg: DrafterConfig, tgt: Qwen3Config) -> list[_Entry]:
    """The full mapping for a resolved dspark/dflash ``cfg`` (frozen copies excluded)."""
    d, v, m = tgt.hidden_size, tgt.vocab_size, len(cfg.taps)
    bb = ("backbone",)
    out = [
        _Entry("fc.weight", bb + ("fc", "kernel"), (d, m * d), _t, _t),
        _Entry("hidden_norm.weight", bb + ("hidden_norm", "scale"), (d,), _same, _same),
        _Entry("norm.weight", bb + ("norm", "scale"), (d,), _same, _same),
    ]

    layer_cfg = tgt.replace(num_hidden_layers=cfg.resolved_num_layers)
    for i in range(cfg.resolved_num_layers):
        for lt in decoder_layer_tensors(layer_cfg):
            out.append(
                _Entry(
                    f"layers.{i}.{lt.hf_suffix}",
                    bb + (f"layers_{i}",) + lt.path,
                    lt.hf_shape,
                    lt.to_ours,
                    lt.to_hf,
                )
            )

    head, r = cfg.resolved_head, cfg.head_rank
    mh = ("markov_head",)
    if head != "none":
        out.append(
            _Entry("markov_head.markov_w1.weight", mh + ("markov_w1",), (v, r), _same, _same)
        )
        out.append(_Entry("markov_head.markov_w2.weight", mh + ("markov_w2",), (v, r), _t, _t))
    if head == "gated":
        out.append(
            _Entry("markov_head.gate_proj.weight", mh + ("gate_kernel",), (r, d + r), _t, _t)
        )
        out.append(_Entry("markov_head.gate_proj.bias", mh + ("gate_bias",), (r,), _same, _same))
    if head == "rnn":
        out.append(
            _Entry(
                "markov_head.joint_proj.weight", mh + ("joint_kernel",), (3 * r, 2 * r + d), _t, _t
            )
        )
        out.append(
            _Entry("markov_head.joint_proj.bias", mh + ("joint_bias",), (3 * r,), _same, _same)
        )
    if cfg.has_confidence:
        use_prev = cfg.confidence_with_prev and head != "none"
        n_in = d + (r if use_prev else 0)
        out.append(
            _Entry(
                "confidence_head.proj.weight",
                ("confidence_head", "kernel"),
                (1, n_in),
                lambda w: w.reshape(n_in),
                lambda k: k.reshape(1, n_in),
            )
        )
        out.append(
            _Entry("confidence_head.proj.bias", ("confidence_head", "bias"), (1,), _same, _same)
        )
    return out


def deepspec_tensor_shapes(
    drafter_config: DrafterConfig, target_config: Qwen3Config, include_frozen: bool = True
) -> dict[str, tuple[int, ...]]:
    """Every tensor a DeepSpec checkpoint of this drafter holds, with its (torch) shape."""
    cfg = drafter_config.resolve(target_config)
    shapes = {e.name: e.ds_shape for e in _entries(cfg, target_config)}
    if include_frozen:
        for name in FROZEN:
            shapes[name] = (target_config.vocab_size, target_config.hidden_size)
    return shapes


def _check_against_module(cfg: DrafterConfig, tgt: Qwen3Config, entries: list[_Entry]) -> None:
    """The mapping must cover exactly the parameter tree our module builds (same shapes)."""
    import flax.linen as nn
    import jax

    from dspark_jax.models.drafters import init_drafter_params, make_drafter

    module = make_drafter(cfg, tgt)
    abstract = nn.unbox(jax.eval_shape(lambda: init_drafter_params(module, jax.random.key(0))))
    want = {p: tuple(s.shape) for p, s in _flatten(abstract).items()}
    have = {e.path: e.to_ours(np.empty(e.ds_shape, np.int8)).shape for e in entries}
    if want != have:  # a bug in this file, not in the user's checkpoint
        raise RuntimeError(
            "DeepSpec mapping and the drafter module disagree: "
            f"only in module {sorted(set(want) - set(have))}, "
            f"only in mapping {sorted(set(have) - set(want))}, "
            f"shape differences {[(p, want[p], have[p]) for p in want if p in have and want[p] != have[p]]}"
        )


def _flatten(tree: Mapping, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out = {}
    for k, val in tree.items():
        if isinstance(val, Mapping):
            out.update(_flatten(val, prefix + (k,)))
        else:
            out[prefix + (k,)] = val
    return out


# ----------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------


def _read_config(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"DeepSpec drafter directory {path} does not exist")
    config_path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"No {CONFIG_NAME} in DeepSpec drafter directory {path}")
    with open(config_path) as fh:
        try:
            ds = json.load(fh)
        except json.JSONDecodeError as err:
            raise ValueError(f"{config_path} is not valid JSON: {err}") from err
    if not isinstance(ds, dict):
        raise ValueError(f"{config_path} must hold a JSON object")
    return ds


def _names_problems(expected: Mapping[str, tuple], present: set[str]) -> list[str]:
    required = set(expected) - set(FROZEN)
    missing = sorted(required - present)
    unexpected = sorted(present - set(expected))
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {missing}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {unexpected}")
    return problems


def _bf16_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal at bfloat16 precision (DeepSpec keeps its frozen copies in bf16)."""
    import ml_dtypes

    bf = ml_dtypes.bfloat16
    return bool(np.array_equal(np.asarray(a).astype(bf), np.asarray(b).astype(bf)))


# Rows of the frozen copies compared at a time: the check holds two such chunks, never a
# whole [V, d] table (1.2 GB each for Qwen3-8B in bfloat16).
_FROZEN_CHECK_ROWS = 4096


def _check_frozen(slice_of: Callable[[str], Any], present: set[str], target_dir: str) -> None:
    """Compare the checkpoint's frozen embedding / LM head with the target's own tensors,
    ``_FROZEN_CHECK_ROWS`` rows at a time (``slice_of(name)``: a safetensors slice)."""
    from safetensors import safe_open

    target = read_hf_config(target_dir)
    located = _weight_files(target_dir)
    sources = {"embed_tokens.weight": "model.embed_tokens.weight"}
    sources["lm_head.weight"] = (
        "model.embed_tokens.weight" if target.tie_word_embeddings else "lm_head.weight"
    )
    problems = []
    for name, tname in sources.items():
        if name not in present:
            continue
        if tname not in located:
            raise ValueError(f"target directory {target_dir} has no tensor {tname!r}")
        with safe_open(located[tname], framework="numpy") as fh:
            want, have = fh.get_slice(tname), slice_of(name)
            shape, have_shape = tuple(want.get_shape()), tuple(have.get_shape())
            if shape != have_shape:
                problems.append(
                    f"{name!r} differs from the target's {tname!r} (shapes {have_shape} vs {shape})"
                )
                continue
            differs, diff = False, 0.0
            for start in range(0, shape[0], _FROZEN_CHECK_ROWS):
                rows = slice(start, min(shape[0], start + _FROZEN_CHECK_ROWS))
                a, b = have[rows], want[rows]
                if not _bf16_equal(a, b):
                    d = np.abs(a.astype(np.float32) - b.astype(np.float32))
                    differs, diff = True, float(np.nanmax([diff, np.max(d)]))
            if differs:
                problems.append(f"{name!r} differs from the target's {tname!r} (max |diff| {diff})")
    if problems:
        raise ValueError(
            "The drafter's frozen embedding / LM head do not match the target in "
            f"{target_dir} (was the drafter trained for another target?): " + "; ".join(problems)
        )


def load_deepspec_drafter(
    path: str | os.PathLike,
    target_config: Qwen3Config,
    dtype="float32",
    target_dir: str | os.PathLike | None = None,
) -> tuple[DrafterConfig, Params]:
    """Read a local DeepSpec DSpark/DFlash drafter directory.

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` (or shards + index).
      target_config: the target's ``Qwen3Config`` (e.g. from ``read_hf_config``).
      dtype: dtype of the returned arrays (``float32``, ``bfloat16`` or ``float16``).
      target_dir: optional Hugging Face target directory; when given, the checkpoint's
        frozen ``embed_tokens`` / ``lm_head`` copies must equal the target's (bf16 precision).

    Returns ``(drafter_config, params)``: a resolved ``DrafterConfig`` (kind ``dspark`` or
    ``dflash``) and a plain tree of numpy arrays for ``make_drafter(cfg, target_config)``.
    Raises ``FileNotFoundError`` / ``ValueError`` naming every missing and unexpected
    tensor and every shape mismatch.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    out_dtype = _np_dtype(dtype)
    cfg = deepspec_config_to_drafter(_read_config(path), target_config)
    entries = _entries(cfg, target_config)
    _check_against_module(cfg, target_config, entries)
    expected = deepspec_tensor_shapes(cfg, target_config)

    located = {}  # normalised name -> (file, stored name)
    for raw, file in _weight_files(path).items():
        if raw.endswith(_IGNORED_SUFFIXES):
            continue
        name = raw[len(_COMPILE_PREFIX) :] if raw.startswith(_COMPILE_PREFIX) else raw
        located[name] = (file, raw)
    problems = _names_problems(expected, set(located))
    if problems:
        raise ValueError(
            f"DeepSpec checkpoint {path} does not match its config ({cfg.kind}, head "
            f"{cfg.resolved_head}, {cfg.resolved_num_layers} layers): " + "; ".join(problems)
        )

    handles = {}
    try:
        for file in sorted({f for f, _ in located.values()}):
            handles[file] = safe_open(file, framework="numpy")
        shape_problems = []
        for name, (file, raw) in sorted(located.items()):
            sl = handles[file].get_slice(raw)
            shape = tuple(sl.get_shape())
            if shape != expected[name]:
                shape_problems.append(f"{name!r}: expected {expected[name]}, got {shape}")
            elif sl.get_dtype() not in ("F32", "BF16", "F16", "F64"):
                shape_problems.append(f"{name!r}: unsupported dtype {sl.get_dtype()}")
        if shape_problems:
            raise ValueError(
                f"DeepSpec checkpoint {path} has tensors of the wrong shape or dtype: "
                + "; ".join(shape_problems)
            )

        def get(name: str) -> np.ndarray:
            file, raw = located[name]
            return handles[file].get_tensor(raw)

        def slice_of(name: str):
            file, raw = located[name]
            return handles[file].get_slice(raw)

        if target_dir is not None:
            _check_frozen(slice_of, set(located), os.fspath(target_dir))
        params: Params = {}
        for e in entries:
            node = params
            for key in e.path[:-1]:
                node = node.setdefault(key, {})
            leaf = e.to_ours(get(e.name).astype(np.float32)).astype(out_dtype)
            node[e.path[-1]] = np.ascontiguousarray(leaf)
    finally:
        for fh in handles.values():
            fh.__exit__(None, None, None)
    return cfg, params


# ----------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------


def _hf_vocab_tensor(x, name: str, tgt: Qwen3Config) -> np.ndarray:
    arr = np.asarray(x)
    want = (tgt.vocab_size, tgt.hidden_size)
    if arr.shape != want:
        raise ValueError(f"{name} must have the Hugging Face shape {want}, got {arr.shape}")
    return arr


def save_deepspec_drafter(
    path: str | os.PathLike,
    drafter_config: DrafterConfig,
    target_config: Qwen3Config,
    params: Mapping,
    *,
    embed=None,
    lm_head=None,
    dtype="float32",
    num_anchors: int = 512,
) -> list[str]:
    """Write ``params`` as a DeepSpec drafter directory (``config.json``, ``model.safetensors``).

    ``params`` may be boxed or ``{"params": tree}``. ``embed`` / ``lm_head`` (both in the
    Hugging Face layout ``[vocab, hidden]``) are the target's, stored as DeepSpec's frozen
    copies; DeepSpec's own loader needs them, ours ignores them. ``dtype``: tensor dtype
    (DeepSpec's released checkpoints are bfloat16). Returns the written paths.
    """
    from safetensors.numpy import save_file

    out_dtype = _np_dtype(dtype)
    cfg = drafter_config.resolve(target_config)
    ds = drafter_to_deepspec_config(cfg, target_config, num_anchors=num_anchors)
    ds["torch_dtype"] = ds["dtype"] = out_dtype.name
    entries = _entries(cfg, target_config)
    tree = _flatten(_unbox_tree(params))
    paths = {e.path for e in entries}
    missing = sorted("/".join(p) for p in paths - set(tree))
    unexpected = sorted("/".join(p) for p in set(tree) - paths)
    if missing or unexpected:
        raise ValueError(
            f"params do not match the {cfg.kind} drafter config: missing {missing}, "
            f"unexpected {unexpected}"
        )
    state = {}
    bad = []
    for e in entries:
        leaf = np.asarray(tree[e.path])
        want = e.to_ours(np.empty(e.ds_shape, np.int8)).shape
        if leaf.shape != want:
            bad.append(f"{'/'.join(e.path)}: expected {want}, got {leaf.shape}")
            continue
        state[e.name] = np.ascontiguousarray(e.to_ds(leaf.astype(np.float32)).astype(out_dtype))
    if bad:
        raise ValueError("params have leaves of the wrong shape: " + "; ".join(bad))
    for name, value in (("embed_tokens.weight", embed), ("lm_head.weight", lm_head)):
        if value is not None:
            arr = _hf_vocab_tensor(value, name, target_config).astype(np.float32)
            state[name] = np.ascontiguousarray(arr.astype(out_dtype))

    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"Cannot write a DeepSpec drafter to {path}: not a directory")
    os.makedirs(path, exist_ok=True)
    config_path = os.path.join(path, CONFIG_NAME)
    with open(config_path, "w") as fh:
        json.dump(ds, fh, indent=2)
        fh.write("\n")
    weights_path = os.path.join(path, WEIGHTS_NAME)
    save_file(state, weights_path, metadata={"format": "pt"})
    return [config_path, weights_path]


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dspark_jax.convert.deepspec",
        description="Convert a DeepSpec DSpark/DFlash drafter checkpoint to a dspark_jax "
        "drafter directory (drafter_config.json + model.safetensors).",
    )
    parser.add_argument("--drafter", required=True, help="DeepSpec drafter directory")
    parser.add_argument("--target", required=True, help="Hugging Face Qwen3 target directory")
    parser.add_argument("--out", required=True, help="output dspark_jax drafter directory")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--skip-target-check",
        action="store_true",
        help="do not compare the drafter's frozen embedding / LM head with the target's",
    )
    args = parser.parse_args(argv)
    from dspark_jax.cli import run_main
    from dspark_jax.models.drafter_io import save_drafter

    def cli():
        target = read_hf_config(args.target)
        cfg, params = load_deepspec_drafter(
            args.drafter,
            target,
            dtype=args.dtype,
            target_dir=None if args.skip_target_check else args.target,
        )
        written = save_drafter(args.out, cfg, target, params, dtype=args.dtype)
        n = sum(int(np.prod(v.shape)) for v in _flatten(params).values())
        print(
            f"converted {cfg.kind} drafter (gamma={cfg.gamma}, layers="
            f"{cfg.resolved_num_layers}, taps={list(cfg.taps)}, head={cfg.resolved_head}, "
            f"rank={cfg.head_rank}, confidence={cfg.has_confidence}, {n / 1e6:.1f}M params) "
            f"-> {', '.join(written)}"
        )

    return run_main(cli)


if __name__ == "__main__":
    sys.exit(main())
