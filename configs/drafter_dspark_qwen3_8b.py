"""DSpark drafter for Qwen3-8B at DeepSpec's released size (DESIGN §3.2–3.4, §4).

5 draft layers of the target's width, Markov head rank 256, confidence head, γ = 7,
taps [1, 9, 17, 25, 33], loss 0.1·CE + 0.9·L1 + 1.0·BCE with decay 4.0, AdamW lr 6e-4.
Precision: bf16 compute, float32 drafter master weights and AdamW moments, frozen target
stored in bf16 (no master copy needed: it is never updated). Mesh: FSDP over every device
(drafter, its optimizer state and the frozen target are all sharded, ``embed`` axis).

Train (one process per host; see README "Training on a TPU pod / multi-GPU host"):
    python train.py --config configs/drafter_dspark_qwen3_8b.py --workdir WD \
        --config.target.dir=QWEN3_8B_DIR --config.data.data_dir=DISTILL_DIR [--distributed]
Compile only, for 64 chips, and report memory per device (nothing is allocated):
    python train.py --config configs/drafter_dspark_qwen3_8b.py --aot --aot-devices 64 \
        --aot-mesh 1,64,1 --aot-device-memory-gb 95

``target.preset`` gives the target's shape to ``--aot`` when ``target.dir`` holds no model.
"""

from dspark_jax.train.drafter_task import drafter_default_config


def get_config(preset: str = "qwen3-8b"):
    cfg = drafter_default_config("dspark")
    d = cfg.drafter
    d.gamma = 7
    d.num_layers = 5
    d.markov_rank = 256
    d.anchors_per_seq = 32
    d.eval_anchors_per_seq = 32
    cfg.target.dir = ""
    cfg.target.preset = preset
    cfg.target.dtype = "bfloat16"
    cfg.mesh.data = 1
    cfg.mesh.fsdp = -1
    cfg.mesh.tensor = 1
    cfg.data.seq_len = 4096
    cfg.data.batch_size = 64  # sequences per step (global): 262k tokens
    cfg.data.num_shards = 64  # fixed: the data order does not depend on the host count
    cfg.train.compute_dtype = "bfloat16"
    cfg.train.steps = 20000
    cfg.train.lr = 6e-4
    cfg.train.warmup_frac = 0.04
    cfg.train.weight_decay = 0.0
    cfg.train.clip_norm = 1.0
    cfg.train.log_every = 20
    cfg.train.eval_every = 1000
    cfg.train.eval_batches = 4
    cfg.train.checkpoint_every = 1000
    return cfg
