"""DSpark with the RNN sequential head (rank 256) + confidence head. Bundled drafter; its
shared budget and build commands: ``dspark_jax/train/bundled.py``."""

from dspark_jax.train.bundled import bundled_drafter_config


def get_config(budget: str = "compute"):
    # DESIGN's default rank, as for the Markov head; head_init as in drafter_dspark.py.
    return bundled_drafter_config(
        "dspark", arm="dspark_rnn", budget=budget, gamma=7, num_layers=2, head="rnn",
        rnn_rank=256, markov_rank=256, head_init="zero_bias",
    )  # fmt: skip
