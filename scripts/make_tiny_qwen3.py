"""Write a tiny random Qwen3 checkpoint (Hugging Face layout), offline: the stand-in for
"your own Qwen3" on which CI runs scripts/byo_qwen3.sh.

    python scripts/make_tiny_qwen3.py OUT_DIR [--writer auto|transformers|save_hf]

``auto`` writes the weights with ``transformers`` (``Qwen3ForCausalLM(config)
.save_pretrained``) when torch is importable, else with this package's ``save_hf``; either
way the tokenizer is a byte-level BPE trained on a few standard-library modules, with
Qwen3's special tokens and a ChatML chat template (``dspark_jax.testing.tiny_hf_qwen3``).
Its text is meaningless: it exists so that every step runs, not to measure anything.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--writer", default="auto", choices=["auto", "transformers", "save_hf"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from dspark_jax.testing import tiny_hf_qwen3

    info = tiny_hf_qwen3(args.out_dir, writer=args.writer, seed=args.seed)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
