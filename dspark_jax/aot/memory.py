"""Per-device byte accounting of abstract trees and compiled programs, the fit against a
device's memory, and the report's text."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np

from dspark_jax import sharding as shd

GB = 1e9  # device memory is quoted in decimal GB (95 GB v5p, 141 GB H200)


# ----------------------------------------------------------------------------------------
# Byte accounting
# ----------------------------------------------------------------------------------------
def per_device_bytes(tree: Any) -> int:
    """Bytes one device holds of a tree of sharded arrays / ``ShapeDtypeStruct``s (the
    largest shard, i.e. what the most loaded device stores)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            shape = sharding.shard_shape(shape)
        total += math.prod(shape) * _itemsize(leaf.dtype)
    return int(total)


def _itemsize(dtype) -> int:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):  # typed PRNG keys: 2 x uint32
        return 8
    return np.dtype(dtype).itemsize


def global_bytes(tree: Any) -> int:
    return int(sum(math.prod(x.shape) * _itemsize(x.dtype) for x in jax.tree.leaves(tree)))


def param_count(tree: Any) -> int:
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def memory_fields(compiled) -> dict[str, int]:
    """Per-device sizes from ``compiled.memory_analysis()`` and the peak estimate."""
    m = compiled.memory_analysis()
    if m is None:
        raise ValueError("this backend's compiler reports no memory analysis")
    out = {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
        "code_bytes": int(m.generated_code_size_in_bytes),
    }
    out["peak_bytes"] = (
        out["argument_bytes"]
        + out["output_bytes"]
        - out["alias_bytes"]
        + out["temp_bytes"]
        + out["code_bytes"]
    )
    return out


def with_fit(report: dict[str, Any], device_memory_gb: float | None) -> dict[str, Any]:
    if device_memory_gb:
        report["device_memory_gb"] = float(device_memory_gb)
        report["fits"] = bool(report["memory"]["peak_bytes"] <= device_memory_gb * GB)
    return report


def abstract_tree(boxed_tree, mesh):
    """Unboxed ``ShapeDtypeStruct``s with the rules-table shardings of a boxed abstract tree."""
    sh = shd.param_shardings(boxed_tree, mesh)
    plain = shd.unboxed(boxed_tree)  # not nn.unbox: see shd.unboxed
    return (
        jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), plain, sh),
        sh,
    )


def _gb(b: int) -> str:
    return f"{b / GB:8.2f} GB"


def format_report(report: dict[str, Any]) -> str:
    where = report.get("topology") or f"{report['num_devices']} devices"
    lines = [
        f"AOT {report['kind']} by {report.get('compiler', 'XLA')}: mesh {report['mesh']} "
        f"({where}); lower {report['lower_s']:.1f}s, compile {report['compile_s']:.1f}s",
        "per device:",
    ]
    for k, v in report["per_device"].items():
        lines.append(f"  {k:<18}{_gb(v)}")
    for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "peak_bytes"):
        lines.append(f"  {k:<18}{_gb(report['memory'][k])}")
    if "fits" in report:
        verdict = "fits" if report["fits"] else "DOES NOT FIT"
        lines.append(f"  {verdict} in {report['device_memory_gb']:.0f} GB per device")
    return "\n".join(lines)
