"""Export a trained target from a training workdir as a Hugging Face Qwen3 directory.

    python -m dspark_jax.export --workdir DIR --out OUT [--step N] [--dtype bfloat16]

Reads ``DIR/config.json`` (written by ``train.py``), restores the chosen checkpoint (the
latest by default) and writes ``config.json``, ``generation_config.json``,
``model.safetensors`` (``dspark_jax.convert.save_hf``) and the run's ``tokenizer.json``
into ``OUT``, so the result loads like any Hugging Face directory. A drafter run
(``task = "drafter"``) exports a ``drafter_io`` directory (``drafter_config.json``,
``model.safetensors``) with a model card instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from dspark_jax.train.restore import load_run_config, restore_params


def export(workdir: str, out: str, step: int | None = None, dtype: str = "bfloat16") -> dict:
    from dspark_jax.convert import save_hf

    if load_run_config(workdir).get("task") == "drafter":  # a drafter_io directory + card
        from dspark_jax.train.drafter_task import export_drafter

        return export_drafter(workdir, out, step, dtype)

    cfg, model_config, step, params = restore_params(workdir, step)
    # The exported config describes the architecture; precision is the file dtype.
    model_config = model_config.replace(dtype="float32", param_dtype="float32")
    written = save_hf(out, model_config, params, dtype=dtype)
    tok = cfg.data.tokenizer
    if not tok or not os.path.isfile(tok):
        raise FileNotFoundError(f"Tokenizer of the run not found: {tok!r} (data.tokenizer)")
    dst = os.path.join(out, "tokenizer.json")
    shutil.copyfile(tok, dst)
    written.append(dst)
    return {"step": step, "out": os.path.abspath(out), "dtype": dtype, "files": written}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dspark_jax.export", description=__doc__)
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    from dspark_jax.cli import run_main

    def cli(args):
        print(json.dumps(export(args.workdir, args.out, args.step, args.dtype), indent=2))

    return run_main(cli, args)


if __name__ == "__main__":
    sys.exit(main())
