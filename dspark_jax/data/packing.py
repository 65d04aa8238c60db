"""Concatenate-and-split packing of tokenised documents into fixed-length rows.

Layout of one packed row of length ``L`` (all ``int32``, shape ``[L]``):

* ``tokens``: the stream ``doc_1 EOS doc_2 EOS ...`` cut every ``L`` tokens; the tail of a
  finite stream is padded with ``pad_id``.
* ``segment_ids``: ``1..n`` numbering the document pieces inside the row, ``0`` = padding.
  A document that does not fit continues in the next row as that row's segment 1.
* ``positions``: restart at ``0`` at every segment start (a document start or a row start).
  The target uses RoPE, whose attention scores depend only on position *differences*, so
  restarting for a continued piece changes nothing inside the piece and keeps every
  position ``< L``.
* ``targets``: next token *within the same segment*: ``targets[t] = tokens[t + 1]`` when
  ``segment_ids[t + 1] == segment_ids[t] != 0``, else ``pad_id``.
* ``loss_mask``: 1 exactly where ``targets`` is defined, i.e. 0 on padding, 0 on the last
  token of every segment (a document's EOS, whose successor is another document, or the
  last token of a row whose continuation is in the next row).

Attention must then be restricted to ``segment_ids[q] == segment_ids[k] != 0`` and
``k <= q`` (see :func:`attention_mask_from_segments`), so no token attends across a
document boundary. The EOS stays inside its document's segment, so the model learns to
emit EOS after a document's last token.

The iterator is a grain ``DatasetIterator``; its state is the parent state *before* the
document currently being consumed plus the offset into it, so it is small (no token data)
and restoring re-reads and re-tokenises just that one document.
"""

from __future__ import annotations

from typing import Any

import grain
import numpy as np

PACKED_KEYS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


def targets_and_loss_mask(
    tokens: np.ndarray, segment_ids: np.ndarray, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Next-token targets within a segment and the matching loss mask (last axis = seq)."""
    seg = segment_ids
    same = (seg[..., 1:] == seg[..., :-1]) & (seg[..., :-1] != 0)
    loss_mask = np.zeros_like(seg, dtype=np.int32)
    loss_mask[..., :-1] = same
    targets = np.full_like(tokens, pad_id, dtype=np.int32)
    targets[..., :-1] = np.where(same, tokens[..., 1:], pad_id)
    return targets, loss_mask


def attention_mask_from_segments(segment_ids: np.ndarray) -> np.ndarray:
    """Boolean ``[..., L, L]`` mask: causal, within one segment, never to/from padding."""
    seg = np.asarray(segment_ids)
    q = seg[..., :, None]
    k = seg[..., None, :]
    length = seg.shape[-1]
    causal = np.tril(np.ones((length, length), dtype=bool))
    return (q == k) & (q != 0) & causal


class _PackIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, *, seq_len: int, eos_id: int, pad_id: int):
        super().__init__(parent)
        self._seq_len = seq_len
        self._eos = np.asarray([eos_id], np.int32)
        self._pad_id = pad_id
        self._arange = np.arange(seq_len, dtype=np.int32)
        self._doc: np.ndarray | None = None  # current document incl. trailing EOS
        self._doc_state: Any = None  # parent state just before `_doc` was read
        self._offset = 0  # tokens of `_doc` already emitted

    def _load_next_doc(self) -> None:
        while True:
            state = self._parent.get_state()
            toks = np.asarray(next(self._parent), dtype=np.int32)  # StopIteration propagates
            if toks.ndim != 1:
                raise ValueError(f"packing expects 1-D token arrays, got shape {toks.shape}")
            if toks.size:  # empty documents would only add a lone EOS
                self._doc = np.concatenate([toks, self._eos])
                self._doc_state = state
                self._offset = 0
                return

    def __next__(self) -> dict[str, np.ndarray]:
        n = self._seq_len
        tokens = np.full(n, self._pad_id, np.int32)
        seg = np.zeros(n, np.int32)
        pos = np.zeros(n, np.int32)
        fill = 0
        n_seg = 0
        while fill < n:
            if self._doc is None:
                try:
                    self._load_next_doc()
                except StopIteration:
                    break
            take = min(n - fill, self._doc.size - self._offset)
            tokens[fill : fill + take] = self._doc[self._offset : self._offset + take]
            n_seg += 1
            seg[fill : fill + take] = n_seg
            pos[fill : fill + take] = self._arange[:take]
            fill += take
            self._offset += take
            if self._offset == self._doc.size:
                self._doc = None
        if fill == 0:
            raise StopIteration
        targets, loss_mask = targets_and_loss_mask(tokens, seg, self._pad_id)
        return {
            "tokens": tokens,
            "targets": targets,
            "segment_ids": seg,
            "positions": pos,
            "loss_mask": loss_mask,
        }

    def get_state(self) -> dict[str, Any]:
        if self._doc is None:
            return {"parent": self._parent.get_state(), "offset": -1}
        return {"parent": self._doc_state, "offset": int(self._offset)}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        self._doc = None
        if state["offset"] >= 0:
            try:
                self._load_next_doc()
            except StopIteration as e:
                raise ValueError(f"cannot restore packing state {state}: parent ended") from e
            if state["offset"] >= self._doc.size:
                raise ValueError(
                    f"cannot restore packing state {state}: document has {self._doc.size} "
                    "tokens (the data or tokenizer changed since the state was saved?)"
                )
            self._offset = int(state["offset"])


class PackedSequenceIterDataset(grain.IterDataset):
    """Packs a dataset of 1-D token-id arrays into rows of ``seq_len`` (see module doc)."""

    def __init__(self, parent: grain.IterDataset, *, seq_len: int, eos_id: int, pad_id: int):
        super().__init__(parent)
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (one input and one target), got {seq_len}")
        self._seq_len = int(seq_len)
        self._eos_id = int(eos_id)
        self._pad_id = int(pad_id)

    def __iter__(self) -> grain.DatasetIterator:
        return _PackIterator(
            self._parent.__iter__(),
            seq_len=self._seq_len,
            eos_id=self._eos_id,
            pad_id=self._pad_id,
        )

    def __str__(self) -> str:
        return f"PackedSequenceIterDataset(seq_len={self._seq_len})"


def pad_batch(batch: dict[str, np.ndarray], batch_size: int, pad_id: int) -> dict:
    """Pads a short final batch to ``batch_size`` rows of padding (segment 0, no loss)."""
    rows = next(iter(batch.values())).shape[0]
    if rows == batch_size:
        return batch
    out = {}
    for k, v in batch.items():
        fill = pad_id if k in ("tokens", "targets") else 0
        extra = np.full((batch_size - rows, *v.shape[1:]), fill, v.dtype)
        out[k] = np.concatenate([v, extra], axis=0)
    return out
