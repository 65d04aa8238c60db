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

PRESETS: dict[str, Qwen3Config] = {
    "qwen3-0.6b": Qwen3Config(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=True,
        **_QWEN3_COMMON,
    ),
    "qwen3-1.7b": Qwen3Config(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=True,
        **_QWEN3_COMMON,
    ),
    "qwen3-4b": Qwen3Config(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=True,
        **_QWEN3_COMMON,
    ),
    "qwen3-8b": Qwen3Config(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
        **_QWEN3_COMMON,
    ),
    "qwen3-14b": Qwen3Config(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        tie_word_embeddings=False,
        **_QWEN3_COMMON,
    ),
    # Test sizes: GQA with 2 query heads per KV head, small vocabulary.
    "tiny": Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10_000.0,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    # The bundled code model (~7M parameters with an 8192-token vocabulary).
    "pycode-small": Qwen3Config(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_theta=10_000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
}


def get_preset(name: str) -> Qwen3Config:
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; allowed presets: {sorted(PRESETS)}")
    return PRESETS[name]
