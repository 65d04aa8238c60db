"""Which layout serves which Qwen3 size on a TPU slice: the engine's own decode round
(``aot.compile_serve_round``: draft -> schedule -> packed verify -> commit, state by
``SpeculativeDecoder.state_shardings``) compiled by XLA:TPU for data × tensor layouts of 1
to 8 chips of v5e and v5p (libtpu on this host, nothing allocated), with its per-chip peak
memory against the chip's HBM.

    python benchmarks/serve_fit.py                    # 4B/8B/14B x v5e/v5p x every layout
    python benchmarks/serve_fit.py --only 8B          # rows whose name contains "8B"
    python benchmarks/serve_fit.py --layouts 2x4,8x1  # data x tensor
    python benchmarks/serve_fit.py --layouts 2x4 --merge   # add rows to the existing table

Qwen3 targets in bf16 with the DSpark drafter at DeepSpec's released size (5 layers, Markov
rank 256, γ = 7), R = 64 slots in all (R/data per replica), max_len 4096 (the KV page pool
holds every slot at max_len), the largest verify bucket K = R/data·γ per replica. Data d ×
tensor t runs on a d·t-chip slice (what ``serve.py --data d --tensor t`` uses); a chip the
layout leaves out is not counted. A compile that runs out of HBM is a row that says so
with the compiler's own figures. Writes ``benchmarks/results/serve_fit.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")
sys.path.insert(0, REPO)

# The smallest slice libtpu names for t chips (one device per chip): 4 and 8; tensor 1 and
# 2 compile on the first t chips of the 4-chip slice.
# 16 chips: a slice of 4 hosts (v5p-32, v5e-16), whose round gathers its outputs onto
# every chip for the 4 host processes (``SpeculativeDecoder.spans_processes``).
TOPOLOGY = {"v5e": {4: "v5e:2x2", 8: "v5e:2x4", 16: "v5e:4x4"},
            "v5p": {4: "v5p:2x2x1", 8: "v5p:2x2x2", 16: "v5p:2x2x4"}}  # fmt: skip
# HBM per chip, GB = 1e9 (Google Cloud TPU system architecture pages).
HBM_GB = {"v5e": 16.0, "v5p": 95.0}
SIZES = ("qwen3-4b", "qwen3-8b", "qwen3-14b")


def compile_row(preset: str, chip: str, data: int, tensor: int, slots: int, max_len: int) -> dict:
    from dspark_jax import aot
    from dspark_jax.models.drafter_config import DrafterConfig
    from dspark_jax.models.presets import get_preset
    from dspark_jax.sharding import make_mesh

    n = data * tensor
    topology = TOPOLOGY[chip][max(n, 4)]
    devices = aot.topology_devices(topology)[:n]
    mesh = make_mesh(data, 1, tensor, devices=devices)
    hosts = len({d.process_index for d in devices})
    if n < 4:
        topology += f" (first {n} chip{'s' if n > 1 else ''})"
    elif hosts > 1:
        topology += f" ({hosts} hosts)"
    target = get_preset(preset)
    drafter = DrafterConfig(
        kind="dspark", gamma=7, num_layers=5, markov_rank=256,
        mask_token_id=target.vocab_size - 1,
    ).resolve(target)  # fmt: skip
    name = row_name(preset, chip, data, tensor)
    row = {"name": name, "preset": preset, "chip": chip, "data": data, "tensor": tensor,
           "chips": n, "topology": topology, "hbm_gb": HBM_GB[chip]}  # fmt: skip
    t0 = time.perf_counter()
    try:
        report, _ = aot.compile_serve_round(
            target, drafter, mesh, slots, max_len, device_memory_gb=HBM_GB[chip]
        )
    except Exception as e:  # XLA:TPU refuses a program that cannot fit: keep its words
        text = str(e).strip().splitlines()
        row.update(fits=False, error=" ".join(text[:2])[:400], compile_s=time.perf_counter() - t0)
        return row
    gb = 1e9
    per = report["per_device"]
    row.update(
        fits=bool(report["fits"]),
        target_gb=per["target_bytes"] / gb,
        drafter_gb=per["drafter_bytes"] / gb,
        kv_cache_gb=per["kv_cache_bytes"] / gb,
        temp_gb=report["memory"]["temp_bytes"] / gb,
        peak_gb=report["memory"]["peak_bytes"] / gb,
        compile_s=round(time.perf_counter() - t0, 1),
    )
    return row


def row_name(preset: str, chip: str, data: int, tensor: int) -> str:
    layout = f"tensor {tensor}" if data == 1 else f"data {data} × tensor {tensor}"
    return f"{preset.removeprefix('qwen3-').upper()} {chip} {layout}"


def render(report: dict) -> str:
    lines = [
        "# Serving layouts that fit (XLA:TPU, AOT)",
        "",
        f"Produced by `{report['command']}` (libtpu {report['libtpu']}, jax {report['jax']}). "
        f"The engine's own decode round for Qwen3 targets in bf16 + the DSpark drafter "
        f"(5 layers, Markov rank 256, γ = 7), R = {report['slots']} slots, max_len "
        f"{report['max_len']} (the KV pool holds every slot at max_len; R/data per data "
        "replica, each with its own pool), verify budget K = R/data·γ per replica, data d × "
        "tensor t on a d·t-chip slice. GB = 1e9 per chip; peak = arguments + outputs − "
        "donated + temp, XLA:TPU's own plan.",
        "",
        "| run | topology | target | drafter | KV pool | temp | peak | HBM | fits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        if "peak_gb" in r:
            cells = [f"{r[k]:.2f}" for k in ("target_gb", "drafter_gb", "kv_cache_gb",
                                             "temp_gb", "peak_gb")]  # fmt: skip
        else:
            cells = ["—"] * 4 + [f"does not compile: {r.get('error', '')}"]
        fits = "yes" if r["fits"] else "**no**"
        lines.append(f"| {r['name']} | {r['topology']} | " + " | ".join(cells)
                     + f" | {r['hbm_gb']:.0f} | {fits} |")  # fmt: skip
    lines.append("")
    for chip in ("v5e", "v5p"):
        for preset in SIZES:
            ok = [(r.get("chips", r["tensor"]), r.get("data", 1), r["tensor"])
                  for r in report["rows"]
                  if r["chip"] == chip and r["preset"] == preset and r["fits"]]  # fmt: skip
            if any(r["chip"] == chip and r["preset"] == preset for r in report["rows"]):
                if ok:
                    n = min(o[0] for o in ok)
                    flags = " or ".join(
                        f"--tensor {t}" if d == 1 else f"--data {d} --tensor {t}"
                        for c, d, t in sorted(ok)
                        if c == n
                    )
                    fewest = f"{n} chip{'s' * (n > 1)} ({flags})"
                else:
                    fewest = "none of the layouts compiled here"
                lines.append(f"- {preset} on {chip}: fewest chips that fit: {fewest}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None, help="rows whose name contains this")
    p.add_argument("--chips", default="v5e,v5p")
    p.add_argument(
        "--layouts", default="1x1,1x2,1x4,1x8,2x4,4x2,8x1", help="data x tensor, comma-separated"
    )
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--out", default=os.path.join(RESULTS, "serve_fit"))
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the existing table's other rows (same slots, max_len and versions); "
        "the page lists every command that produced a row",
    )
    args = p.parse_args(argv)
    import jax

    from dspark_jax import aot

    rows = []
    for chip in args.chips.split(","):
        for preset in SIZES:
            for layout in args.layouts.split(","):
                d, t = (int(x) for x in layout.lower().split("x"))
                name = row_name(preset, chip, d, t)
                if args.only and args.only not in name:
                    continue
                row = compile_row(preset, chip, d, t, args.slots, args.max_len)
                print(json.dumps(row), flush=True)
                rows.append(row)
    report = {
        "command": "python benchmarks/serve_fit.py " + " ".join(argv or sys.argv[1:]),
        "jax": jax.__version__,
        "libtpu": aot.libtpu_version(),
        "slots": args.slots,
        "max_len": args.max_len,
        "rows": rows,
    }
    report["command"] = report["command"].strip()
    if args.merge and os.path.isfile(args.out + ".json"):
        with open(args.out + ".json") as f:
            old = json.load(f)
        same = ("jax", "libtpu", "slots", "max_len")
        if any(old.get(k) != report[k] for k in same):
            raise SystemExit(
                "--merge: the existing table was made with other settings or versions "
                f"({ {k: old.get(k) for k in same} }); rerun it whole"
            )
        new = {r["name"] for r in rows}
        kept = [r for r in old["rows"] if r["name"] not in new]
        order = {row_name(p, c, d, t): i for i, (c, p, d, t) in enumerate(
            (c, p, *(int(x) for x in lay.split("x")))
            for c in ("v5e", "v5p") for p in SIZES
            for lay in "1x1,1x2,1x4,1x8,2x4,4x2,8x1".split(",")
        )}  # fmt: skip
        report["rows"] = sorted(kept + rows, key=lambda r: order.get(r["name"], len(order)))
        commands = old.get("commands", [old["command"]])
        report["commands"] = commands + [report["command"]]
        report["command"] = " and ".join(f"`{c}`" for c in report["commands"]).strip("`")
    with open(args.out + ".json", "w") as f:
        json.dump(report, f, indent=2)
    with open(args.out + ".md", "w") as f:
        f.write(render(report))
    print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
