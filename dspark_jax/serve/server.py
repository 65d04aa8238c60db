"""OpenAI-compatible HTTP API over the serving engine (FastAPI + uvicorn, DESIGN §6).

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or SSE
streaming; chat messages rendered with the model's chat template, ``serve/chat.py``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text).

Access and bounds (``ServerLimits``): with an API key every ``/v1/*`` route needs
``Authorization: Bearer <key>`` (compared in constant time; 401 otherwise), while
``/health`` and ``/metrics`` stay open for probes and scrapers. A request body over
``max_body_bytes`` is a 413, and a request whose choices (prompts × ``n``) times
``max_tokens`` exceed ``max_request_tokens`` is a 400 naming the bound.

``/health`` is 200 ``{"status": "ok"}`` when serving, and 503 with ``"starting"`` (plus
the warm-up step, e.g. ``compiling verify round 3 of 8``) while an engine started with
``start(background=True)`` compiles, ``"shutting_down"`` while draining, ``"failed"``
after an engine error, so orchestration can tell "up but warming" from "down".

Errors use the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``: 400 for
invalid input (the field is named in ``param``; a field this server does not implement is
a 400 naming it, never silently ignored), 404 for an unknown model, 429 when the
admission queue is full, 503 while shutting down. Request bodies are parsed by hand (not
by pydantic models) so every message names the offending field in OpenAI's format.

Shutdown (SIGTERM/SIGINT): ``DrainingServer`` first stops the engine from accepting new
requests (503), then lets uvicorn's graceful shutdown wait for in-flight HTTP requests,
which keep being served by the still-running engine; the lifespan hook finally drains and
stops the engine. A client that disconnects (streaming or not) cancels its request, which
frees its slot at the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import signal
import socket
import threading
import time
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark_jax.serve.chat import ChatTemplate, parse_messages
from dspark_jax.serve.engine import (
    ContextLengthExceeded,
    Delta,
    Engine,
    EngineClosed,
    InvalidRequest,
    QueueFull,
    Result,
    SamplingParams,
)
from dspark_jax.serve.logprobs import chat_logprobs, completion_logprobs
from dspark_jax.serve.metrics import EngineMetrics

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: until the cache ends)
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; pass 0 for greedy
MAX_N = 16  # choices per request (n): each is one engine request
MAX_CHOICES = 64  # prompts × n of one /v1/completions request
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_REQUEST_TOKENS = 65536  # n × max_tokens summed over a request's prompts
API_KEY_ENV = "DSPARK_API_KEY"
# Fields each endpoint understands; any other field is a 400 naming it, never ignored.
# Penalties are accepted only at their neutral value 0.
_SAMPLING_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream",
    "stream_options", "n", "user", "frequency_penalty", "presence_penalty", "stop_token_ids",
}  # fmt: skip
_COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "logprobs"}
_CHAT_FIELDS = _SAMPLING_FIELDS | {
    "messages", "max_completion_tokens", "chat_template_kwargs", "logprobs", "top_logprobs",
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Access and size bounds of one server. ``api_key``: required on every ``/v1/*``
    route as ``Authorization: Bearer <key>`` (None: open). ``max_body_bytes``: largest
    request body (413 beyond). ``max_request_tokens``: bound on the tokens a request may
    ask to generate, choices (prompts × ``n``) × ``max_tokens`` (400 beyond; a chat
    request without ``max_tokens`` counts the room its prompt leaves in the context)."""

    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS

    def __post_init__(self):
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty; give a non-empty key or none")
        for name in ("max_body_bytes", "max_request_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind=None, code=None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or "invalid_request_error"
        self.code = code


def _error_body(message: str, kind: str, param=None, code=None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(_error_body(e.message, e.kind, e.param, e.code), status_code=e.status)


def _parse_sampling(body: Any, model_name: str, known: set[str], max_tokens_default):
    """The fields both endpoints share: ``(params, options)`` or ``APIError``."""
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_name:
        raise APIError(
            404,
            f"model {model!r} does not exist; this server serves {model_name!r}",
            "model",
            code="model_not_found",
        )
    unknown = sorted(set(body) - known)
    if unknown:
        raise APIError(
            400, f"unsupported field(s) {', '.join(unknown)} (this server does not implement "
            "them)", unknown[0],
        )  # fmt: skip
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) not in (None, 0, 0.0) or isinstance(body.get(name), bool):
            raise APIError(400, f"{name} is not supported by this server (only 0)", name)
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise APIError(400, f"n must be an integer in [1, {MAX_N}], got {n!r}", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be a boolean, got {stream!r}", "stream")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list):
        stop = tuple(stop)
    top_k = body.get("top_k", 0)
    if top_k == -1 and not isinstance(top_k, bool):
        top_k = 0  # vLLM's spelling of "off"
    params = SamplingParams(
        max_tokens=_or_default(body, "max_tokens", max_tokens_default),
        temperature=_or_default(body, "temperature", DEFAULT_TEMPERATURE),
        top_k=top_k,
        top_p=_or_default(body, "top_p", 1.0),
        stop=stop,
        seed=body.get("seed"),
        stop_token_ids=_id_list(body.get("stop_token_ids")),
    )
    options = {
        "n": n,
        "stream": stream,
        "include_usage": bool((body.get("stream_options") or {}).get("include_usage", False))
        if isinstance(body.get("stream_options"), dict | None)
        else False,
    }
    return params, options


def parse_completion_request(body: Any, model_name: str) -> tuple[Any, SamplingParams, dict]:
    """Validate a ``/v1/completions`` body: ``(prompts, params, options)`` or
    ``APIError``. ``prompt`` is a string or a list of strings (OpenAI's batch: ``n``
    choices per prompt, choice ``i * n + j`` is prompt ``i``'s ``j``-th);
    ``prompts`` is always a list."""
    params, options = _parse_sampling(body, model_name, _COMPLETION_FIELDS, DEFAULT_MAX_TOKENS)
    if "prompt" not in body:
        raise APIError(400, "prompt is required", "prompt")
    prompt = body["prompt"]
    prompts = prompt if isinstance(prompt, list) else [prompt]
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise APIError(
            400,
            "prompt must be a string or a non-empty list of strings (token-id prompts are "
            f"not supported), got {str(prompt)[:80]}",
            "prompt",
        )
    if len(prompts) * options["n"] > MAX_CHOICES:
        raise APIError(
            400,
            f"{len(prompts)} prompts x n = {options['n']} is {len(prompts) * options['n']} "
            f"choices; at most {MAX_CHOICES} per request",
            "prompt",
        )
    # An integer: alternatives per token (validated with the other settings).
    params = dataclasses.replace(params, logprobs=body.get("logprobs"))
    return prompts, params, options


def parse_chat_request(body: Any, model_name: str, template: ChatTemplate | None):
    """Validate a ``/v1/chat/completions`` body and render its messages with the model's
    chat template: ``([prompt text], params, options)`` or ``APIError``."""
    if isinstance(body, dict) and "max_completion_tokens" in body:
        if body.get("max_tokens") is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", "max_tokens")
        rest = {k: v for k, v in body.items() if k != "max_completion_tokens"}
        body = {**rest, "max_tokens": body["max_completion_tokens"]}
    params, options = _parse_sampling(body, model_name, _CHAT_FIELDS, None)
    if template is None:
        raise APIError(
            400,
            "this model has no chat template (no chat_template.jinja and no chat_template in "
            "its tokenizer_config.json); use /v1/completions with a prompt",
            "messages",
        )
    if "messages" not in body:
        raise APIError(400, "messages is required", "messages")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    try:
        text = template.render(parse_messages(body["messages"]), True, kwargs)
    except InvalidRequest as e:
        raise APIError(400, str(e), e.param) from e
    return [text], dataclasses.replace(params, logprobs=_chat_logprobs_field(body)), options


def _chat_logprobs_field(body: dict) -> int | None:
    """Chat's ``logprobs`` (bool) and ``top_logprobs`` (alternatives) as one setting."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise APIError(400, f"logprobs must be a boolean, got {wanted!r}", "logprobs")
    if top is not None and not wanted:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise APIError(400, f"top_logprobs must be an integer >= 0, got {top!r}", "top_logprobs")
    if not wanted:
        return None
    return 0 if top is None else top


def _id_list(value):
    """``stop_token_ids`` as a tuple (vLLM's extension); validated with the other params."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else value


def _or_default(body: dict, name: str, default):
    v = body.get(name)
    return default if v is None else v


def _usage(res: Result) -> dict[str, int]:
    return {
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens,
        "total_tokens": res.prompt_tokens + res.completion_tokens,
    }


def _dspark_info(res: Result) -> dict[str, float]:
    """Non-standard extension: per-request speculation statistics."""
    return {
        "rounds": res.rounds,
        "accepted_length": res.mean_accepted_length,
        "verified_per_round": res.mean_verified,
    }


def create_app(
    engine: Engine,
    model_name: str | None = None,
    metrics: EngineMetrics | None = None,
    shutdown_engine: bool = True,
    chat_template: ChatTemplate | None = None,
    limits: ServerLimits | None = None,
) -> FastAPI:
    """The FastAPI app for a started ``engine``. With ``shutdown_engine`` the app's
    lifespan drains and stops the engine when the server shuts down. ``chat_template``
    (``serve.chat.load_chat_template`` of the target directory) enables
    ``/v1/chat/completions``; without one that endpoint answers 400. ``limits``: the
    API key and size bounds (default: no key, the default bounds)."""
    name = model_name or engine.config.model_name
    limits = limits or ServerLimits()
    metrics = metrics or EngineMetrics()
    metrics.attach(engine)
    engine.listener = metrics
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if shutdown_engine:
            await asyncio.to_thread(engine.shutdown, True)

    app = FastAPI(title="dspark_jax", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.model_name = engine, metrics, name
    app.state.limits = limits
    app.add_middleware(_AccessGuard, limits=limits)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(_error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        return JSONResponse(
            _error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"),
            status_code=500,
        )

    @app.get("/health")
    async def health():
        if engine.failure is not None:
            return JSONResponse({"status": "failed", "error": engine.failure}, status_code=503)
        if engine.starting:  # up but still compiling: 503 so load balancers wait
            return JSONResponse(
                {"status": "starting", "warmup": engine.warmup_status}, status_code=503
            )
        if not engine.accepting:
            return JSONResponse({"status": "shutting_down"}, status_code=503)
        return {
            "status": "ok",
            "active_slots": engine.active_slots,
            "queue_depth": engine.queue_depth,
        }

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": name, "object": "model", "created": created, "owned_by": "dspark_jax"}],
        }

    @app.get("/metrics")
    async def prometheus():
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    async def submit(request: Request, parse, chat: bool) -> Response:
        try:
            raw = await _read_body(request, limits.max_body_bytes)
            try:
                body = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"request body is not valid JSON: {e}") from e
            prompts, params, options = parse(body)
            n = options["n"]
            handles = []
            try:
                # Every prompt checked (and the request's size bounded) before any is queued.
                checked = [engine.check_request(p, params) for p in prompts]
                _check_request_tokens(
                    [p.max_tokens for _, p in checked], n, limits.max_request_tokens, chat
                )
                for ids, _ in checked:
                    for j in range(n):
                        # n independent samples; a seeded request's choice j uses seed + j.
                        p = params
                        if params.seed is not None and j:
                            p = dataclasses.replace(params, seed=params.seed + j)
                        handles.append(engine.submit(ids, p, loop=asyncio.get_running_loop()))
            except ContextLengthExceeded as e:
                what = "messages" if chat else "prompt"
                raise APIError(
                    400, e.describe(what), "messages" if chat else e.param, code=e.code
                ) from e
            except InvalidRequest as e:
                param = "top_logprobs" if chat and e.param == "logprobs" else e.param
                raise APIError(400, str(e), param) from e
            except QueueFull as e:
                metrics.rejected.labels("queue_full").inc()
                raise APIError(429, str(e), kind="rate_limit_error", code="queue_full") from e
            except EngineClosed as e:
                metrics.rejected.labels("shutting_down").inc()
                raise APIError(503, str(e), kind="service_unavailable") from e
            finally:
                if len(handles) < n * len(prompts):  # refused part-way: drop the rest
                    for h in handles:
                        h.cancel()
        except APIError as e:
            if e.status in (400, 404, 413):
                metrics.rejected.labels("invalid").inc()
            return _error(e)

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        fmt = _LogprobFormat(engine.tokenizer, chat)
        if options["stream"]:
            return StreamingResponse(
                _stream(handles, rid, name, options["include_usage"], chat, fmt, n),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _complete(request, handles, rid, name, chat, fmt, n)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await submit(request, lambda body: parse_completion_request(body, name), False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        parse = lambda body: parse_chat_request(body, name, chat_template)  # noqa: E731
        return await submit(request, parse, True)

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 once it grows past ``limit`` bytes (a declared
    ``Content-Length`` over it was refused before the route, by ``_AccessGuard``)."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise _too_large(limit)
    return bytes(raw)


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"request body is larger than this server's bound of {limit} bytes "
        "(serve.py --max-body-bytes)",
        code="request_too_large",
    )


def _check_request_tokens(max_tokens: list[int], n: int, bound: int, chat: bool) -> None:
    """``APIError`` 400 when the request's choices could generate more than ``bound``
    tokens in all: sum over prompts of ``n`` × its ``max_tokens``."""
    total = n * sum(max_tokens)
    if total <= bound:
        return
    each = f"max_tokens {max_tokens[0]}" if len(set(max_tokens)) == 1 else "their max_tokens"
    what = "" if len(max_tokens) == 1 else f"{len(max_tokens)} prompts x "
    room = " (no max_tokens: the room left in the context)" if chat else ""
    raise APIError(
        400,
        f"this request may generate {total} tokens ({what}n = {n} x {each}{room}), over "
        f"this server's bound of {bound} tokens per request (n x max_tokens, serve.py "
        "--max-request-tokens); lower n or max_tokens",
        "max_tokens",
        code="request_too_large",
    )


class _AccessGuard:
    """ASGI middleware in front of every route: the API key on ``/v1/*`` (constant-time
    comparison; 401 in OpenAI's error shape) and a declared body size over the bound
    (413). Plain ASGI, so streaming responses and disconnect detection are untouched."""

    def __init__(self, app, limits: ServerLimits):
        self.app, self.limits = app, limits
        self.key = None if limits.api_key is None else limits.api_key.encode()

    async def __call__(self, scope, receive, send):
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await refusal(scope, receive, send)

    def _refusal(self, scope) -> Response | None:
        headers = dict(scope.get("headers") or ())
        path = scope.get("path", "")
        if self.key is not None and (path == "/v1" or path.startswith("/v1/")):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            # compare_digest always runs, so a missing header takes as long as a wrong key.
            good = hmac.compare_digest(token.strip(), self.key)
            if not good or scheme.lower() != b"bearer":
                return JSONResponse(
                    _error_body(
                        "missing or incorrect API key: send the header "
                        "'Authorization: Bearer <key>' with the key the server was started "
                        f"with (serve.py --api-key or {API_KEY_ENV})",
                        "invalid_request_error",
                        code="invalid_api_key",
                    ),
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                return _error(APIError(400, f"Content-Length is not a number: {length!r}"))
            if declared > self.limits.max_body_bytes:
                return _error(_too_large(self.limits.max_body_bytes))
        return None


class _LogprobFormat:
    """Logprobs of one response's choices in its endpoint's format (``text_offset`` of a
    streamed completion continues across chunks)."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.offsets: dict[int, int] = {}

    def __call__(self, lps, index: int = 0):
        if lps is None:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, lps)
        out, self.offsets[index] = completion_logprobs(
            self.tokenizer, lps, self.offsets.get(index, 0)
        )
        return out


def _choice(
    text: str, finish, chat: bool, delta: dict | None = None, index: int = 0, logprobs=None
) -> dict:
    if not chat:
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}
    if delta is not None:  # a streamed chat chunk
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    message = {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def _envelope(rid: str, model: str, chat: bool, stream: bool) -> dict:
    kind = ("chat.completion" if chat else "text_completion") + (
        ".chunk" if stream and chat else ""
    )
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def _chunk(
    rid, model, text, finish, chat, usage=None, extra=None, first=False, index=0, logprobs=None
) -> str:
    obj = _envelope(rid, model, chat, True)
    delta = None
    if chat:
        delta = {"content": text} if text or not finish else {}
        if first:
            delta = {"role": "assistant", **delta}
    obj["choices"] = [_choice(text, finish, chat, delta, index, logprobs)]
    if usage is not None:
        obj["usage"] = usage
    if extra is not None:
        obj["dspark"] = extra
    return f"data: {json.dumps(obj)}\n\n"


def _usage_of(results: list[Result], n: int = 1) -> dict[str, int]:
    """One request's usage over its choices (``n`` per prompt, in choice order): each
    prompt counted once."""
    completion = sum(r.completion_tokens for r in results)
    prompt = sum(r.prompt_tokens for r in results[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


async def _events(handles):
    """``(choice index, event)`` of every handle, in arrival order."""
    if len(handles) == 1:
        async for ev in handles[0].aevents():
            yield 0, ev
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, h):
        async for ev in h.aevents():
            await queue.put((i, ev))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        for _ in range(len(handles)):
            while True:
                i, ev = await queue.get()
                yield i, ev
                if isinstance(ev, Result):
                    break
    finally:
        for t in tasks:
            t.cancel()


async def _stream(handles, rid: str, model: str, include_usage: bool, chat: bool, fmt, n=1):
    """SSE: one chunk per decode round with new text (or, when asked for, logprobs) of a
    choice (chat: a choice's first chunk carries the assistant role), a final chunk per
    choice with its finish reason, then (``include_usage``) the usage, then
    ``data: [DONE]``. A disconnect cancels every choice (``finally``)."""
    started, results = set(), {}
    try:
        async for i, ev in _events(handles):
            if isinstance(ev, Delta):
                if ev.text or ev.logprobs:
                    lps = fmt(ev.logprobs, i)
                    yield _chunk(
                        rid, model, ev.text, None, chat, first=i not in started, index=i,
                        logprobs=lps,
                    )  # fmt: skip
                    started.add(i)
                continue
            results[i] = ev
            if ev.finish_reason in ("stop", "length"):
                first = i not in started
                started.add(i)
                yield _chunk(
                    rid, model, "", ev.finish_reason, chat, _usage(ev), _dspark_info(ev),
                    first, i,
                )  # fmt: skip
            else:
                msg = ev.error or f"request ended: {ev.finish_reason}"
                yield f"data: {json.dumps(_error_body(msg, 'server_error'))}\n\n"
        if include_usage and len(results) == len(handles):
            usage = _usage_of([results[i] for i in range(len(handles))], n)
            obj = {**_envelope(rid, model, chat, True), "choices": [], "usage": usage}
            yield f"data: {json.dumps(obj)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for h in handles:
            if not h.done.is_set():
                h.cancel()


async def _complete(request: Request, handles, rid: str, model: str, chat: bool, fmt, n=1):
    tasks = [asyncio.ensure_future(h.aresult()) for h in handles]
    try:
        while True:
            done, pending = await asyncio.wait(tasks, timeout=0.5)
            if not pending:
                break
            if await request.is_disconnected():
                for h, t in zip(handles, tasks):
                    h.cancel()
                    t.cancel()
                return Response(status_code=499)
    finally:
        for h in handles:
            if not h.done.is_set():
                h.cancel()
    results: list[Result] = [t.result() for t in tasks]
    for res in results:
        if res.finish_reason not in ("stop", "length"):
            status = 503 if res.finish_reason == "abort" else 500
            message = res.error or f"request ended: {res.finish_reason}"
            return _error(APIError(status, message, kind="server_error"))
    body = {
        **_envelope(rid, model, chat, False),
        "choices": [
            _choice(r.text, r.finish_reason, chat, index=i, logprobs=fmt(r.logprobs, i))
            for i, r in enumerate(results)
        ],
        "usage": _usage_of(results, n),
        "dspark": _dspark_info(results[0]),
    }
    if len(results) > 1:
        body["dspark"] = [_dspark_info(r) for r in results]
    return JSONResponse(body)


# ------------------------------------------------------------------------------------------
# running
# ------------------------------------------------------------------------------------------
class DrainingServer(uvicorn.Server):
    """uvicorn server whose exit signal first closes the engine to new requests, then
    performs uvicorn's graceful shutdown (in-flight requests finish)."""

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame) -> None:
        self.engine.begin_drain()
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            # uvicorn re-raises captured signals after its shutdown, so a drained server
            # would exit 143. A SIGTERM drain is the normal way to stop: exit 0.
            self._captured_signals = [s for s in self._captured_signals if s != sig]


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, **kw) -> DrainingServer:
    config = uvicorn.Config(app, host=host, port=port, log_level=kw.pop("log_level", "info"), **kw)
    return DrainingServer(config, app.state.engine)


class BackgroundServer:
    """Run an app on a free loopback port in a thread (tests, benchmarks)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = make_server(app, host, self.port, log_level="warning")
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("HTTP server failed to start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Graceful shutdown, as on SIGTERM."""
        self.server.handle_exit(None, None)
        self.thread.join(timeout)


__all__ = [
    "APIError",
    "BackgroundServer",
    "DrainingServer",
    "ServerLimits",
    "create_app",
    "make_server",
    "parse_chat_request",
    "parse_completion_request",
]
