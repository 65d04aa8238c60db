"""Roofline of the serving decode round at every verify bucket, from XLA:TPU's own cost
analysis of the compiled round for a named TPU topology (no TPU needed: libtpu compiles on
this host; ``pip install -e '.[tpu]'``).

    python benchmarks/roofline.py --topology v5p:2x2x1 --tensor 4      # 8B + 5-layer DSpark
    python benchmarks/roofline.py --topology v5p:2x2x2 --tensor 8 --budgets 0,56,448
    python benchmarks/roofline.py --topology v5p:2x2x2 --data 2 --tensor 4  # two replicas
    python benchmarks/roofline.py --quick       # tiny models on v5e:2x2 (seconds; a check)

For each budget K (B = R + K verified tokens) the round is compiled with the target's layer
scan unrolled (XLA counts a loop body once) and the report gives, per chip: XLA's flops and
bytes accessed, the hand-counted flops (``perf.roofline.round_flops_hand_count``), the
floor bytes (weights + each slot's KV and drafter context up to ``--context-fraction`` of
max_len, each read once), bytes / floor, the modelled time max(flops/peak, bytes/HBM BW)
from the chip's public figures (``perf.roofline.CHIPS``) and the modelled SPS(B), plus the
largest producers of bytes in the program. With ``--data d`` the round is the engine's
own with d replicas (``decode.replicas``), R slots and K verified drafts *each*, and every
figure is per chip (one replica's share). Writes ``<out>.json``, ``<out>.md`` and
``<out>_sps.json`` (the modelled SPS table in the format ``--sps-cache`` reads).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default="v5p:2x2x1", help="TPU topology, e.g. v5p:2x2x1")
    p.add_argument("--tensor", type=int, default=4, help="tensor-parallel ways (mesh d,D/dt,t)")
    p.add_argument(
        "--data", type=int, default=1, help="data replicas, each with R slots (decode.replicas)"
    )
    p.add_argument("--preset", default="qwen3-8b", help="target shape (models/presets.py)")
    p.add_argument(
        "--drafter",
        choices=("dspark", "mtp1", "none"),
        default="dspark",
        help="the round's drafter: DSpark (default), MTP-1 (γ = 1), or none (target only)",
    )
    p.add_argument("--drafter-layers", type=int, default=5, help="DSpark draft layers")
    p.add_argument("--gamma", type=int, default=7)
    p.add_argument("--markov-rank", type=int, default=256)
    p.add_argument("--slots", type=int, default=64, help="request slots R (per data replica)")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument(
        "--context-fraction",
        type=float,
        default=1.0,
        help="each slot's length as a fraction of max-len, for the floor (1 = full cache)",
    )
    p.add_argument(
        "--budgets",
        default=None,
        help="comma-separated verify budgets K (default: 0 and the serving buckets up to R·γ)",
    )
    p.add_argument("--quick", action="store_true", help="tiny models on v5e:2x2")
    p.add_argument("--out", default=None, help="output prefix (default benchmarks/results/...)")
    p.add_argument(
        "--render", action="store_true", help="only rewrite <out>.md and <out>_sps.json from .json"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.topology, args.tensor, args.preset = "v5e:2x2", 2, "tiny"
        args.drafter_layers, args.gamma, args.markov_rank = 1, 4, 16
        args.slots, args.max_len = 4, 64
    if args.out is None:
        name = "roofline_quick" if args.quick else f"roofline_{args.topology.replace(':', '_')}"
        arm = "" if args.drafter == "dspark" else f"_{args.drafter}"
        dp = "" if args.data == 1 else f"_dp{args.data}"
        args.out = os.path.join(REPO, "benchmarks", "results", f"{name}{dp}_tp{args.tensor}{arm}")
    return args


def run(args) -> dict:
    import jax

    from dspark_jax import aot
    from dspark_jax.decode.policy import default_buckets
    from dspark_jax.models.drafter_config import DrafterConfig
    from dspark_jax.models.presets import get_preset
    from dspark_jax.perf import hlo_bytes
    from dspark_jax.perf import roofline as rl

    if args.data > 1 and tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11):
        # Seen with jax 0.10.2 / libtpu 0.0.42.1: the unrolled round with data replicas and
        # the TPU kernel aborts the process in XLA's SPMD partitioner ("Check failed:
        # target.IsManualSubgroup() == sharding().IsManualSubgroup()"); jax 0.12.1 /
        # libtpu 0.0.52 compiles it (the scanned serving round compiles on both).
        raise SystemExit(
            f"--data {args.data}: the unrolled round with data replicas needs jax >= 0.11 "
            f"(this is {jax.__version__}, whose XLA:TPU aborts on it); use Python 3.12+"
        )
    chip = rl.chip_for_topology(args.topology)
    devices = aot.topology_devices(args.topology)
    dt = args.data * args.tensor
    if len(devices) % dt:
        raise ValueError(
            f"--data {args.data} × --tensor {args.tensor} does not divide {len(devices)} chips"
        )
    mesh = aot.aot_mesh(f"{args.data},{len(devices) // dt},{args.tensor}", topology=args.topology)
    target = get_preset(args.preset).replace(scan_layers=False)
    if args.drafter == "none":
        drafter, gamma, scheduler = None, 0, "none"
    elif args.drafter == "mtp1":
        drafter = DrafterConfig(kind="mtp1", gamma=1).resolve(target)
        gamma, scheduler = 1, "fixed"
    else:
        drafter = DrafterConfig(
            kind="dspark",
            gamma=args.gamma,
            num_layers=args.drafter_layers,
            markov_rank=args.markov_rank,
            mask_token_id=target.vocab_size - 1,
        ).resolve(target)
        gamma, scheduler = args.gamma, "topk"
    full = args.slots * gamma
    if args.budgets:
        budgets = sorted({int(b) for b in args.budgets.split(",")})
    elif gamma == 0:
        budgets = [0]
    else:
        budgets = sorted({0, *default_buckets(args.slots, gamma)})
    if any(not 0 <= k <= full for k in budgets):
        raise ValueError(f"--budgets must lie in [0, R·γ = {full}], got {budgets}")
    context_len = max(1, round(args.context_fraction * args.max_len))
    rows = []
    for k in budgets:
        t0 = time.perf_counter()
        report, compiled = aot.compile_serve_round(
            target, drafter, mesh, args.slots * args.data, args.max_len, budget=k,
            scheduler=scheduler,
        )  # fmt: skip
        cost = rl.cost_of(compiled)
        hlo = compiled.as_text()
        # The Pallas attention kernel is opaque to XLA's cost analysis: add its model. Its
        # calls: one per target layer (verify) and the drafter's over its paged context:
        # DSpark/DFlash one per draft layer (the block, γ queries folded into each slot's
        # row); EAGLE-3/MTP-1 one per draft step (one query per slot).
        calls = rl.ragged_attention_calls(hlo)
        draft_calls, draft_queries = 0, gamma
        if calls and drafter is not None:
            draft_calls = drafter.resolved_num_layers
            if drafter.next_token_states:
                draft_calls, draft_queries = drafter.draft_len, 1
        if calls and calls - draft_calls != target.num_hidden_layers:
            raise RuntimeError(
                f"expected {target.num_hidden_layers} verify + {draft_calls} draft kernel "
                f"calls in the unrolled round, found {calls}"
            )
        kernel = rl.kernel_attention_cost(
            target, slots=args.slots, rows=args.slots + k, context_len=context_len,
            page_size=report["page_size"], tensor=args.tensor,
        )  # fmt: skip
        draft_kernel = rl.kernel_attention_cost(
            target, slots=args.slots, rows=args.slots, context_len=context_len + gamma,
            page_size=report["page_size"], tensor=args.tensor, queries_per_row=draft_queries,
        )  # fmt: skip
        xla_cost = dict(cost)
        modelled = {
            n: (calls - draft_calls) * kernel[n] + draft_calls * draft_kernel[n]
            for n in ("flops", "bytes")
        }
        cost = {n: cost[n] + modelled[n] for n in ("flops", "bytes")}
        floor = rl.round_floor_bytes(report["per_device"], args.context_fraction)
        hand = rl.round_flops_hand_count(
            target, drafter, slots=args.slots, budget=k, context_len=context_len
        )
        hand_per_chip = hand["total"] / (mesh.size // args.data)  # one replica's chips
        # HBM traffic only (perf.hlo_bytes hbm_only): XLA's figure also counts transfers to
        # and from on-chip memory (weights prefetched into VMEM count at the copy and again
        # at their consumer) and a gather's whole table.
        hbm = hlo_bytes.bytes_by_scope(hlo, depth=1, top=1, hbm_only=True)["total"]
        hbm_once = hlo_bytes.bytes_by_scope(hlo, depth=1, top=1, hbm_only=True, loop_trips=False)[
            "total"
        ]
        hbm += modelled["bytes"]
        seconds = chip.seconds(cost["flops"], cost["bytes"])
        floor_s = chip.seconds(hand_per_chip, floor["bytes"])
        row = {
            "budget": k,
            "B": args.slots + k,
            "flops": cost["flops"],
            "flops_hand_count": hand_per_chip,
            "flops_ratio": cost["flops"] / hand_per_chip,
            "bytes": cost["bytes"],
            "xla_bytes": xla_cost["bytes"],
            "xla_flops": xla_cost["flops"],
            "attention": report["attention"],
            "kernel_calls": calls,
            "draft_kernel_calls": draft_calls,
            "kernel_bytes_modelled": modelled["bytes"],
            "kernel_flops_modelled": modelled["flops"],
            "floor_bytes": floor["bytes"],
            "floor_parts": floor["parts"],
            "bytes_over_floor": cost["bytes"] / floor["bytes"],
            "hbm_bytes": hbm,
            "hbm_over_floor": hbm / floor["bytes"],
            "hbm_modelled_ms": 1e3 * chip.seconds(cost["flops"], hbm),
            "modelled_ms": 1e3 * seconds,
            "floor_ms": 1e3 * floor_s,
            "modelled_sps": 1.0 / seconds,
            "bound": "memory" if cost["bytes"] / (chip.hbm_gb_per_s * 1e9)
            >= cost["flops"] / (chip.bf16_tflops * 1e12) else "compute",
            "while_loops": rl.while_loops(hlo),
            # Each executed loop's static trip count (None: unknown, its body counted once).
            "loop_trips": [t for _, t in hlo_bytes.loop_trips(hlo)],
            # What counting the loops by their trips adds to the HBM count (above once).
            "hbm_loop_extra_bytes": hbm - modelled["bytes"] - hbm_once,
            # Why XLA's bytes exceed the HBM count, both counting each loop body once.
            "xla_excess": hlo_bytes.xla_excess(hlo),
            "peak_memory_bytes": report["memory"]["peak_bytes"],
            "top_bytes": rl.bytes_by_op(hlo, top=8),
            # XLA's bytes re-derived per instruction, by the name scope that emitted it.
            "bytes_by_scope": hlo_bytes.bytes_by_scope(hlo, depth=SCOPE_DEPTH, top=40),
            # Weights XLA copies into another layout before use (each one every round).
            "parameter_relayouts": hlo_bytes.parameter_relayouts(hlo),
            # The target's all-reduces of every row's hidden state held in HBM.
            "hidden_allreduces_in_hbm": hlo_bytes.hbm_all_reduces(
                hlo, (args.slots + k) * target.hidden_size, "Qwen3.decode/"
            ),
            "compile_s": round(time.perf_counter() - t0, 1),
        }  # fmt: skip
        rows.append(row)
        print(
            f"[roofline] B={row['B']}: {cost['bytes'] / 1e9:.1f} GB ({row['bytes_over_floor']:.1f}x "
            f"floor), {cost['flops'] / 1e9:.0f} GFLOP ({row['flops_ratio']:.2f}x hand count), "
            f"{row['modelled_ms']:.1f} ms modelled, compile {row['compile_s']}s",
            flush=True,
        )
    base = rows[0]["modelled_sps"]
    for r in rows:
        r["sps_over_sps_R"] = r["modelled_sps"] / base
        r["hbm_sps_over_sps_R"] = rows[0]["hbm_modelled_ms"] / r["hbm_modelled_ms"]
    return {
        "topology": args.topology,
        "chip": chip.__dict__,
        "tensor": args.tensor,
        "data": args.data,
        "mesh": dict(mesh.shape),
        "compiler": aot.compiler_info(mesh),
        "target": args.preset,
        "drafter": None if drafter is None else drafter.to_dict(),
        "drafter_kind": args.drafter,
        "slots": args.slots,
        "max_len": args.max_len,
        "context_fraction": args.context_fraction,
        "command": "python benchmarks/roofline.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }


def excess_lines(res: dict) -> list[str]:
    """What XLA's extra bytes are, and what the loops' trips add, at the largest bucket."""
    from dspark_jax.perf.hlo_bytes import EXCESS_KINDS

    last = res["rows"][-1]
    if "xla_excess" not in last:
        return []
    ex = last["xla_excess"]
    parts = "; ".join(
        f"{EXCESS_KINDS[k]}: {ex[k] / 1e9:.2f} GB"
        for k in sorted(EXCESS_KINDS, key=lambda k: -abs(ex[k]))
        if abs(ex[k]) >= 5e5
    )
    return [
        "",
        f"Why XLA's bytes exceed the HBM count at B = {last['B']} "
        f"(`perf.hlo_bytes.xla_excess`, both counting each loop body once, the kernel "
        f"left out of both): {ex['total'] / 1e9:.2f} GB in all; {parts}.",
        "",
        f"Counting each loop's body by its trips adds "
        f"{last['hbm_loop_extra_bytes'] / 1e9:.3f} GB of HBM traffic at B = {last['B']} "
        f"(loops: {_loops(last)}), included in the HBM table.",
    ]


def _loops(row: dict) -> str:
    """The loops column: how many while loops the round keeps, with their trip counts
    where the result records them (``?``: unknown, counted once everywhere)."""
    trips = row.get("loop_trips")
    if trips is None:
        return str(row["while_loops"])
    if not trips:
        return "0"
    return f"{len(trips)} ({', '.join('?' if t is None else str(t) for t in trips)})"


# Name-scope components kept when summing bytes by scope: jit(_round_impl)/Module.method/
# .../layer/<sublayer>/<op> (e.g. Qwen3.decode/layers/closed_call/layer/mlp/up_proj).
SCOPE_DEPTH = 7


def _short_scope(scope: str) -> str:
    return scope.removeprefix("jit(_round_impl)/").replace("/layers/closed_call/layer/", "/layer/")


def scope_lines(res: dict, top: int = 12) -> list[str]:
    """The largest name scopes by XLA bytes at B = R and at the largest bucket, and which
    scopes the extra rows' bytes go to."""
    first, last = res["rows"][0], res["rows"][-1]
    if "bytes_by_scope" not in first or first is last:
        return []
    a, b = first["bytes_by_scope"], last["bytes_by_scope"]
    scopes = set(a["by_scope"]) | set(b["by_scope"])
    rows = sorted(scopes, key=lambda s: -(b["by_scope"].get(s, 0) - a["by_scope"].get(s, 0)))[:top]
    lines = [
        "",
        f"XLA's bytes by name scope (`perf.hlo_bytes`: per instruction, slices and in-place "
        f"updates counted as XLA does; its total is {a['total'] / 1e9:.2f} GB at B = "
        f"{first['B']} and {b['total'] / 1e9:.2f} GB at B = {last['B']}, against XLA's "
        f"{first['xla_bytes'] / 1e9:.2f} and {last['xla_bytes'] / 1e9:.2f}), the scopes "
        f"that grow most from B = {first['B']} to B = {last['B']} (GB):",
        "",
        f"| scope | B = {first['B']} | B = {last['B']} | growth |",
        "|---|---|---|---|",
    ]
    for s in rows:
        x, y = a["by_scope"].get(s, 0), b["by_scope"].get(s, 0)
        lines.append(
            f"| `{_short_scope(s)}` | {x / 1e9:.3f} | {y / 1e9:.3f} | {(y - x) / 1e9:.3f} |"
        )
    return lines


def growth_lines(res: dict) -> list[str]:
    """What each added verify row costs in HBM traffic, derived from the first and last
    rows of the HBM table (the kernel's modelled bytes do not grow with B: each slot's
    pages are read once whatever its query count)."""
    from dspark_jax.models.presets import get_preset
    from dspark_jax.perf.roofline import ALLREDUCE_PASSES, allreduce_activation_bytes

    first, last = res["rows"][0], res["rows"][-1]
    added = last["B"] - first["B"]
    if added <= 0:
        return []
    cfg = get_preset(res["target"])
    grown = last["hbm_bytes"] - first["hbm_bytes"]
    per_row_layer = grown / added / cfg.num_hidden_layers
    vector = cfg.hidden_size * 2  # one row's hidden state in bf16
    weights = last["floor_parts"]["target_weights"] + last["floor_parts"]["drafter_weights"]
    tp_note = []
    if "hidden_allreduces_in_hbm" in last:
        d = cfg.hidden_size
        moved = [
            allreduce_activation_bytes(r["hidden_allreduces_in_hbm"], r["B"], d)
            for r in (first, last)
        ]
        share = moved[1] - moved[0]
        reach = first["hbm_bytes"] + share
        tp_note = [
            "",
            f"All-reduces of every row's hidden state that XLA left in HBM: "
            f"{first['hidden_allreduces_in_hbm']} at B = {first['B']}, "
            f"{last['hidden_allreduces_in_hbm']} at B = {last['B']} "
            f"(`perf.hlo_bytes.hbm_all_reduces`; the target has {cfg.num_hidden_layers} "
            f"layers, two each). At {ALLREDUCE_PASSES} passes each (the matmul writes "
            "it, the all-reduce reads and writes it, the norm reads it; "
            f"`perf.roofline.allreduce_activation_bytes`) they account for "
            f"{share / 1e9:.2f} GB of the growth; B = {first['B']}'s HBM bytes plus that "
            f"are {reach / 1e9:.2f} GB, {reach / last['floor_bytes']:.2f}× the floor at "
            f"B = {last['B']} (derived). Sequence parallelism keeps those passes (the "
            "matmul writes its partial sums, the reduce-scatter reads them, the all-gather "
            "writes every row back, the next matmul reads it) and only moves the norms and "
            "residual adds to 1/tensor of the rows; below it needs collectives that never "
            "hold a full-size buffer in HBM (fused into the matmuls) or fewer tensor ways.",
        ]
    return [
        "",
        f"Growth with B (derived from the HBM table): {grown / 1e9:.2f} GB from B = "
        f"{first['B']} to B = {last['B']}, {grown / added / 1e6:.2f} MB per added row; spread "
        f"over the target's {cfg.num_hidden_layers} layers, {per_row_layer / 1e3:.0f} KB per "
        f"row per layer, {per_row_layer / vector:.1f} hidden states of d = {cfg.hidden_size} "
        "in bf16: activation traffic (projection outputs, the per-layer all-reduces, norm "
        "reads), which every tensor-parallel chip moves for every row while its share of "
        f"the weights shrinks with the tensor ways. At B = {last['B']}: "
        f"{grown / 1e9:.2f} GB above B = {first['B']} against {weights / 1e9:.2f} GB of "
        "weights per chip in the floor.",
        *tp_note,
    ]


def markdown(res: dict) -> str:
    chip = res["chip"]
    kind = res.get("drafter_kind", "dspark")
    what = {"none": "target only (no speculation)", "mtp1": "MTP-1"}.get(
        kind, f"{(res['drafter'] or {}).get('num_layers')}-layer DSpark"
    )
    lines = [
        f"# Roofline of the decode round: {res['target']} + {what} on {res['topology']} "
        + (f"(data = {res['data']} × " if res.get("data", 1) > 1 else "(")
        + f"tensor = {res['tensor']})",
        "",
        f"Produced by `{res['command']}` with {res['compiler']['compiler']} (libtpu "
        f"{res['compiler'].get('libtpu')}); R = {res['slots']}"
        + (" per data replica" if res.get("data", 1) > 1 else "")
        + f", max_len = {res['max_len']}, "
        f"slots at {res['context_fraction']:.0%} of max_len for the floor; chip figures "
        f"{chip['bf16_tflops']:.0f} bf16 TFLOP/s, {chip['hbm_gb_per_s']:.0f} GB/s "
        f"([source]({chip['source']})). Per chip; modelled time = max(flops / peak, "
        "bytes / HBM bandwidth).",
        "",
        f"Verify attention: `{res['rows'][0].get('attention', 'dense gather')}`"
        + (
            f", also for the drafter's attention over its paged context "
            f"(kernel calls per round: {res['rows'][0]['draft_kernel_calls']})"
            if res["rows"][0].get("draft_kernel_calls")
            else ""
        )
        + ". XLA's cost analysis does not see inside the Pallas kernel; its bytes and flops "
        "are modelled (`perf.roofline.kernel_attention_cost`: each slot's pages up to its "
        "length once per layer) and added, shown in their own column.",
        "",
        "| B = R + K | bytes GB | of which kernel (modelled) GB | floor GB | bytes / floor | "
        "GFLOP | flops / hand count | modelled ms | floor ms | modelled SPS | SPS(B) / SPS(R) "
        "| bound | loops (trips) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['B']} | {r['bytes'] / 1e9:.1f} | "
            f"{r.get('kernel_bytes_modelled', 0) / 1e9:.1f} | {r['floor_bytes'] / 1e9:.1f} | "
            f"{r['bytes_over_floor']:.2f} | {r['flops'] / 1e9:.0f} | {r['flops_ratio']:.2f} | "
            f"{r['modelled_ms']:.1f} | {r['floor_ms']:.1f} | {r['modelled_sps']:.1f} | "
            f"{r['sps_over_sps_R']:.2f} | {r['bound']} | {_loops(r)} |"
        )
    if "hbm_bytes" in res["rows"][0]:
        lines += [
            "",
            "HBM traffic only (`perf.hlo_bytes.bytes_by_scope(..., hbm_only=True)`, re-derived "
            "from the compiled HLO; kernel bytes as above). XLA's bytes above count every "
            "memory space: a weight that XLA prefetches into on-chip VMEM is counted at the "
            "copy and again where its consumer reads VMEM, and a gather counts its whole "
            "table. Here each buffer in VMEM counts nothing, a prefetch its HBM read once, a "
            "gather the rows it gathers. An estimate, not XLA's figure; the SPS table "
            "(`_sps.json`) keeps XLA's."
            + (
                " A loop's body counts its static trip count times here (the loops column "
                "above: XLA's bytes count every body once)."
                if "loop_trips" in res["rows"][0]
                else " Loops are counted once here too (this result predates trip counts)."
            ),
            "",
            "| B = R + K | HBM bytes GB | HBM / floor | modelled ms | SPS(B) / SPS(R) |",
            "|---|---|---|---|---|",
        ]
        for r in res["rows"]:
            lines.append(
                f"| {r['B']} | {r['hbm_bytes'] / 1e9:.1f} | {r['hbm_over_floor']:.2f} | "
                f"{r['hbm_modelled_ms']:.1f} | {r['hbm_sps_over_sps_R']:.2f} |"
            )
        lines += growth_lines(res) + excess_lines(res)
    last = res["rows"][-1]
    if "parameter_relayouts" in last:
        moved = sum(last["parameter_relayouts"].values())
        lines += [
            "",
            f"Weights copied into another layout before use (`perf.hlo_bytes."
            f"parameter_relayouts`, every round): {len(last['parameter_relayouts'])} "
            f"parameters, {moved / 1e9:.2f} GB at B = {last['B']}.",
        ]
    lines += [
        "",
        f"Largest producers of bytes at B = {last['B']} (output bytes by HLO opcode, GB):",
        "",
    ]
    for op, b in list(last["top_bytes"]["by_opcode"].items())[:8]:
        lines.append(f"- `{op}`: {b / 1e9:.2f}")
    lines += ["", "Largest single instructions:", ""]
    for e in last["top_bytes"]["largest"][:6]:
        lines.append(f"- {e['bytes'] / 1e9:.2f} GB `{e['opcode']}` {e['op_name'][:120]}")
    lines += scope_lines(res)
    lines += [
        "",
        "Loops left: while loops still in the program (the drafter's γ-step sequential-head "
        "scan, sampling); XLA counts their bodies once, so their share is undercounted. "
        "Output bytes of an in-place update (a scatter into the carried page pool, whose "
        "output aliases its input) are the whole buffer, though it writes only its rows.",
    ]
    return "\n".join(lines) + "\n"


def sps_table(res: dict) -> dict:
    """The modelled table as an ``--sps-cache`` file: {key: SPSTable JSON}."""
    from dspark_jax.sched.sps import SPSTable

    secs = {r["B"]: r["modelled_ms"] / 1e3 for r in res["rows"]}
    kind = res.get("drafter_kind", "dspark")
    key = (
        f"modelled|{res['topology']}|"
        + (f"data={res['data']}|" if res.get("data", 1) > 1 else "")
        + f"tensor={res['tensor']}|R={res['slots']}|"
        f"max_len={res['max_len']}|drafter={kind}"
    )
    return {key: SPSTable.from_seconds(secs).to_json()}


def main(argv=None) -> int:
    from dspark_jax.cli import run_main

    def cli(args):
        if args.render:
            with open(args.out + ".json") as f:
                res = json.load(f)
        else:
            res = run(args)
            os.makedirs(os.path.dirname(args.out), exist_ok=True)
            with open(args.out + ".json", "w") as f:
                json.dump(res, f, indent=2)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(res))
        with open(args.out + "_sps.json", "w") as f:
            json.dump(sps_table(res), f, indent=1)
        print(f"wrote {args.out}.json, .md and _sps.json")

    return run_main(cli, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
