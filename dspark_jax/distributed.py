"""Several processes, one program: the multi-controller start every entry point shares.

JAX runs a slice larger than one host (a TPU pod slice, several GPU hosts) as one process
per host, each running the same program on its own devices of one global mesh. Training
(``train.py``) and everything that decodes (``serve.py``, ``python -m dspark_jax.eval``,
``data.distill``, ``generate``) start that way through this module:

* :func:`add_arguments` / :func:`initialize_from_args`: ``--distributed``,
  ``--coordinator HOST:PORT``, ``--num-processes N``, ``--process-id I``, or the
  environment variables ``JAX_COORDINATOR_ADDRESS`` (read by JAX itself),
  ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, or JAX's own cluster detection (Cloud TPU,
  Slurm, Open MPI, Kubernetes) with ``--distributed`` alone. On CPU the cross-process
  collectives are gloo (TCP).
* :func:`finalize`: every process leaves together.
* The processes' host-side agreement goes through JAX's coordination service (its
  key-value store, which process 0 hosts): :func:`broadcast_bytes` (a value process 0
  decided, e.g. a timed SPS table), :func:`check_same` (every process started with the
  same models, mesh and settings, or an error naming what differs).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

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
    heartbeat_timeout: int | None = None,
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
    if heartbeat_timeout is not None:  # how long the coordination service waits for a
        settings["heartbeat_timeout_seconds"] = heartbeat_timeout  # silent process
    # Every process must compile the same program, down to its debug metadata: jax 0.12's
    # CPU collectives only meet across processes when the modules' fingerprints match, and
    # by default each op's location carries the whole Python stack it was traced from, which
    # differs where one process traces in a thread (the server's leader) and another in its
    # main thread (a follower); they then wait on each other forever. Only the innermost
    # frame (the model code, the same everywhere) is kept. Shown by a two-process repro:
    # the same jitted sum, called from stacks of different depth, hangs with full
    # tracebacks and completes without.
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
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

    multihost_utils.sync_global_devices("dspark_jax.distributed.finalize")
    jax.distributed.shutdown()


def finalize_if_started() -> None:
    """:func:`finalize` when this process started the distributed runtime (and has not
    left it); nothing otherwise (JAX is not even imported)."""
    import sys

    if "jax" not in sys.modules:
        return
    import jax

    if jax.distributed.is_initialized():
        finalize()


def is_main_process() -> bool:
    import jax

    return jax.process_index() == 0


def process_index() -> int:
    import jax

    return jax.process_index()


def process_count() -> int:
    import jax

    return jax.process_count()


# ----------------------------------------------------------------------------------------
# Flags
# ----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser, what: str = "run") -> None:
    """The multi-process flags (as ``train.py`` takes them)."""
    g = parser.add_argument_group(f"multi-process (multi-host) {what}")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize(); without the flags below JAX auto-detects "
        "the cluster (Cloud TPU, Slurm, Open MPI, Kubernetes)",
    )
    g.add_argument("--coordinator", help="HOST:PORT of process 0 (or JAX_COORDINATOR_ADDRESS)")
    g.add_argument("--num-processes", type=int, help="number of processes (or JAX_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, help="this process, 0..N-1 (or JAX_PROCESS_ID)")


def initialize_from_args(args: argparse.Namespace, **kwargs) -> bool:
    """:func:`initialize` from the flags of :func:`add_arguments` (absent flags: none)."""
    return initialize(
        getattr(args, "coordinator", None),
        getattr(args, "num_processes", None),
        getattr(args, "process_id", None),
        bool(getattr(args, "distributed", False)),
        **kwargs,
    )


# ----------------------------------------------------------------------------------------
# Host-side agreement through the coordination service's key-value store
# ----------------------------------------------------------------------------------------
def kv_client():
    """JAX's coordination-service client (None in a one-process run). Its key-value store
    is hosted by process 0; every process reaches it over the coordinator's gRPC channel."""
    from jax._src import distributed as jax_distributed

    return jax_distributed.global_state.client


def broadcast_bytes(key: str, value: bytes | None, timeout_s: float = 600.0) -> bytes:
    """Process 0's ``value`` on every process (``value`` is ignored elsewhere). ``key``
    must be unique to this exchange. One process: ``value`` itself."""
    client = kv_client()
    if client is None or process_count() <= 1:
        return value
    key = f"dspark/broadcast/{key}"
    if process_index() == 0:
        client.key_value_set_bytes(key, value)
        return value
    return client.blocking_key_value_get_bytes(key, int(timeout_s * 1000))


_exchanges: dict[str, int] = {}


def broadcast_json(name: str, value: Any, timeout_s: float = 600.0) -> Any:
    """Process 0's JSON-able ``value`` on every process. Every process calls it for the
    same ``name`` in the same order (the n-th call of a name on one process meets the n-th
    on the others), so a name may be used again."""
    n = _exchanges.get(name, 0)
    _exchanges[name] = n + 1
    data = json.dumps(value).encode() if process_index() == 0 else None
    return json.loads(broadcast_bytes(f"{name}/{n}", data, timeout_s))


def on_leader(name: str, fn, timeout_s: float = 600.0) -> Any:
    """``fn()`` run by process 0 alone, its JSON-able result (or the ``ValueError`` it
    raised, raised again) on every process: a decision from files only process 0 reads
    and writes (the output of an offline job), so no process decides differently."""
    outcome = None
    if process_index() == 0:
        try:
            outcome = {"value": fn()}
        except ValueError as e:
            outcome = {"error": str(e)}
        if process_count() <= 1:
            if "error" in outcome:
                raise ValueError(outcome["error"])
            return outcome["value"]
    outcome = broadcast_json(name, outcome, timeout_s)
    if "error" in outcome:
        raise ValueError(outcome["error"])
    return outcome["value"]


def to_host(x, rows: slice | None = None):
    """``x`` (or its ``rows``, a slice of its first axis) as a numpy array on this process.
    A ``jax.Array`` spread over other processes' devices is sliced and gathered onto every
    device inside one jitted program, which every process runs (so call this on every
    process, in the same order)."""
    import jax
    import numpy as np

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.sharding import NamedSharding, PartitionSpec

        take = (lambda a: a) if rows is None else (lambda a: a[rows])
        x = jax.jit(take, out_shardings=NamedSharding(x.sharding.mesh, PartitionSpec()))(x)
        return np.asarray(x)
    return np.asarray(x if rows is None else x[rows])


def check_same(what: str, settings: dict[str, Any], timeout_s: float = 600.0) -> None:
    """Every process must run with the same ``settings`` (JSON-able: models, mesh, slots,
    …): each publishes its own, then compares them with process 0's; a difference raises
    ``ValueError`` naming the keys, both values and the process (process 0 checks every
    follower, so both sides of a mismatch fail at start instead of hanging in the first
    collective). One process: nothing to check."""
    client = kv_client()
    n = process_count()
    if client is None or n <= 1:
        return
    me = process_index()
    mine = json.loads(json.dumps(settings, sort_keys=True, default=str))
    client.key_value_set(f"dspark/check/{what}/{me}", json.dumps(mine, sort_keys=True))
    others = range(1, n) if me == 0 else (0,)
    for p in others:
        theirs = json.loads(
            client.blocking_key_value_get(f"dspark/check/{what}/{p}", int(timeout_s * 1000))
        )
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if diff:
            shown = "; ".join(
                f"{k}: process {me} has {mine.get(k)!r}, process {p} has {theirs.get(k)!r}"
                for k in diff[:4]
            )
            raise ValueError(
                f"the processes were started with different {what}: {shown}. Every process "
                "must get the same models, mesh (--data/--tensor) and settings"
            )


__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "add_arguments",
    "broadcast_bytes",
    "broadcast_json",
    "check_same",
    "finalize",
    "finalize_if_started",
    "initialize",
    "initialize_from_args",
    "is_main_process",
    "kv_client",
    "on_leader",
    "process_count",
    "process_index",
    "resolve_settings",
    "to_host",
]
