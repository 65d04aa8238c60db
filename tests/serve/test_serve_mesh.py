"""``serve.py --data 2 --tensor 4`` on 8 fake CPU devices: the bundled target read straight
onto two replicas of a tensor-parallel mesh answers the ``openai`` client (completion and
stream, concurrently) with plain greedy decoding's tokens, ``/metrics`` names the mesh
and counts the replicas' padding, and SIGTERM lets a stream under way finish. In process:
cancellation frees both replicas' slots and pages, and a drain completes what it
accepted."""

import concurrent.futures
import os
import pathlib
import signal
import subprocess
import sys

import httpx
import openai
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import serve  # noqa: E402
from dspark_jax.convert.loading import load_target  # noqa: E402
from dspark_jax.decode.autoregressive import generate as ar_generate  # noqa: E402
from dspark_jax.testing import free_port, wait_until_healthy  # noqa: E402


@pytest.mark.slow  # 130 s; data replicas are tested at the engine level in test_decode_mesh
def test_serve_on_data_replicas_of_a_tensor_mesh_answers_the_openai_client(tmp_path):
    port = free_port()
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))  # 8 fake devices: conftest's flags
    cmd = [sys.executable, serve.__file__, "--data", "2", "--tensor", "4", "--scheduler", "fixed"]
    cmd += ["--slots", "2", "--max-len", "96", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    signalled = False
    try:
        wait_until_healthy(url, [proc])  # a request before then gets 503 (warming up)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        prompt = "def fibonacci(n):\n"
        # Both at once: one on each replica (the least-loaded one takes the second).
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            done = pool.submit(
                client.completions.create,
                model="target", prompt=prompt, max_tokens=24, temperature=0,
            )  # fmt: skip
            streamed = pool.submit(lambda: "".join(
                c.choices[0].text
                for c in client.completions.create(
                    model="target", prompt=prompt, max_tokens=24, temperature=0, stream=True
                )
            ))  # fmt: skip
            done, streamed = done.result(), streamed.result()
        metrics = httpx.get(url + "/metrics", timeout=10).text
        # SIGTERM while a stream is under way: it completes, then the server exits 0.
        chunks = client.completions.create(
            model="target", prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        first = next(iter(chunks)).choices[0].text
        proc.send_signal(signal.SIGTERM)
        signalled = True
        drained = first + "".join(c.choices[0].text for c in chunks)
    finally:
        if not signalled:  # a second SIGTERM would cut the drain short
            proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert proc.returncode == 0, err
    assert "onto 8 devices (data 2 × tensor 4)" in err
    assert 'dspark_mesh_devices{data="2",platform="cpu",tensor="4"} 8.0' in metrics
    assert "dspark_replica_padding_rows " in metrics
    assert "dspark_compilations_after_warmup 0.0" in metrics
    # Greedy speculative decoding on the mesh = plain greedy decoding on one device.
    target = load_target(serve.DEFAULT_TARGET)
    ids = target.tokenizer.encode(prompt)
    ref = ar_generate(target.module, target.params, [ids], 24, max_len=96,
                      eos_id=target.tokenizer.eos_id)  # fmt: skip
    want = target.tokenizer.decode(ref.tokens[0], skip_special_tokens=True)
    assert done.choices[0].text == want
    assert streamed == want
    assert drained == want


def test_cancellation_and_drain_on_data_replicas(tmp_path):
    """The serving engine on data 2 × tensor 2: cancelled requests free their slots and
    pages in both replicas (and on the device), the slots serve again with the same
    greedy tokens; a drain finishes every accepted request on both replicas and refuses
    new ones by name."""
    import numpy as np
    import pytest

    from dspark_jax.data.tokenizer_train import train_bpe_tokenizer
    from dspark_jax.decode.mesh import decode_mesh
    from dspark_jax.serve.engine import Engine, EngineClosed, EngineConfig, SamplingParams
    from dspark_jax.testing import tiny_random_models

    texts = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n    print(i)\n"] * 20
    tok = train_bpe_tokenizer(texts, vocab_size=300, out_path=tmp_path)
    target, tp, drafter, dp = tiny_random_models(tok, "dspark", gamma=3, max_len=48)
    cfg = EngineConfig(num_slots=4, max_len=48, scheduler="fixed", max_queue=16, sps_repeats=1)
    engine = Engine(target, tp, tok, drafter, dp, cfg, mesh=decode_mesh(data=2, tensor=2))
    engine.start()
    try:
        assert engine.decoder.replicas == 2
        greedy = SamplingParams(max_tokens=12)
        want = engine.generate("def add", greedy, timeout=120)
        # Six long requests on four slots over two replicas: cancel all but the last.
        long = SamplingParams(max_tokens=40, temperature=1.0)
        handles = [engine.submit("x", long) for _ in range(6)]
        for h in handles[:-1]:
            h.cancel()
        results = [h.result(120) for h in handles]
        assert [r.finish_reason for r in results[:-1]] == ["cancelled"] * 5
        assert results[-1].finish_reason in ("stop", "length")
        assert engine.wait_idle(60)
        assert not np.asarray(engine._state.active).any()  # released on the device too
        assert engine.pages.free == engine.pages.capacity  # both replicas' pages back
        # Four at once: both replicas serve again, each with the one-request tokens.
        again = [engine.submit("def add", greedy) for _ in range(4)]
        assert all(h.result(120).token_ids == want.token_ids for h in again)
        # Drain: what was accepted completes, what comes later is refused.
        accepted = [engine.submit("def add", greedy) for _ in range(5)]
        engine.begin_drain()
        with pytest.raises(EngineClosed, match="shutting down"):
            engine.submit("def add", greedy)
        assert all(h.result(120).token_ids == want.token_ids for h in accepted)
    finally:
        engine.shutdown(drain=True, timeout=60)
    assert not engine.running
