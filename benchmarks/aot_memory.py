"""Per-device memory of the full-size DSpark drafter training step (Qwen3-4B/8B/14B targets)
and of the serving decode round, from ahead-of-time compilation.

Every row is one ``python train.py --config ... --aot`` run in its own process (so each can
choose its devices), with nothing allocated: the numbers are XLA's per-device plan
(``compiled.memory_analysis()``), see ``dspark_jax/aot/``.

    python benchmarks/aot_memory.py [--quick] [--out benchmarks/results/aot_memory]
    python benchmarks/aot_memory.py --tpu v5p     # XLA:TPU for v5p slices (needs '.[tpu]')

Without ``--tpu`` the rows compile for fake CPU devices (an estimate of temp memory); with
``--tpu CHIP`` each row compiles with XLA:TPU for the slice of that chip family with the
row's chip count (``TOPOLOGIES``), and the files get the chip's suffix
(``aot_memory_v5p.json``). Writes ``<out>.json`` (all reports) and ``<out>.md`` (the
table). ``--quick`` runs only the 8B fsdp-64 row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ANCHORS_512 = ["--config.drafter.anchors_per_seq=512", "--config.drafter.eval_anchors_per_seq=512"]
# (name, config, devices, mesh data,fsdp,tensor, extra overrides, serve?)
TRAIN_ROWS = [
    ("4B fsdp64", "recipes/drafter_dspark_qwen3_4b.py", 64, "1,64,1", [], False),
    ("4B data8xfsdp8", "recipes/drafter_dspark_qwen3_4b.py", 64, "8,8,1", [], False),
    ("8B fsdp64", "recipes/drafter_dspark_qwen3_8b.py", 64, "1,64,1", [], False),
    ("8B data8xfsdp8", "recipes/drafter_dspark_qwen3_8b.py", 64, "8,8,1", [], False),
    (
        "8B fsdp64 remat",
        "recipes/drafter_dspark_qwen3_8b.py",
        64,
        "1,64,1",
        ["--config.drafter.remat=full"],
        False,
    ),  # fmt: skip
    (
        "8B fsdp64 T=2048",
        "recipes/drafter_dspark_qwen3_8b.py",
        64,
        "1,64,1",
        ["--config.data.seq_len=2048"],
        False,
    ),  # fmt: skip
    ("14B fsdp64", "recipes/drafter_dspark_qwen3_14b.py", 64, "1,64,1", [], False),
    ("14B data8xfsdp8", "recipes/drafter_dspark_qwen3_14b.py", 64, "8,8,1", [], False),
    # DeepSpec's released DSpark/DFlash recipe supervises 512 anchors per sequence (ours: 32);
    # the draft forward then runs on 512·(γ+1) = 4096 block positions per sequence.
    ("8B fsdp64 A=512", "recipes/drafter_dspark_qwen3_8b.py", 64, "1,64,1", ANCHORS_512, False),
    (
        "8B fsdp64 A=512 remat",
        "recipes/drafter_dspark_qwen3_8b.py",
        64,
        "1,64,1",
        [*ANCHORS_512, "--config.drafter.remat=full"],
        False,
    ),  # fmt: skip
    (
        "14B fsdp64 A=512 remat",
        "recipes/drafter_dspark_qwen3_14b.py",
        64,
        "1,64,1",
        [*ANCHORS_512, "--config.drafter.remat=full"],
        False,
    ),  # fmt: skip
    (
        "8B serve R=64 M=4096 tp8",
        "recipes/drafter_dspark_qwen3_8b.py",
        8,
        "1,1,8",
        ["--aot-serve", "--slots", "64", "--max-len", "4096"],
        True,
    ),  # fmt: skip
    (
        "14B serve R=64 M=4096 tp8",
        "recipes/drafter_dspark_qwen3_14b.py",
        8,
        "1,1,8",
        ["--aot-serve", "--slots", "64", "--max-len", "4096"],
        True,
    ),  # fmt: skip
]
QUICK = {"8B fsdp64"}
# The TPU slice of each chip family with a row's chip count (one device per chip).
TOPOLOGIES = {
    "v5p": {8: "v5p:2x2x2", 64: "v5p:4x4x4"},
    "v5e": {8: "v5e:2x4", 64: "v5e:8x8"},
    "v6e": {8: "v6e:2x4", 64: "v6e:8x8"},
}
# HBM per chip (GB = 1e9): v5p 95 GB, v5e 16 GB, v6e 32 GB (Google Cloud TPU system
# architecture pages); H200 141 GB (NVIDIA H200 datasheet).
CHIP_HBM_GB = {"v5p": 95.0, "v5e": 16.0, "v6e": 32.0}
H200_GB = 141.0


def device_gb(tpu: str | None) -> dict[str, float]:
    """The devices a row's peak is checked against: the compiled chip (v5p by default)
    and an H200."""
    chip = tpu or "v5p"
    return {f"{chip} {CHIP_HBM_GB[chip]:.0f} GB": CHIP_HBM_GB[chip], "H200 141 GB": H200_GB}


def run_row(name, config, devices, mesh, extra, timeout, tpu=None) -> dict:
    where = ["--aot-topology", TOPOLOGIES[tpu][devices]] if tpu else ["--aot-devices", str(devices)]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        cmd = [sys.executable, "train.py", "--config", os.path.join("configs", config), "--aot",
               *where, "--aot-mesh", mesh, "--aot-device-memory-gb", str(CHIP_HBM_GB[tpu or "v5p"]),
               "--aot-out", out, *extra]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"{name}: {' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            report = json.load(f)
    report.update(name=name, config=config, wall_s=round(wall, 1), command=" ".join(cmd[1:-2]))
    return report


def failed_row(name, config, devices, mesh, extra, message: str) -> dict:
    """A row whose compile failed, with the compiler's own last words (e.g. XLA:TPU's
    "Ran out of memory in memory space hbm ... Used X of Y hbm")."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    oom = [
        ln
        for ln in lines
        if "memory" in ln.lower()
        and ("exceed" in ln.lower() or "ran out" in ln.lower() or "used" in ln.lower())
    ]
    kind = "serve_round" if "--aot-serve" in extra else "train_step"
    return {"name": name, "config": config, "kind": kind, "devices": devices, "mesh_text": mesh,
            "extra": extra, "error": (oom or lines or ["(no message)"])[-1][:400]}  # fmt: skip


def _gb(b) -> str:
    return f"{b / 1e9:.2f}"


def _failed_line(r: dict, n_cols: int) -> str:
    mesh = r.get("mesh_text", "?")
    return (
        f"| {r['name']} | {mesh} | "
        + " | ".join(["—"] * (n_cols - 3))
        + (f" | **compile failed**: {r['error']} |")
    )


def markdown(reports: list[dict], tpu: str | None = None) -> str:
    if tpu:
        title = f"# AOT memory per device (XLA:TPU for {tpu} slices, nothing allocated)"
        command = f"`python benchmarks/aot_memory.py --tpu {tpu}`"
        temp = "temp is XLA:TPU's own plan for the slice (libtpu compiles on this host)"
    else:
        title = "# AOT memory per device (fake CPU devices, nothing allocated)"
        command = "`python benchmarks/aot_memory.py`"
        temp = "temp is the CPU compiler's plan (TPU/GPU schedules differ; treat it as an estimate)"
    lines = [
        title,
        "",
        f"Produced by {command}. DSpark drafter at DeepSpec's released "
        "size (5 layers, Markov rank 256, γ = 7, 32 anchors/sequence), bf16 compute, fp32 "
        "master weights + AdamW moments, frozen target in bf16; global batch 64 sequences × "
        "T tokens. Bytes are per device (GB = 1e9). `peak = arguments + outputs − aliased "
        f"(donated state) + temp`. {temp}; parameter/optimizer/target bytes are exact.",
        "",
        "| run | mesh (data,fsdp,tensor) | T | anchors | remat | drafter params | opt state | frozen target | "
        "temp | peak | " + " | ".join(f"fits {k}" for k in device_gb(tpu)) + " | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    n_cols = 13
    for r in reports:
        if r["kind"] != "train_step":
            continue
        if "error" in r:
            lines.append(_failed_line(r, n_cols))
            continue
        m, pd = r["memory"], r["per_device"]
        mesh = ",".join(str(r["mesh"][a]) for a in ("data", "fsdp", "tensor"))
        fits = [
            ("yes" if m["peak_bytes"] <= gb * 1e9 else "**no**") for gb in device_gb(tpu).values()
        ]
        lines.append(
            f"| {r['name']} | {mesh} | {r['seq_len']} | {r.get('anchors_per_seq', 32)} | "
            f"{r.get('remat') or 'none'} | {_gb(pd['params_bytes'])} | "
            f"{_gb(pd['opt_state_bytes'])} | {_gb(pd['frozen_bytes'])} | {_gb(m['temp_bytes'])} | "
            f"{_gb(m['peak_bytes'])} | {fits[0]} | {fits[1]} | {r['compile_s']:.0f} |"
        )
    recipe = [r for r in reports if r["kind"] == "train_step" and "512" in r["name"]]
    if recipe:
        chip, gb = next(iter(device_gb(tpu).items()))
        desc = []
        for r in recipe:
            if "error" in r:
                desc.append(f"{r['name']}: does not compile within {chip}")
            else:
                fit = "fits" if r["memory"]["peak_bytes"] <= gb * 1e9 else "does not fit"
                desc.append(f"{r['name']}: {_gb(r['memory']['peak_bytes'])} GB, {fit}")
        lines += [
            "",
            "DeepSpec's recipe (512 anchors per sequence, 16× our supervised blocks): "
            + "; ".join(desc)
            + ". Full remat of the draft layers is what brings it down; micro-batching "
            "(not implemented) would be the next lever.",
        ]
    serve = [r for r in reports if r["kind"] == "serve_round"]
    if serve:
        lines += [
            "",
            "Serving decode round (one fused draft → schedule → verify → commit executable, "
            "verify budget K = R·γ, bf16 weights and KV cache):",
            "",
            "| run | mesh | slots R | max_len | target | drafter | KV cache | decode state (KV + "
            "drafter context) | temp | peak | "
            + " | ".join(f"fits {k}" for k in device_gb(tpu))
            + " | compile s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in serve:
            if "error" in r:
                lines.append(_failed_line(r, 13))
                continue
            m, pd = r["memory"], r["per_device"]
            mesh = ",".join(str(r["mesh"][a]) for a in ("data", "fsdp", "tensor"))
            lines.append(
                f"| {r['name']} | {mesh} | {r['slots']} | {r['max_len']} | "
                f"{_gb(pd['target_bytes'])} | {_gb(pd['drafter_bytes'])} | "
                f"{_gb(pd['kv_cache_bytes'])} | {_gb(pd['state_bytes'])} | {_gb(m['temp_bytes'])} | "
                f"{_gb(m['peak_bytes'])} | "
                + " | ".join(
                    "yes" if m["peak_bytes"] <= gb * 1e9 else "**no**"
                    for gb in device_gb(tpu).values()
                )
                + f" | {r['compile_s']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "aot_memory"))
    p.add_argument("--quick", action="store_true", help="only the 8B fsdp-64 row")
    p.add_argument(
        "--only", nargs="*", help="row names to (re)run, keeping the other rows (default: all)"
    )
    p.add_argument("--timeout", type=int, default=1800, help="seconds per row")
    p.add_argument("--render", action="store_true", help="only rewrite <out>.md from <out>.json")
    p.add_argument(
        "--tpu",
        choices=sorted(TOPOLOGIES),
        default=None,
        help="compile with XLA:TPU for slices of this chip (needs pip install -e '.[tpu]')",
    )
    args = p.parse_args(argv)
    if args.tpu:
        args.out = f"{args.out}_{args.tpu}"
    if args.render:
        with open(args.out + ".json") as f:
            reports = json.load(f)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(reports, args.tpu))
        return 0
    rows = [r for r in TRAIN_ROWS if not args.quick or r[0] in QUICK]
    if args.only:
        rows = [r for r in rows if r[0] in args.only]
    reports = []
    if args.only and os.path.exists(args.out + ".json"):
        # Re-measure the named rows and keep the others' earlier reports (table order).
        with open(args.out + ".json") as f:
            reports = [r for r in json.load(f) if r["name"] not in args.only]
    order = {r[0]: i for i, r in enumerate(TRAIN_ROWS)}
    for name, config, devices, mesh, extra, _ in rows:
        print(f"[aot_memory] {name} ...", flush=True)
        try:
            r = run_row(name, config, devices, mesh, extra, args.timeout, args.tpu)
        except RuntimeError as e:
            # XLA:TPU refuses a program that exceeds the chip's HBM at compile time: a row,
            # not a crash of the whole table.
            r = failed_row(name, config, devices, mesh, extra, str(e))
            print(f"[aot_memory] {name}: FAILED: {r['error']}", flush=True)
        else:
            print(
                f"[aot_memory] {name}: peak {r['memory']['peak_bytes'] / 1e9:.2f} GB/device, "
                f"compile {r['compile_s']:.0f}s",
                flush=True,
            )
        reports.append(r)
        reports.sort(key=lambda x: order.get(x["name"], len(order)))
        # Written after every row: a long run can be inspected (or resumed by --only).
        with open(args.out + ".json", "w") as f:
            json.dump(reports, f, indent=2)
        with open(args.out + ".md", "w") as f:
            f.write(markdown(reports, args.tpu))
    return 0


if __name__ == "__main__":
    sys.exit(main())
