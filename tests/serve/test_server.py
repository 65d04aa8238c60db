"""HTTP server on a loopback port with tiny random models: OpenAI client (plain and
streaming), 4xx errors naming the field, 429/503, a 200-request load at concurrency 32 with
mid-stream disconnects, no slot leaks and no compilation after warm-up (from /metrics)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import asyncio
import json
import re
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from dspark_jax.data.tokenizer_train import train_bpe_tokenizer
from dspark_jax.decode.autoregressive import generate
from dspark_jax.serve.chat import ChatTemplate, load_chat_template
from dspark_jax.serve.engine import Engine, EngineConfig, SamplingParams
from dspark_jax.serve.logprobs import token_text
from dspark_jax.serve.server import APIError, BackgroundServer, create_app, parse_chat_request
from dspark_jax.testing import tiny_random_models

MAX_LEN = 32
MODEL = "tiny-dspark"
TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * i)\n"] * 20
PROMPTS = ["def add(a, b):", "for i in range", "print(i", "return a"]
N_NEW = 8
# The bundled target's template (assets/target/tokenizer_config.json): turns as comments.
CHAT = load_chat_template(os.path.join(os.path.dirname(__file__), "..", "..", "assets", "target"))
MESSAGES = [{"role": "system", "content": "helpers"}, {"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = train_bpe_tokenizer(TEXTS, vocab_size=300, out_path=tmp_path_factory.mktemp("tok"))
    target, tp, drafter, dp = tiny_random_models(tok, "dspark", gamma=3, max_len=MAX_LEN)
    cfg = EngineConfig(
        num_slots=4,
        max_len=MAX_LEN,
        scheduler="topk",
        max_queue=64,
        verify_buckets=(6,),
        sps_repeats=2,
        model_name=MODEL,
    )
    engine = Engine(target, tp, tok, drafter, dp, cfg).start()
    server = BackgroundServer(create_app(engine, chat_template=CHAT)).start()
    ids = [tok.encode(p) for p in PROMPTS]
    ref = generate(target, tp, ids, N_NEW, eos_id=tok.eos_id, max_len=MAX_LEN)
    want = {
        p: (tok.decode(t, skip_special_tokens=True), len(t)) for p, t in zip(PROMPTS, ref.tokens)
    }
    yield server, engine, want
    server.stop()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_openai_client_completions_and_streaming(served):
    server, engine, want = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    for p in PROMPTS:
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=N_NEW, temperature=0)
        text, n = want[p]
        assert r.choices[0].text == text  # greedy through the server == AR greedy
        assert r.usage.completion_tokens == n
        assert r.usage.total_tokens == r.usage.prompt_tokens + n
        assert r.choices[0].finish_reason in ("stop", "length")
    p = PROMPTS[0]
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=p, max_tokens=N_NEW, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[p][0]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0.8, seed=3)
    assert r.usage.completion_tokens <= 5
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


BAD = [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    ({"prompt": 5}, 400, "prompt", "prompt must be a string"),
    ({"max_tokens": 4}, 400, "prompt", "prompt is required"),
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens", ">= 1"),
    (
        {"prompt": "x", "max_tokens": 10**9},
        400,
        "max_tokens",
        "maximum context length is 32 tokens. However, you requested 1000000001 tokens "
        "(1 in the prompt, 1000000000 in the completion)",
    ),
    ({"prompt": "x", "max_tokens": 32}, 400, "max_tokens", "you requested 33 tokens"),
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "integer"),
    ({"prompt": "x", "temperature": "hot"}, 400, "temperature", "number"),
    ({"prompt": "x", "top_p": 2}, 400, "top_p", "(0, 1]"),
    ({"prompt": "x", "top_k": 1.5}, 400, "top_k", "integer"),
    ({"prompt": "x", "stop": 7}, 400, "stop", "string"),
    ({"prompt": "x", "seed": "s"}, 400, "seed", "integer"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream", "boolean"),
    ({"prompt": "x", "n": 0}, 400, "n", "n must be an integer in [1, 16]"),
    ({"prompt": "x", "stop_token_ids": [1, "a"]}, 400, "stop_token_ids", "token ids"),
    (
        {"prompt": "def " * 40},
        400,
        "prompt",
        "maximum context length is 32 tokens. However, "
        "your prompt has 80 tokens; at most 30 tokens fit",
    ),
    ({"prompt": "x", "model": "gpt-9"}, 404, "model", "does not exist"),
    # Fields this server does not implement are named, never ignored.
    ({"prompt": "x", "logprobs": "2"}, 400, "logprobs", "integer >= 0"),
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs", "at most 20"),
    ({"prompt": "x", "best_of": 2}, 400, "best_of", "unsupported field(s) best_of"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix", "unsupported field(s) suffix"),
    ({"prompt": "x", "frequency_penalty": 0.5}, 400, "frequency_penalty", "only 0"),
]
BAD_CHAT = [
    ({"max_tokens": 4}, 400, "messages", "messages is required"),
    ({"messages": []}, 400, "messages", "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "one of"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", "string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", "only text parts"),
    ({"messages": MESSAGES, "tools": []}, 400, "tools", "unsupported field(s) tools"),
    ({"messages": MESSAGES, "max_tokens": 2, "max_completion_tokens": 2}, 400, "max_tokens",
     "not both"),
    ({"messages": MESSAGES, "chat_template_kwargs": [1]}, 400, "chat_template_kwargs", "object"),
    ({"messages": MESSAGES, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs", "may not set messages"),
    ({"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs: true"),
    ({"messages": MESSAGES, "logprobs": 1}, 400, "logprobs", "boolean"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs",
     "at most 20"),
    ({"messages": MESSAGES, "max_tokens": 30}, 400, "messages",
     "maximum context length is 32 tokens. However, you requested"),
]  # fmt: skip


def test_bad_input_gets_4xx_naming_the_field(served):
    server, engine, want = served
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for body, status, param, msg in BAD:
            if isinstance(body, bytes):
                r = c.post("/v1/completions", content=body, headers={"content-type": "json"})
            else:
                r = c.post("/v1/completions", json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and msg in err["message"], (body, err)
            assert err["type"] == "invalid_request_error"
            context = "context length" in msg or "you requested" in msg
            want_code = "context_length_exceeded" if context else None
            assert err["code"] == want_code or status == 404, (body, err)
        assert c.get("/nope").status_code == 404
        # Still serving afterwards.
        r = c.post(
            "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": N_NEW, "temperature": 0}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[PROMPTS[1]][0]


def test_chat_completions_through_the_openai_client(served):
    """Messages rendered with the template, then the same engine path as a completion: the
    greedy reply equals the completion of the rendered prompt; streamed chunks carry the
    assistant role first and join to the same text."""
    server, engine, _ = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompt = CHAT.render(MESSAGES)
    assert prompt == "# helpers\n# def add(a, b):\n"
    ref = engine.generate(prompt, SamplingParams(max_tokens=N_NEW, temperature=0.0))
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=N_NEW, temperature=0
    )
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == ref.prompt_tokens
    assert r.usage.completion_tokens == ref.completion_tokens
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_completion_tokens=N_NEW, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage.completion_tokens == ref.completion_tokens
    # No max_tokens: the reply may run to the end of the request's cache row.
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0)
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= MAX_LEN
    with httpx.Client(base_url=server.url, timeout=30) as c:
        for body, status, param, msg in BAD_CHAT:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and msg in err["message"], (body, err)


def test_n_choices_and_stop_token_ids(served):
    """n independent samples per request (greedy: n equal choices), streamed with their
    index; usage counts the prompt once; stop_token_ids end a choice before the id."""
    server, engine, want = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    p = PROMPTS[0]
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=N_NEW, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [want[p][0]] * 2
    assert r.usage.completion_tokens == 2 * want[p][1]
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(p))
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=N_NEW, temperature=1.0, n=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=N_NEW, temperature=0, n=2, stream=True
        )
    )
    texts = {0: "", 1: ""}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    ref = engine.generate(CHAT.render(MESSAGES), SamplingParams(max_tokens=N_NEW))
    assert texts == {0: ref.text, 1: ref.text}
    # stop_token_ids (vLLM's field): cut before the first occurrence of the id.
    full = engine.generate(p, SamplingParams(max_tokens=N_NEW))
    stop_id = full.token_ids[2]
    r = client.completions.create(
        model=MODEL, prompt=p, max_tokens=N_NEW, temperature=0,
        extra_body={"stop_token_ids": [stop_id]},
    )  # fmt: skip
    cut = full.token_ids.index(stop_id)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == engine.tokenizer.decode(full.token_ids[:cut])
    assert r.usage.completion_tokens == cut + 1  # the stop id is generated, not shown


def test_logprobs_are_the_targets_in_both_formats(served):
    """logprobs / top_logprobs: the target's log-softmax at every output token, equal to a
    full forward pass of the target over prompt + output (prefill's token and every round's
    tokens); greedy tokens are their row's top alternative; streamed chunks carry the same
    values; chat's format through the openai client, bytes joining to the content."""
    server, engine, _ = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    tok, dec = engine.tokenizer, engine.decoder
    p = PROMPTS[1]
    r = client.completions.create(
        model=MODEL, prompt=p, max_tokens=N_NEW, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    out = engine.generate(p, SamplingParams(max_tokens=N_NEW, logprobs=3))
    ids = tok.encode(p) + [t for t in out.token_ids if t not in tok.stop_ids]
    full = jax.nn.log_softmax(dec.target.apply({"params": dec.target_params}, jnp.asarray([ids])))
    n_prompt = len(tok.encode(p))
    ref = [float(full[0, n_prompt - 1 + i, t]) for i, t in enumerate(ids[n_prompt:])]
    np.testing.assert_allclose(lp.token_logprobs, ref, atol=1e-4)
    # Random weights emit stray bytes: tokens holding part of a character are "bytes:\\x..".
    new = ids[n_prompt:]
    assert lp.tokens == [token_text(tok, t)[0] for t in new]
    raw = b"".join(tok.token_bytes(t) for t in new)
    assert raw.decode("utf-8", errors="replace") == r.choices[0].text
    lengths = [len(tok.decode([t])) for t in new]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(new))]
    for i, top in enumerate(lp.top_logprobs):
        assert len(top) == 3 and max(top.values()) == pytest.approx(lp.token_logprobs[i])
        want_top = np.sort(np.asarray(full[0, n_prompt - 1 + i]))[::-1][:3]
        np.testing.assert_allclose(sorted(top.values(), reverse=True), want_top, atol=1e-4)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=p, max_tokens=N_NEW, temperature=0, logprobs=3, stream=True
        )
    )
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    # Chat: a bool and a count; sampled tokens get their own (not the top) log-probability.
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=N_NEW, temperature=1.0, seed=4,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) <= r.usage.completion_tokens and content
    raw = b"".join(bytes(c.bytes) for c in content)
    assert raw.decode("utf-8", errors="replace") == r.choices[0].message.content
    assert all(len(c.top_logprobs) == 2 and c.logprob <= c.top_logprobs[0].logprob + 1e-6
               for c in content)  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert r.choices[0].logprobs is None  # not asked for


def test_chat_without_a_template_is_a_400_naming_it():
    with pytest.raises(APIError) as e:
        parse_chat_request({"messages": MESSAGES}, MODEL, None)
    assert e.value.status == 400 and "no chat template" in e.value.message
    assert "tokenizer_config.json" in e.value.message


# A Qwen3-style template (ChatML turns, enable_thinking off => an empty think block) and a
# template that rejects a conversation with raise_exception.
CHATML = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"
)
STRICT = (
    "{%- if messages[0].role != 'user' %}{{ raise_exception('the first turn must be the "
    "user') }}{%- endif %}{{ messages[0].content | tojson }}"
)


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_chat_template_renders_as_transformers_does(tmp_path, kwargs):
    from transformers import AutoTokenizer

    tok = train_bpe_tokenizer(TEXTS, vocab_size=300, out_path=tmp_path / "tokenizer.json")
    config = {"eos_token": tok.eos_token, "chat_template": CHATML}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_chat_template(tmp_path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path))
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Sum 2 + 2\nthen stop"},
    ]
    want = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.render(msgs, True, kwargs) == want
    # The bundled target's template too.
    bundled = os.path.join(os.path.dirname(__file__), "..", "..", "assets", "target")
    theirs = AutoTokenizer.from_pretrained(bundled)
    want = theirs.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert CHAT.render(msgs) == want


def test_chat_template_errors_become_400s():
    from dspark_jax.serve.requests import InvalidRequest

    strict = ChatTemplate(STRICT, "test")
    assert strict.render([{"role": "user", "content": "é"}]) == '"é"'  # tojson, not ASCII
    with pytest.raises(InvalidRequest, match="rejected the messages: the first turn must be"):
        strict.render([{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}", "broken.jinja")


def test_full_queue_is_429(served):
    server, engine, _ = served
    old = engine.config.max_queue
    engine.config.max_queue = 0  # every submission now finds the queue full
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    finally:
        engine.config.max_queue = old
    assert r.status_code == 429 and "queue is full" in r.json()["error"]["message"]


async def _load(url, n_requests, concurrency, want):
    sem = asyncio.Semaphore(concurrency)
    outcomes = []

    async def one(i, client):
        p = PROMPTS[i % len(PROMPTS)]
        body = {"prompt": p, "max_tokens": N_NEW, "temperature": 0, "model": MODEL}
        async with sem:
            if i % 5 == 0:  # disconnect mid-stream
                async with client.stream(
                    "POST", "/v1/completions", json={**body, "stream": True}
                ) as r:
                    async for _ in r.aiter_lines():
                        break
                outcomes.append(("dropped", None, None))
            elif i % 2 == 0:
                text, usage = "", None
                async with client.stream(
                    "POST", "/v1/completions", json={**body, "stream": True}
                ) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        obj = json.loads(line[6:])
                        text += obj["choices"][0]["text"]
                        usage = obj.get("usage", usage)
                outcomes.append((p, text, usage["completion_tokens"]))
            else:
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                obj = r.json()
                outcomes.append((p, obj["choices"][0]["text"], obj["usage"]["completion_tokens"]))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        await asyncio.gather(*(one(i, client) for i in range(n_requests)))
    return outcomes


def test_load_with_disconnects_no_leaks_no_recompiles(served):
    server, engine, want = served
    outcomes = asyncio.run(_load(server.url, 210, 32, want))
    assert len(outcomes) == 210
    done = [o for o in outcomes if o[0] != "dropped"]
    assert len(done) == 210 - 42
    for p, text, n in done:
        assert (text, n) == want[p]
    for _ in range(200):
        m = httpx.get(server.url + "/metrics").text
        if _metric(m, "dspark_active_slots") == 0 and _metric(m, "dspark_queue_depth") == 0:
            break
        time.sleep(0.05)
    assert _metric(m, "dspark_active_slots") == 0
    assert _metric(m, "dspark_queue_depth") == 0
    assert _metric(m, "dspark_compilations_after_warmup") == 0
    # The round timeline: the engine thread's time by phase, and its host share.
    for phase in ("dispatch", "device_wait", "host", "idle"):
        assert _metric(m, f'dspark_engine_seconds\\{{phase="{phase}"\\}}') >= 0
    assert _metric(m, 'dspark_engine_seconds\\{phase="device_wait"\\}') > 0
    assert 0 < _metric(m, "dspark_host_share") < 1
    assert _metric(m, "dspark_rounds_total") > 0
    assert "dspark_round_seconds_bucket" in m and "dspark_verify_budget_bucket" in m


def test_drain_then_503(served):
    """Last test: draining rejects new requests with 503 but finishes in-flight ones."""
    server, engine, want = served

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            body = {"prompt": PROMPTS[2], "max_tokens": N_NEW, "temperature": 0}
            inflight = asyncio.ensure_future(c.post("/v1/completions", json=body))
            await asyncio.sleep(0)  # let the request be sent first
            while engine.active_slots == 0 and engine.queue_depth == 0 and not inflight.done():
                await asyncio.sleep(0.001)
            engine.begin_drain()
            late = await c.post("/v1/completions", json=body)
            health = await c.get("/health")
            return await inflight, late, health

    first, late, health = asyncio.run(run())
    assert first.status_code == 200 and first.json()["choices"][0]["text"] == want[PROMPTS[2]][0]
    assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
    assert health.status_code == 503


def test_health_says_starting_while_warming_up(tmp_path):
    """The port answers during warm-up: /health 503 "starting" with the warm-up step,
    completions 503; then 200 "ok" once warm. Warm-up is held on an event so the test
    sees the starting state for certain."""
    import threading

    tok = train_bpe_tokenizer(TEXTS, vocab_size=300, out_path=tmp_path)
    target, tp, _, _ = tiny_random_models(tok, None, max_len=MAX_LEN)
    cfg = EngineConfig(num_slots=2, max_len=MAX_LEN, scheduler="none")
    engine = Engine(target, tp, tok, config=cfg)
    release, original = threading.Event(), engine.warmup

    def held_warmup():
        engine._progress("compiling prefill", 1, 9)
        assert release.wait(60)
        original()

    engine.warmup = held_warmup
    server = BackgroundServer(create_app(engine, chat_template=CHAT)).start()
    try:
        engine.start(background=True)
        with httpx.Client(base_url=server.url, timeout=30) as c:
            h = c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "starting"
            assert h.json()["warmup"]["phase"] == "compiling prefill"
            r = c.post("/v1/completions", json={"prompt": "def f", "max_tokens": 2})
            assert r.status_code == 503 and "warming up" in r.json()["error"]["message"]
            release.set()
            assert engine.wait_ready(120)
            h = c.get("/health")
            assert h.status_code == 200 and h.json()["status"] == "ok"
            r = c.post("/v1/completions", json={"prompt": "def f", "max_tokens": 2})
            assert r.status_code == 200
    finally:
        release.set()
        server.stop()
