"""EAGLE-3 baseline: one fused-input layer, training-time test over γ = 7. Bundled
drafter; its shared budget and build commands: ``dspark_jax/train/bundled.py``."""

from dspark_jax.train.bundled import bundled_drafter_config


def get_config(budget: str = "compute"):
    # Same labels per step as DSpark/DFlash: only the sampled anchors' states are scored
    # (LM head only there); "all" positions costs ~6x more per step on CPU (measured).
    return bundled_drafter_config(
        "eagle3", arm="eagle3", budget=budget, gamma=7, num_layers=1, sequence_positions="anchors"
    )
