"""Byte-level BPE training for the bundled models (DESIGN §8).

Byte-level (GPT-2 / Qwen style): every string maps to bytes first, so any text - including
unusual unicode - is encodable with no unknown token, and decoding restores it exactly. No
normaliser and no added prefix space, so ``decode(encode(s)) == s`` holds for source code
with its exact indentation.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from dspark_jax.tokenizer import EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, Tokenizer

SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, MASK_TOKEN)  # ids 0, 1, 2
_N_BYTES = 256


def build_byte_level_bpe() -> tokenizers.Tokenizer:
    """An untrained byte-level BPE pipeline (no normaliser, no prefix space)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # trim_offsets=False keeps character offsets covering the whitespace tokens too.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8192,
    *,
    out_path: str | os.PathLike,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> Tokenizer:
    """Trains a byte-level BPE on ``texts`` and writes ``tokenizer.json`` to ``out_path``.

    ``out_path`` may be a file path or an existing directory (``tokenizer.json`` is written
    inside). Special tokens ``<|endoftext|>``, ``<|pad|>``, ``<|mask|>`` get ids 0, 1, 2.
    Returns the loaded :class:`Tokenizer`.
    """
    min_vocab = _N_BYTES + len(SPECIAL_TOKENS)
    if vocab_size < min_vocab:
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least {min_vocab} "
            f"({_N_BYTES} byte symbols + {len(SPECIAL_TOKENS)} special tokens)"
        )
    out = Path(out_path)
    if out.is_dir():
        out = out / "tokenizer.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    counter = {"n": 0}

    def counted(it):
        for t in it:
            if not isinstance(t, str):
                raise ValueError(f"train_bpe_tokenizer expects str texts, got {type(t).__name__}")
            counter["n"] += 1
            yield t

    tok = build_byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet up front: unseen bytes stay encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(counted(texts), trainer=trainer)
    if counter["n"] == 0:
        raise ValueError("train_bpe_tokenizer got no texts (empty corpus)")
    tok.save(str(out))
    return Tokenizer(out)
