"""MTP-1 baseline (DeepSeek-V3 style): one block, one draft token. Bundled drafter; its
shared budget and build commands: ``dspark_jax/train/bundled.py``."""

from dspark_jax.train.bundled import bundled_drafter_config


def get_config(budget: str = "compute"):
    # Same labels per step as DSpark/DFlash (see drafter_eagle3.py).
    return bundled_drafter_config(
        "mtp1", arm="mtp1", budget=budget, gamma=1, num_layers=1, sequence_positions="anchors"
    )
