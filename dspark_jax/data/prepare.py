"""CLI: build a corpus into array_record files and optionally train a BPE tokenizer on it.

    python -m dspark_jax.data.prepare --kind source_tree --data-dir /work/data/stdlib \
        --train-tokenizer --vocab-size 8192

``--source`` defaults to the running Python's stdlib for ``source_tree``; for ``jsonl`` it
is a file, a directory of ``*.jsonl`` or a glob. The tokenizer is trained on the train split
only and written to ``--tokenizer-out`` (default ``<data-dir>/tokenizer.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

from dspark_jax.data.corpus import (
    BUILDERS,
    DEFAULT_HELDOUT_PERCENT,
    TRAIN,
    find_dataset_dir,
    make_text_dataset,
    prepare_corpus,
    read_metadata,
)
from dspark_jax.data.tokenizer_train import train_bpe_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.data.prepare", description=__doc__)
    p.add_argument("--kind", choices=sorted(BUILDERS), required=True)
    p.add_argument("--source", default=None, help="corpus root / jsonl file, dir or glob")
    p.add_argument("--data-dir", required=True, help="TFDS data dir to write into")
    p.add_argument("--heldout-percent", type=float, default=DEFAULT_HELDOUT_PERCENT)
    p.add_argument("--overwrite", action="store_true", help="rebuild even if already built")
    p.add_argument("--train-tokenizer", action="store_true")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--tokenizer-out", default=None)
    p.add_argument("--progress", action="store_true", help="show TFDS progress bars")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from dspark_jax.cli import run_main

    return run_main(run, parse_args(argv))


def run(args: argparse.Namespace) -> dict:
    """Build the corpus (and tokenizer); prints and returns the JSON report."""
    t0 = time.perf_counter()
    # TFDS prints its progress to stdout; keep stdout for the JSON report.
    with contextlib.redirect_stdout(sys.stderr):
        counts = prepare_corpus(
            args.kind,
            args.source,
            args.data_dir,
            heldout_percent=args.heldout_percent,
            overwrite=args.overwrite,
            progress=args.progress,
        )
    ds_dir = find_dataset_dir(args.data_dir, args.kind)
    meta = read_metadata(ds_dir)
    report = {
        "dataset_dir": str(ds_dir),
        "source": meta.get("source"),
        "records": counts,
        "chars": meta.get("num_chars"),
        "skipped_non_utf8": meta.get("skipped_non_utf8"),
        "skipped_empty": meta.get("skipped_empty"),
        "prepare_seconds": round(time.perf_counter() - t0, 2),
    }
    if args.train_tokenizer:
        out = Path(args.tokenizer_out or Path(args.data_dir) / "tokenizer.json")
        train_ds = make_text_dataset(args.data_dir, TRAIN, shuffle=False, name=args.kind)
        t1 = time.perf_counter()
        tok = train_bpe_tokenizer(
            (r["text"] for r in train_ds), args.vocab_size, out_path=out, show_progress=False
        )
        t_train = time.perf_counter() - t1
        # chars/token over the train split, measured with the trained tokenizer.
        n_chars = n_tokens = 0
        for r in train_ds:
            n_chars += len(r["text"])
            n_tokens += len(tok.encode(r["text"]))
        report["tokenizer"] = {
            "path": str(tok.path),
            "vocab_size": tok.vocab_size,
            "train_seconds": round(t_train, 2),
            "train_tokens": n_tokens,
            "chars_per_token": round(n_chars / max(n_tokens, 1), 3),
        }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    sys.exit(main())
