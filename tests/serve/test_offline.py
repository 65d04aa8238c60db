"""The offline Python API (serve/offline.py LLM): results in prompt order over more
prompts than slots, greedy equal to autoregressive decoding, per-prompt settings, chat
through the template, and bad input named before anything runs."""

import os

import pytest

from dspark_jax.data.tokenizer_train import train_bpe_tokenizer
from dspark_jax.decode.autoregressive import generate
from dspark_jax.serve import LLM, EngineConfig, InvalidRequest, SamplingParams
from dspark_jax.serve.chat import load_chat_template
from dspark_jax.testing import tiny_random_models

MAX_LEN = 32
TEXTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i * i)\n"] * 20
PROMPTS = ["def add(a, b):", "for i in range", "print(i", "return a", "def f", "for x"]
BUNDLED = os.path.join(os.path.dirname(__file__), "..", "..", "assets", "target")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    tok = train_bpe_tokenizer(TEXTS, vocab_size=300, out_path=tmp_path_factory.mktemp("tok"))
    target, tp, drafter, dp = tiny_random_models(tok, "dspark", gamma=3, max_len=MAX_LEN)
    cfg = EngineConfig(num_slots=2, max_len=MAX_LEN, scheduler="fixed", verify_buckets=(6,))
    llm = LLM.from_models((target, tp, tok, drafter, dp, None), cfg, load_chat_template(BUNDLED))
    yield llm, (target, tp, tok)
    llm.close()


def test_generate_keeps_prompt_order_and_equals_greedy_decoding(llm):
    llm, (target, tp, tok) = llm
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=6))
    ref = generate(target, tp, [tok.encode(p) for p in PROMPTS], 6, eos_id=tok.eos_id,
                   max_len=MAX_LEN)  # fmt: skip
    assert [r.token_ids for r in results] == [list(t) for t in ref.tokens]
    per_prompt = [SamplingParams(max_tokens=k + 1) for k in range(len(PROMPTS))]
    results = llm.generate(PROMPTS, per_prompt)
    assert [r.completion_tokens <= k + 1 for k, r in enumerate(results)] == [True] * 6
    assert all(r.token_ids == list(t[: r.completion_tokens]) for r, t in zip(results, ref.tokens))


def test_chat_and_errors(llm):
    llm, (target, tp, tok) = llm
    conv = [{"role": "user", "content": "def add(a, b):"}]
    (reply,) = llm.chat([conv], SamplingParams(max_tokens=5))
    (plain,) = llm.generate(["# def add(a, b):\n"], SamplingParams(max_tokens=5))
    assert reply.token_ids == plain.token_ids
    with pytest.raises(InvalidRequest, match="prompt 1: prompt is empty"):
        llm.generate(["x", ""])
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        llm.generate(["x", "y"], [SamplingParams()])
