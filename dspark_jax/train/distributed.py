"""Multi-process start and per-host data for training on a pod or several GPU hosts.

JAX is multi-controller: the same ``train.py`` runs once per host (process), every process
sees all devices of the mesh, and each feeds only its own devices' rows of the global
batch. This module holds the pieces the loop needs for that:

* :func:`initialize`: ``jax.distributed.initialize`` from explicit flags
  (``--coordinator HOST:PORT --num-processes N --process-id I``), from environment variables
  (``JAX_COORDINATOR_ADDRESS`` — read by JAX itself — plus ``JAX_NUM_PROCESSES`` /
  ``JAX_PROCESS_ID``, read here), or from JAX's cluster auto-detection (Cloud TPU, Slurm,
  Open MPI, Kubernetes) when ``--distributed`` is given without details. On CPU the
  cross-process collectives are gloo (TCP).
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
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np

ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"  # JAX's own variable


def _env_int(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {text!r}") from None


def _check_address(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"coordinator address must be HOST:PORT (e.g. 10.0.0.2:1234), got {address!r}"
        )


def resolve_settings(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    auto: bool = False,
) -> dict[str, Any] | None:
    """The keyword arguments for ``jax.distributed.initialize``, or ``None`` (single process).

    Flags win over environment variables. ``auto`` (``--distributed``) with nothing else
    set returns ``{}``: JAX then detects the cluster (Cloud TPU metadata, Slurm, Open MPI,
    Kubernetes). A coordinator without a process count/id is an error (except under
    ``auto``, where detection may fill them in).
    """
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    if coordinator is None and num_processes is None and process_id is None:
        return {} if auto else None
    if coordinator is not None:
        _check_address(coordinator)
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"--num-processes must be >= 1, got {num_processes}")
    if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
        raise ValueError(
            f"--process-id must be in [0, {num_processes - 1}] for --num-processes "
            f"{num_processes}, got {process_id}"
        )
    if not auto:
        missing = [
            flag
            for flag, value in (
                ("--coordinator", coordinator),
                ("--num-processes", num_processes),
                ("--process-id", process_id),
            )
            if value is None
        ]
        if missing:
            raise ValueError(
                f"multi-process start needs --coordinator, --num-processes and --process-id "
                f"(or {ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}); missing "
                f"{missing}. Use --distributed alone to auto-detect a TPU/Slurm/MPI cluster."
            )
    out: dict[str, Any] = {}
    if coordinator is not None:
        out["coordinator_address"] = coordinator
    if num_processes is not None:
        out["num_processes"] = num_processes
    if process_id is not None:
        out["process_id"] = process_id
    return out


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    auto: bool = False,
    initialization_timeout: int = 300,
) -> bool:
    """Start the JAX distributed runtime if a multi-process run is configured.

    Must run before any JAX computation. Returns True when initialised. A one-process
    "cluster" (``--num-processes 1``) is valid and initialises too (useful to test the path).
    """
    import jax

    settings = resolve_settings(coordinator, num_processes, process_id, auto)
    if settings is None:
        return False
    # CPU processes exchange collectives over TCP with gloo (the JAX default since 0.5, set
    # explicitly so an environment override of the default cannot silently disable it).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(initialization_timeout=initialization_timeout, **settings)
    # Before anything compiles: a multi-process CPU run would hang on a cached executable's
    # collectives (compile_cache's docstring says why).
    from dspark_jax.compile_cache import disable_where_unsafe

    reason = disable_where_unsafe()
    if reason is not None:
        logging.getLogger(__name__).warning("%s", reason)
    return True


def finalize() -> None:
    """End a multi-process run in step: every process waits at a barrier until all have
    finished (their last checkpoint writes included), then leaves the distributed runtime.
    Left to interpreter exit, process 0 can tear down the coordination service while
    another process still has a request in flight, and the gRPC server then aborts
    process 0 (seen once in CI, jax 0.10.2: ``Check failed: queue.Pop() == nullptr`` in
    ``DistributedRuntimeService::Shutdown``). Nothing to do in a one-process run."""
    import jax

    if jax.process_count() <= 1:
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("dspark_jax.train.distributed.finalize")
    jax.distributed.shutdown()


def is_main_process() -> bool:
    import jax

    return jax.process_index() == 0


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
