"""Data: local corpora as TFDS/array_record datasets, BPE training, packing, grain input."""

from dspark_jax.data.corpus import (
    HELDOUT,
    TRAIN,
    JsonlPromptCorpus,
    SourceTreeCorpus,
    default_stdlib_root,
    make_text_dataset,
    prepare_corpus,
)
from dspark_jax.data.packing import (
    PackedSequenceIterDataset,
    attention_mask_from_segments,
    targets_and_loss_mask,
)
from dspark_jax.data.pipeline import make_packed_batches, make_packed_dataset
from dspark_jax.data.tokenizer_train import train_bpe_tokenizer

__all__ = [
    "HELDOUT",
    "TRAIN",
    "JsonlPromptCorpus",
    "PackedSequenceIterDataset",
    "SourceTreeCorpus",
    "attention_mask_from_segments",
    "default_stdlib_root",
    "make_packed_batches",
    "make_packed_dataset",
    "make_text_dataset",
    "prepare_corpus",
    "targets_and_loss_mask",
    "train_bpe_tokenizer",
]
