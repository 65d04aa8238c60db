"""Tables of the training-step roofline (``benchmarks/train_roofline.py``)."""

from __future__ import annotations

from typing import Any


def case_line(res: dict[str, Any]) -> str:
    pc, s = res["per_chip"], res["seconds"]
    return (
        f"{res['case']}: {pc['flops'] / 1e12:.2f} TFLOP/chip (x{res['flops_vs_hand']:.3f} hand), "
        f"{pc['bytes'] / 1e9:.1f} GB, coll {pc['collective_bytes'] / 1e9:.2f} GB; "
        f"step {s['step'] * 1e3:.1f} ms (flops {s['flops'] * 1e3:.1f}, bytes "
        f"{s['bytes'] * 1e3:.1f}, ici {s['collectives'] * 1e3:.1f}); MFU {res['mfu']:.3f}"
    )


def cost_table(cases: dict[str, Any]) -> dict[str, Any]:
    return {}


def to_markdown(res: dict[str, Any]) -> str:
    return "\n".join(case_line(c) for c in res["cases"].values()) + "\n"
