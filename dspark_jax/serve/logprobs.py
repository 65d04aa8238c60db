"""Log-probabilities in the OpenAI response formats (``/v1/completions`` and chat).

The engine reports, per output token, the target's log-probability of it and of its most
likely alternatives (``TokenLogprob``; the target's own distribution, before temperature,
top-k and top-p). Here they become the two shapes OpenAI clients parse: the completions
API's parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``) and
the chat API's ``content`` list of ``{token, logprob, bytes, top_logprobs}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dspark_jax.serve.requests import TokenLogprob
from dspark_jax.tokenizer import Tokenizer

__all__ = ["chat_logprobs", "completion_logprobs", "token_text"]


def token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token as text and as its UTF-8 bytes. A token holding part of a multi-byte
    character is written ``bytes:\\xNN...``, as the OpenAI API writes it."""
    raw = tokenizer.token_bytes(token_id)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return text, list(raw)


def completion_logprobs(
    tokenizer: Tokenizer, lps: Sequence[TokenLogprob], offset: int = 0
) -> tuple[dict[str, Any], int]:
    """The completions API's ``logprobs`` object and the offset after its last token;
    ``offset``: characters of the output before these tokens (a stream's earlier chunks),
    for ``text_offset``."""
    tokens, offsets = [], []
    for lp in lps:
        text, _ = token_text(tokenizer, lp.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(tokenizer.decode([lp.token_id]))
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [
            {token_text(tokenizer, t)[0]: v for t, v in lp.top} if lp.top else None for lp in lps
        ],
        "text_offset": offsets,
    }, offset


def chat_logprobs(tokenizer: Tokenizer, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """The chat API's ``logprobs`` object."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in lps
        ],
        "refusal": None,
    }
