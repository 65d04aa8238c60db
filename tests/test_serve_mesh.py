"""``serve.py --data 2 --tensor 4`` on 8 fake CPU devices: the bundled target read straight
onto two replicas of a tensor-parallel mesh answers the ``openai`` client (completion and
stream, concurrently) with plain greedy decoding's tokens, and ``/metrics`` names the mesh
and counts the replicas' padding."""

import concurrent.futures
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import serve  # noqa: E402
from dspark_jax.convert.loading import load_target  # noqa: E402
from dspark_jax.decode.autoregressive import generate as ar_generate  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_on_data_replicas_of_a_tensor_mesh_answers_the_openai_client(tmp_path):
    port = _free_port()
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))  # 8 fake devices: conftest's flags
    cmd = [sys.executable, serve.__file__, "--data", "2", "--tensor", "4", "--scheduler", "fixed"]
    cmd += ["--slots", "2", "--max-len", "96", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1]
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
    finally:
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
