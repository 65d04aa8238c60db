"""A roofline cost model of compiled programs (DESIGN §9).

``time = max(flops / peak_flops, bytes / hbm_bandwidth)`` per chip, with flops and bytes
from XLA's own cost analysis of the compiled executable (``compiled.cost_analysis()``: for
an SPMD program these are per device). XLA counts a while-loop body once, so the target's
layer scan must be unrolled (``Qwen3Config.scan_layers=False``) before the figures mean
anything; ``while_loops`` lists the loops that remain (e.g. the γ-step sequential-head
scan, whose body is then counted once) so a report can say what it undercounts.

XLA does not see inside a Pallas kernel: the TPU ragged-paged-attention custom call counts
for almost nothing in its cost analysis. ``kernel_attention_cost`` models what that kernel
moves and computes (each slot's pages up to its length once per layer, its queries and
outputs; QKᵀ and AV), and the roofline adds it once per call found in the program
(``ragged_attention_calls``), reported apart from XLA's own figures.

The *floor* is what a round cannot avoid: read every weight once, each slot's KV cache and
drafter context up to its length once, and run the matmul flops of the tokens verified
(``decode_round_floor``). The ratio of XLA's bytes to the floor is what a kernel or layout
change can win; ``bytes_by_op`` names the largest producers of bytes in the program.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any


@dataclasses.dataclass(frozen=True)
class Chip:
    """Public per-chip peak figures (dense bf16 matmul throughput, HBM bandwidth, HBM)."""

    name: str
    bf16_tflops: float
    hbm_gb_per_s: float
    hbm_gb: float
    source: str

    def seconds(self, flops: float, bytes_accessed: float) -> float:
        return max(flops / (self.bf16_tflops * 1e12), bytes_accessed / (self.hbm_gb_per_s * 1e9))


# Vendor spec sheets (per chip; TPU figures are per chip of the named generation).
CHIPS: dict[str, Chip] = {
    c.name: c
    for c in (
        Chip("v5e", 197.0, 819.0, 16.0, "https://cloud.google.com/tpu/docs/v5e"),
        Chip("v5p", 459.0, 2765.0, 95.0, "https://cloud.google.com/tpu/docs/v5p"),
        Chip("v6e", 918.0, 1640.0, 32.0, "https://cloud.google.com/tpu/docs/v6e"),
        Chip("H100", 989.0, 3350.0, 80.0, "https://www.nvidia.com/en-us/data-center/h100/"),
        Chip("H200", 989.0, 4800.0, 141.0, "https://www.nvidia.com/en-us/data-center/h200/"),
    )
}


def chip_for_topology(topology: str) -> Chip:
    """``v5p:2x2x1`` -> the v5p figures."""
    family = topology.split(":", 1)[0].lower()
    for name, chip in CHIPS.items():
        if name.lower() == family:
            return chip
    raise ValueError(f"no chip figures for {topology!r}; known: {sorted(CHIPS)}")


def cost_of(compiled) -> dict[str, float]:
    """``{"flops", "bytes"}`` of a compiled executable (XLA's cost analysis, per device)."""
    ca = compiled.cost_analysis()
    if isinstance(ca, list | tuple):  # older jax: one dict per partition
        ca = ca[0]
    if not ca or "flops" not in ca:
        raise ValueError("this backend's compiler reports no cost analysis")
    return {"flops": float(ca["flops"]), "bytes": float(ca.get("bytes accessed", 0.0))}


# -- the compiled program's HLO -----------------------------------------------------------
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z][\w\-]*)\(", re.M)
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]+)"')


def _shape_bytes(type_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        size = _DTYPE_BYTES.get(dtype)
        if size is None:
            continue
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * size
    return total


_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")


def bytes_by_op(hlo_text: str, top: int = 12) -> dict[str, Any]:
    """Output bytes of the instructions that write memory (those of the entry computation
    and of loop bodies, not the instructions inside a fusion, which stay in registers),
    summed by opcode, plus the ``top`` largest with their source op names. Output bytes
    are what an instruction writes; a fusion's reads are its operands' writes."""
    by_kind: Counter = Counter()
    largest: list[tuple[int, str, str]] = []
    inside_fusion = False
    for line in hlo_text.splitlines():
        c = _COMPUTATION.match(line)
        if c:
            # Bodies of fusions (fused_computation.N), wrapped ops and reducers (region_N).
            inside_fusion = c.group(2).startswith(("fused", "wrapped", "region"))
            continue
        if inside_fusion:
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        type_text, opcode = m.groups()
        if opcode in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast"):
            continue
        b = _shape_bytes(type_text)
        if not b:
            continue
        by_kind[opcode] += b
        src = _OP_NAME.search(line)
        largest.append((b, opcode, src.group(1) if src else ""))
    largest.sort(reverse=True)
    return {
        "by_opcode": dict(by_kind.most_common()),
        "largest": [{"bytes": b, "opcode": op, "op_name": name} for b, op, name in largest[:top]],
    }


def ragged_attention_calls(hlo_text: str) -> int:
    """Calls of the TPU ragged-paged-attention kernel in the program (one per layer when
    the layer scan is unrolled)."""
    return sum(
        1
        for line in hlo_text.splitlines()
        if 'custom_call_target="tpu_custom_call"' in line and "ragged_paged_attention" in line
    )


def kernel_attention_cost(
    target, *, slots: int, rows: int, context_len: int, page_size: int, tensor: int,
    dtype_bytes: int = 2, queries_per_row: int = 1,
) -> dict[str, float]:  # fmt: skip
    """Modelled HBM bytes and flops per chip of one ragged-paged-attention call: every
    slot's KV pages up to ``context_len`` read once (whole pages), ``rows`` query rows read
    and written; QKᵀ and AV over ``context_len`` keys. Heads split over ``tensor`` chips
    (replicated when they do not divide). ``queries_per_row``: query positions folded into
    a row's heads (a drafted block, ``ops.paged_attention.block_attention``: γ). A slot
    whose query rows straddle two of the kernel's query blocks is read twice; that is not
    counted."""
    kv_heads = target.num_key_value_heads
    heads = target.num_attention_heads * queries_per_row
    if kv_heads % tensor == 0 and heads % tensor == 0:
        kv_heads, heads = kv_heads // tensor, heads // tensor
    pages = -(-context_len // page_size)
    kv = slots * pages * page_size * 2 * kv_heads * target.head_dim * dtype_bytes
    qo = 2 * rows * heads * target.head_dim * dtype_bytes
    return {
        "bytes": float(kv + qo),
        "flops": float(4 * rows * context_len * heads * target.head_dim),
    }


def while_loops(hlo_text: str) -> int:
    """Number of while loops left in the program (their bodies are counted once)."""
    return len(re.findall(r"\bwhile\(", hlo_text))


# -- what a decode round must do ----------------------------------------------------------
def round_floor_bytes(per_device: dict[str, int], context_fraction: float = 1.0) -> dict:
    """Bytes per chip a decode round cannot avoid: every weight once, and each slot's KV
    cache and drafter context once up to its length (``context_fraction`` of ``max_len``).
    ``per_device``: the AOT report's per-device sizes (``dspark_jax/aot/``), which follow the
    real shardings."""
    kv = per_device["kv_cache_bytes"] * context_fraction
    ctx = (per_device["state_bytes"] - per_device["kv_cache_bytes"]) * context_fraction
    parts = {
        "target_weights": float(per_device["target_bytes"]),
        "kv_cache": float(kv),
        "drafter_weights": float(per_device["drafter_bytes"]),
        "drafter_context": float(ctx),
    }
    return {"bytes": sum(parts.values()), "parts": parts}


# HBM passes of one row's hidden state per all-reduce that XLA:TPU leaves in HBM: the
# row-parallel matmul (o_proj, down_proj; the vocabulary-split embedding) writes its partial
# sums, the all-reduce reads and writes them, the residual-add + norm fusion reads the sum.
ALLREDUCE_PASSES = 4


def allreduce_activation_bytes(all_reduces: int, rows: int, width: int, dtype_bytes=2) -> float:
    """Bytes per chip that ``all_reduces`` all-reduces of a ``[rows, width]`` activation
    held in HBM (``perf.hlo_bytes.hbm_all_reduces``) move: ``ALLREDUCE_PASSES`` passes of
    it each. Every tensor-parallel chip moves all of it for every row however small its
    weight share. A sequence-parallel layout moves as much: its reduce-scatter reads the
    full partial sums and its all-gather writes the full rows (only the norms and residual
    adds in between shrink to 1/tensor of the rows)."""
    return float(all_reduces * ALLREDUCE_PASSES * rows * width * dtype_bytes)


def _layer_flops(c, rows: int, context_len: int) -> float:
    """One Qwen3 decoder layer on ``rows`` tokens attending to ``context_len`` keys."""
    d, h, kvh, hd = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    proj = 2 * rows * d * (2 * h * hd + 2 * kvh * hd)
    mlp = 2 * rows * d * 3 * c.intermediate_size
    attn = 4 * rows * context_len * h * hd  # QKᵀ and AV
    return float(proj + mlp + attn)


def target_forward_flops(c, rows: int, context_len: int) -> float:
    """Hand count of the target's forward on ``rows`` tokens (LM head included)."""
    return c.num_hidden_layers * _layer_flops(c, rows, context_len) + 2.0 * rows * (
        c.hidden_size * c.vocab_size
    )


def round_flops_hand_count(
    target, drafter, *, slots: int, budget: int, context_len: int
) -> dict[str, float]:
    """Hand count of one fused decode round's flops (whole program, all chips together):
    the target verifying ``B = slots + budget`` tokens, and the drafter drafting γ tokens
    for every slot (its layers over the γ block tokens against the context, the shared LM
    head on every draft row, the Markov/RNN head's rank-r factor) plus its context rows
    for the ``B`` verified positions: the feature projection (``fc``; MTP-1's ``eh_proj``
    over hidden and next-token embedding) and every draft layer's K/V projection.
    Elementwise work is left out."""
    b = slots + budget
    out = {"target": target_forward_flops(target, b, context_len)}
    if drafter is not None:
        g = drafter.draft_len
        rows = slots * g
        d, v = target.hidden_size, target.vocab_size
        layers = drafter.resolved_num_layers
        draft = layers * _layer_flops(target, rows, context_len + g)
        lm_head = 2.0 * rows * d * v
        rank = getattr(drafter, "head_rank", 0) or 0
        head = 2.0 * rows * rank * v
        proj_in = drafter.feature_width(target) + (0 if drafter.uses_taps else d)
        kv_out = 2 * target.num_key_value_heads * target.head_dim
        ctx_proj = 2.0 * b * proj_in * d + layers * 2.0 * b * d * kv_out
        out.update(drafter_layers=draft, drafter_lm_head=lm_head, drafter_head=head,
                   drafter_context=ctx_proj)  # fmt: skip
    out["total"] = float(sum(out.values()))
    return out


__all__ = [
    "CHIPS",
    "Chip",
    "bytes_by_op",
    "chip_for_topology",
    "cost_of",
    "kernel_attention_cost",
    "ragged_attention_calls",
    "round_floor_bytes",
    "round_flops_hand_count",
    "target_forward_flops",
    "while_loops",
]
