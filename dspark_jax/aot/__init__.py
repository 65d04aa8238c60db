"""Ahead-of-time compilation of the full-size training step / serving round (DESIGN §4).

Nothing is allocated: parameters, optimizer state, frozen target and batch are
``jax.ShapeDtypeStruct`` carrying their ``NamedSharding``; ``jax.jit(...).lower(...)
.compile()`` builds the SPMD executable for the mesh and ``compiled.memory_analysis()``
gives the *per-device* sizes XLA planned:

* ``argument``: every input shard (trainable params + optimizer state + frozen params +
  batch), ``output``: the outputs, ``alias``: outputs written in place of donated inputs
  (the training state is donated, so it is not counted twice), ``temp``: activations,
  gradients and other scratch live during the step;
* ``peak ≈ argument + output − alias + temp`` (+ generated code): what must fit in HBM.

Two compilers:

* **XLA:TPU for a named topology** (``--aot-topology v5p:2x2x1``): with ``libtpu`` installed
  (``pip install -e '.[tpu]'``, the version ``jax[tpu]`` pins), ``topology_devices(name)``
  gives the devices of a TPU slice this host does not have, through
  ``jax.experimental.topologies``; the mesh is built on them and XLA:TPU compiles and plans
  memory exactly as on the pod. Nothing concrete may be created on such a mesh, so the code
  paths here build abstract values only (``ShapeDtypeStruct``, ``jax.eval_shape``).
* **XLA:CPU with fake devices** (the fallback): ``configure_devices(N)``
  (``--aot-devices N``) makes the CPU backend expose N devices before JAX starts, so a
  64-chip mesh compiles on a laptop. The CPU compiler's fusion/scheduling differs from
  TPU/GPU, so ``temp`` is an estimate (typically within tens of percent);
  parameter/optimizer/argument bytes are exact since they follow the shardings.

Every report says which compiler produced it (``compiler``, ``topology``).
"""

from dspark_jax.aot.cli import aot_mesh, run_cli, serve_configs
from dspark_jax.aot.memory import (
    GB,
    abstract_tree,
    format_report,
    global_bytes,
    memory_fields,
    per_device_bytes,
)
from dspark_jax.aot.serve_round import compile_serve_round
from dspark_jax.aot.topology import (
    compiler_info,
    configure_devices,
    libtpu_version,
    parse_mesh,
    topology_devices,
)
from dspark_jax.aot.train_step import (
    abstract_batch,
    abstract_frozen,
    aot_task,
    compile_train_step,
)

__all__ = [
    "GB",
    "abstract_batch",
    "abstract_frozen",
    "abstract_tree",
    "aot_mesh",
    "aot_task",
    "compile_serve_round",
    "compile_train_step",
    "compiler_info",
    "configure_devices",
    "format_report",
    "global_bytes",
    "libtpu_version",
    "memory_fields",
    "parse_mesh",
    "per_device_bytes",
    "run_cli",
    "serve_configs",
    "topology_devices",
]
