"""DFlash baseline: the same 2-layer backbone, no head, no confidence, CE only. Bundled
drafter; its shared budget and build commands: ``dspark_jax/train/bundled.py``."""

from dspark_jax.train.bundled import bundled_drafter_config


def get_config(budget: str = "compute"):
    return bundled_drafter_config("dflash", arm="dflash", budget=budget, gamma=7, num_layers=2)
