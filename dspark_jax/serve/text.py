"""Detokenisation and stop strings of one request's output (DESIGN §6).

``TextStream.add`` appends the tokens a round emitted, detokenises them incrementally
(UTF-8 characters split across tokens wait for their last byte), ends the output at a stop
id (EOS or another end-of-text marker, not part of the text) or before the first stop
string, and returns the piece that may be streamed now: text that could still turn out to
begin a stop string is held back until the next tokens decide.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from dspark_jax.tokenizer import IncrementalDecoder, Tokenizer

__all__ = ["TextStream", "find_stop", "holdback"]


class TextStream:
    """The output of one request: token ids, text, and how much of it was streamed."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: Collection[int], stops: Sequence[str]):
        self.detok = IncrementalDecoder(tokenizer)
        self.stop_ids = stop_ids
        self.stops = tuple(stops)
        self.token_ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of ``text`` already streamed

    def add(self, tokens: Sequence[int], device_reason: str | None = None):
        """Append ``tokens``; ``device_reason`` ("stop" / "length") when the device ended
        the sequence with them. Returns ``(ids taken, piece to stream, finish reason or
        None, ended by a stop string)``; tokens after a stop are not taken."""
        stops = self.stops
        new_ids: list[int] = []
        reason, by_stop_string = None, False
        for tok in tokens:
            new_ids.append(tok)
            self.token_ids.append(tok)
            if tok in self.stop_ids:
                reason = "stop"
                break
            self.text += self.detok.add(tok)
            cut = find_stop(self.text, stops, self.sent) if stops else None
            if cut is not None:
                self.text, reason, by_stop_string = self.text[:cut], "stop", True
                break
        if reason is None:
            reason = device_reason
        if reason is not None and not by_stop_string:
            # Generation is over: release text held back for an unfinished UTF-8 char.
            self.text += self.detok.flush()
            cut = find_stop(self.text, stops, self.sent) if stops else None
            if cut is not None:
                self.text = self.text[:cut]
        safe = len(self.text) if reason is not None else len(self.text) - holdback(self.text, stops)
        piece = self.text[self.sent : safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return new_ids, piece, reason, by_stop_string

    def drop_unsent(self) -> None:
        """Keep only what was streamed (a request cut short: cancelled, aborted, failed)."""
        self.text = self.text[: self.sent]


def find_stop(text: str, stops: Sequence[str], sent: int) -> int | None:
    """Index of the earliest stop string in ``text`` that is not inside already-streamed
    text (streamed text never contains a whole stop string, so search just before it)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, sent - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def holdback(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of ``text`` that could begin a stop string: they are not
    streamed until the next tokens decide."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    return keep
