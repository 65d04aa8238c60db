"""JAX's persistent compilation cache, on by default for the server (fast restarts).

Every executable the serving engine compiles at start-up (prefill buckets × rows, verify
buckets) is written to ``$XDG_CACHE_HOME/dspark_jax/jax_cache`` (default ``~/.cache``);
a later start with the same models, shapes, JAX version and device reads them back
instead of compiling. The cache is keyed by JAX on the program and the compile options,
so a stale entry is never used for a different program.

One exception is refused: a multi-process run on the CPU backend (several processes whose
collectives go over gloo, as the multi-process tests run). On jax 0.12.1 an executable with
cross-process collectives that such a process loads from the persistent cache never
completes them: every process waits in its first collective forever, whichever process
count or layout wrote the entry (the cache key already holds the device assignment, so
entries of another layout are never loaded; a hit of the same layout hangs too, and so
does one process hitting while another compiles). Executables without collectives load
fine, and jax 0.10.2 is not affected. :func:`disable_where_unsafe` turns the cache off
for such runs; ``train/distributed.initialize`` calls it, so no multi-process CPU run of
this project can hang on it, whatever ``JAX_COMPILATION_CACHE_DIR`` says.
"""

from __future__ import annotations

import os

import jax

__all__ = [
    "default_compile_cache_dir",
    "disable_where_unsafe",
    "enable_compile_cache",
    "unsafe_reason",
]


def default_compile_cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "dspark_jax", "jax_cache")


def unsafe_reason(platform: str | None = None, process_count: int | None = None) -> str | None:
    """Why this process must not use the persistent compilation cache, or None."""
    platform = platform or jax.default_backend()
    process_count = jax.process_count() if process_count is None else process_count
    if process_count > 1 and platform == "cpu":
        return (
            f"the persistent compilation cache is off in this {process_count}-process CPU "
            "run: a cached executable with cross-process collectives never completes them "
            "there (jax 0.12), so every process would hang in its first collective"
        )
    return None


def disable_where_unsafe() -> str | None:
    """Turn JAX's persistent compilation cache off if :func:`unsafe_reason` says so (call
    after ``jax.distributed.initialize`` and before anything compiles); returns the
    reason, or None when the cache may stay as configured."""
    reason = unsafe_reason()
    if reason is not None:
        jax.config.update("jax_enable_compilation_cache", False)
        # JAX decides once per process whether the cache is in use; make it decide again.
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()
    return reason


def enable_compile_cache(path: str | os.PathLike | None = None) -> str | None:
    """Use ``path`` (default ``default_compile_cache_dir()``) as JAX's persistent
    compilation cache for every executable of this process; returns the directory, or
    None where :func:`unsafe_reason` keeps the cache off."""
    if unsafe_reason() is not None:
        disable_where_unsafe()
        return None
    path = os.fspath(path or default_compile_cache_dir())
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot use {path} as the compilation cache: {e}") from None
    if not os.access(path, os.W_OK):
        raise ValueError(f"cannot use {path} as the compilation cache: it is not writable")
    jax.config.update("jax_compilation_cache_dir", path)
    # Cache everything: the small CPU programs compile in well under JAX's default 1 s
    # threshold, yet dozens of them make up the start-up time.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
