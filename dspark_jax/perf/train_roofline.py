"""A roofline of the drafter training step on a TPU slice (issue 48).

The decode roofline (``perf.roofline``) models one serving round; this module does the same
for ``train.py``'s training step, compiled by XLA:TPU for a named topology
(``dspark_jax.aot``), with every loop unrolled so that XLA's cost analysis counts every layer
(``unrolled_scans``: the frozen target's layer scan, the draft layers' blocked attention
over key chunks). Per chip:

* **flops**: XLA's count of the compiled step plus the frozen target's causal attention,
  which runs in the Pallas splash kernel on TPU (a custom call: XLA counts nothing inside
  it) and is modelled here (``splash_cost``: the 512 × 512 blocks on or below the
  diagonal, one call per target layer found in the program);
* **bytes**: XLA's bytes accessed plus the kernel's modelled reads and writes;
* **collectives**: every all-gather, reduce-scatter, all-reduce, all-to-all and
  collective-permute of the program (``collective_bytes``), at the bytes a ring
  algorithm sends per chip: all-gather and all-to-all ``out·(n-1)/n``, reduce-scatter
  ``out·(n-1)``, all-reduce ``2·out·(n-1)/n``, collective-permute ``out``, with ``n`` the
  replica group's size and ``out`` the logical (untiled) output bytes;
* **modelled step time** ``= max(flops / peak, bytes / HBM bandwidth) + collective bytes /
  ICI bandwidth``: the collectives are *not* assumed to overlap compute (a bound from
  above; XLA:TPU's async collectives overlap most of the FSDP all-gathers in practice);
* **MFU** ``= useful flops / (peak × modelled time)`` per chip, where useful flops are the
  hand count (``train_flops_hand_count``): the frozen target's forward (all of its layers:
  the drafter's labels are the target's distribution after its last layer, so nothing past
  the last tap can be skipped), the drafter's forward and backward, the LM head at the
  label rows (target and drafter), the Markov head, with no recomputation counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from collections import Counter
from typing import Any

from dspark_jax.perf.roofline import _shape_bytes, chip_for_topology

# Inter-chip interconnect bandwidth per chip (Google Cloud TPU system-architecture pages:
# v5e 1,600 Gbps, v5p 4,800 Gbps, v6e 3,584 Gbps per chip), in GB/s.
ICI_GB_PER_S = {"v5e": 200.0, "v5p": 600.0, "v6e": 448.0}
ICI_SOURCE = "https://cloud.google.com/tpu/docs/system-architecture-tpu-vm"

# The splash kernel's blocks (ops.flash_attention._splash: min(512, T)).
SPLASH_BLOCK = 512

# XLA's count of the elementwise work of the DSpark loss per label logit (softmaxes of the
# drafter's and the target's logits, the L1 and CE terms, their backward), and of the
# optimizer per trainable parameter (AdamW moments, bias correction, update, gradient
# clipping's norm). Measured once on XLA:CPU (tests/perf/test_train_roofline.py); both are
# small next to the matmuls at real sizes (< 1 % of the 8B step).
LOSS_FLOPS_PER_LOGIT = 40
OPT_FLOPS_PER_PARAM = 20


# ----------------------------------------------------------------------------------------
# Hand count
# ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepShape:
    """One training step's shape: global batch ``batch`` sequences of ``seq_len`` tokens,
    ``anchors`` draft blocks of ``gamma`` labels per sequence, ``pack`` sequences per packed
    attention group (``drafter.pack_sequences``)."""

    batch: int
    seq_len: int
    anchors: int
    gamma: int
    pack: int = 1

    @property
    def label_rows(self) -> int:
        return self.batch * self.anchors * self.gamma


def causal_pairs(seq_len: int, attention: str) -> float:
    """Query-key pairs one sequence's causal self-attention computes: ``splash`` the
    ``SPLASH_BLOCK``-square blocks on or below the diagonal, ``causal`` the exact
    triangle, ``xla`` every query against the keys padded to whole ``XLA_BLOCK`` blocks
    (``ops.flash_attention.blocked_attention`` scores masked pairs too)."""
    t = seq_len
    if attention == "xla":
        from dspark_jax.ops.flash_attention import XLA_BLOCK

        blk = min(XLA_BLOCK, t)
        return float(t * (-(-t // blk) * blk))
    if attention == "causal":
        return t * (t + 1) / 2.0
    if attention == "splash":
        blk = min(SPLASH_BLOCK, t)
        nb = -(-t // blk)
        return nb * (nb + 1) / 2.0 * blk * blk
    raise ValueError(f"attention must be splash, causal or xla, got {attention!r}")


def _proj_flops(c) -> float:
    """Matmul flops per token of one Qwen3 layer's q, k, v, o projections."""
    return (
        2.0 * c.hidden_size * (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * (c.head_dim)
    )


def _mlp_flops(c) -> float:
    return 6.0 * c.hidden_size * c.intermediate_size


def train_flops_hand_count(
    target, drafter, shape: StepShape, *, target_attention: str = "causal",
    drafter_attention_passes: float = 3.0, trainable_params: int = 0,
) -> dict[str, float]:  # fmt: skip
    """Flops of one DSpark/DFlash training step, whole program (all chips together).

    ``target``: the frozen target's ``Qwen3Config``; ``drafter``: the resolved
    ``DrafterConfig`` (its layers have the target's widths). Matmuls count ``2·m·n·k``;
    a weight's backward is two matmuls (input and weight gradients), one where only the
    weight's gradient is needed (the context projection ``fc``, whose input is the frozen
    target's features; the first draft layer's q/k/v, whose input is the frozen
    embedding) or only the input's (the frozen LM head). ``drafter_attention_passes``:
    3 for forward + backward; 4 when the backward recomputes the scores (the blocked path's
    ``jax.checkpoint``), which is what XLA executes but not useful work.
    ``target_attention``: the pairs counted for the target's causal attention
    (``causal_pairs``). ``trainable_params``: the drafter's, for the optimizer's term.
    """
    c = target
    d, v = c.hidden_size, c.vocab_size
    heads_dim = c.num_attention_heads * c.head_dim
    kv_dim = c.num_key_value_heads * c.head_dim
    tokens = shape.batch * shape.seq_len
    rows = shape.label_rows
    layers_t = c.num_hidden_layers
    layers_d = drafter.resolved_num_layers
    out: dict[str, float] = {}
    out["target_layers"] = tokens * layers_t * (_proj_flops(c) + _mlp_flops(c))
    out["target_attention"] = (
        4.0 * heads_dim * layers_t * shape.batch * causal_pairs(shape.seq_len, target_attention)
    )
    out["target_lm_head_at_labels"] = 2.0 * rows * d * v
    taps = len(drafter.taps) if drafter.uses_taps else 1
    out["drafter_fc"] = 2.0 * (2.0 * tokens * taps * d * d)  # forward + weight gradient
    out["drafter_context_kv"] = 3.0 * layers_d * tokens * 2.0 * d * 2 * kv_dim
    first_qkv_dx = 2.0 * rows * d * (heads_dim + 2 * kv_dim)
    out["drafter_block_layers"] = (
        3.0 * layers_d * rows * (_proj_flops(c) + _mlp_flops(c)) - first_qkv_dx
    )
    keys = shape.pack * shape.seq_len + shape.gamma  # every context key of the group is scored
    out["drafter_attention"] = drafter_attention_passes * layers_d * 4.0 * rows * keys * heads_dim
    out["drafter_lm_head"] = 2.0 * (2.0 * rows * d * v)  # forward + input gradient
    rank = getattr(drafter, "head_rank", 0) or 0
    out["drafter_markov_head"] = 3.0 * 2.0 * rows * rank * v if rank else 0.0
    out["loss_elementwise"] = float(LOSS_FLOPS_PER_LOGIT * rows * v)
    out["optimizer"] = float(OPT_FLOPS_PER_PARAM * trainable_params)
    out["total"] = float(sum(out.values()))
    return out


def useful_flops(parts: dict[str, float], shape: StepShape, target, drafter) -> float:
    """The hand count's useful work: the parts with the target's attention at the exact
    causal triangle and the drafter's attention at forward + backward (3 passes)."""
    c = target
    heads_dim = c.num_attention_heads * c.head_dim
    keys = shape.pack * shape.seq_len + shape.gamma
    attn_t = (
        4.0 * heads_dim * c.num_hidden_layers * shape.batch * causal_pairs(shape.seq_len, "causal")
    )
    attn_d = 3.0 * drafter.resolved_num_layers * 4.0 * shape.label_rows * keys * heads_dim
    skip = ("target_attention", "drafter_attention", "total")
    return float(sum(v for k, v in parts.items() if k not in skip) + attn_t + attn_d)


# ----------------------------------------------------------------------------------------
# The compiled program: collectives and kernels
# ----------------------------------------------------------------------------------------
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*(.+?)\s+"
    r"(all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\((.*)$",
    re.M,
)
_ARRAY_TYPE = re.compile(r"\b[a-z]\w*\[[\d,]*\]")
_MESH_GROUP = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_IOTA_GROUP = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_LIST_GROUP = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]+)"')


def _group_size(line: str, num_devices: int) -> int:
    m = _MESH_GROUP.search(line)
    if m:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        axes = re.findall(r"'(\w+)'", m.group(2))
        return math.prod(int(sizes[a]) for a in axes if a in sizes) or 1
    m = _IOTA_GROUP.search(line)
    if m:
        return int(m.group(2))
    m = _LIST_GROUP.search(line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    return num_devices


def _ici_bytes(kind: str, out: int, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind in ("all-gather", "all-to-all"):
        return out * (n - 1) / n
    if kind == "reduce-scatter":
        return float(out * (n - 1))
    if kind == "all-reduce":
        return 2.0 * out * (n - 1) / n
    return float(out)  # collective-permute


def collective_bytes(hlo_text: str, num_devices: int, top: int = 8) -> dict[str, Any]:
    """Bytes each chip sends over ICI for the program's collectives (see the module
    docstring), by kind and by JAX name scope, with the ``top`` largest single collectives.
    Every instance in the text counts once: the program must have no loops doing model
    work (unroll them first), so each collective runs once per step."""
    by_kind: Counter = Counter()
    count: Counter = Counter()
    by_scope: Counter = Counter()
    by_dtype: Counter = Counter()
    gathers_as_all_reduce = 0.0
    largest = []
    for m in _COLLECTIVE.finditer(hlo_text):
        type_text, kind, start, rest = m.groups()
        arrays = _ARRAY_TYPE.findall(type_text)
        if start:  # an async start returns (operands..., results...): the results count
            arrays = arrays[len(arrays) // 2 :]
        # A combined (variadic) collective returns one array per operand: all of them count.
        out = sum(_shape_bytes(a) for a in arrays)
        b = _ici_bytes(kind, out, _group_size(rest, num_devices))
        if not b:
            continue
        by_kind[kind] += b
        count[kind] += 1
        for a in arrays:
            by_dtype[a.split("[")[0]] += b * _shape_bytes(a) / out
        name = _OP_NAME.search(rest)
        operands = rest.split(")", 1)[0]
        if kind == "all-reduce" and "dynamic-update-slice" in operands:
            # XLA:TPU's all-gather written as an all-reduce of each chip's shard placed in
            # zeros (dynamic-update-slice): twice an all-gather's ring bytes.
            gathers_as_all_reduce += b
        scope = _scope(name.group(1)) if name else _operand_scope(operands)
        by_scope[scope] += b
        largest.append((b, kind, name.group(1) if name else operands[:120]))
    largest.sort(key=lambda x: -x[0])
    return {
        "total": float(sum(by_kind.values())),
        "by_kind": {k: float(v) for k, v in by_kind.most_common()},
        "count": dict(count),
        "by_dtype": {k: float(v) for k, v in by_dtype.most_common()},
        "gathers_as_all_reduce": gathers_as_all_reduce,
        "by_scope": {k: float(v) for k, v in by_scope.most_common(top)},
        "largest": [{"bytes": b, "kind": k, "op_name": n} for b, k, n in largest[:top]],
    }


def _operand_scope(operands: str) -> str:
    """A name for a collective without a JAX name: the kinds of its operands."""
    kinds = sorted({re.sub(r"[.\d]+$", "", o) for o in re.findall(r"%([\w.\-]+)", operands)})
    return "(unnamed: " + ", ".join(kinds[:4]) + ")"


def _scope(op_name: str, depth: int = 5) -> str:
    """A readable JAX name scope: ``jit(train_step)/`` and transform wrappers dropped."""
    parts = [p for p in op_name.split("/") if not p.startswith("jit(")]
    return "/".join(parts[:depth])


def splash_calls(hlo_text: str) -> int:
    """Calls of the splash-attention kernel (Pallas ``tpu_custom_call``) in the program."""
    return sum(
        1
        for line in hlo_text.splitlines()
        if 'custom_call_target="tpu_custom_call"' in line and "splash" in line.lower()
    )


def splash_cost(target, *, sequences: int, seq_len: int, dtype_bytes: int = 2) -> dict:
    """Modelled flops and HBM bytes of one splash-attention forward call over ``sequences``
    sequences (per chip): ``causal_pairs(..., "splash")`` pairs per query head (QKᵀ and AV),
    each query block reading its K/V blocks up to the diagonal (per query head: GQA heads
    re-read their shared K/V), Q read and O written once."""
    c = target
    t, blk = seq_len, min(SPLASH_BLOCK, seq_len)
    nb = -(-t // blk)
    heads = c.num_attention_heads
    pairs = causal_pairs(t, "splash")
    flops = 4.0 * sequences * heads * c.head_dim * pairs
    kv_blocks = nb * (nb + 1) / 2.0
    kv = sequences * heads * kv_blocks * blk * 2 * c.head_dim * dtype_bytes
    qo = 2.0 * sequences * t * heads * c.head_dim * dtype_bytes
    return {"flops": float(flops), "bytes": float(kv + qo)}


def largest_instructions(hlo_text: str, top: int = 10, hbm_only: bool = True) -> list[dict]:
    """The ``top`` executed instructions that move the most bytes (``perf.hlo_bytes``'s
    per-instruction estimate; HBM only by default), with their JAX name."""
    from dspark_jax.perf import hlo_bytes as hb

    comps = hb.parse_hlo(hlo_text)
    rows = []
    for comp in hb._executed(comps):
        for instr in comp.instrs:
            b = hb.instruction_bytes(comps, comp, instr, hbm_only)
            if b:
                name = _OP_NAME.search(instr.line)
                rows.append((b, instr.opcode, name.group(1) if name else "(unnamed)"))
    rows.sort(key=lambda r: -r[0])
    return [{"bytes": float(b), "opcode": op, "op_name": n} for b, op, n in rows[:top]]


# ----------------------------------------------------------------------------------------
# Compile and model
# ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def unrolled_scans():
    """Every ``jax.lax.scan`` traced inside is fully unrolled (``unroll=True``), so the
    compiled program has no loop whose body XLA's cost analysis would count once."""
    import jax

    original = jax.lax.scan

    def scan(f, init, xs=None, length=None, reverse=False, unroll=1, **kw):
        return original(f, init, xs, length=length, reverse=reverse, unroll=True, **kw)

    jax.lax.scan = scan
    try:
        yield
    finally:
        jax.lax.scan = original


def compile_unrolled(cfg, mesh):
    """``(aot report, compiled)`` of ``cfg``'s training step on ``mesh`` with the frozen
    target's layers and every scan unrolled (``train_cost.model_loops`` must then be
    empty)."""
    from dspark_jax import aot

    task = aot.aot_task(cfg)
    read = task._read_target_config
    task._read_target_config = lambda: read().replace(scan_layers=False)
    with unrolled_scans():
        return aot.compile_train_step(cfg, mesh, task=task)


def step_shape(cfg, drafter) -> StepShape:
    return StepShape(
        batch=int(cfg.data.batch_size),
        seq_len=int(cfg.data.seq_len),
        anchors=int(cfg.drafter.anchors_per_seq),
        gamma=int(drafter.gamma),
        pack=int(cfg.drafter.get("pack_sequences", 1)),
    )


def train_roofline(cfg, mesh, chip_name: str) -> dict[str, Any]:
    """Compile ``cfg``'s training step for ``mesh`` (unrolled) and model it
    (``analyse``). ``chip_name``: ``v5p``, ``v5e`` ... (peak, HBM and ICI figures)."""
    from dspark_jax.perf.roofline import cost_of

    report, compiled = compile_unrolled(cfg, mesh)
    return analyse(cfg, int(mesh.size), dict(mesh.shape), chip_name, compiled.as_text(),
                   cost_of(compiled), report)  # fmt: skip


def analyse(
    cfg, chips: int, mesh_shape: dict, chip_name: str, hlo: str, xla: dict, report: dict
) -> dict[str, Any]:
    """The roofline (module docstring) of a compiled unrolled step: its optimised HLO text
    ``hlo``, XLA's cost ``xla`` (``{"flops", "bytes"}`` per chip) and the AOT ``report``."""
    from dspark_jax import aot
    from dspark_jax.perf.train_cost import model_loops

    loops = model_loops(hlo)
    task = aot.aot_task(cfg)
    target, drafter = task.frozen_config(), task.drafter_config
    shape = step_shape(cfg, drafter)
    chip = chip_for_topology(chip_name)
    ici = ICI_GB_PER_S[chip.name]
    calls = splash_calls(hlo)
    kernel = {"flops": 0.0, "bytes": 0.0}
    if calls:
        # Each call is one target layer over this chip's sequences (batch split over chips).
        per_chip_seqs = max(1, shape.batch // chips)
        one = splash_cost(target, sequences=per_chip_seqs, seq_len=shape.seq_len)
        kernel = {k: calls * v for k, v in one.items()}
    blocked = shape.pack * shape.seq_len > _key_chunk()
    hand = train_flops_hand_count(
        target, drafter, shape,
        target_attention="splash" if calls else "xla",
        drafter_attention_passes=4.0 if blocked else 3.0,
        trainable_params=int(report["trainable_params"]),
    )  # fmt: skip
    useful = useful_flops(hand, shape, target, drafter)
    coll = collective_bytes(hlo, chips)
    flops = xla["flops"] + kernel["flops"]
    bytes_ = xla["bytes"] + kernel["bytes"]
    t_flops = flops / (chip.bf16_tflops * 1e12)
    t_bytes = bytes_ / (chip.hbm_gb_per_s * 1e9)
    t_coll = coll["total"] / (ici * 1e9)
    t_step = max(t_flops, t_bytes) + t_coll
    mfu = useful / chips / (chip.bf16_tflops * 1e12 * t_step)
    # Were the gathers written as all-reduces real all-gathers: half their ring bytes.
    t_coll_ag = (coll["total"] - coll["gathers_as_all_reduce"] / 2) / (ici * 1e9)
    t_step_ag = max(t_flops, t_bytes) + t_coll_ag
    largest = largest_instructions(hlo, top=10)
    hbm_total = _hbm_total(hlo) + kernel["bytes"]
    return {
        "chips": chips,
        "mesh": mesh_shape,
        "chip": dataclasses.asdict(chip),
        "ici_gb_per_s": ici,
        "shape": dataclasses.asdict(shape),
        "target_layers": target.num_hidden_layers,
        "drafter_layers": drafter.resolved_num_layers,
        "loops_left": len(loops),
        "splash_calls": calls,
        "per_chip": {
            "xla_flops": xla["flops"],
            "xla_bytes": xla["bytes"],
            "kernel_flops": kernel["flops"],
            "kernel_bytes": kernel["bytes"],
            "flops": flops,
            "bytes": bytes_,
            "hbm_bytes_estimate": hbm_total,
            "hand_flops": hand["total"] / chips,
            "useful_flops": useful / chips,
            "collective_bytes": coll["total"],
        },
        "hand_count": {k: v / chips for k, v in hand.items()},
        "flops_vs_hand": flops / (hand["total"] / chips),
        "seconds": {
            "flops": t_flops,
            "bytes": t_bytes,
            "collectives": t_coll,
            "step": t_step,
            "collectives_gathers_as_all_gather": t_coll_ag,
            "step_gathers_as_all_gather": t_step_ag,
        },
        "mfu_gathers_as_all_gather": useful / chips / (chip.bf16_tflops * 1e12 * t_step_ag),
        "unnamed_hbm_bytes_by_opcode": unnamed_by_opcode(hlo),
        "bound": "compute" if t_flops >= t_bytes else "memory",
        "mfu": mfu,
        "collectives": coll,
        "largest_instructions": largest,
        "largest_share_of_hbm_bytes": (largest[0]["bytes"] / hbm_total) if largest else 0.0,
        "bytes_by_scope": _scopes(hlo),
        "memory": report.get("memory"),
        "compile_s": report.get("compile_s"),
    }


def unnamed_by_opcode(hlo_text: str, top: int = 8) -> dict[str, float]:
    """HBM bytes of the executed instructions that carry no JAX name (XLA's own: the
    collectives' buffers, zero-filled broadcasts, prefetch copies), summed by opcode."""
    from dspark_jax.perf import hlo_bytes as hb

    comps = hb.parse_hlo(hlo_text)
    out: Counter = Counter()
    for comp in hb._executed(comps):
        for instr in comp.instrs:
            if 'op_name="' in instr.line:
                continue
            b = hb.instruction_bytes(comps, comp, instr, True)
            if b:
                out[instr.opcode] += b
    return {k: float(v) for k, v in out.most_common(top)}


def _key_chunk() -> int:
    from dspark_jax.models import backbone

    return backbone.KEY_CHUNK


def _hbm_total(hlo: str) -> float:
    from dspark_jax.perf.hlo_bytes import bytes_by_scope

    return float(bytes_by_scope(hlo, hbm_only=True)["total"])


def _scopes(hlo: str) -> dict[str, float]:
    from dspark_jax.perf.hlo_bytes import bytes_by_scope

    return {
        k: float(v)
        for k, v in bytes_by_scope(hlo, depth=5, top=12, hbm_only=True)["by_scope"].items()
    }


__all__ = [
    "ICI_GB_PER_S",
    "StepShape",
    "causal_pairs",
    "collective_bytes",
    "compile_unrolled",
    "largest_instructions",
    "splash_calls",
    "splash_cost",
    "step_shape",
    "train_flops_hand_count",
    "train_roofline",
    "analyse",
    "unnamed_by_opcode",
    "unrolled_scans",
    "useful_flops",
]
