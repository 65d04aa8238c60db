"""Serving (DESIGN §6), one responsibility per module:

- ``requests``: request/response types (``SamplingParams``, ``Delta``, ``Result``), their
  validation and the request-level errors;
- ``handle``: ``RequestHandle``, how events reach a sync or asyncio consumer;
- ``delivery``: an admitted request's host side (stream, stop ids, logprobs, result);
- ``service``: the engine's warm-up / loop-thread lifecycle;
- ``text``: detokenisation and stop strings of one output (``TextStream``);
- ``compilation``: every shape the engine runs, warm-up, SPS and prefill profiling;
- ``config``: ``EngineConfig`` and the counters ``EngineStats``;
- ``engine``: the continuous-batching loop (admission, pipelined rounds, delivery);
- ``loading``: the target and drafter directories a server runs;
- ``server`` / ``metrics``: the OpenAI-compatible HTTP API and its Prometheus metrics;
- ``chat``: chat messages -> prompt with the checkpoint's chat template;
- ``logprobs``: token log-probabilities in the OpenAI completions and chat formats;
- ``offline``: ``LLM``, offline batches in one Python call over the engine.
"""

from dspark_jax.serve.engine import (
    ContextLengthExceeded,
    Delta,
    Engine,
    EngineClosed,
    EngineConfig,
    InvalidRequest,
    QueueFull,
    RequestHandle,
    Result,
    SamplingParams,
    TokenLogprob,
    load_models,
)
from dspark_jax.serve.offline import LLM

__all__ = [
    "ContextLengthExceeded",
    "Delta",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "InvalidRequest",
    "LLM",
    "QueueFull",
    "RequestHandle",
    "Result",
    "SamplingParams",
    "TokenLogprob",
    "load_models",
]
