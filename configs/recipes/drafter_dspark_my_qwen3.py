"""DSpark drafter for your own Qwen3 checkpoint ("my model"): the recipe of
docs/guides/train-drafter.md and scripts/byo_qwen3.sh.

    python train.py --config configs/recipes/drafter_dspark_my_qwen3.py --workdir WD \
        --config.target.dir=MY_QWEN3_DIR --config.data.data_dir=DISTILL_DIR

The two overrides every run needs have no default here, so a run without them fails naming
the key: ``target.dir`` (your Hugging Face Qwen3 directory; its ``tokenizer.json`` is used)
and ``data.data_dir`` (what ``python -m dspark_jax.data.distill`` wrote). Any other key
takes ``--config.<section>.<key>=<value>`` the same way.

Sized for one accelerator host and any Qwen3 from 0.6B to 14B (the draft layers take the
target's width, so the drafter grows with it): DeepSpec's drafter shape (5 draft layers,
Markov head rank 256, confidence head, gamma = 7, taps spread over the target's layers), bf16
compute, frozen target stored in bf16, FSDP over every local device. What to change:

- ``data.seq_len``: the distilled record length, ``--prompt-len`` + ``--max-new-tokens``
  of ``dspark_jax.data.distill`` (128 + 256 here). It must be longer than ``--prompt-len``:
  only generated tokens are supervised.
- ``train.steps`` x ``data.batch_size``: about 2-4 passes over the distilled train records
  (2000 x 32 = 64k rows, i.e. 4 passes over 16k prompts). More data beats more passes:
  DeepSpec's released Qwen3 drafters saw 64 x 4096 tokens per step for 20k steps
  (configs/recipes/drafter_dspark_qwen3_8b.py, for a TPU slice).
- ``data.batch_size``: global; lower it (or set ``--config.drafter.remat=full``) if a step
  does not fit, and check first with ``python train.py ... --aot`` (docs/guides/plan-memory.md).
- ``drafter.mask_token``: the MASK placeholder of the parallel draft block must be a token
  of the target's tokenizer. Qwen3 has no ``<|mask|>``; ``<|fim_pad|>`` is a special token
  every Qwen3 tokenizer defines and chat text never contains. Use another special token of
  your ``tokenizer.json`` if you need that one.
"""

from dspark_jax.config import update_config
from dspark_jax.train.drafter_schema import drafter_default_config


def get_config():
    return update_config(
        drafter_default_config("dspark"),
        drafter=dict(gamma=7, num_layers=5, markov_rank=256, anchors_per_seq=32,
                     eval_anchors_per_seq=32, mask_token="<|fim_pad|>"),
        target=dict(dir="", dtype="bfloat16"),
        mesh=dict(data=1, fsdp=-1, tensor=1),
        data=dict(data_dir="", seq_len=384, batch_size=32),
        train=dict(compute_dtype="bfloat16", steps=2000, lr=6e-4, warmup_frac=0.04,
                   weight_decay=0.0, clip_norm=1.0, log_every=20, eval_every=250,
                   eval_batches=4, checkpoint_every=250),
    )  # fmt: skip
