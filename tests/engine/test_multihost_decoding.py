"""Decoding on two processes × 4 fake CPU devices (gloo collectives, coordinator on
127.0.0.1), against one process with the same 8-device mesh.

* ``slow``: ``generate`` (the offline engine, as evaluation drives it) on data 2 × tensor 4
  at T = 1: the same samples as one process, written once, by process 0. (Distillation's
  two-process test, in ``tests/data/test_distill.py``, runs by default.)
* ``serve.py`` on tensor 8: the ``openai`` client gets the single-process server's
  answers (completion, stream, chat, ``n`` > 1 with logprobs, a seeded T = 1 request,
  coupled); ``/metrics`` counts the leader's turns and their bytes; SIGTERM to the leader
  mid-stream lets the stream finish and both processes exit 0.
* A follower started with another setting fails at start naming it (both exit 2).
* ``slow``: a follower killed with SIGKILL (its sockets close: the leader's collective
  fails at once) and one stopped with SIGSTOP (nothing closes: only the heartbeat tells)
  end the leader with status 3 within the bound, no request left hanging; a leader
  killed with SIGKILL ends its follower within the bound.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from dspark_jax import generate
from dspark_jax.testing import free_port, launch_processes, multiprocess_env, wait_until_healthy

REPO = pathlib.Path(__file__).resolve().parents[2]
SERVE = str(REPO / "serve.py")
PROMPTS = REPO.parent / "shared" / "eval_datasets" / "humaneval.jsonl"


def _wait_all(procs, timeout: float, what: str) -> list[str]:
    """Each process's stderr once all exited (killed after ``timeout``: a hang fails)."""
    errs = []
    try:
        for p in procs:
            errs.append(p.communicate(timeout=timeout)[1])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{what} hung for {timeout} s")
    return errs


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """Four prompts (the shared HumanEval set when beside the checkout, else made up)."""
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    if PROMPTS.is_file():
        lines = PROMPTS.read_text().splitlines()[:4]
    else:
        lines = [json.dumps({"turns": [f"def f{i}(x):\n"]}) for i in range(4)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.slow  # about 2.5 minutes on 2 cores; distillation's two-process test runs by default
def test_generate_on_two_processes_equals_one_process(tmp_path, prompts_file):
    args = ["--target", str(REPO / "assets" / "target"),
            "--drafter", str(REPO / "assets" / "drafters" / "dspark"),
            "--prompts", prompts_file, "--max-new-tokens", "16", "--slots", "4",
            "--temperature", "1", "--seed", "5", "--data", "2", "--tensor", "4",
            "--sps-cache", str(tmp_path / "sps.json")]  # fmt: skip
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    generate.run(generate.parse_args(args + ["--out", str(one)]))  # this process: 8 devices
    procs = launch_processes(
        [sys.executable, "-m", "dspark_jax.generate", *args, "--out", str(two)], 2,
        free_port(), multiprocess_env(4), cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    errs = _wait_all(procs, 400, "the two-process generate run")
    for i, (p, err) in enumerate(zip(procs, errs)):
        assert p.returncode == 0, f"process {i}:\n{err[-3000:]}"
    assert two.read_text() == one.read_text()  # written once (by process 0), same samples
    assert len(one.read_text().splitlines()) == 4


def _serve_cmd(port: int, *extra: str) -> list[str]:
    return [sys.executable, SERVE, "--tensor", "8", "--scheduler", "fixed", "--slots", "2",
            "--max-len", "64", "--prefill-batch", "1", "--verify-buckets", "14",
            "--no-compile-cache", "--port", str(port), *extra]  # fmt: skip


def _ask_everything(url: str) -> dict:
    """The answers the two servers must agree on (greedy, and seeded + coupled at T = 1)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    prompt = "def fibonacci(n):\n"
    out = {}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both slots at once
        plain = pool.submit(client.completions.create, model="target", prompt=prompt,
                            max_tokens=20, temperature=0)  # fmt: skip
        streamed = pool.submit(lambda: "".join(
            c.choices[0].text for c in client.completions.create(
                model="target", prompt="import os\n", max_tokens=20, temperature=0, stream=True)
        ))  # fmt: skip
        out["completion"] = plain.result().choices[0].text
        out["stream"] = streamed.result()
    chat = client.chat.completions.create(
        model="target", messages=[{"role": "user", "content": "Sort a list."}], max_tokens=12,
        temperature=0,
    )  # fmt: skip
    out["chat"] = chat.choices[0].message.content
    many = client.completions.create(model="target", prompt=prompt, max_tokens=10, n=2,
                                     temperature=0, logprobs=2)  # fmt: skip
    out["n=2"] = [c.text for c in many.choices]
    out["logprobs"] = [
        [round(x, 4) for x in c.logprobs.token_logprobs] for c in many.choices
    ]  # fmt: skip
    seeded = client.completions.create(model="target", prompt=prompt, max_tokens=16,
                                       temperature=1.0, seed=11)  # fmt: skip
    out["seeded T=1"] = seeded.choices[0].text
    return out


@pytest.mark.slow  # 130 s; the lockstep turns and watchdog are tested in test_lockstep, two-process decoding offline in test_distill
def test_two_process_server_answers_as_one_process_and_drains_on_sigterm(tmp_path):
    env1 = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "one"))  # 8 fake devices
    port = free_port()
    one = subprocess.Popen(_serve_cmd(port), env=env1, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", [one])
        want = _ask_everything(f"http://127.0.0.1:{port}")
    finally:
        one.send_signal(signal.SIGTERM)
        one.communicate(timeout=60)

    port = free_port()
    env = dict(multiprocess_env(4), XDG_CACHE_HOME=str(tmp_path / "two"))
    procs = launch_processes(_serve_cmd(port, "--peer-timeout", "20"), 2, free_port(), env,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    signalled = False
    try:
        wait_until_healthy(url, procs)
        got = _ask_everything(url)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        chunks = client.completions.create(
            model="target", prompt="def fibonacci(n):\n", max_tokens=20, temperature=0,
            stream=True,
        )  # fmt: skip
        first = next(iter(chunks)).choices[0].text
        procs[0].send_signal(signal.SIGTERM)  # the leader: drain, then stop the follower
        signalled = True
        drained = first + "".join(c.choices[0].text for c in chunks)
    finally:
        if not signalled:
            procs[0].send_signal(signal.SIGTERM)
        errs = _wait_all(procs, 120, "the two-process server's shutdown")
    for i, (p, err) in enumerate(zip(procs, errs)):
        assert p.returncode == 0, f"process {i}:\n{err[-3000:]}"
    assert got == want
    assert drained == want["completion"]
    assert "following process 0" in errs[1]
    turns = float(next(line.split()[-1] for line in metrics.splitlines()
                       if line.startswith('dspark_lockstep{quantity="turns"}')))  # fmt: skip
    assert turns > 10
    assert "dspark_compilations_after_warmup 0.0" in metrics


def _run_each(cmds: list[list[str]], tmp_path, what: str):
    """One process per command, as the processes of one run (process ``i`` runs
    ``cmds[i]``); waits for all and returns them with their stderr."""
    env = dict(multiprocess_env(4), XDG_CACHE_HOME=str(tmp_path))
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(cmd + ["--coordinator", coordinator, "--num-processes", str(len(cmds)),
                                "--process-id", str(i)],
                         env=env, stderr=subprocess.PIPE, text=True)
        for i, cmd in enumerate(cmds)
    ]  # fmt: skip
    return procs, _wait_all(procs, 300, what)


def test_a_follower_with_other_settings_fails_at_start_naming_them(tmp_path):
    port = free_port()
    cmds = [_serve_cmd(port) for _ in range(2)]
    cmds[1][cmds[1].index("--slots") + 1] = "4"
    procs, errs = _run_each(cmds, tmp_path, "the mismatched start")
    for i, (p, err) in enumerate(zip(procs, errs)):
        assert p.returncode == 2, f"process {i}:\n{err[-3000:]}"
        assert "different serving settings: engine num_slots" in err, err[-2000:]
        assert ("process 0 has 2, process 1 has 4" in err) or (
            "process 1 has 4, process 0 has 2" in err
        )


def test_a_follower_with_other_weights_fails_at_start_naming_them(tmp_path):
    """Same config, same shapes, other weight bytes (as a host with a stale copy of a
    fine-tune would have): refused before loading, by the checkpoint files' fingerprint."""
    other = tmp_path / "target"
    shutil.copytree(REPO / "assets" / "target", other)
    with open(other / "model.safetensors", "r+b") as f:  # the file's last window is hashed
        f.seek(-4, os.SEEK_END)
        last = f.read(4)
        f.seek(-4, os.SEEK_END)
        f.write(bytes(b ^ 0x55 for b in last))
    port, drafter = free_port(), str(REPO / "assets" / "drafters" / "dspark")
    cmds = [_serve_cmd(port, "--target", str(target), "--drafter", drafter)
            for target in (REPO / "assets" / "target", other)]  # fmt: skip
    procs, errs = _run_each(cmds, tmp_path, "the start with other weights")
    for i, (p, err) in enumerate(zip(procs, errs)):
        assert p.returncode == 2, f"process {i}:\n{err[-3000:]}"
        assert "different checkpoints: target files: process" in err, err[-2000:]
        assert "drafter files" not in err  # the same drafter on both
        assert "loading target" not in err  # refused before reading the weights


@pytest.mark.slow
@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_lost_follower_ends_the_leader_within_the_bound(tmp_path, how):
    port = free_port()
    env = dict(multiprocess_env(4), XDG_CACHE_HOME=str(tmp_path))
    timeout = 5.0
    procs = launch_processes(_serve_cmd(port, "--peer-timeout", str(timeout)), 2,
                             free_port(), env, stderr=subprocess.PIPE, text=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, procs)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                               timeout=60)  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pending = [pool.submit(client.completions.create, model="target",
                                   prompt="def f(x):\n", max_tokens=40, temperature=0)
                       for _ in range(2)]  # fmt: skip
            time.sleep(1.0)
            t0 = time.monotonic()
            procs[1].send_signal(signal.SIGKILL if how == "kill" else signal.SIGSTOP)
            statuses = set()
            while procs[0].poll() is None and time.monotonic() - t0 < 60:
                try:
                    statuses.add(httpx.get(url + "/health", timeout=2).status_code)
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            elapsed = time.monotonic() - t0
            outcomes = []
            for f in pending:  # every request answered (an error), none left hanging
                try:
                    f.result(timeout=10)
                    outcomes.append("ok")
                except openai.APIStatusError as e:
                    outcomes.append(e.status_code)
                except openai.APIConnectionError:
                    outcomes.append("closed")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        errs = [p.communicate()[1] for p in procs]
    assert procs[0].returncode == 3, errs[0][-3000:]
    assert elapsed < timeout + 5, f"the leader took {elapsed:.1f} s to exit"
    assert "ok" not in outcomes, outcomes  # every request ended with an error, none hung
    if how == "stop":  # no socket closed: the heartbeat found it; 503 until the exit
        assert 503 in statuses and set(outcomes) <= {503, "closed"}, (statuses, outcomes)
        assert "its heartbeat stopped" in errs[0]


@pytest.mark.slow
def test_a_lost_leader_ends_the_follower_within_the_bound(tmp_path):
    """SIGKILL to process 0 (it hosts the coordination service): the follower's store
    calls fail (or its collective does), and it exits non-zero within the bound."""
    port = free_port()
    env = dict(multiprocess_env(4), XDG_CACHE_HOME=str(tmp_path))
    timeout = 5.0
    procs = launch_processes(_serve_cmd(port, "--peer-timeout", str(timeout)), 2,
                             free_port(), env, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", procs)
        t0 = time.monotonic()
        procs[0].send_signal(signal.SIGKILL)
        try:
            procs[1].wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the follower outlived its leader by 60 s")
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        err = procs[1].communicate()[1]
    assert procs[1].returncode != 0, err[-3000:]
    assert elapsed < timeout + 5, f"the follower took {elapsed:.1f} s to exit:\n{err[-2000:]}"
