"""Train a model (the Qwen3 target, or a drafter task) from a Python config.

    python train.py --config configs/target_pycode.py --workdir workdirs/target_pycode \
        [--config.train.steps=100 ...] [--no-progress]

Re-running the same command on the same workdir resumes from the latest checkpoint.
Metrics go to ``<workdir>/metrics.jsonl``; the resolved config to ``<workdir>/config.json``.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    from dspark_jax.config import ConfigError, load_config, split_config_args

    argv = sys.argv[1:] if argv is None else argv
    try:
        spec, overrides, rest = split_config_args(argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog="train.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="checkpoints, metrics and configs")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    parser.add_argument(
        "--distributed", action="store_true", help="call jax.distributed.initialize() first"
    )
    args = parser.parse_args(rest)
    if spec is None:
        parser.error("--config FILE is required")

    import jax

    if args.distributed:
        jax.distributed.initialize()
    # Import the trainer first: it registers the task/precision choices the loader checks.
    from dspark_jax.train.trainer import train

    try:
        cfg = load_config(spec, overrides)
        summary = train(cfg, args.workdir, progress=not args.no_progress)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
