"""Train a model (the Qwen3 target, or a drafter task) from a Python config.

    python train.py --config configs/bundled/target_pycode.py --workdir workdirs/target_pycode \
        [--config.train.steps=100 ...] [--no-progress]

Re-running the same command on the same workdir resumes from the latest checkpoint.
Metrics go to ``<workdir>/metrics.jsonl``; the resolved config to ``<workdir>/config.json``.

Multi-host (one process per host, same command everywhere):
    python train.py ... --coordinator HOST0:1234 --num-processes N --process-id I
or ``--distributed`` alone on Cloud TPU / Slurm / Open MPI (auto-detected).

Ahead-of-time compile for a topology, nothing allocated (no --workdir needed):
    python train.py --config configs/recipes/drafter_dspark_qwen3_8b.py --aot --aot-topology v5p:4x4x4 \
        --aot-mesh 1,64,1 --aot-device-memory-gb 95 [--aot-serve --slots 64 --max-len 4096]
(``--aot-topology`` needs ``pip install -e '.[tpu]'``: XLA:TPU itself plans the memory;
``--aot-devices 64`` instead compiles for 64 fake CPU devices, an estimate.)
"""

from __future__ import annotations

import argparse
import json
import sys

CONFIG_HELP = """configuration:
  --config FILE          the Python config file (required), e.g. configs/tiny/drafter_tiny.py;
                         it defines get_config() returning the run's settings
  --config.KEY.SUB=VALUE override one setting of that config, e.g.
                           --config.train.steps=100 --config.target.dir=models/my-qwen3
                           --config.data.data_dir=data/my_distill
                         (repeatable; --config.KEY VALUE works too; a value is read as
                         the type of the setting it replaces: true/false, an integer, a
                         number, a Python list; an unknown key is an error naming it)
  configs/ holds the shipped ones, by audience (configs/README.md): bundled/, recipes/
  (real Qwen3 sizes, your own Qwen3), tiny/ (drafter_tiny.py: a small drafter for a quick run).
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="train.py",
        description=__doc__.split("\n\n")[0],
        usage="train.py --config FILE [--config.KEY=VALUE ...] [--workdir DIR] [options]",
        epilog=CONFIG_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--workdir", help="checkpoints, metrics and configs (required to train)")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    from dspark_jax import distributed

    distributed.add_arguments(parser, "training")
    a = parser.add_argument_group("ahead-of-time compilation (memory report, no allocation)")
    a.add_argument("--aot", action="store_true", help="compile the training step and report")
    a.add_argument(
        "--aot-topology",
        help="compile with XLA:TPU for a named TPU topology this host does not have, e.g. "
        "v5e:2x2, v5p:2x2x1, v5p:4x4x4, v6e:2x2 (needs libtpu: pip install -e '.[tpu]')",
    )
    a.add_argument(
        "--aot-devices", type=int, help="compile for N fake CPU devices (default: real devices)"
    )
    a.add_argument(
        "--aot-mesh", help="data,fsdp,tensor sizes, one may be -1 (default: the config's mesh)"
    )
    a.add_argument(
        "--aot-device-memory-gb",
        type=float,
        default=95.0,
        help="per-device memory to check against (95 = TPU v5p, 141 = H200)",
    )
    a.add_argument("--aot-serve", action="store_true", help="compile the serving decode round")
    a.add_argument("--slots", type=int, default=64, help="--aot-serve: request slots R")
    a.add_argument("--max-len", type=int, default=4096, help="--aot-serve: KV cache length")
    a.add_argument("--aot-out", help="also write the report as JSON to this file")
    return parser


def main(argv=None) -> int:
    from dspark_jax.cli import run_main

    return run_main(_main, sys.argv[1:] if argv is None else argv)


def _main(argv) -> int:
    from dspark_jax.config import load_config, split_config_args

    spec, overrides, rest = split_config_args(argv)
    parser = _parser()
    args = parser.parse_args(rest)
    if spec is None:
        parser.error("--config FILE is required")
    if args.aot_serve:
        args.aot = True
    if not args.aot and not args.workdir:
        parser.error("--workdir is required (except with --aot)")

    from dspark_jax import aot
    from dspark_jax.train import distributed as dist

    if args.aot_topology and args.aot_devices:
        parser.error("give --aot-topology (XLA:TPU) or --aot-devices (fake CPU devices), not both")
    if args.aot_topology and not args.aot:
        parser.error("--aot-topology needs --aot or --aot-serve")
    if args.aot:
        # Must precede the first JAX computation: the fake devices are created then.
        aot.configure_devices(args.aot_devices)
    else:
        dist.initialize(args.coordinator, args.num_processes, args.process_id, args.distributed)
    # Import the trainer first: it registers the task/precision choices the loader checks.
    from dspark_jax.train.trainer import train

    cfg = load_config(spec, overrides)
    if args.aot:
        report = aot.run_cli(cfg, args)
        print(aot.format_report(report))
        if args.aot_out:
            with open(args.aot_out, "w") as f:
                json.dump(report, f, indent=2)
        return 0
    summary = train(cfg, args.workdir, progress=not args.no_progress)
    print(json.dumps(summary, default=str), flush=True)
    dist.finalize()  # every process leaves the distributed runtime together
    return 0


if __name__ == "__main__":
    sys.exit(main())
