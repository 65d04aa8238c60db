"""Thin wrapper over a Hugging Face `tokenizers` ``tokenizer.json`` (DESIGN §2).

The same file format is used by the locally trained BPE of the bundled models and by Qwen3
checkpoints, so one class serves both. Special tokens are resolved by *name* and a missing
one is an error that lists what the file does define, because a silently substituted id
(e.g. a pad or mask token that is really EOS) corrupts training masks and drafter inputs.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
# EOS names tried in order when none is given: our BPE and Qwen3 base models use
# <|endoftext|>; Qwen3 chat models end a turn with <|im_end|>.
DEFAULT_EOS_CANDIDATES = (EOS_TOKEN, "<|im_end|>")
TOKENIZER_FILENAME = "tokenizer.json"


def resolve_tokenizer_path(path: str | os.PathLike) -> Path:
    """Returns the ``tokenizer.json`` for a file path or a directory containing one."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKENIZER_FILENAME
    if not p.is_file():
        raise FileNotFoundError(
            f"Tokenizer file not found: {p} (pass a tokenizer.json or a directory containing one)"
        )
    return p


class Tokenizer:
    """A ``tokenizer.json`` with named special tokens.

    Args:
      path: a ``tokenizer.json`` file or a directory that contains one (e.g. a HF model dir).
      eos_token: EOS name; default: the first of ``<|endoftext|>``, ``<|im_end|>`` present.
      pad_token: pad name; default ``<|pad|>``. If the default is absent (Qwen3 ships none),
        EOS is used as pad **with a warning**; an explicitly requested name must exist.
      mask_token: mask name for the DFlash/DSpark block inputs; default ``<|mask|>``. An
        explicit name must exist now; with the default, ``mask_id`` raises on access if absent.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        eos_token: str | None = None,
        pad_token: str | None = None,
        mask_token: str | None = None,
    ):
        self.path = resolve_tokenizer_path(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # the Rust error text is terse; name the file
            raise ValueError(f"Could not parse tokenizer file {self.path}: {e}") from e

        if eos_token is None:
            present = [t for t in DEFAULT_EOS_CANDIDATES if self._tok.token_to_id(t) is not None]
            if not present:
                self._missing(" or ".join(DEFAULT_EOS_CANDIDATES), "EOS")
            eos_token = present[0]
        self.eos_token = eos_token
        self.eos_id = self._require(eos_token, "EOS")

        if pad_token is None:
            if self._tok.token_to_id(PAD_TOKEN) is not None:
                pad_token = PAD_TOKEN
            else:
                warnings.warn(
                    f"{self.path} defines no {PAD_TOKEN!r}; using EOS {eos_token!r} as pad. "
                    "Pass pad_token= to choose another.",
                    stacklevel=2,
                )
                pad_token = eos_token
        self.pad_token = pad_token
        self.pad_id = self._require(pad_token, "pad")

        self._mask_explicit = mask_token is not None
        self.mask_token = mask_token if mask_token is not None else MASK_TOKEN
        self._mask_id = self._tok.token_to_id(self.mask_token)
        if self._mask_explicit and self._mask_id is None:
            self._missing(self.mask_token, "mask")

        # Every end-of-text marker the file defines: serving stops on any of them.
        stops = {self.eos_id}
        for name in DEFAULT_EOS_CANDIDATES:
            tid = self._tok.token_to_id(name)
            if tid is not None:
                stops.add(tid)
        self.stop_ids: tuple[int, ...] = tuple(sorted(stops))

    # -- special tokens -----------------------------------------------------------------
    @property
    def special_tokens(self) -> dict[str, int]:
        """Name -> id of every added token flagged special in the file."""
        return {
            t.content: i
            for i, t in sorted(self._tok.get_added_tokens_decoder().items())
            if t.special
        }

    def _missing(self, name: str, role: str):
        defined = ", ".join(self.special_tokens) or "(none)"
        raise ValueError(
            f"{role} token {name!r} is not in {self.path}; special tokens defined there: "
            f"{defined}. Pass {role.lower()}_token=<one of them> or add the token to the file."
        )

    def _require(self, name: str, role: str) -> int:
        tid = self._tok.token_to_id(name)
        if tid is None:
            self._missing(name, role)
        return tid

    @property
    def mask_id(self) -> int:
        if self._mask_id is None:
            self._missing(self.mask_token, "mask")
        return self._mask_id

    @property
    def has_mask(self) -> bool:
        return self._mask_id is not None

    # -- encode / decode ----------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids incl. added tokens (max id + 1), i.e. the embedding rows needed."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS added: packing inserts EOS itself, Qwen3 uses no BOS.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may hold part of a UTF-8
        character, which ``decode([id])`` would turn into U+FFFD)."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary ({self.vocab_size})")
        special = int(token_id) in self.special_tokens.values()
        if isinstance(self._tok.decoder, tokenizers.decoders.ByteLevel) and not special:
            table = _byte_level_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return self.decode([token_id]).encode("utf-8")

    def __repr__(self) -> str:
        return (
            f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eos={self.eos_token!r}"
            f", pad={self.pad_token!r}, mask={self.mask_token if self.has_mask else None!r})"
        )


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins, inverted: every byte is written as one
    character, printable ASCII and Latin-1 as themselves, the other 68 bytes (controls,
    space, soft hyphen, ...) as the code points from U+0100 on, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in set(printable)]
    table = {chr(b): b for b in printable}
    table.update({chr(0x100 + i): b for i, b in enumerate(rest)})
    return table


class IncrementalDecoder:
    """Streams text for token ids fed one at a time.

    Byte-level BPE can split one multi-byte UTF-8 character over several tokens; decoding a
    prefix then yields U+FFFD. We decode a small window ``ids[prefix:]`` (not the whole
    sequence, so cost stays O(window) per token) and emit only the text beyond what the
    window's first part already produced, holding everything back while the window's text
    ends in U+FFFD. The window starts one emitted chunk back so decoders that treat the
    first token specially (e.g. a Metaspace leading space) see the same context.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids before this index have been emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Feeds one id; returns the newly completed text (possibly empty)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            out = new_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self._ids)
            return out
        return ""

    def flush(self) -> str:
        """Returns whatever is still held back (a genuinely incomplete char becomes U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]

    @property
    def ids(self) -> list[int]:
        return list(self._ids)
