"""text -> tokenize -> pack -> batch, as one checkpointable grain pipeline.

``MapDataset`` (array_record records, strided host shard, per-epoch shuffle, repeat,
tokenise) -> ``to_iter_dataset`` -> :class:`PackedSequenceIterDataset` -> ``batch``. The
returned ``DatasetIterator`` has ``get_state()/set_state()``; the state is a small
JSON-serialisable dict (record index + offset into the current document), so it can be
saved with the training checkpoint and restored to continue with exactly the same batches.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import grain
import numpy as np

from dspark_jax.data.corpus import make_text_dataset
from dspark_jax.data.packing import PackedSequenceIterDataset, pad_batch
from dspark_jax.tokenizer import Tokenizer


def _tokenize(record: dict, *, tokenizer: Tokenizer) -> np.ndarray:
    return np.asarray(tokenizer.encode(record["text"]), dtype=np.int32)


def make_packed_dataset(
    data_dir: str | os.PathLike,
    split: str,
    tokenizer: Tokenizer | str | os.PathLike,
    seq_len: int,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    num_epochs: int | None = None,
    *,
    shuffle: bool = True,
    name: str | None = None,
    num_threads: int = 2,
) -> grain.IterDataset:
    """The packed-batch ``IterDataset`` (``iter()`` it for a fresh iterator).

    ``num_epochs=None`` repeats forever (reshuffled every epoch); a finite value ends with
    a final batch padded to ``batch_size`` rows of padding, so every batch has the same
    shape ``[batch_size, seq_len]``.
    """
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = Tokenizer(tokenizer)
    ds = make_text_dataset(
        data_dir, split, seed=seed, shuffle=shuffle, shard_index=shard_index,
        shard_count=shard_count, name=name,
    )  # fmt: skip

    def pack(rows: grain.IterDataset) -> grain.IterDataset:
        return PackedSequenceIterDataset(
            rows, seq_len=seq_len, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id
        )

    return read_batches(
        ds,
        functools.partial(_tokenize, tokenizer=tokenizer),
        batch_size,
        num_epochs,
        pad_id=tokenizer.pad_id,
        num_threads=num_threads,
        regroup=pack,
    )


def read_batches(
    records: grain.MapDataset,
    to_row: Callable[[dict], object],
    batch_size: int,
    num_epochs: int | None,
    *,
    pad_id: int,
    num_threads: int = 2,
    regroup: Callable[[grain.IterDataset], grain.IterDataset] | None = None,
) -> grain.IterDataset:
    """The one grain reader of every training input: records (sharded, shuffled) ->
    repeat ``num_epochs`` (None = forever, reshuffled each epoch) -> ``to_row`` -> optional
    ``regroup`` of the row stream (packing) -> batches of exactly ``batch_size`` rows, a
    short last batch padded with rows of ``pad_id`` tokens and zeros elsewhere.
    Checkpointable: the iterator's ``get_state()/set_state()`` resume exactly."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be None (forever) or >= 1, got {num_epochs}")
    if num_epochs != 1:
        records = records.repeat(num_epochs)
    # A few threads overlap record reads and row work; grain keeps the order, so the
    # output does not depend on num_threads.
    rows = records.map(to_row).to_iter_dataset(
        grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=4 * batch_size)
    )
    if regroup is not None:
        rows = regroup(rows)
    batched = rows.batch(batch_size, drop_remainder=False)
    return batched.map(functools.partial(pad_batch, batch_size=batch_size, pad_id=pad_id))


def make_packed_batches(*args, **kwargs) -> grain.DatasetIterator:
    """``iter(make_packed_dataset(...))`` (same arguments): an iterator of ``{"tokens",
    "targets", "segment_ids", "positions", "loss_mask"}``, each ``int32 [batch_size,
    seq_len]`` (layout in :mod:`dspark_jax.data.packing`), with ``get_state/set_state``.

    Deterministic given ``seed``; ``shard_index/shard_count`` select this host's disjoint
    share of the records (e.g. ``jax.process_index()/jax.process_count()``).
    """
    return iter(make_packed_dataset(*args, **kwargs))
