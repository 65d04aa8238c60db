"""Access and bounds through the real HTTP server (``serve.server.ServerLimits``): the API
key on every ``/v1/*`` route (401 in OpenAI's error shape; ``/health`` and ``/metrics``
open), the request body bound (413) and the ``n x max_tokens`` bound (400 naming it); and
``"prompt": [list]`` in ``/v1/completions`` (one choice per prompt x n, OpenAI's order)."""

import json

import httpx
import openai
import pytest

from dspark_jax.data.tokenizer_train import train_bpe_tokenizer
from dspark_jax.serve.engine import Engine, EngineConfig, SamplingParams
from dspark_jax.serve.server import BackgroundServer, ServerLimits, create_app
from dspark_jax.testing import tiny_random_models

KEY = "sk-test-key"
MAX_LEN = 32
BODY_BOUND = 2000
TOKEN_BOUND = 20
TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * i)\n"] * 20


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tok = train_bpe_tokenizer(TEXTS, vocab_size=300, out_path=tmp_path_factory.mktemp("tok"))
    target, tp, _, _ = tiny_random_models(tok, None, max_len=MAX_LEN)
    cfg = EngineConfig(num_slots=4, max_len=MAX_LEN, scheduler="none", model_name="tiny")
    engine = Engine(target, tp, tok, config=cfg).start()
    limits = ServerLimits(KEY, max_body_bytes=BODY_BOUND, max_request_tokens=TOKEN_BOUND)
    server = BackgroundServer(create_app(engine, limits=limits)).start()
    yield server, engine
    server.stop()


def _auth(key=KEY):
    return {"Authorization": f"Bearer {key}"}


def test_api_key_guards_v1_routes_only(served):
    server, _ = served
    with httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        body = {"prompt": "def add", "max_tokens": 2, "temperature": 0}
        for headers in ({}, _auth("sk-wrong"), {"Authorization": KEY}, _auth(KEY + "x")):
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                                 ("POST", "/v1/chat/completions"), ("GET", "/v1/nope")):  # fmt: skip
                r = c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (headers, path, r.text)
                err = r.json()["error"]
                assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
                assert "Authorization: Bearer" in err["message"] and KEY not in err["message"]
                assert set(err) == {"message", "type", "param", "code"}
        assert c.get("/v1/models", headers=_auth()).status_code == 200
    # The OpenAI client sends the key as a bearer token.
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    r = client.completions.create(model="tiny", prompt="def add", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_body_size_bound_is_413(served):
    server, _ = served
    big = json.dumps({"prompt": "x" * (BODY_BOUND + 10), "max_tokens": 1}).encode()
    with httpx.Client(base_url=server.url, timeout=30, headers=_auth()) as c:
        r = c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert f"{BODY_BOUND} bytes" in err["message"] and err["code"] == "request_too_large"

        def chunks():  # no Content-Length: the bound applies while reading
            for i in range(0, len(big), 500):
                yield big[i : i + 500]

        r = c.post("/v1/completions", content=chunks())
        assert r.status_code == 413, r.text
        # Under the bound: served.
        r = c.post("/v1/completions", json={"prompt": "def", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text


def test_n_times_max_tokens_bound_is_400_naming_it(served):
    server, _ = served
    with httpx.Client(base_url=server.url, timeout=30, headers=_auth()) as c:
        for body in (
            {"prompt": "def", "n": 3, "max_tokens": 7},
            {"prompt": ["def", "for"], "n": 2, "max_tokens": 6},
        ):
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert f"bound of {TOKEN_BOUND} tokens" in err["message"], err
            assert "--max-request-tokens" in err["message"] and err["param"] == "max_tokens"
        ok = c.post("/v1/completions", json={"prompt": "def", "n": 2, "max_tokens": 10})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_prompt_list_gives_n_choices_per_prompt_in_openai_order(served):
    server, engine = served
    prompts = ["def add(a, b):", "for i in range", "print(i"]
    want = [engine.generate(p, SamplingParams(max_tokens=3, temperature=0.0)) for p in prompts]
    with httpx.Client(base_url=server.url, timeout=60, headers=_auth()) as c:
        body = {"prompt": prompts, "n": 2, "max_tokens": 3, "temperature": 0}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        choices = out["choices"]
        assert [ch["index"] for ch in choices] == list(range(6))
        for i, ch in enumerate(choices):  # choice i * n + j is prompt i's j-th
            assert ch["text"] == want[i // 2].text, (i, ch)
        assert out["usage"]["prompt_tokens"] == sum(w.prompt_tokens for w in want)
        assert out["usage"]["completion_tokens"] == 2 * sum(w.completion_tokens for w in want)
        # Streamed: each choice's chunks join to its text; usage counts every prompt once.
        body.update(stream=True, stream_options={"include_usage": True})
        texts, usage = {}, None
        with c.stream("POST", "/v1/completions", json=body) as s:
            for line in s.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                for ch in obj["choices"]:
                    texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
                usage = obj.get("usage") or usage
        assert texts == {i: want[i // 2].text for i in range(6)}
        assert usage["prompt_tokens"] == out["usage"]["prompt_tokens"]
        for bad in ([], [1, 2], ["ok", 3], [["a"]]):
            r = c.post("/v1/completions", json={"prompt": bad, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            assert "list of strings" in r.json()["error"]["message"]
