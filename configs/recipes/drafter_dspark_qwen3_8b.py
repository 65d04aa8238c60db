"""DSpark drafter for Qwen3-8B at DeepSpec's released size (DESIGN §3.2–3.4, §4).

5 draft layers of the target's width, Markov head rank 256, confidence head, γ = 7,
taps [1, 9, 17, 25, 33], loss 0.1·CE + 0.9·L1 + 1.0·BCE with decay 4.0, AdamW lr 6e-4.
Precision: bf16 compute, float32 drafter master weights and AdamW moments, frozen target
stored in bf16 (no master copy needed: it is never updated). Mesh: FSDP over every device
(drafter, its optimizer state and the frozen target are all sharded, ``embed`` axis).

Train (one process per host; see README "Training on a TPU pod / multi-GPU host"):
    python train.py --config configs/recipes/drafter_dspark_qwen3_8b.py --workdir WD \
        --config.target.dir=QWEN3_8B_DIR --config.data.data_dir=DISTILL_DIR [--distributed]
Compile only, for 64 chips, and report memory per device (nothing is allocated):
    python train.py --config configs/recipes/drafter_dspark_qwen3_8b.py --aot --aot-devices 64 \
        --aot-mesh 1,64,1 --aot-device-memory-gb 95

``target.preset`` gives the target's shape to ``--aot`` when ``target.dir`` holds no model.
"""

from dspark_jax.config import update_config
from dspark_jax.train.drafter_schema import drafter_default_config


def get_config(preset: str = "qwen3-8b"):
    return update_config(
        drafter_default_config("dspark"),
        drafter=dict(gamma=7, num_layers=5, markov_rank=256, anchors_per_seq=32,
                     eval_anchors_per_seq=32),
        target=dict(dir="", preset=preset, dtype="bfloat16"),
        mesh=dict(data=1, fsdp=-1, tensor=1),
        # 64 sequences per step (global): 262k tokens; 64 data shards, fixed, so the data
        # order does not depend on the host count.
        data=dict(seq_len=4096, batch_size=64, num_shards=64),
        train=dict(compute_dtype="bfloat16", steps=20000, lr=6e-4, warmup_frac=0.04,
                   weight_decay=0.0, clip_norm=1.0, log_every=20, eval_every=1000,
                   eval_batches=4, checkpoint_every=1000),
    )  # fmt: skip
