"""DFlash baseline: the same 2-layer backbone, no head, no confidence, CE only.

Bundled drafter (DESIGN §8) for the "pycode-small" target in ``assets/target`` (d = 256,
6 layers, vocab 8192, tied embeddings), trained on its self-distillation data in
``data/distill`` (``python -m dspark_jax.data.distill --target assets/target ...``).

    python train.py --config configs/drafter_dflash.py --workdir workdirs/drafter_dflash
    python -m dspark_jax.export --workdir workdirs/drafter_dflash --out assets/drafters/dflash

Equal budgets across the bundled drafters (DSpark, DSpark-RNN, DFlash, EAGLE-3, MTP-1):
same target, data, steps, batch (8 x 384 tokens = one 128-token prompt + 256 generated),
optimiser and schedule, set in one place: ``dspark_jax.train.bundled``.
"""

from dspark_jax.train.bundled import bundled_drafter_config


def get_config():
    cfg = bundled_drafter_config("dflash")
    d = cfg.drafter
    d.gamma = 7
    d.num_layers = 2
    return cfg
