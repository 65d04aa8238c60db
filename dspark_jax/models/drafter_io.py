"""Save / load a trained drafter as a directory (used by ``dspark_jax.generate``).

Layout of ``<dir>``:

* ``drafter_config.json``: ``{"format": 3, "drafter": DrafterConfig fields, "target":
  {"vocab_size", "hidden_size", "num_hidden_layers", "weights"}}``. The target entry is what
  the drafter's embedding / LM-head / tap shapes were built for, and ``weights`` the
  trained-against target's ``models.fingerprint.weights_fingerprint``; loading against
  another target (other shapes, or the same shapes with other weights) is an error that
  names both values. Drafters saved before ``weights`` existed load without that check.
* ``model.safetensors``: the flattened (unboxed) parameter tree, keys joined with ``/``
  (e.g. ``backbone/layer/attn/q_proj/kernel``), float32 or bfloat16. Format 3 stores the
  q/k/v kernels ``[heads, head_dim, d]`` (``models.qwen3.Projection.out_first``); files of
  format 1 (``[d, heads, head_dim]``) and 2 (``[heads, d, head_dim]``) load with the axes
  moved.
* ``sts.json`` (optional): the confidence head's calibration (``eval.calibration`` fits
  it; ``load_sts`` reads it for the decoder and the engine), ``sts_data.npz`` beside it the
  labels it was fitted on.
* ``sts_draft_probability.json`` (optional, any drafter kind): the same calibration of the
  *draft-probability* survival estimate (``decode.plan_step``: ``c_k`` from the largest
  probability of the drafter's own distribution at position k), which is how drafters
  without a confidence head (DFlash, EAGLE-3, MTP-1) get survivals for the budgeted
  schedulers; ``sts_draft_probability_data.npz`` beside it.

Every reader and writer of a drafter directory goes through this module.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from dspark_jax import sharding as shd
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.drafters import init_drafter_params, make_drafter
from dspark_jax.models.qwen3 import Qwen3Config

__all__ = [
    "CONFIG_NAME",
    "STS",
    "STS_FILENAME",
    "SURVIVAL_ESTIMATORS",
    "WEIGHTS_NAME",
    "drafter_dir_error",
    "is_drafter_dir",
    "load_drafter",
    "load_sts",
    "read_drafter_config",
    "resolve_estimator",
    "save_drafter",
    "save_sts",
    "sts_path",
]

CONFIG_NAME = "drafter_config.json"
WEIGHTS_NAME = "model.safetensors"
FORMAT_VERSION = 3
# Older formats this version still reads (axes moved on load: ``_file_axes``).
_READS_FORMATS = (1, 2, 3)
_TARGET_SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers")
STS_FILENAME = "sts.json"
# Where a drafter's survival c_k comes from (``decode.plan_step.draft``), and the file
# beside the weights that calibrates each: the confidence head's logit z_k (DESIGN §3.4),
# or logit(max_v q_k(v)) of the drafter's untempered distribution at position k.
SURVIVAL_ESTIMATORS = ("confidence_head", "draft_probability")
STS_FILENAMES = {
    "confidence_head": STS_FILENAME,
    "draft_probability": "sts_draft_probability.json",
}


def resolve_estimator(estimator: str | None, has_confidence: bool, drafter: str = "drafter") -> str:
    """The survival estimator to use: ``None``/``"auto"`` picks the confidence head where
    the drafter has one, else the draft probability; an explicit choice is checked (the
    CLI's dashes are accepted: ``draft-probability``)."""
    if estimator in (None, "auto"):
        return "confidence_head" if has_confidence else "draft_probability"
    name = estimator.replace("-", "_")
    if name not in SURVIVAL_ESTIMATORS:
        allowed = ", ".join(["auto"] + [e.replace("_", "-") for e in SURVIVAL_ESTIMATORS])
        raise ValueError(f"unknown survival estimator {estimator!r}; allowed: {allowed}")
    if name == "confidence_head" and not has_confidence:
        raise ValueError(
            f"{drafter} has no confidence head; use the draft-probability survival estimate "
            "(--survival-estimator draft-probability, or auto)"
        )
    return name


def is_drafter_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like a drafter directory (it holds ``drafter_config.json``)."""
    return os.path.isfile(os.path.join(os.fspath(path), CONFIG_NAME))


def read_drafter_config(path: str | os.PathLike) -> DrafterConfig:
    """The ``DrafterConfig`` of a drafter directory, without its weights or a target."""
    config_path = os.path.join(os.fspath(path), CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"Drafter directory {path} has no {CONFIG_NAME}")
    return DrafterConfig.from_dict(_read_meta(config_path, ("drafter",))["drafter"])


def _read_meta(config_path: str, keys: tuple[str, ...]) -> dict:
    """``drafter_config.json`` as a dict holding ``keys``, or an error naming the file."""
    try:
        with open(config_path) as f:
            meta = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from e
    if not isinstance(meta, dict) or any(k not in meta for k in keys):
        what = f"a {keys[0]!r} entry" if len(keys) == 1 else " and ".join(map(repr, keys))
        plural = "" if len(keys) == 1 else " entries"
        raise ValueError(f"{config_path} must hold {what}{plural}")
    return meta


def drafter_dir_error(
    path: str | os.PathLike, flag: str | None = "--target", drafter_flag: str | None = "--drafter"
) -> ValueError:
    """The one message for a drafter directory given where a target (a Hugging Face
    Qwen3 directory) is expected: ``flag`` names where it was given, ``drafter_flag``
    where it belongs (None: the entry point has no such flag)."""
    given = f"{flag} {os.fspath(path)}" if flag else os.fspath(path)
    where = f"pass it as {drafter_flag}" if drafter_flag else "give it where a drafter goes"
    target = f" as {flag}" if flag else " as the target"
    return ValueError(
        f"{given} is a drafter directory (it has {CONFIG_NAME}), not a Hugging Face Qwen3 "
        f"target: {where}, and a Qwen3 directory (config.json, model.safetensors, "
        f"tokenizer.json){target}"
    )


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
    target_fingerprint: str | None = None,
) -> list[str]:
    """Write ``drafter_config.json`` and ``model.safetensors`` under ``path`` (created).

    ``params`` may be boxed (``nn.Partitioned``) or plain; ``target_fingerprint`` is the
    ``weights_fingerprint`` of the target it was trained against. Returns the written paths.
    """
    from safetensors.numpy import save_file

    if not isinstance(drafter_config, DrafterConfig):
        raise ValueError(f"save_drafter needs a DrafterConfig, got {type(drafter_config).__name__}")
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"Cannot save a drafter to {path}: it exists and is not a directory")
    os.makedirs(path, exist_ok=True)
    out_dtype = _np_dtype(dtype)
    flat = _flatten(jax.device_get(shd.unboxed(params)))
    tensors = {k: np.ascontiguousarray(np.asarray(v).astype(out_dtype)) for k, v in flat.items()}
    config_path = os.path.join(path, CONFIG_NAME)
    target = {k: getattr(target_config, k) for k in _TARGET_SHAPE_KEYS}
    if target_fingerprint is not None:
        target["weights"] = target_fingerprint
    meta = {
        "format": FORMAT_VERSION,
        "drafter": drafter_config.to_dict(),
        "target": target,
        "dtype": dtype,
    }
    with open(config_path, "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    weights_path = os.path.join(path, WEIGHTS_NAME)
    save_file(tensors, weights_path, metadata={"format": "np"})
    return [config_path, weights_path]


def load_drafter(
    path: str | os.PathLike,
    target_config: Qwen3Config,
    target_fingerprint: str | None = None,
    *,
    mesh=None,
):
    """Load a drafter directory for ``target_config``: returns ``(module, params)``.

    Params come back as a plain tree of host arrays in the module's ``param_dtype``, or,
    given ``mesh``, of ``jax.Array``s on it, sharded by the logical-axis rules table: each
    process then reads from the file only the blocks its own devices hold, one block at a
    time (``sharding.array_from_blocks``), never the whole drafter. Raises
    ``FileNotFoundError`` for a missing directory / file and ``ValueError`` for a drafter
    built for another target (its shapes, or, given ``target_fingerprint``, its weights)
    or a weights file that does not match its config.
    """
    from safetensors import safe_open

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
    meta = _read_meta(config_path, ("drafter", "target"))
    if meta.get("format") not in _READS_FORMATS:
        raise ValueError(
            f"{config_path} has format {meta.get('format')!r}; this version reads formats "
            f"{', '.join(map(str, _READS_FORMATS))}"
        )
    for key in _TARGET_SHAPE_KEYS:
        want, have = meta["target"].get(key), getattr(target_config, key)
        if want != have:
            raise ValueError(
                f"Drafter {path} was trained for a different target: its {key} is {want}, "
                f"the target's is {have}"
            )
    trained_for = meta["target"].get("weights")
    if target_fingerprint is not None and trained_for not in (None, target_fingerprint):
        raise ValueError(
            f"Drafter {path} was trained against other target weights (target fingerprint "
            f"{trained_for}; this target's is {target_fingerprint}): the architectures match "
            "but the weights do not, so its drafts would rarely be accepted. Use the target "
            "it was trained for, or retrain it against this one"
        )
    dcfg = DrafterConfig.from_dict(meta["drafter"])
    module = make_drafter(dcfg, target_config)
    boxed = jax.eval_shape(lambda: init_drafter_params(module, jax.random.key(0)))
    expected = _flatten(shd.unboxed(boxed))
    shardings = _flatten(shd.param_shardings(boxed, mesh)) if mesh is not None else None
    params = {}
    with safe_open(weights_path, framework="numpy") as fh:
        stored = set(fh.keys())
        missing = sorted(set(expected) - stored)
        extra = sorted(stored - set(expected))
        if missing or extra:
            raise ValueError(
                f"{weights_path} does not match its config: missing {missing[:5]}"
                f"{' …' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                f"{' …' if len(extra) > 5 else ''}"
            )
        for name, spec in expected.items():
            tensor = fh.get_slice(name)
            perm = _file_axes(meta["format"], name, len(tensor.get_shape()))
            shape = tuple(tensor.get_shape()[a] for a in perm)
            if shape != tuple(spec.shape):
                raise ValueError(
                    f"{weights_path}: tensor {name!r} has shape {shape}, expected "
                    f"{tuple(spec.shape)}"
                )

            def block(index, tensor=tensor, perm=perm, dtype=spec.dtype):
                # Our axis i is the file's axis perm[i]: slice the file there, then move
                # the axes into our layout.
                file_index = [slice(None)] * len(perm)
                for i, a in enumerate(perm):
                    file_index[a] = index[i] if i < len(index) else slice(None)
                x = np.transpose(np.asarray(tensor[tuple(file_index)]), perm)
                return np.ascontiguousarray(np.asarray(x, np.float32).astype(dtype))

            if mesh is None:
                params[name] = block(())
            else:
                params[name] = shd.array_from_blocks(shape, shardings[name], block)
    return module, _unflatten(params)


_QKV_KERNELS = ("q_proj/kernel", "k_proj/kernel", "v_proj/kernel")
# Where format 1 and 2 kept a q/k/v kernel's axes, as a permutation to [heads, head_dim, d].
_QKV_AXES = {1: (1, 2, 0), 2: (0, 2, 1)}


def _file_axes(fmt: int, name: str, ndim: int) -> tuple[int, ...]:
    """Where a format-``fmt`` file keeps each of our axes (ours = ``np.transpose(file,
    axes)``): format 1 stored the q/k/v kernels ``[d, heads, head_dim]``, format 2
    ``[heads, d, head_dim]``, format 3 ``[heads, head_dim, d]`` (same values)."""
    if fmt in _QKV_AXES and name.endswith(_QKV_KERNELS) and ndim == 3:
        return _QKV_AXES[fmt]
    return tuple(range(ndim))


# -- sts.json: the confidence head's calibration -------------------------------------
class STS(NamedTuple):
    """Fitted calibration of a drafter's survival estimate, applied as ``σ(z / T + b)``,
    or, at positions with isotonic ``knots``, as ``σ(step_k(z / T + b))`` (T = 1, b = 0
    there; ``eval.calibration`` module docstring)."""

    temperatures: np.ndarray  # [γ], > 0
    biases: np.ndarray  # [γ]; all zero for DESIGN's temperature-only STS
    estimator: str = "confidence_head"  # which z it calibrates (SURVIVAL_ESTIMATORS)
    # [γ, 2, J]: per position, the step map's left edges (in z units) and its calibrated
    # logits, padded to J by repeating the last knot; NaN rows: no step map there. None:
    # no position has one (temperature and affine STS).
    knots: np.ndarray | None = None

    def first(self, n: int) -> STS:
        """The calibration of the first ``n`` positions (a run drafting fewer than γ)."""
        knots = None if self.knots is None else np.asarray(self.knots)[:n]
        return STS(
            np.asarray(self.temperatures)[:n], np.asarray(self.biases)[:n], self.estimator, knots
        )


# Most knots a step map may have (a fit with more pools neighbouring blocks): they are
# constants of every compiled round, and PAV on ~10^4 rounds gives a few tens.
MAX_KNOTS = 64


def check_knots(knots, gamma: int) -> np.ndarray | None:
    """``[γ, 2, J]`` float32 (NaN rows: no map) from a per-position list of
    ``{"edges": [...], "logits": [...]}`` or None, or None when no position has a map.
    Edges must increase strictly and logits never decrease (the map is monotone, so the
    ranking of survivals across requests is kept up to ties)."""
    if knots is None:
        return None
    if not isinstance(knots, list) or len(knots) != gamma:
        raise ValueError(f"need {gamma} knot entries (one per position, or null), got {knots!r}")
    rows = []
    for k, entry in enumerate(knots):
        if entry is None:
            rows.append(None)
            continue
        if not isinstance(entry, dict) or set(entry) != {"edges", "logits"}:
            raise ValueError(
                f"knots of position {k + 1} must be {{'edges': [...], 'logits': [...]}}"
            )
        e = np.asarray(entry["edges"], np.float64).reshape(-1)
        v = np.asarray(entry["logits"], np.float64).reshape(-1)
        if e.size == 0 or e.shape != v.shape or e.size > MAX_KNOTS:
            raise ValueError(
                f"knots of position {k + 1}: need 1 to {MAX_KNOTS} edges and as many logits, "
                f"got {e.size} and {v.size}"
            )
        if not (np.all(np.isfinite(e)) and np.all(np.isfinite(v))):
            raise ValueError(f"knots of position {k + 1} must be finite")
        if np.any(np.diff(e) <= 0) or np.any(np.diff(v) < 0):
            raise ValueError(
                f"knots of position {k + 1}: edges must increase and logits must not decrease"
            )
        rows.append((e, v))
    if all(r is None for r in rows):
        return None
    j = max(r[0].size for r in rows if r is not None)
    out = np.full((gamma, 2, j), np.nan, np.float32)
    for k, r in enumerate(rows):
        if r is not None:
            n = r[0].size
            out[k, 0, :n], out[k, 1, :n] = r
            out[k, :, n:] = out[k, :, n - 1 : n]  # repeat the last knot
    return out


def check_temperatures(temperatures, gamma: int) -> np.ndarray:
    t = np.asarray(temperatures, np.float64).reshape(-1)
    if t.shape != (gamma,):
        raise ValueError(f"need {gamma} temperatures (one per position), got {t.shape[0]}")
    if np.any(~np.isfinite(t)) or np.any(t <= 0):
        raise ValueError(f"STS temperatures must be finite and > 0, got {t.tolist()}")
    return t


def check_biases(biases, gamma: int) -> np.ndarray:
    if biases is None:
        return np.zeros(gamma)
    b = np.asarray(biases, np.float64).reshape(-1)
    if b.shape != (gamma,):
        raise ValueError(f"need {gamma} STS biases (one per position), got {b.shape[0]}")
    if np.any(~np.isfinite(b)):
        raise ValueError(f"STS biases must be finite, got {b.tolist()}")
    return b


def sts_path(drafter_dir: str | os.PathLike, estimator: str = "confidence_head") -> Path:
    """Where the decoder and the engine read a drafter's calibration of ``estimator``."""
    return Path(drafter_dir) / STS_FILENAMES[resolve_estimator(estimator, True)]


def check_new_file(path: str | os.PathLike) -> None:
    """Refuse to replace an STS file (or its label arrays) silently."""
    for p in (Path(path), sts_data_path(path)):
        if p.exists():
            raise FileExistsError(
                f"{p} already exists; pass --overwrite to replace it, or choose another --out"
            )


def sts_data_path(path: str | os.PathLike) -> Path:
    """The label arrays beside an STS file: ``sts.json`` -> ``sts_data.npz``."""
    path = Path(path)
    return path.with_name(path.stem + "_data.npz")


def save_sts(
    path: str | os.PathLike,
    result,
    *,
    heldout: list[dict] | None = None,
    fit_report: list[dict] | None = None,
    data: dict[str, Any] | None = None,
    arrays: dict[str, np.ndarray] | None = None,
    overwrite: bool = False,
    estimator: str = "confidence_head",
) -> Path:
    """Write the STS file ``path`` (a ``.json`` file, or a directory: ``<dir>/sts.json``,
    or ``<dir>/sts_draft_probability.json`` for that ``estimator``, where the decoder and
    engine look for it) and, with ``arrays``, the labels beside it (``<stem>_data.npz``).
    An existing file is replaced only with ``overwrite``.

    ``heldout``: per-position before/after metrics on the reporting split;
    ``fit_report``: AUROC etc. on the fit split; ``data``: a description of the prompts
    and decode settings the labels came from.
    """
    path = Path(path)
    estimator = resolve_estimator(estimator, True)
    if path.is_dir():
        path = sts_path(path, estimator)
    if not path.parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {path.parent} does not exist")
    if not overwrite:
        check_new_file(path)
    payload: dict[str, Any] = {
        "format": "dspark_jax.sts/1",
        "estimator": estimator,
        "gamma": len(result.temperatures),
        "mode": result.mode,
        "temperatures": result.temperatures,
        "biases": result.biases,
        "knots": getattr(result, "knots", None),
        "fit": result.to_dict(),
        "fit_metrics": fit_report,
        "heldout_metrics": heldout,
        "data": data or {},
    }
    if arrays:
        np.savez_compressed(sts_data_path(path), **arrays)
        payload["data"]["arrays_file"] = sts_data_path(path).name
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(to_jsonable(payload), indent=2) + "\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return path


def load_sts(
    drafter_dir: str | os.PathLike,
    gamma: int | None = None,
    estimator: str = "confidence_head",
) -> STS | None:
    """``STS(temperatures, biases, estimator, knots)`` from the drafter's file for
    ``estimator`` (``sts.json``, or ``sts_draft_probability.json``), or None when there is
    none. Files without ``biases`` (temperature-only STS) get zeros.

    Pass it as ``sts=`` to ``SpeculativeDecoder`` or the serving ``Engine``. ``gamma`` (the
    drafter's draft length), when given, is checked against the file.
    """
    estimator = resolve_estimator(estimator, True)
    path = sts_path(drafter_dir, estimator)
    if not path.is_file():
        return None
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(payload, dict) or "temperatures" not in payload:
        raise ValueError(f"{path} has no 'temperatures' list")
    # Files written before the draft-probability estimate existed calibrate the head.
    written_for = payload.get("estimator", "confidence_head")
    if written_for != estimator:
        raise ValueError(
            f"{path} calibrates the {written_for!r} survival estimate, not {estimator!r}: "
            f"the {estimator!r} calibration belongs in {STS_FILENAMES[estimator]}"
        )
    temps = payload["temperatures"]
    if not isinstance(temps, list) or not temps:
        raise ValueError(f"{path}: 'temperatures' must be a non-empty list, got {temps!r}")
    n = len(temps) if gamma is None else gamma
    if len(temps) != n:
        raise ValueError(
            f"{path} holds {len(temps)} temperatures but the drafter drafts {gamma} tokens"
        )
    biases = payload.get("biases")
    if biases is not None and not isinstance(biases, list):
        raise ValueError(f"{path}: 'biases' must be a list, got {biases!r}")
    try:
        return STS(
            check_temperatures(temps, n).astype(np.float32),
            check_biases(biases, n).astype(np.float32),
            estimator,
            check_knots(payload.get("knots"), n),
        )
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def to_jsonable(x):
    """JSON-safe copy: numpy scalars/arrays to Python, NaN/inf to None."""
    if isinstance(x, dict):
        return {str(k): to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [to_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return to_jsonable(x.tolist())
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    return x
