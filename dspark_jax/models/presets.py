"""Named Qwen3 sizes.

The real family matches the Hugging Face ``config.json`` of ``Qwen/Qwen3-*`` (hidden size,
MLP width, depth, heads, KV heads, head_dim 128, vocab 151936, rope theta 1e6, RMSNorm eps
1e-6, 40960 positions; embeddings tied up to 4B, untied from 8B). The tiny sizes exist for
tests and the bundled models.
"""

from __future__ import annotations

from dspark_jax.models.qwen3 import Qwen3Config

_QWEN3_COMMON = dict(
    vocab_size=151936,
    head_dim=128,
    num_key_value_heads=8,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_id=151645,
)

# The small test-bed sizes: 4 query heads over 2 KV heads, RoPE theta 1e4.
_SMALL = dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=10_000.0)

# name: (hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, tied)
_QWEN3_SIZES = {
    "qwen3-0.6b": (1024, 3072, 28, 16, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, True),
    "qwen3-4b": (2560, 9728, 36, 32, True),
    "qwen3-8b": (4096, 12288, 36, 32, False),
    "qwen3-14b": (5120, 17408, 40, 40, False),
}

# fmt: off
PRESETS: dict[str, Qwen3Config] = {
    **{
        name: Qwen3Config(
            hidden_size=d, intermediate_size=f, num_hidden_layers=n_layers,
            num_attention_heads=heads, tie_word_embeddings=tied, **_QWEN3_COMMON,
        )
        for name, (d, f, n_layers, heads, tied) in _QWEN3_SIZES.items()
    },
    # Test sizes: GQA with 2 query heads per KV head, small vocabulary.
    "tiny": Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        head_dim=16, max_position_embeddings=256, tie_word_embeddings=False, **_SMALL,
    ),
    # The bundled code model (~7M parameters with an 8192-token vocabulary).
    "pycode-small": Qwen3Config(
        vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
        head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True, **_SMALL,
    ),
}
# fmt: on


def get_preset(name: str) -> Qwen3Config:
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; allowed presets: {sorted(PRESETS)}")
    return PRESETS[name]
