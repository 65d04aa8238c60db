"""JAX's persistent compilation cache, on by default for the server (fast restarts).

Every executable the serving engine compiles at start-up (prefill buckets × rows, verify
buckets) is written to ``$XDG_CACHE_HOME/dspark_jax/jax_cache`` (default ``~/.cache``);
a later start with the same models, shapes, JAX version and device reads them back
instead of compiling. The cache is keyed by JAX on the program and the compile options,
so a stale entry is never used for a different program.
"""

from __future__ import annotations

import os

import jax

__all__ = ["default_compile_cache_dir", "enable_compile_cache"]


def default_compile_cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "dspark_jax", "jax_cache")


def enable_compile_cache(path: str | os.PathLike | None = None) -> str:
    """Use ``path`` (default ``default_compile_cache_dir()``) as JAX's persistent
    compilation cache for every executable of this process; returns the directory."""
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
