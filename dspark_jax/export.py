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

import flax.linen as nn
import jax
import numpy as np

from dspark_jax.train.restore import load_run_config, restore_params

CARD_NAME = "README.md"  # the drafter's model card, and its fields as JSON
CARD_JSON = "model_card.json"


def export(workdir: str, out: str, step: int | None = None, dtype: str = "bfloat16") -> dict:
    from dspark_jax.convert import save_hf

    if load_run_config(workdir).get("task") == "drafter":  # a drafter_io directory + card
        return export_drafter(workdir, out, step, dtype)

    cfg, model_config, step, params, _ = restore_params(workdir, step)
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


def count_params(params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nn.unbox(params))))


def export_drafter(workdir: str, out: str, step: int | None = None, dtype: str = "float32"):
    """Write a trained drafter as a ``drafter_io`` directory plus a model card."""
    from dspark_jax.models.drafter_io import save_drafter
    from dspark_jax.train.trainer import make_task, read_metrics

    cfg, tcfg, step, params, meta = restore_params(workdir, step, tasks=("drafter",))
    task = make_task(cfg)
    dc = task.drafter_config
    tcfg = tcfg.replace(dtype="float32", param_dtype="float32", remat="none")
    fingerprint = meta.get("target_fingerprint")
    # A calibration belongs to the weights it was fitted on: re-exporting over a drafter
    # directory drops its sts.json (and label arrays) rather than keep a stale fit.
    from dspark_jax.models.drafter_io import sts_data_path, sts_path

    stale = [p for p in (sts_path(out), sts_data_path(sts_path(out))) if p.is_file()]
    for p in stale:
        p.unlink()
    written = save_drafter(out, dc, tcfg, params, dtype=dtype, target_fingerprint=fingerprint)
    evals = [m for m in read_metrics(workdir) if m.get("kind") == "eval" and m["step"] <= step]
    last = evals[-1] if evals else {}
    card = {
        "kind": dc.kind,
        "drafter_config": dc.to_dict(),
        "parameters": count_params(params),
        "steps": int(step),
        "batch_size": cfg.data.batch_size,
        "seq_len": cfg.data.seq_len,
        "target": cfg.target.dir,
        "target_fingerprint": fingerprint,
        "data": cfg.data.data_dir,
        "loss": cfg.loss.to_dict(),
        "heldout": {k: v for k, v in last.items() if k.startswith("heldout")},
        "heldout_step": last.get("step"),
        "weights_dtype": dtype,
    }
    with open(os.path.join(out, CARD_JSON), "w") as f:
        json.dump(card, f, indent=2)
        f.write("\n")
    written.append(os.path.join(out, CARD_JSON))
    lines = [
        f"# {dc.kind} drafter",
        "",
        f"- kind: `{dc.kind}`, γ = {dc.gamma}, layers = {dc.num_layers}, taps = {dc.taps}, "
        f"head = {dc.head}, confidence = {dc.confidence}",
        f"- parameters: {card['parameters']:,} (trainable; the target's embedding / LM head "
        "are shared and frozen)",
        f"- trained: {step} steps x {cfg.data.batch_size} sequences x {cfg.data.seq_len} "
        f"tokens on `{cfg.data.data_dir}` against `{cfg.target.dir}`",
        f"- command: `python train.py --config <config> --workdir {workdir}` then "
        f"`python -m dspark_jax.export --workdir {workdir} --out {out}`",
        "",
        f"Held-out teacher-forced acceptance Σ min(p_t, p_d) at T = 1 (step {last.get('step')}):",
        "",
        "| k | " + " | ".join(str(k) for k in range(1, dc.draft_len + 1)) + " |",
        "|---|" + "---|" * dc.draft_len,
        "| α_k | "
        + " | ".join(
            f"{last.get(f'heldout_accept_k{k}', float('nan')):.3f}"
            for k in range(1, dc.draft_len + 1)
        )  # fmt: skip
        + " |",
        "",
        f"τ_tf (teacher-forced accepted length) = {last.get('heldout_tau_tf', float('nan')):.3f}",
    ]
    if "heldout_conf_ece" in last:
        lines.append(
            f"Confidence: BCE {last['heldout_conf_bce']:.4f}, ECE {last['heldout_conf_ece']:.4f}"
        )
    with open(os.path.join(out, CARD_NAME), "w") as f:
        f.write("\n".join(lines) + "\n")
    written.append(os.path.join(out, CARD_NAME))
    return {"step": step, "out": os.path.abspath(out), "dtype": dtype, "files": written,
            "kind": dc.kind, "parameters": card["parameters"],
            "removed_stale_calibration": [str(p) for p in stale]}  # fmt: skip


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
