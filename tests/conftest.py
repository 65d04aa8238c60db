"""Test set-up: 8 fake CPU devices, set before JAX is imported anywhere.

Compiled executables go to a persistent compilation cache in a fresh directory for this
session, so the many tests that build the same tiny models and engines (and their
subprocesses, which inherit the variables) compile each program once. This changes no
behaviour under test: jit's in-memory caches, which the compile-count tests read, are
per process and untouched; only XLA's compile time is saved.
"""

import os
import tempfile

# LLVM's backend optimisation off: the suite compiles hundreds of tiny programs whose run
# time is negligible, so compile time is most of it (20 % less wall time measured on
# tests/serve/test_engine.py); XLA's own HLO passes are unchanged, so are the programs' values.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Keep fp32 matmuls exact enough for parity tests.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="dspark_jax_xla_"))
# Two xdist workers may each load libtpu at once to compile for a TPU topology
# (tests/aot/test_aot_tpu.py, tests/perf/test_train_roofline.py); libtpu's lock file
# refuses the second. The tests never run on TPU chips (JAX_PLATFORMS=cpu), so two loads
# share nothing.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
