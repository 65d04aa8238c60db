"""Orbax checkpointing of the training state and the data-iterator state (DESIGN §4).

One ``CheckpointManager`` per workdir (``<workdir>/checkpoints/<step>``), three items:

* ``state``: :class:`TrainState` as a pytree (``StandardSave``/``StandardRestore``),
  restored straight into an abstract *sharded* target, so each device reads only its shard;
* ``data``: the grain iterator (grain's own Orbax handler: one JSON file per process,
  written during the blocking part of ``save``, i.e. before the loop advances the iterator);
* ``meta``: JSON (model config, task name, tokens seen) used to refuse a mismatched resume.

Saves are asynchronous and atomic (Orbax writes a temporary directory and renames it), so
killing the process at any moment leaves the last *finished* checkpoint intact.
"""

from __future__ import annotations

import os
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

_STATE, _DATA, _META = "state", "data", "meta"


def path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """``{path: shape}`` of every leaf of ``tree`` that has a shape (arrays, abstract
    values, Orbax metadata)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_str(p): tuple(x.shape) for p, x in leaves if hasattr(x, "shape")}


def first_shape_mismatch(have: dict, want: dict) -> tuple[str, str] | None:
    """The first difference between two ``flat_shapes``: ``("missing", key)`` (in ``want``,
    not ``have``), ``("shape", key)`` or ``("extra", key)``; parameters first, their names
    being the most informative. None when they agree."""
    for key in sorted(want, key=lambda k: (not k.startswith("params"), k)):
        if key not in have:
            return "missing", key
        if have[key] != want[key]:
            return "shape", key
    extra = sorted(set(have) - set(want))
    return ("extra", extra[0]) if extra else None


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` with the items above."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, use_async: bool = True):
        self.directory = os.path.abspath(os.fspath(directory))
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                create=True,
                enable_async_checkpointing=use_async,
                cleanup_tmp_directories=True,
            ),
            item_handlers={
                _STATE: ocp.StandardCheckpointHandler(),
                _DATA: grain.checkpoint.CheckpointHandler(),
                _META: ocp.JsonCheckpointHandler(),
            },
        )

    # -- queries ----------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def meta(self, step: int) -> dict[str, Any]:
        out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out[_META])

    def check_compatible(self, step: int, abstract_state: Any) -> None:
        """Raise ``ValueError`` naming the first leaf whose saved shape/structure differs.

        Reads only the checkpoint's metadata (no arrays), so a wrong workdir fails fast and
        with a readable message instead of an Orbax shape error deep in restore.
        """
        saved_flat = flat_shapes(self.manager.item_metadata(step)[_STATE])
        want_flat = flat_shapes(abstract_state)
        where = os.path.join(self.directory, str(step))
        found = first_shape_mismatch(saved_flat, want_flat)
        if found is None:
            return
        problem, key = found
        head = f"Checkpoint {where} does not match the configured model: "
        advice = "Use another --workdir or the config the checkpoint was trained with."
        if problem == "missing":
            raise ValueError(
                f"{head}it has no parameter '{key}' (shape {want_flat[key]} in the config). "
                + advice
            )
        if problem == "shape":
            raise ValueError(
                f"{head}parameter '{key}' has shape {saved_flat[key]} in the checkpoint but "
                f"{want_flat[key]} in the config. " + advice
            )
        raise ValueError(
            f"{head}it has parameter '{key}' (shape {saved_flat[key]}) that the config does "
            "not define."
        )

    # -- save / restore ---------------------------------------------------------------
    def save(self, step: int, state: Any, data_iterator: Any, meta: dict[str, Any]) -> None:
        args = {_STATE: ocp.args.StandardSave(state), _META: ocp.args.JsonSave(meta)}
        if data_iterator is not None:
            args[_DATA] = grain.checkpoint.CheckpointSave(data_iterator)
        self.manager.save(step, args=ocp.args.Composite(**args), force=True)

    def restore(self, step: int, abstract_state: Any, data_iterator: Any = None) -> Any:
        """Restore the state into ``abstract_state`` (``ShapeDtypeStruct`` with shardings);
        when ``data_iterator`` is given its position is restored in place."""
        args = {_STATE: ocp.args.StandardRestore(abstract_state)}
        if data_iterator is not None:
            args[_DATA] = grain.checkpoint.CheckpointRestore(data_iterator)
        out = self.manager.restore(step, args=ocp.args.Composite(**args))
        return out[_STATE]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def tree_bytes(tree: Any) -> int:
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
