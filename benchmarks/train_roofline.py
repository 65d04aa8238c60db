"""Roofline of the drafter training step on TPU slices, and what a DeepSpec-recipe run costs.

    python benchmarks/train_roofline.py --case 8b_v5p64 [--case ...] [--hlo-dir DIR]
    python benchmarks/train_roofline.py --case tiny_v5e4 --out /tmp/x   # seconds

Each case compiles ``train.py``'s DSpark training step with XLA:TPU for a named topology
(``dspark_jax.aot``; libtpu on this host, nothing allocated), the frozen target's layers and
every scan unrolled so XLA's cost analysis counts every layer, and models it
(``perf.train_roofline``): XLA's flops and bytes per chip beside the hand count, the
splash kernel's attention modelled, the collectives' bytes over ICI, the modelled step
time, MFU and the largest consumers. ``--hlo-dir`` keeps each compiled program's text and
cost so ``--reuse`` can re-model without recompiling (an 8B case compiles for minutes).

The cost table (``--costs``, from the cases in the result file) scales each size's
modelled step to DeepSpec's DSpark recipe (``RECIPE``) on v5p and v5e, for (a) the frozen
target run inside the step (this project) and (b) target features read from a cache at
``--cache-gbps`` per host. Writes ``benchmarks/results/train_roofline.json`` / ``.md``;
``python benchmarks/summarize.py`` puts the latter in ``docs/results/train-cost.md``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# name: (config under configs/, preset, topology, mesh data,fsdp,tensor, overrides)
CASES = {
    "tiny_v5e4": ("tiny/drafter_tiny.py:dspark", "tiny", "v5e:2x2", "1,4,1", {"data.batch_size": 4}),
    "4b_v5p64": ("recipes/drafter_dspark_qwen3_4b.py", "qwen3-4b", "v5p:4x4x4", "1,64,1", {}),
    "8b_v5p64": ("recipes/drafter_dspark_qwen3_8b.py", "qwen3-8b", "v5p:4x4x4", "1,64,1", {}),
    "14b_v5p64": ("recipes/drafter_dspark_qwen3_14b.py", "qwen3-14b", "v5p:4x4x4", "1,64,1", {}),
    # The same 64 chips as data 2 x fsdp 32: XLA:TPU writes the 64-way weight all-gathers of
    # fsdp 64 as all-reduces (twice the ring bytes); 32-way ones stay all-gathers.
    "8b_v5p64_d2": ("recipes/drafter_dspark_qwen3_8b.py", "qwen3-8b", "v5p:4x4x4", "2,32,1", {}),
    # DeepSpec's 512 anchors per sequence (fits v5p without remat: aot_memory_v5p.md).
    "8b_v5p64_a512": ("recipes/drafter_dspark_qwen3_8b.py", "qwen3-8b", "v5p:4x4x4", "1,64,1",
                      {"drafter.anchors_per_seq": 512}),
    "8b_v5p64_d2_a512": ("recipes/drafter_dspark_qwen3_8b.py", "qwen3-8b", "v5p:4x4x4", "2,32,1",
                         {"drafter.anchors_per_seq": 512}),
    "4b_v5p64_d2_a512": ("recipes/drafter_dspark_qwen3_4b.py", "qwen3-4b", "v5p:4x4x4", "2,32,1",
                         {"drafter.anchors_per_seq": 512}),
    "14b_v5p64_d2_a512": ("recipes/drafter_dspark_qwen3_14b.py", "qwen3-14b", "v5p:4x4x4", "2,32,1",
                          {"drafter.anchors_per_seq": 512}),
    # v5e's 16 GB: 512 anchors need the draft layers rematerialised.
    "8b_v5e64_d2_a512": ("recipes/drafter_dspark_qwen3_8b.py", "qwen3-8b", "v5e:8x8", "2,32,1",
                         {"drafter.anchors_per_seq": 512, "drafter.remat": "full"}),
    "8b_v5e64": ("recipes/drafter_dspark_qwen3_8b.py", "qwen3-8b", "v5e:8x8", "1,64,1", {}),
    # One sequence per chip as on the 64-chip slice, on a 4-chip slice (compiles faster).
    "8b_v5p4": ("recipes/drafter_dspark_qwen3_8b.py", "qwen3-8b", "v5p:2x2x1", "1,4,1",
                {"data.batch_size": 4, "data.num_shards": 4}),
    "8b_v5p4_a512": ("recipes/drafter_dspark_qwen3_8b.py", "qwen3-8b", "v5p:2x2x1", "1,4,1",
                     {"data.batch_size": 4, "data.num_shards": 4, "drafter.anchors_per_seq": 512,
                      "drafter.remat": "full"}),
    "8b_v5e4": ("recipes/drafter_dspark_qwen3_8b.py", "qwen3-8b", "v5e:2x2", "1,4,1",
                {"data.batch_size": 4, "data.num_shards": 4}),
}  # fmt: skip


def load_case(name: str):
    from dspark_jax.config import load_config

    config, preset, topology, mesh, overrides = CASES[name]
    cfg = load_config(os.path.join(ROOT, "configs", config))
    cfg.target.preset = preset
    cfg.target.dir = ""
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor = (int(x) for x in mesh.split(","))
    for key, value in overrides.items():
        section, field = key.split(".")
        cfg[section][field] = value
    return cfg, topology, mesh


def run_case(name: str, hlo_dir: str | None, reuse: bool) -> dict:
    from dspark_jax import aot
    from dspark_jax.perf import train_roofline as tr
    from dspark_jax.perf.roofline import cost_of

    cfg, topology, mesh_text = load_case(name)
    chip = topology.split(":")[0]
    saved = os.path.join(hlo_dir, name) if hlo_dir else None
    mesh = aot.aot_mesh(mesh_text, topology=topology)
    if reuse and saved and os.path.exists(saved + ".json"):
        with open(saved + ".json") as f:
            meta = json.load(f)
        with gzip.open(saved + ".hlo.gz", "rt") as f:
            hlo = f.read()
        report, xla = meta["report"], meta["xla"]
    else:
        t0 = time.perf_counter()
        report, compiled = tr.compile_unrolled(cfg, mesh)
        print(f"{name}: compiled in {time.perf_counter() - t0:.0f}s", flush=True)
        hlo, xla = compiled.as_text(), cost_of(compiled)
        del compiled
        if saved:
            os.makedirs(hlo_dir, exist_ok=True)
            with gzip.open(saved + ".hlo.gz", "wt") as f:
                f.write(hlo)
            with open(saved + ".json", "w") as f:
                json.dump({"report": report, "xla": xla}, f)
    res = tr.analyse(cfg, int(mesh.size), dict(mesh.shape), chip, hlo, xla, report)
    res.update(case=name, topology=topology, config=CASES[name][0], preset=CASES[name][1],
               libtpu=report.get("libtpu"), trainable_params=report["trainable_params"],
               frozen_params=report["frozen_params"])  # fmt: skip
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", choices=sorted(CASES), default=[])
    p.add_argument("--hlo-dir", default=None, help="keep compiled HLO + cost here")
    p.add_argument("--reuse", action="store_true", help="re-model from --hlo-dir")
    p.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "train_roofline"))
    args = p.parse_args(argv)
    from dspark_jax.perf import train_report
    from dspark_jax.perf.results import write_result

    previous = {}
    if os.path.exists(args.out + ".json"):
        with open(args.out + ".json") as f:
            previous = json.load(f).get("cases", {})
    cases = dict(previous)
    for name in args.case:
        res = run_case(name, args.hlo_dir, args.reuse)
        res["command"] = " ".join(
            ["python benchmarks/train_roofline.py", "--case", name]
            + (["--hlo-dir", "DIR"] if args.hlo_dir else [])
        )
        cases[name] = res
        print(train_report.case_line(res), flush=True)
        # Written after every case: an 8B compile takes minutes.
        write_result(args.out + ".json", {"cases": cases, **train_report.cost_table(cases)})
    res = write_result(args.out + ".json", {"cases": cases, **train_report.cost_table(cases)})
    md = train_report.to_markdown(res)
    with open(args.out + ".md", "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
