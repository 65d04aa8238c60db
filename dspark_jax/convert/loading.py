"""The one loader of model directories every entry point uses (distillation, evaluation,
generation, serving): a Hugging Face Qwen3 target directory (``config.json``, safetensors,
``tokenizer.json``) and a drafter directory (``models/drafter_io.py``: weights, config and
its ``sts.json``). Missing files and mismatched models fail here with errors that name them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from dspark_jax.convert.hf_qwen3 import load_hf
from dspark_jax.models.drafter_io import (
    STS,
    drafter_dir_error,
    is_drafter_dir,
    load_drafter,
    load_sts,
    resolve_estimator,
)
from dspark_jax.models.fingerprint import weights_fingerprint
from dspark_jax.models.qwen3 import Qwen3, Qwen3Config
from dspark_jax.tokenizer import TOKENIZER_FILENAME, Tokenizer

__all__ = ["LoadedDrafter", "LoadedTarget", "load_drafter_dir", "load_target"]


@dataclasses.dataclass
class LoadedTarget:
    """A target model read from its directory; ``params`` are device arrays."""

    module: Qwen3
    params: Any
    config: Qwen3Config
    tokenizer: Tokenizer
    path: str
    # The device mesh the weights were read onto (None: one device). Decoders built for
    # this target run on it (``SpeculativeDecoder(mesh=...)``).
    mesh: Any = None

    @functools.cached_property
    def fingerprint(self) -> str:
        """``models.fingerprint.weights_fingerprint`` of these weights (what a drafter
        trained against them records, and is checked against when loaded)."""
        return weights_fingerprint(self.params)


@dataclasses.dataclass
class LoadedDrafter:
    """A drafter read from its directory for one target; ``survival_estimator`` says where
    its survivals come from (``models.drafter_io.SURVIVAL_ESTIMATORS``) and ``sts`` is that
    estimate's calibration (``sts.json`` or ``sts_draft_probability.json``; None without
    the file)."""

    label: str
    module: Any
    params: Any
    path: str | None = None
    sts: STS | None = None
    survival_estimator: str = "confidence_head"

    @property
    def calibration(self) -> STS:
        """``sts``, or the identity map (T = 1, b = 0) for the same estimator: what the
        decoder and the engine take as ``sts=``."""
        if self.sts is not None:
            return self.sts
        g = self.draft_len
        return STS(np.ones(g, np.float32), np.zeros(g, np.float32), self.survival_estimator)

    @property
    def config(self):
        return self.module.config

    @property
    def draft_len(self) -> int:
        return self.module.config.draft_len

    @property
    def has_confidence(self) -> bool:
        return bool(self.module.config.has_confidence)


def load_target(
    target_dir: str | os.PathLike,
    dtype=None,
    *,
    mesh=None,
    check_tokenizer: bool = True,
    flag: str | None = "--target",
    drafter_flag: str | None = "--drafter",
) -> LoadedTarget:
    """The target in ``target_dir``; ``dtype`` casts the weights (None: the config's
    ``param_dtype``). ``check_tokenizer``: refuse a tokenizer with more ids than the
    target's vocabulary here (the serving engine checks it itself, after the drafter).
    A drafter directory given as the target is refused by name (``flag``: the option it
    was given as, ``drafter_flag``: the one it belongs to; None where there is none).
    ``mesh``: read the weights straight onto that device mesh, sharded by the logical-axis
    rules, each process reading only its devices' blocks (``convert.hf_mesh``); None: the
    whole model through host memory onto the default device."""
    d = Path(target_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"target directory {d} does not exist")
    if is_drafter_dir(d):
        raise drafter_dir_error(d, flag, drafter_flag)
    for name in ("config.json", TOKENIZER_FILENAME):
        if not (d / name).is_file():
            raise FileNotFoundError(f"target directory {d} has no {name}")
    tokenizer = Tokenizer(d)
    if mesh is not None:
        from dspark_jax.convert.hf_mesh import hf_dir_fingerprint, load_hf_to_mesh

        config, params = load_hf_to_mesh(d, mesh, dtype=dtype)
        loaded = LoadedTarget(
            Qwen3(config), params, config, tokenizer, os.fspath(target_dir), mesh=mesh
        )
        loaded.fingerprint = hf_dir_fingerprint(d)  # from the files, not a gathered table
    else:
        config, params = load_hf(d, dtype=dtype)
        loaded = None
    if check_tokenizer and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer in {d} has {tokenizer.vocab_size} ids but the target's vocabulary "
            f"has {config.vocab_size}: they were not trained together"
        )
    if loaded is not None:
        return loaded
    params = jax.tree.map(jax.numpy.asarray, params)
    return LoadedTarget(Qwen3(config), params, config, tokenizer, os.fspath(target_dir))


def load_drafter_dir(
    drafter_dir: str | os.PathLike,
    target: LoadedTarget | Qwen3Config,
    label: str | None = None,
    survival_estimator: str | None = None,
) -> LoadedDrafter:
    """The drafter in ``drafter_dir`` for ``target``, with the calibration of its survival
    estimate (``survival_estimator``: None or ``auto`` picks the confidence head where the
    drafter has one, else the draft probability; ``models.drafter_io.resolve_estimator``). A
    :class:`LoadedTarget` is checked by its shapes and its weights' fingerprint (a drafter
    trained against another checkpoint of the same architecture is refused); a bare
    ``Qwen3Config`` by its shapes only. A target read onto a mesh has its drafter read
    onto the same mesh, block by block (``load_drafter(mesh=)``)."""
    path = os.fspath(drafter_dir)
    if isinstance(target, LoadedTarget):
        module, params = load_drafter(path, target.config, target.fingerprint, mesh=target.mesh)
    else:
        module, params = load_drafter(path, target)
    drafter = LoadedDrafter(label or Path(path).name, module, params, path)
    estimator = resolve_estimator(
        survival_estimator, drafter.has_confidence, f"drafter {path} ({drafter.config.kind})"
    )
    drafter.survival_estimator = estimator
    drafter.sts = load_sts(path, drafter.draft_len, estimator)
    return drafter
