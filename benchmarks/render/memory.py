"""Memory pages: ahead-of-time per-device memory for the 4B / 8B / 14B configs (fake CPU
devices and XLA:TPU), and the decode state against the KV page pool."""

from __future__ import annotations

import pathlib

from . import common


def aot(results: pathlib.Path) -> list[str]:
    path = results / "aot_memory.md"
    return common.included(path, "python benchmarks/aot_memory.py") if path.is_file() else []


def aot_tpu(results: pathlib.Path) -> list[str]:
    out = []
    for path in sorted(results.glob("aot_memory_*.md")):
        chip = path.stem.removeprefix("aot_memory_")
        out += common.included(path, f"python benchmarks/aot_memory.py --tpu {chip}")
    return out


def kv(results: pathlib.Path) -> list[str]:
    path = results / "kv_memory.md"
    return common.included(path, common.command_of(path)) if path.is_file() else []


def serve_fit(results: pathlib.Path) -> list[str]:
    path = results / "serve_fit.md"
    return common.included(path, common.command_of(path)) if path.is_file() else []
