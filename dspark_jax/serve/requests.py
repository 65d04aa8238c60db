"""Request and response types of the serving engine, and request validation (DESIGN §6).

``SamplingParams.validate`` turns every bad field into an ``InvalidRequest`` naming it (the
HTTP layer maps it to a 400); ``QueueFull`` / ``EngineClosed`` are the overload answers
(429 / 503).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

MAX_STOP_STRINGS = 4  # the OpenAI API's limit


# ------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------
class EngineError(RuntimeError):
    """Base of the engine's request-level errors."""


class QueueFull(EngineError):
    """The admission queue is at its bound (HTTP 429)."""


class EngineClosed(EngineError):
    """The engine is draining or stopped and accepts no new requests (HTTP 503)."""


class InvalidRequest(ValueError):
    """A request parameter is invalid; ``param`` names the offending field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(InvalidRequest):
    """Prompt (plus ``max_tokens``) beyond what a request's cache row holds: HTTP 400 with
    code ``context_length_exceeded``, worded as the OpenAI API words it, so clients that
    look for "maximum context length" recognise it."""

    code = "context_length_exceeded"

    def __init__(self, max_len: int, prompt_tokens: int, max_tokens: int | None, limit: int):
        self.max_len, self.prompt_tokens = max_len, prompt_tokens
        self.max_tokens, self.limit = max_tokens, limit
        super().__init__(self.describe("prompt"), "prompt" if max_tokens is None else "max_tokens")

    def describe(self, what: str = "prompt") -> str:
        """The message, naming the input ``what`` (``prompt``, or ``messages`` for chat)."""
        head = f"This model's maximum context length is {self.max_len} tokens."
        if self.max_tokens is None:
            return (
                f"{head} However, your {what} has {self.prompt_tokens} tokens; at most "
                f"{self.limit} tokens fit, with room left to generate. Please reduce the "
                f"length of the {what}."
            )
        total = self.prompt_tokens + self.max_tokens
        return (
            f"{head} However, you requested {total} tokens ({self.prompt_tokens} in the "
            f"{what}, {self.max_tokens} in the completion). Please reduce the length of the "
            f"{what} or completion."
        )


# ------------------------------------------------------------------------------------------
# requests and results
# ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings.

    temperature 0 = greedy. top_k 0 = off. top_p 1 = off. ``stop``: up to 4 strings; the
    output is cut before the first occurrence. ``seed``: see the module docstring.
    ``max_tokens`` None: until the request's cache row is full (the chat default).
    ``stop_token_ids``: ids that end the output (finish reason "stop", not part of the
    text), besides the tokenizer's end-of-text ids. ``logprobs``: None, or report each
    output token's target log-probability and its ``logprobs`` most likely alternatives
    (0: the token's own only); the target's own distribution, before temperature, top-k
    and top-p (what vLLM reports by default).
    """

    max_tokens: int | None = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None

    def validate(self, max_len: int, max_logprobs: int = 0) -> None:
        def bad(field, msg):
            raise InvalidRequest(f"{field} {msg}", field)

        mt = max_len - 1 if self.max_tokens is None else self.max_tokens
        if isinstance(mt, bool) or not isinstance(mt, int | np.integer):
            bad("max_tokens", f"must be an integer, got {mt!r}")
        if mt < 1:
            bad("max_tokens", f"must be >= 1, got {mt}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
            bad("temperature", f"must be a finite number, got {t!r}")
        if not 0.0 <= t <= 100.0:
            bad("temperature", f"must be in [0, 100], got {t}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int | np.integer) or k < 0:
            bad("top_k", f"must be an integer >= 0 (0 disables it), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not 0.0 < p <= 1.0:
            bad("top_p", f"must be a number in (0, 1], got {p!r}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            bad("stop", f"must be a string or a list of strings, got {self.stop!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            bad("stop", f"accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(s == "" for s in self.stop):
            bad("stop", "strings must be non-empty")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or not all(
            isinstance(i, int | np.integer) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            bad("stop_token_ids", f"must be a list of token ids (integers >= 0), got {ids!r}")
        lp = self.logprobs
        if lp is not None and (
            isinstance(lp, bool) or not isinstance(lp, int | np.integer) or not 0 <= lp
        ):
            bad("logprobs", f"must be an integer >= 0 (alternatives per token), got {lp!r}")
        if lp is not None and lp > max_logprobs:
            bad(
                "logprobs",
                f"asks for {lp} alternatives per token; this server reports at most "
                f"{max_logprobs} (serve.py --max-logprobs)",
            )
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int | np.integer)):
            bad("seed", f"must be an integer, got {s!r}")
        if s is not None and not 0 <= s < 2**63:
            bad("seed", f"must be in [0, 2**63), got {s}")


@dataclasses.dataclass
class TokenLogprob:
    """An output token's target log-probability and the most likely alternatives there
    (``top``: ``(token id, log-probability)``, most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclasses.dataclass
class Delta:
    """A streamed piece of a request's output (``logprobs``: one per output token of
    ``token_ids`` when the request asked for them; stop ids have none)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


@dataclasses.dataclass
class Result:
    """The final event of a request."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled" | "abort" | "error"
    prompt_tokens: int
    completion_tokens: int
    rounds: int  # decode rounds that produced tokens for this request
    mean_accepted_length: float  # τ: tokens per round incl. the bonus token
    mean_verified: float  # draft tokens sent to the target per round
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # see Delta


__all__ = [
    "MAX_STOP_STRINGS",
    "ContextLengthExceeded",
    "Delta",
    "EngineClosed",
    "EngineError",
    "InvalidRequest",
    "QueueFull",
    "Result",
    "SamplingParams",
    "TokenLogprob",
]
