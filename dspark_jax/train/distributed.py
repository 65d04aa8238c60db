"""Multi-process start and per-host data for training on a pod or several GPU hosts.

JAX is multi-controller: the same ``train.py`` runs once per host (process), every process
sees all devices of the mesh, and each feeds only its own devices' rows of the global
batch. This module holds the pieces the loop needs for that:

* :func:`initialize` / :func:`finalize` (re-exported from ``dspark_jax.distributed``,
  which every entry point shares): the multi-process start from flags, environment
  variables or JAX's cluster detection, and the common end.
* :class:`HostShardedIterator`: the data is split into ``data.num_shards`` *logical* shards
  (grain's strided record sharding); process ``i`` of ``P`` reads shards
  ``[i·S/P, (i+1)·S/P)`` and concatenates their rows into its share of the global batch.
  With a fixed ``S`` the global batch is the same whatever the number of processes, so a
  checkpoint written by P processes resumes on P' processes (any ``P'`` dividing ``S``)
  with the same data order: :func:`restore_host_iterator` reads every process's iterator
  file of the checkpoint and picks the shards this process now owns.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

# The process start is shared with every decoding entry point (dspark_jax/distributed.py).
from dspark_jax.distributed import (  # noqa: E402, F401
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    finalize,
    initialize,
    is_main_process,
    resolve_settings,
)


# ----------------------------------------------------------------------------------------
# Logical data shards
# ----------------------------------------------------------------------------------------
def resolve_num_shards(num_shards: int | None, process_count: int, batch_size: int) -> int:
    """``data.num_shards`` (0/None = one shard per process), checked against the topology."""
    s = int(num_shards or 0) or process_count
    if s < 1:
        raise ValueError(f"data.num_shards must be >= 0, got {num_shards}")
    if s % process_count:
        raise ValueError(
            f"data.num_shards = {s} is not divisible by the number of processes "
            f"{process_count}; use a multiple of every process count you run on"
        )
    if batch_size % s:
        raise ValueError(
            f"data.batch_size = {batch_size} is not divisible by data.num_shards = {s}"
        )
    return s


def owned_shards(num_shards: int, process_index: int, process_count: int) -> list[int]:
    per = num_shards // process_count
    return list(range(process_index * per, (process_index + 1) * per))


class HostShardedIterator:
    """This process's rows of every global batch: its logical shards' batches, concatenated.

    ``make_iterator(batch_size, shard_index, shard_count)`` is the task's checkpointable
    (grain) iterator factory. ``get_state`` returns JSON bytes (grain's Orbax handler writes
    them as this process's file); the state lists every owned shard by index.
    """

    def __init__(
        self,
        make_iterator: Callable[[int, int, int], Any],
        local_batch_size: int,
        num_shards: int,
        process_index: int,
        process_count: int,
    ):
        self.num_shards = num_shards
        self.shards = owned_shards(num_shards, process_index, process_count)
        per = local_batch_size // len(self.shards)
        self._its = {j: make_iterator(per, j, num_shards) for j in self.shards}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(self._its[j]) for j in self.shards]
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts], axis=0) for k in parts[0]}

    def get_state(self) -> bytes:
        states = {str(j): self._its[j].get_state() for j in self.shards}
        return json.dumps({"num_shards": self.num_shards, "shards": states}).encode()

    def set_state(self, state: bytes | str | dict) -> None:
        if isinstance(state, (bytes, str)):
            state = json.loads(state)
        self.set_shard_states(state)

    def set_shard_states(self, state: dict[str, Any]) -> None:
        if "shards" not in state:  # a plain grain state (written without this wrapper)
            if len(self.shards) != 1:
                raise ValueError(
                    "the checkpoint's data-iterator state holds one shard, but this process "
                    f"reads {len(self.shards)} shards (data.num_shards = {self.num_shards})"
                )
            state = {"num_shards": self.num_shards, "shards": {str(self.shards[0]): state}}
        if state["num_shards"] != self.num_shards:
            raise ValueError(
                f"the checkpoint was written with data.num_shards = {state['num_shards']}, but "
                f"this run uses {self.num_shards}; resume with "
                f"--config.data.num_shards={state['num_shards']}"
            )
        missing = [j for j in self.shards if str(j) not in state["shards"]]
        if missing:
            raise ValueError(f"the checkpoint has no data-iterator state for shard(s) {missing}")
        for j in self.shards:
            self._its[j].set_state(state["shards"][str(j)])

    def start_prefetch(self) -> None:
        for it in self._its.values():
            if hasattr(it, "start_prefetch"):
                it.start_prefetch()


def host_iterator(task, local_batch_size: int, num_shards: int | None) -> HostShardedIterator:
    """The training iterator of ``task`` for this process (see :class:`HostShardedIterator`)."""
    import jax

    p, n = jax.process_index(), jax.process_count()
    s = resolve_num_shards(num_shards, n, local_batch_size * n)
    return HostShardedIterator(task.train_iterator, local_batch_size, s, p, n)


def host_eval_batches(task, local_batch_size: int, num_batches: int, num_shards: int | None):
    """Held-out batches for this process, from the same logical shards as training."""
    import jax

    p, n = jax.process_index(), jax.process_count()
    s = resolve_num_shards(num_shards, n, local_batch_size * n)
    shards = owned_shards(s, p, n)
    per = local_batch_size // len(shards)
    lists = [task.eval_batches(per, num_batches, j, s) for j in shards]
    if len(lists) == 1:
        return lists[0]
    return [
        {k: np.concatenate([b[k] for b in group], axis=0) for k in group[0]}
        for group in zip(*lists)
    ]


def restore_host_iterator(checkpoint_dir: str, step: int, iterator: HostShardedIterator) -> None:
    """Restore ``iterator`` from the data item of checkpoint ``step``, whatever the number of
    processes that wrote it: every ``process_*-of-*.json`` file is read and merged, and this
    process takes the shards it owns now (the files live on the shared checkpoint storage).
    """
    data_dir = os.path.join(checkpoint_dir, str(step), "data")
    files = sorted(glob.glob(os.path.join(data_dir, "process_*-of-*.json")))
    if not files:
        raise FileNotFoundError(
            f"checkpoint {os.path.join(checkpoint_dir, str(step))} has no data-iterator state "
            f"(expected {data_dir}/process_*-of-*.json)"
        )
    merged: dict[str, Any] = {}
    num_shards = None
    for path in files:
        with open(path) as f:
            state = json.load(f)
        if "shards" not in state:  # written without the wrapper: one shard per process
            name = os.path.basename(path)[len("process_") : -len(".json")]
            idx, _, count = name.partition("-of-")
            state = {"num_shards": int(count), "shards": {idx: state}}
        if num_shards is not None and state["num_shards"] != num_shards:
            raise ValueError(f"inconsistent data.num_shards across the files in {data_dir}")
        num_shards = state["num_shards"]
        merged.update(state["shards"])
    iterator.set_shard_states({"num_shards": num_shards, "shards": merged})
    iterator.start_prefetch()
