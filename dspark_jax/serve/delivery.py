"""A request's host-side life once admitted: tokens in, text and events out, one result.

The engine loop hands each emitted token batch to the ``ActiveRequest`` that owns the
slot; this module decides what that means for the consumer (detokenised ``Delta``, stop
ids / stop strings, the finish reason, the final ``Result``), so the loop only owns slots
and rounds.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dspark_jax.decode.step import FINISH_EOS, FINISH_NONE
from dspark_jax.serve.handle import RequestHandle
from dspark_jax.serve.requests import (
    ContextLengthExceeded,
    Delta,
    InvalidRequest,
    Result,
    TokenLogprob,
)
from dspark_jax.serve.text import TextStream
from dspark_jax.tokenizer import Tokenizer

# Reasons that end a request before its natural end: text held back for stop strings is
# never sent (the request did not finish producing it).
_INTERRUPTED = ("cancelled", "abort", "error")


def encode_prompt(
    tokenizer: Tokenizer, prompt: str | Sequence[int], vocab_size: int, max_prompt: int, max_len
) -> list[int]:
    """Prompt ids of a text or token-id prompt; ``InvalidRequest`` names what is wrong."""
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, Sequence) and all(
        isinstance(x, int | np.integer) and not isinstance(x, bool) for x in prompt
    ):
        ids = [int(x) for x in prompt]
        if any(not 0 <= x < vocab_size for x in ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    else:
        raise InvalidRequest("prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise InvalidRequest("prompt is empty (it encodes to no tokens)", "prompt")
    if len(ids) > max_prompt:
        raise ContextLengthExceeded(max_len, len(ids), None, max_prompt)
    return ids


def unstarted_result(handle: RequestHandle, reason: str, message: str | None = None) -> Result:
    """The result of a request that never reached a slot (cancelled in the queue, shut
    down, engine failure)."""
    return Result(handle.id, "", [], reason, len(handle.prompt_ids), 0, 0, 0.0, 0.0, message)


class ActiveRequest:
    """Host-side progress of a request that owns a slot."""

    def __init__(self, handle: RequestHandle, tokenizer: Tokenizer):
        self.handle = handle
        stop_ids = set(tokenizer.stop_ids) | {int(i) for i in handle.params.stop_token_ids}
        self.stream = TextStream(tokenizer, stop_ids, handle.params.stop)
        self.stop_ids = stop_ids
        self.top_n = handle.params.logprobs  # None: logprobs not requested
        self.logprobs: list[TokenLogprob] | None = None if self.top_n is None else []
        self.done = False
        self.rounds = 0
        self.accepted = 0  # emitted tokens summed over rounds (for τ)
        self.verified = 0

    def count_round(self, emitted: int, verified: int) -> None:
        self.rounds += 1
        self.accepted += emitted
        self.verified += verified

    def emit(self, tokens: list[int], finish_code: int, lps=None) -> str | None:
        """Stream ``tokens`` (the device's ``finish_code`` for this slot; ``lps``: their
        ``(logprob [n], top ids [n, N], top logprobs [n, N])``); returns the finish reason if
        the request ends here (EOS / length from the device, or a stop id / stop string /
        max tokens found on the host), else ``None``."""
        device_reason = None
        if finish_code != FINISH_NONE:
            device_reason = "stop" if finish_code == FINISH_EOS else "length"
        new_ids, piece, reason, _ = self.stream.add(tokens, device_reason)
        if new_ids:
            self.handle._deliver(Delta(piece, new_ids, self._logprobs_of(new_ids, lps)))
        return reason

    def _logprobs_of(self, ids: list[int], lps) -> list[TokenLogprob] | None:
        """The requested logprobs of the tokens just taken (stop ids have none)."""
        if self.top_n is None or lps is None:
            return None
        logprob, top_ids, top_lps = lps
        got = [
            TokenLogprob(
                tok,
                float(logprob[i]),
                [(int(t), float(v)) for t, v in zip(top_ids[i, : self.top_n], top_lps[i])],
            )
            for i, tok in enumerate(ids)
            if tok not in self.stop_ids
        ]
        self.logprobs.extend(got)
        return got

    def result(self, reason: str, error: str | None = None) -> Result:
        """Mark the request done and build its final event (call once)."""
        self.done = True
        if reason in _INTERRUPTED:
            self.stream.drop_unsent()
        return Result(
            request_id=self.handle.id,
            text=self.stream.text,
            token_ids=list(self.stream.token_ids),
            finish_reason=reason,
            prompt_tokens=len(self.handle.prompt_ids),
            completion_tokens=len(self.stream.token_ids),
            rounds=self.rounds,
            mean_accepted_length=self.accepted / max(self.rounds, 1),
            mean_verified=self.verified / max(self.rounds, 1),
            error=error,
            logprobs=self.logprobs,
        )


def deliver_final(handle: RequestHandle, result: Result) -> None:
    """The last event of a request: ``done`` is set before the consumer sees it."""
    handle.done.set()
    handle._deliver(result)


__all__ = ["ActiveRequest", "deliver_final", "encode_prompt", "unstarted_result"]
