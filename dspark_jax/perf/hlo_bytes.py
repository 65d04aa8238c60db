"""Where a compiled program's bytes go: bytes accessed per instruction of the optimised HLO
text, summed by the JAX name scope that emitted it, over every memory space (as XLA's cost
analysis counts) or over HBM only.

XLA's cost analysis gives one total. This module re-derives it per instruction from the
text of the compiled module, with the same rules HloCostAnalysis applies to the things
that dominate a decode round:

* an instruction reads its operands and writes its output;
* a fusion reads of an operand only what its fused computation takes of it: when every use
  of the parameter (through bitcasts, reshapes, copies and nested fusions) is a slice or
  dynamic slice, the bytes of those slices, not the whole buffer (the source of a gather is
  counted whole, as XLA does: the blocked ``xla`` attention's page gathers weigh the pool);
  a parameter that flows whole to a nested fusion's output (a fusion that only bitcasts
  it) is read whole. XLA's own figure misses that read. XLA:TPU reads several weights
  that way in the Qwen3-8B + DSpark serving round (the LM head, by the target and by the
  drafter, 0.31 GB each per chip at tensor = 4; the drafter's ``fc`` and MLP weights), so
  this estimate exceeds XLA's total there by 1.0-1.2 GB per chip
  (``benchmarks/roofline.py``);
* an in-place update (a fusion or instruction whose root is a scatter or dynamic update
  slice into a parameter, whose output aliases that operand) reads and writes the update,
  not the buffer it updates (the paged KV pool is written this way every layer);
* a while loop's body counts its trip count times when that count is static (the
  ``known_trip_count`` XLA records on the loop, or, where XLA:TPU records none, a
  counter from a constant, stepped by 1, compared with a constant: a ``fori_loop`` or
  ``scan`` of static length, such as the drafter's γ-step sampling loop), its condition
  one more time; a loop of unknown count is counted once, as XLA's own figure counts
  every loop (``loop_trips`` lists both kinds).

It is an estimate of XLA's own figure: equal on CPU (``tests/perf/test_roofline.py``), within
40 % at tiny TPU shapes where tile padding and small collectives dominate
(``tests/aot/test_aot_tpu.py``). It is meant for ranking: which scope moves how many bytes, and
how that changes with the round's size. Kernels (custom calls) count nothing, as in XLA's
figure: callers model them separately (``roofline.kernel_attention_cost``).

``hbm_only=True`` counts the traffic to and from HBM alone, which is what a memory-bound
round's time follows: buffers XLA:TPU placed in on-chip VMEM (layout memory space
``S(1)``) count nothing, an asynchronous copy between memory spaces (memory-space
assignment prefetching a weight into VMEM) counts its HBM side once, and a gather the rows
it gathers (``instruction_bytes``).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from dspark_jax.perf.roofline import _DTYPE_BYTES

# An array type with its layout: dtype[dims]{minor_to_major:T(a,b)(c,d)...}.
_TYPED = re.compile(r"\b([a-z]\w*)\[([\d,]*)\](?:\{([\d,]*)(?::([^}]*))?\})?")
_TILE = re.compile(r"T\(([\d,]+)\)")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")


def _on_chip(layout_extra: str) -> bool:
    """Whether a layout names an on-chip memory space (``S(1)`` VMEM, ``S(2)`` sync flags
    ...) rather than the default, HBM (no ``S(...)`` or ``S(0)``)."""
    m = _MEMORY_SPACE.search(layout_extra or "")
    return bool(m) and m.group(1) != "0"


def _array_bytes(type_text: str, hbm_only: bool = False) -> list[int]:
    """Bytes of each array in an HLO type (a tuple lists several), in their tiled layout:
    a TPU layout's first tile ``T(a, b)`` pads the two most minor physical dimensions to
    multiples of ``a`` and ``b``, as XLA:TPU counts them (small arrays are mostly padding
    there). ``hbm_only``: arrays placed in an on-chip memory space count 0."""
    out = []
    for dtype, dims_text, minor_to_major, extra in _TYPED.findall(type_text):
        size = _DTYPE_BYTES.get(dtype)
        if size is None:
            continue
        if hbm_only and _on_chip(extra):
            out.append(0)
            continue
        dims = [int(d) for d in dims_text.split(",") if d]
        tile = _TILE.search(extra or "")
        if tile and minor_to_major and len(dims) >= 1:
            order = [int(d) for d in minor_to_major.split(",") if d]
            t = [int(x) for x in tile.group(1).split(",")]
            for k, multiple in enumerate(reversed(t)):
                if k < len(order):
                    dim = order[k]
                    dims[dim] = -(-dims[dim] // multiple) * multiple
        n = 1
        for d in dims:
            n *= d
        out.append(n * size)
    return out


def _shape_bytes(type_text: str, hbm_only: bool = False) -> int:
    """Bytes of all arrays in an HLO type (``_array_bytes`` summed)."""
    return sum(_array_bytes(type_text, hbm_only))


_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*(.*?)\s*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%([\w.\-]+)")
_CONTROL = re.compile(
    r"\b(?:body|condition|to_apply|true_computation|false_computation)=%([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"\bbody=%([\w.\-]+)")
_SCALAR_CONSTANT = re.compile(r"\bconstant\((-?\d+)\)")
_TUPLE_INDEX = re.compile(r"\bindex=(\d+)")
_CONDITION = re.compile(r"\bcondition=%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]+)"')

_PASS_THROUGH = {"bitcast", "reshape", "copy", "transpose", "convert", "get-tuple-element"}
_SLICES = {"slice", "dynamic-slice"}
_IN_PLACE = {"scatter", "dynamic-update-slice"}
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"}


@dataclass
class _Instr:
    name: str
    type_text: str
    opcode: str
    operands: list[str]
    line: str
    root: bool
    bytes: int = field(init=False)
    hbm_bytes: int = field(init=False)  # the arrays of its output that live in HBM

    def __post_init__(self):
        self.bytes = _shape_bytes(self.type_text)
        self.hbm_bytes = _shape_bytes(self.type_text, hbm_only=True)


@dataclass
class _Computation:
    name: str
    entry: bool
    instrs: list[_Instr]

    def __post_init__(self):
        self.by_name = {i.name: i for i in self.instrs}
        self.users: dict[str, list[_Instr]] = {}
        for i in self.instrs:
            for o in i.operands:
                self.users.setdefault(o, []).append(i)
        self.root = next((i for i in self.instrs if i.root), self.instrs[-1])


def _operand_names(rest: str) -> list[str]:
    """Operand names of an instruction: the ``%names`` inside its argument parentheses."""
    depth, end = 1, len(rest)
    for k, ch in enumerate(rest):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                end = k
                break
    return _OPERAND.findall(rest[:end])


def parse_hlo(text: str) -> dict[str, _Computation]:
    comps: dict[str, _Computation] = {}
    current, entry, instrs = None, False, []
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            current, entry, instrs = h.group(2), bool(h.group(1)), []
            continue
        if current is None:
            continue
        if line.strip() == "}":
            if instrs:
                comps[current] = _Computation(current, entry, instrs)
            current = None
            continue
        m = _INSTR.match(line)
        if m:
            root, name, type_text, opcode, rest = m.groups()
            instrs.append(_Instr(name, type_text, opcode, _operand_names(rest), line, bool(root)))
    return comps


def _executed(comps: dict[str, _Computation]) -> list[_Computation]:
    """The entry computation and those it runs as control flow (loop bodies, branches),
    not fused computations or reducers."""
    entry = [c for c in comps.values() if c.entry]
    seen, order = set(), []
    stack = list(entry)
    while stack:
        c = stack.pop()
        if c.name in seen:
            continue
        seen.add(c.name)
        order.append(c)
        for i in c.instrs:
            if i.opcode == "fusion":
                continue
            names = _CONTROL.findall(i.line)
            b = _BRANCHES.search(i.line)
            if b:
                names += _OPERAND.findall(b.group(1))
            if i.opcode in ("while", "conditional", "call"):
                names += _CALLS.findall(i.line)
            for n in names:
                if n in comps and i.opcode in ("while", "conditional", "call"):
                    stack.append(comps[n])
    return order


def _int_constant(comp: _Computation, name: str) -> int | None:
    """The value of an integer scalar constant ``name`` in ``comp`` (through copies and
    bitcasts), or None."""
    i = comp.by_name.get(name)
    while i is not None and i.opcode in ("copy", "bitcast") and len(i.operands) == 1:
        i = comp.by_name.get(i.operands[0])
    m = _SCALAR_CONSTANT.search(i.line) if i is not None and i.opcode == "constant" else None
    return int(m.group(1)) if m else None


def _counter_index(comp: _Computation, name: str) -> int | None:
    """``k`` when ``name`` is ``get-tuple-element(<comp's parameter>), index=k`` (through
    copies and bitcasts)."""
    i = comp.by_name.get(name)
    while i is not None and i.opcode in ("copy", "bitcast") and len(i.operands) == 1:
        i = comp.by_name.get(i.operands[0])
    if i is None or i.opcode != "get-tuple-element" or not i.operands:
        return None
    src = comp.by_name.get(i.operands[0])
    m = _TUPLE_INDEX.search(i.line)
    return int(m.group(1)) if m and src is not None and src.opcode == "parameter" else None


def trip_count(instr: _Instr, comps: dict[str, _Computation] | None = None,
               comp: _Computation | None = None) -> int | None:  # fmt: skip
    """The static trip count of a while instruction: the ``known_trip_count`` XLA records
    on it (the CPU and GPU compilers do), or, given the computations, the one its shape
    proves (what XLA:TPU leaves unrecorded): a condition ``counter < constant N``, a
    counter that starts from a constant and that the body adds 1 to. None otherwise."""
    m = _TRIP_COUNT.search(instr.line)
    if m:
        return int(m.group(1))
    if comps is None or comp is None:
        return None
    cond_m, body_m = _CONDITION.search(instr.line), _BODY.search(instr.line)
    cond = comps.get(cond_m.group(1)) if cond_m else None
    body = comps.get(body_m.group(1)) if body_m else None
    if cond is None or body is None or not instr.operands:
        return None
    root = cond.root
    if root.opcode != "compare" or "direction=LT" not in root.line or len(root.operands) != 2:
        return None
    k = _counter_index(cond, root.operands[0])
    bound = _int_constant(cond, root.operands[1])
    init = comp.by_name.get(instr.operands[0])
    if k is None or bound is None or init is None or init.opcode != "tuple":
        return None
    start = _int_constant(comp, init.operands[k]) if k < len(init.operands) else None
    if start is None or body.root.opcode != "tuple" or k >= len(body.root.operands):
        return None
    step = body.by_name.get(body.root.operands[k])
    if step is None or step.opcode != "add" or len(step.operands) != 2:
        return None
    a, b = step.operands
    if _counter_index(body, a) != k:
        a, b = b, a
    if _counter_index(body, a) != k or _int_constant(body, b) != 1:
        return None
    return max(0, bound - start)


def _executed_times(comps: dict[str, _Computation]) -> list[tuple[_Computation, int]]:
    """``(computation, times it runs per call of the program)`` for the entry and every
    computation it runs as control flow: a while body its loop's static trip count times
    the loop's own count (the condition once more), a loop of unknown count once; every
    branch of a conditional once (an upper bound: one runs)."""
    times: Counter = Counter()
    stack = [(c.name, 1) for c in comps.values() if c.entry]
    while stack:  # HLO has no recursion: every path ends
        name, n = stack.pop()
        times[name] += n
        for i in comps[name].instrs:
            if i.opcode == "while":
                known = trip_count(i, comps, comps[name])
                body, cond = (1, 1) if known is None else (known, known + 1)
                for pattern, k in ((_BODY, body), (_CONDITION, cond)):
                    m = pattern.search(i.line)
                    if m and m.group(1) in comps:
                        stack.append((m.group(1), n * k))
            elif i.opcode in ("conditional", "call"):
                names = _CONTROL.findall(i.line) + _CALLS.findall(i.line)
                b = _BRANCHES.search(i.line)
                if b:
                    names += _OPERAND.findall(b.group(1))
                stack += [(c, n) for c in names if c in comps]
    return [(comps[name], k) for name, k in times.items()]


def loop_trips(hlo_text: str) -> list[tuple[str, int | None]]:
    """Every executed while loop of a compiled program with its static trip count (None
    where XLA recorded none; such a loop's body is counted once)."""
    comps = parse_hlo(hlo_text)
    return [
        (i.name, trip_count(i, comps, comp))
        for comp, _ in _executed_times(comps)
        for i in comp.instrs
        if i.opcode == "while"
    ]


def _params(comp: _Computation) -> list[_Instr]:
    params = [i for i in comp.instrs if i.opcode == "parameter"]
    return sorted(params, key=lambda i: int(re.search(r"parameter\((\d+)\)", i.line).group(1)))


def _reads_of_param(
    comps, comp: _Computation, name: str, seen=None, gather_rows: bool = False
) -> int | None:
    """Bytes a fused computation reads of parameter ``name``: the slices taken of it when
    every use is a slice (through pass-through ops and nested fusions), 0 when it is only
    the buffer an in-place update writes into, None when it is read whole. With
    ``gather_rows`` the source of a gather counts as the rows gathered (what the memory
    system reads) rather than whole (what XLA's cost analysis counts)."""
    seen = seen or set()
    if name in seen:
        return 0
    seen.add(name)
    if comp.root.name == name:  # flows out whole (e.g. a nested fusion that only bitcasts)
        return None
    total = 0
    for user in comp.users.get(name, []):
        if user.opcode in _SLICES and user.operands[0] == name:
            total += user.bytes
        elif gather_rows and user.opcode == "gather" and user.operands[0] == name:
            total += user.bytes
        elif user.opcode in _IN_PLACE and user.operands[0] == name:
            continue
        elif user.opcode in _PASS_THROUGH:
            sub = _reads_of_param(comps, comp, user.name, seen, gather_rows)
            if sub is None:
                return None
            total += sub
        elif user.opcode == "fusion":  # a nested fusion: what it reads of that operand
            called = _CALLS.search(user.line)
            inner = comps.get(called.group(1)) if called else None
            if inner is None:
                return None
            inner_params = _params(inner)
            for k, op in enumerate(user.operands):
                if op != name:
                    continue
                if k >= len(inner_params):
                    return None
                sub = _reads_of_param(comps, inner, inner_params[k].name, None, gather_rows)
                if sub is None:
                    return None
                total += sub
        else:
            return None
    return total


def _update_bytes(comp: _Computation, instr: _Instr) -> int | None:
    """For an in-place update root (scatter / dynamic-update-slice, possibly behind
    bitcasts): the bytes of its update operand, else None."""
    while instr.opcode in ("bitcast", "reshape") and instr.operands:
        nxt = comp.by_name.get(instr.operands[0])
        if nxt is None:
            return None
        instr = nxt
    if instr.opcode == "dynamic-update-slice":
        upd = comp.by_name.get(instr.operands[1])
        return None if upd is None else upd.bytes
    if instr.opcode == "scatter":
        upd = comp.by_name.get(instr.operands[-1])
        return None if upd is None else upd.bytes
    return None


def instruction_bytes(comps, comp: _Computation, instr: _Instr, hbm_only: bool = False) -> int:
    """Estimated bytes accessed by one instruction of an executed computation.

    ``hbm_only``: only the traffic to and from HBM. Operands and outputs that XLA placed in
    an on-chip memory space (``S(1)``, VMEM on TPU) count nothing, an asynchronous copy
    between memory spaces (``copy-start``, as memory-space assignment issues to prefetch a
    weight into VMEM or evict a buffer) counts its HBM side once, at its start, and a
    gather reads the rows it gathers. XLA's own figure (and this function without
    ``hbm_only``) counts every memory space, so a weight prefetched into VMEM is counted at
    the copy and again where the consumer reads VMEM, and a gather's whole table."""
    if instr.opcode in _FREE or instr.opcode in ("while", "conditional", "call"):
        return 0
    if instr.opcode == "custom-call":  # opaque to XLA's cost analysis too (module docstring)
        return 0
    shapes = comp.by_name

    def size(i: _Instr) -> int:
        return i.hbm_bytes if hbm_only else i.bytes

    if hbm_only and instr.opcode in ("copy-start", "copy-done"):
        if instr.opcode == "copy-done":
            return 0
        dest = _array_bytes(instr.type_text, hbm_only=True)[:1]  # (dest, source, context)
        return sum(dest) + sum(size(shapes[o]) for o in instr.operands if o in shapes)
    if instr.opcode == "fusion":
        called = _CALLS.search(instr.line)
        fused = comps.get(called.group(1)) if called else None
        if fused is None:
            return size(instr) + sum(size(shapes[o]) for o in instr.operands if o in shapes)
        params = _params(fused)
        reads = 0
        for k, op in enumerate(instr.operands):
            full = size(shapes[op]) if op in shapes else 0
            if k < len(params) and full:
                part = _reads_of_param(comps, fused, params[k].name, None, hbm_only)
                reads += full if part is None else min(part, full)
            else:
                reads += full
        roots = [fused.root]
        if fused.root.opcode == "tuple":
            roots = [fused.by_name[o] for o in fused.root.operands if o in fused.by_name]
        # Which of the fusion's outputs live in HBM (a tuple output lists one per root).
        in_hbm = [b > 0 for b in _array_bytes(instr.type_text, hbm_only=True)]
        if len(in_hbm) != len(roots):
            in_hbm = [size(instr) > 0] * len(roots)
        writes = 0
        for r, keep in zip(roots, in_hbm, strict=True):
            if hbm_only and not keep:
                continue
            upd = _update_bytes(fused, r)
            writes += r.bytes if upd is None else upd
        return reads + writes
    upd = _update_bytes(comp, instr)
    if upd is not None:  # an unfused in-place update: reads and writes the update only
        return 0 if hbm_only and not instr.hbm_bytes else 2 * upd
    if instr.opcode in _SLICES:
        return 2 * size(instr)
    if hbm_only and instr.opcode == "gather":  # the rows it reads, its indices, its output
        indices = sum(size(shapes[o]) for o in instr.operands[1:] if o in shapes)
        return 2 * size(instr) + indices
    return size(instr) + sum(size(shapes[o]) for o in instr.operands if o in shapes)


# Why XLA's figure (every memory space) exceeds the HBM count, by kind (``xla_excess``).
EXCESS_KINDS = {
    "activations_in_vmem": "activations XLA:TPU keeps in on-chip VMEM (counted by XLA, "
    "moving no HBM bytes)",
    "prefetched_in_vmem": "buffers prefetched into VMEM (mostly weights), counted again "
    "where their consumer reads the VMEM copy",
    "prefetch_copies": "the prefetch copies' VMEM side and bookkeeping",
    "whole_gathers": "gathers (embedding rows, logits columns) counted as their whole table",
    "other": "anything else",
}


def _from_prefetch(comp: _Computation, name: str) -> bool:
    """Whether ``name`` is (through pass-through ops) the output of a ``copy-done``: a
    buffer memory-space assignment prefetched into VMEM."""
    i = comp.by_name.get(name)
    while i is not None and i.opcode in _PASS_THROUGH and i.operands:
        i = comp.by_name.get(i.operands[0])
    return i is not None and i.opcode == "copy-done"


def _excess_of(comps, comp: _Computation, instr: _Instr) -> Counter:
    """``instruction_bytes`` over every memory space minus over HBM, split by kind."""
    out: Counter = Counter()
    total = instruction_bytes(comps, comp, instr) - instruction_bytes(
        comps, comp, instr, hbm_only=True
    )
    if not total:
        return out
    if instr.opcode in ("copy-start", "copy-done"):
        out["prefetch_copies"] += total
        return out
    if instr.opcode == "gather":
        table = comp.by_name.get(instr.operands[0]) if instr.operands else None
        if table is not None and table.hbm_bytes:
            out["whole_gathers"] += table.bytes - instr.bytes
    called = _CALLS.search(instr.line) if instr.opcode == "fusion" else None
    fused = comps.get(called.group(1)) if called else None
    params = _params(fused) if fused is not None else []
    for k, op in enumerate(instr.operands):
        src = comp.by_name.get(op)
        if src is None or not src.bytes:
            continue
        if not src.hbm_bytes:  # read from VMEM: counted by XLA only
            read = src.bytes
            if k < len(params):
                part = _reads_of_param(comps, fused, params[k].name)
                read = read if part is None else min(part, read)
            kind = "prefetched_in_vmem" if _from_prefetch(comp, op) else "activations_in_vmem"
            out[kind] += read
        elif k < len(params):  # in HBM: XLA counts a gathered table whole
            whole = _reads_of_param(comps, fused, params[k].name)
            rows = _reads_of_param(comps, fused, params[k].name, None, True)
            whole = src.bytes if whole is None else min(whole, src.bytes)
            rows = src.bytes if rows is None else min(rows, src.bytes)
            out["whole_gathers"] += whole - rows
    out["activations_in_vmem"] += max(0, total - sum(out.values()))  # outputs in VMEM
    over = sum(out.values()) - total
    if over:  # a rule above and instruction_bytes disagree: keep the sum exact
        out["other"] -= over
    return out


def xla_excess(hlo_text: str) -> dict[str, int]:
    """Bytes by which XLA's figure (every memory space, each loop body once, as XLA
    counts) exceeds the HBM-only count of the same program (each body once too), split
    by ``EXCESS_KINDS``; ``"total"`` is the sum. The split is per operand: a VMEM operand
    that a ``copy-done`` produced is a prefetched buffer, any other VMEM operand or
    output an activation kept on chip, an HBM operand gathered inside the fusion a
    whole-table count."""
    comps = parse_hlo(hlo_text)
    out: Counter = Counter()
    for comp in _executed(comps):
        for instr in comp.instrs:
            out.update(_excess_of(comps, comp, instr))
    result = {k: int(out.get(k, 0)) for k in EXCESS_KINDS}
    result["total"] = sum(result.values())
    return result


def bytes_by_scope(
    hlo_text: str, depth: int = 4, top: int = 15, hbm_only: bool = False, loop_trips: bool = True
) -> dict:
    """``{"total", "by_scope": {scope: bytes}}``: estimated bytes accessed by one call of
    the program (a loop's body times its static trip count; ``loop_trips=False``: once,
    as XLA counts), summed by the first ``depth`` components of each instruction's JAX ``op_name`` (its
    name scope: ``jit(f)/Module.method/...``), the ``top`` largest scopes. ``hbm_only``:
    HBM traffic only (``instruction_bytes``)."""
    comps = parse_hlo(hlo_text)
    by_scope: Counter = Counter()
    executed = _executed_times(comps) if loop_trips else [(c, 1) for c in _executed(comps)]
    for comp, times in executed:
        for instr in comp.instrs:
            b = instruction_bytes(comps, comp, instr, hbm_only)
            if not b:
                continue
            m = _OP_NAME.search(instr.line)
            scope = "/".join(m.group(1).split("/")[:depth]) if m else "(unnamed)"
            by_scope[scope] += b * times
    return {"total": sum(by_scope.values()), "by_scope": dict(by_scope.most_common(top))}


def parameter_relayouts(hlo_text: str) -> dict[str, int]:
    """``{parameter path: bytes}`` for the parameters a program copies into another layout
    before using them: executed (not fused-inside) copies, transposes and fusions whose JAX
    name is the parameter's path (``params[0]['layers']...``), which is how XLA names a
    copy it inserts on an entry parameter. Bytes as ``instruction_bytes``. A weight read in
    place has none; each entry here rewrites that weight on every call."""
    comps = parse_hlo(hlo_text)
    out: Counter = Counter()
    for comp, times in _executed_times(comps):
        for instr in comp.instrs:
            if instr.opcode not in ("copy", "fusion", "transpose"):
                continue
            m = _OP_NAME.search(instr.line)
            if m and m.group(1).startswith("params["):
                b = instruction_bytes(comps, comp, instr)
                out[m.group(1).replace("\\'", "'")] += b * times
    return dict(out)


def hbm_all_reduces(hlo_text: str, elements: int, scope: str) -> int:
    """How many executed all-reduces under the JAX name scope ``scope`` (a substring of
    the op name, e.g. ``Qwen3.decode/``) reduce one array of ``elements`` elements (a
    hidden state per row: rows × d) whose input and output both lie in HBM, so that its
    producer writes it there and its consumer reads it back. XLA:TPU keeps a small one in
    VMEM (none of this traffic then reaches HBM)."""
    comps = parse_hlo(hlo_text)
    n = 0
    for comp, times in _executed_times(comps):
        for instr in comp.instrs:
            if instr.opcode != "all-reduce" or len(instr.operands) != 1:
                continue
            m = _OP_NAME.search(instr.line)
            dims = re.match(r"\w+\[([\d,]*)\]", instr.type_text)
            if not (m and scope in m.group(1) and dims):
                continue
            size = math.prod(int(x) for x in dims.group(1).split(",") if x)
            src = comp.by_name.get(instr.operands[0])
            if size == elements and instr.hbm_bytes and src is not None and src.hbm_bytes:
                n += times
    return n


__all__ = [
    "EXCESS_KINDS", "bytes_by_scope", "hbm_all_reduces", "instruction_bytes", "loop_trips",
    "parameter_relayouts", "parse_hlo", "trip_count", "xla_excess",
]  # fmt: skip
