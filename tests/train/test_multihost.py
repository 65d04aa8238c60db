"""Real multi-process training on one machine: two processes x 4 fake CPU devices, gloo
collectives, coordinator on 127.0.0.1, versus one process with 8 devices.

Checks: (1) the two-process run logs the same global losses as the one-process run (each
process reads its own logical data shards, metrics only from process 0); (2) a checkpoint
written by two processes resumes in one process and vice versa, continuing the same loss
curve (state restored by Orbax into the new topology, data position from every host's file).

Cost: four 2-process launches plus in-process runs of a tiny model, about a minute on 2 CPU
cores, so it runs in the default suite.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from dspark_jax.config import load_config
from dspark_jax.testing import free_port, stdlib_corpus
from dspark_jax.train import distributed as dist
from dspark_jax.train import read_metrics, train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "tiny", "target_tiny.py")
_STDLIB_FILES = ("abc", "bisect", "colorsys", "copy", "heapq", "keyword", "numbers",
                 "queue", "shlex", "string", "textwrap", "fnmatch", "glob")  # fmt: skip
STEPS = 6


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return stdlib_corpus(tmp_path_factory.mktemp("mh_corpus"), _STDLIB_FILES, heldout_percent=25)


def _overrides(corpus):
    data_dir, tok = corpus
    return [
        ("data.data_dir", data_dir),
        ("data.tokenizer", tok),
        ("data.num_shards", "2"),  # fixed logical shards: same data on 1 or 2 hosts
        ("train.steps", str(STEPS)),
        ("train.checkpoint_every", "3"),
        ("train.eval_every", "0"),
        ("train.eval_batches", "1"),
        ("train.log_every", "1"),
    ]


def _run_two_processes(corpus, workdir: str, cache_dir: str) -> None:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join(
        [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        + ["--xla_force_host_platform_device_count=4"]
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    port = free_port()
    cmd = [sys.executable, "train.py", "--config", TINY, "--workdir", workdir, "--no-progress",
           "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]  # fmt: skip
    cmd += [f"--config.{k}={v}" for k, v in _overrides(corpus)]
    procs = [
        subprocess.Popen(
            cmd + ["--process-id", str(i)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for i in range(2)
    ]
    _wait_all(procs, timeout=300, what="the two-process training run")


def _wait_all(procs, timeout: float, what: str) -> list[tuple[bytes, bytes]]:
    """Each process's (stdout, stderr) once all exited 0; a failure names the process, a
    hang past ``timeout`` fails the test (and SIGKILLs the processes: jax's distributed
    runtime catches SIGTERM)."""
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} hung for {timeout} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i} failed:\n{err.decode()[-4000:]}"
    return outs


def _losses(workdir):
    entries = [m for m in read_metrics(workdir) if m["kind"] == "train"]
    steps = [m["step"] for m in entries]
    assert len(steps) == len(set(steps)), f"a step was logged twice (not only process 0): {steps}"
    return {m["step"]: m["loss"] for m in entries}


def _drop_last_checkpoint(src: str, dst: str) -> None:
    """Copy a finished workdir and delete its final checkpoint: a run 'killed' after step 3."""
    shutil.copytree(src, dst)
    shutil.rmtree(os.path.join(dst, "checkpoints", str(STEPS)))


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("mh_runs")
    cache = str(root / "jax_cache")
    one = str(root / "one_process")
    train(load_config(TINY, _overrides(corpus)), one, progress=False)
    two = str(root / "two_processes")
    _run_two_processes(corpus, two, cache)
    return root, one, two, cache


def test_two_processes_match_one_process(runs):
    _, one, two, _ = runs
    assert jax.process_count() == 1 and len(jax.devices()) == 8
    ref, got = _losses(one), _losses(two)
    assert sorted(ref) == sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(
        [got[s] for s in sorted(got)], [ref[s] for s in sorted(ref)], rtol=0, atol=1e-5
    )
    # Every host saved its own data-iterator position with its shard's state.
    data_dir = os.path.join(two, "checkpoints", str(STEPS), "data")
    files = sorted(f for f in os.listdir(data_dir) if f.startswith("process_"))
    assert files == ["process_0-of-2.json", "process_1-of-2.json"]


@pytest.mark.slow  # 32 s
def test_checkpoint_moves_between_topologies(corpus, runs):
    root, one, two, cache = runs
    ref = _losses(one)

    # Written by two processes, resumed by one (8 devices).
    resumed1 = str(root / "two_then_one")
    _drop_last_checkpoint(two, resumed1)
    summary = train(load_config(TINY, _overrides(corpus)), resumed1, progress=False)
    assert summary["resumed"] and summary["start_step"] == 3
    got = _losses(resumed1)
    np.testing.assert_allclose(
        [got[s] for s in range(4, STEPS + 1)], [ref[s] for s in range(4, STEPS + 1)], atol=1e-5
    )

    # Written by one process, resumed by two.
    resumed2 = str(root / "one_then_two")
    _drop_last_checkpoint(one, resumed2)
    _run_two_processes(corpus, resumed2, cache)
    got = _losses(resumed2)
    assert sorted(got) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(
        [got[s] for s in range(4, STEPS + 1)], [ref[s] for s in range(4, STEPS + 1)], atol=1e-5
    )


_COLLECTIVE_PROGRAM = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from dspark_jax.train import distributed as dist
if len(sys.argv) > 1:
    dist.initialize(sys.argv[1], 2, int(sys.argv[2]))
mesh = jax.make_mesh((8,), ("data",))
x = jax.make_array_from_callback(
    (8, 16), NamedSharding(mesh, P("data")), lambda i: np.ones((1, 16), np.float32)
)
y = jax.jit(lambda x: x + jnp.sum(x * 2.0))(x)  # an all-reduce across every process
print("RESULT", float(np.asarray(y.addressable_data(0))[0, 0]), flush=True)
"""


def _run_collective_program(cache_dir: str, processes: int) -> list[str]:
    env = dict(os.environ)
    devices = 8 // processes
    env["XLA_FLAGS"] = " ".join(
        [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        + [f"--xla_force_host_platform_device_count={devices}"]
    )
    env.update(JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")  # fmt: skip
    port = free_port()
    args = [[]] if processes == 1 else [[f"127.0.0.1:{port}", str(i)] for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _COLLECTIVE_PROGRAM, *a],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        for a in args
    ]
    outs = _wait_all(
        procs, timeout=120, what=f"a {processes}-process run with the compilation cache {cache_dir}"
    )
    return [line for out, _ in outs for line in out.decode().splitlines() if "RESULT" in line]


def test_multiprocess_run_with_a_populated_compile_cache_finishes(tmp_path):
    """A persistent compilation cache written by a one-process run and by an earlier
    two-process run (both collective programs) does not hang the next two-process run.
    On jax 0.12.1 a cached executable with cross-process collectives never completes them
    on the CPU backend, so ``distributed.initialize`` turns the cache off for multi-process
    CPU runs (compile_cache.unsafe_reason); without that, the third run hangs."""
    cache = str(tmp_path / "jax_cache")
    expected = [f"RESULT {1 + 2 * 8 * 16:.1f}"]
    assert _run_collective_program(cache, 1) == expected
    assert _run_collective_program(cache, 2) == expected * 2
    assert _run_collective_program(cache, 2) == expected * 2


def test_compile_cache_is_refused_only_for_multiprocess_cpu():
    from dspark_jax.compile_cache import unsafe_reason

    assert "hang" in unsafe_reason("cpu", 2)
    assert unsafe_reason("cpu", 1) is None
    assert unsafe_reason("tpu", 4) is None
    assert unsafe_reason("gpu", 2) is None


def test_settings_and_shard_checks():
    assert dist.resolve_settings() is None
    assert dist.resolve_settings(auto=True) == {}
    assert dist.resolve_settings("10.0.0.2:1234", 4, 3) == {
        "coordinator_address": "10.0.0.2:1234",
        "num_processes": 4,
        "process_id": 3,
    }
    with pytest.raises(ValueError, match="HOST:PORT"):
        dist.resolve_settings("10.0.0.2", 2, 0)
    with pytest.raises(ValueError, match=r"--process-id must be in \[0, 1\]"):
        dist.resolve_settings("h:1", 2, 2)
    with pytest.raises(ValueError, match="missing.*--process-id"):
        dist.resolve_settings("h:1", 2, None)
    assert dist.owned_shards(8, 1, 4) == [2, 3]
    assert dist.resolve_num_shards(0, 2, 8) == 2
    with pytest.raises(ValueError, match="not divisible by the number of processes"):
        dist.resolve_num_shards(3, 2, 12)
    with pytest.raises(ValueError, match="batch_size = 6 is not divisible by data.num_shards"):
        dist.resolve_num_shards(4, 1, 6)
