"""Serving: the continuous-batching engine (``engine``), the OpenAI-compatible HTTP API
(``server``) and its Prometheus metrics (``metrics``). DESIGN §6."""

from dspark_jax.serve.engine import (
    Delta,
    Engine,
    EngineClosed,
    EngineConfig,
    InvalidRequest,
    QueueFull,
    RequestHandle,
    Result,
    SamplingParams,
    load_models,
)

__all__ = [
    "Delta",
    "Engine",
    "EngineClosed",
    "EngineConfig",
    "InvalidRequest",
    "QueueFull",
    "RequestHandle",
    "Result",
    "SamplingParams",
    "load_models",
]
