"""Tiny drafter runs for tests and smoke checks: ``--config configs/tiny/drafter_tiny.py:KIND``
with KIND in dspark | dspark_rnn | dflash | eagle3 | mtp1 (default dspark).

    python train.py --config configs/tiny/drafter_tiny.py:dspark --workdir /tmp/d \
        --config.target.dir=TARGET_HF_DIR --config.data.data_dir=DISTILL_DIR
"""

from dspark_jax.config import update_config
from dspark_jax.models.drafter_config import drafter_kind
from dspark_jax.testing import smoke_schedule
from dspark_jax.train.drafter_schema import drafter_default_config


def get_config(kind: str = "dspark"):
    head = None
    if kind == "dspark_rnn":
        kind, head = "dspark", "rnn"
    return update_config(
        drafter_default_config(kind),
        drafter=dict(gamma=1 if drafter_kind(kind).single_token else 4, num_layers=1, head=head, markov_rank=16,
                     rnn_rank=16, anchors_per_seq=4, eval_anchors_per_seq=4),
        target=dict(dir=""),
        data=dict(data_dir="", seq_len=32, batch_size=8),
        train=smoke_schedule(steps=12, eval_every=6, eval_batches=1, checkpoint_every=4),
    )  # fmt: skip
