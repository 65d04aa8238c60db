"""serve.py's command-line checks (the server itself is covered by tests/serve/test_server.py).

User errors print one ``error: ...`` line naming the problem and exit with status 2, with
no traceback (the convention of every entry point, ``dspark_jax.cli``).
"""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import serve  # noqa: E402

BUNDLED_TARGET = serve.DEFAULT_TARGET
BUNDLED_DRAFTER = serve.DEFAULT_DRAFTER


def _run(argv, capsys):
    rc = serve.main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_missing_target_dir_is_named(capsys):
    rc, err = _run(["--target", "/nonexistent/target"], capsys)
    assert rc == 2
    assert "error: --target /nonexistent/target: no such directory" in err
    assert f"the bundled one is {BUNDLED_TARGET}" in err


def test_missing_drafter_dir_is_named(capsys):
    rc, err = _run(["--drafter", "/nonexistent/drafter"], capsys)
    assert rc == 2
    assert "error: --drafter /nonexistent/drafter: no such directory" in err
    assert "--drafter none" in err


def test_drafter_dir_given_as_target_is_recognised(capsys):
    rc, err = _run(["--target", BUNDLED_DRAFTER], capsys)
    assert rc == 2
    assert f"--target {BUNDLED_DRAFTER} is a drafter directory" in err
    assert "pass it as --drafter" in err


def test_target_dir_given_as_drafter_is_recognised(capsys):
    rc, err = _run(["--drafter", BUNDLED_TARGET, "--demo"], capsys)
    assert rc == 2
    assert "looks like a Hugging Face model directory" in err and "--target" in err


def test_drafter_for_another_target_is_an_error_line(tmp_path, capsys):
    """A target the bundled drafter was not trained for: one line, status 2."""
    from dspark_jax.convert import save_hf
    from dspark_jax.models.presets import PRESETS
    from dspark_jax.models.qwen3 import Qwen3

    cfg = PRESETS["tiny"]
    params = Qwen3(cfg).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    save_hf(str(tmp_path), cfg, nn.unbox(params), dtype="float32")
    (tmp_path / "tokenizer.json").write_text(
        (pathlib.Path(BUNDLED_TARGET) / "tokenizer.json").read_text()
    )
    rc, err = _run(["--target", str(tmp_path), "--demo", "--demo-prompts", "1"], capsys)
    assert rc == 2
    assert err.count("error: ") == 1 and "was trained for a different target" in err


def test_demo_prompts_fall_back_to_built_in():
    prompts, source = serve.demo_prompts(None, 3)
    assert prompts == serve.FALLBACK_PROMPTS[:3]
    assert source == "3 built-in code prompts"


def test_demo_prompts_file_is_rendered_like_eval(tmp_path):
    f = tmp_path / "he.jsonl"
    f.write_text(json.dumps({"turns": ["Do it:\n```python\ndef f():\n    pass\n```"]}) + "\n")
    assert serve.find_demo_prompts(str(f)) == str(f)
    prompts, source = serve.demo_prompts(str(f), 4)
    assert prompts == ["def f():\n    pass\n"] and str(f) in source
    with pytest.raises(FileNotFoundError, match="--demo-prompts-file /nope.jsonl: no such file"):
        serve.find_demo_prompts("/nope.jsonl")


@pytest.mark.parametrize(
    "flag",
    ["--slots", "--max-queue", "--prefill-batch", "--demo-prompts", "--demo-tokens",
     "--max-body-bytes", "--max-request-tokens"],
)  # fmt: skip
def test_non_positive_sizes_are_named(flag, capsys):
    with pytest.raises(SystemExit):
        serve.parse_args([flag, "0"])
    assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err


def test_demo_defaults_to_one_slot():
    assert serve.parse_args(["--demo"]).slots == 1
    assert serve.parse_args([]).slots == 8
    # The server keeps seeded outputs load-invariant; the demo (one request at a time)
    # measures the paper's rejection sampling.
    assert serve.parse_args([]).seeded_verification == "coupled"
    assert serve.parse_args(["--demo"]).seeded_verification == "standard"
    assert serve.parse_args(["--demo", "--seeded-verification", "coupled"]).seeded_verification == (
        "coupled"
    )


def test_attention_choices_are_the_backends():
    from dspark_jax.ops.paged_attention import ATTENTION_BACKENDS

    for name in ATTENTION_BACKENDS:
        assert serve.parse_args(["--attention", name]).attention == name
    with pytest.raises(SystemExit):
        serve.parse_args(["--attention", "flash"])


def test_serve_reports_warmup_then_exits_0_on_sigterm(tmp_path):
    """`python serve.py`: warm-up progress on stderr, /health 503 "starting" then 200, and
    a SIGTERM drain exits with status 0 (not 143)."""
    import os
    import signal
    import socket
    import subprocess
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    cmd = [sys.executable, serve.__file__, "--drafter", "none", "--slots", "1"]
    cmd += ["--max-len", "32", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    statuses = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            statuses.append(r.json()["status"])
            if r.status_code == 200:
                break
            time.sleep(0.05)
        assert statuses and statuses[-1] == "ok", statuses
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "warm-up: compiling prefill 1 of" in err and "warm-up: compiling verify round" in err
    assert "/health answers 503 'starting' until ready" in err


def test_demo_explains_only_what_its_measurement_shows():
    """The lines under the demo's table: an arm is called slower only when it was, with its
    own τ; the SPS sentence only with a profile of more than one bucket."""
    from dspark_jax.sched.sps import SPSTable

    rows = {
        ("no speculation", 0.0): ("none", 1.0, 300.0, []),
        ("DSpark", 0.0): ("topk", 1.83, 120.0, []),
        ("no speculation", 1.0): ("none", 1.0, 300.0, []),
        ("DSpark", 1.0): ("topk", 2.9, 330.0, []),
    }
    lines = serve.demo_explanations(rows, None)
    assert lines == [
        "DSpark is slower than no speculation here (tau 1.83 at T = 0): the extra tokens "
        "per round do not pay for drafting and verifying gamma tokens on a CPU"
    ]
    # Slower with most rounds plain: the plain rounds are named, not drafting's cost.
    kinds = {0.0: ({"draft": 1, "plain": 90, "probe": 3}, True, "")}
    (line,) = serve.demo_explanations(rows, None, kinds)
    assert line.startswith("DSpark ran most rounds plain at T = 0 (drafting does not pay")
    line = serve.round_kinds_line(0.0, *kinds[0.0])
    assert line.startswith("DSpark rounds at T = 0: 1 drafted, 90 plain")
    assert "3 probes" in line
    rows["DSpark", 0.0] = ("topk", 2.5, 310.0, [])
    sps = SPSTable.from_seconds({2: 0.01, 8: 0.02})
    (line,) = serve.demo_explanations(rows, sps)
    assert line.startswith("on this machine a round verifying 8 tokens costs 2.0x one verifying 2")


def test_busy_port_is_one_error_line(capsys):
    """A port another process listens on: ``error: ...`` and status 2 before any model
    is loaded (it used to abort with status 134 after compiling)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        rc, err = _run(["--drafter", "none", "--port", str(port)], capsys)
    assert rc == 2
    assert f"error: cannot listen on 127.0.0.1:{port}" in err and "--port" in err
    assert "loading target" not in err


def test_access_defaults_agree_with_the_server(monkeypatch):
    from dspark_jax.serve import server

    assert serve.API_KEY_ENV == server.API_KEY_ENV
    assert serve.DEFAULT_MAX_BODY_BYTES == server.DEFAULT_MAX_BODY_BYTES
    assert serve.DEFAULT_MAX_REQUEST_TOKENS == server.DEFAULT_MAX_REQUEST_TOKENS
    monkeypatch.delenv(serve.API_KEY_ENV, raising=False)
    assert serve.parse_args([]).api_key is None
    monkeypatch.setenv(serve.API_KEY_ENV, "from-env")
    assert serve.parse_args([]).api_key == "from-env"
    assert serve.parse_args(["--api-key", "flag"]).api_key == "flag"
    assert serve.parse_args(["--dtype", "bfloat16"]).dtype == "bfloat16"


def test_context_length_defaults_to_the_models():
    """--max-len unset: the target's max_position_embeddings, lowered to what memory
    allows (every slot's KV cache in half the free memory), capped on a CPU; the reason
    is said."""
    assert serve.parse_args([]).max_len is None
    mib = 2**20
    value, why = serve.default_max_len(1024, 8, 1024, None, "cpu")
    assert value == 1024 and "max_position_embeddings (1024)" in why
    value, why = serve.default_max_len(40960, 8, 1024, None, "cpu")
    assert value == serve.CPU_MAX_LEN and "on a CPU" in why
    # 64 MiB free, 8 slots x 1 KiB per position: 32 MiB / 8 KiB = 4096 positions.
    value, why = serve.default_max_len(40960, 8, 1024, 64 * mib, "gpu")
    assert value == 4096 and "allows 40960" in why and "0.1 GiB free" in why
    assert serve.default_max_len(2048, 8, 1024, 64 * mib, "gpu")[0] == 2048


def test_help_says_the_context_default_and_access_flags(capsys):
    with pytest.raises(SystemExit):
        serve.parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Default: the target's max_position_embeddings" in out
    for flag in ("--api-key", "DSPARK_API_KEY", "--max-body-bytes", "--max-request-tokens",
                 "--dtype"):  # fmt: skip
        assert flag in out


def test_dtype_sets_weights_and_compute_of_both_models():
    import jax

    from dspark_jax.serve.engine import load_models

    target, tp, _, drafter, dp, _ = load_models(BUNDLED_TARGET, BUNDLED_DRAFTER, dtype="bfloat16")
    assert target.config.dtype == target.config.param_dtype == "bfloat16"
    assert {str(x.dtype) for x in jax.tree.leaves(tp)} == {"bfloat16"}
    assert {str(x.dtype) for x in jax.tree.leaves(dp)} == {"bfloat16"}
    target, tp, *_ = load_models(BUNDLED_TARGET, None)  # default: as the loader reads it
    assert target.config.dtype == "float32"
    assert {str(x.dtype) for x in jax.tree.leaves(tp)} == {"float32"}
