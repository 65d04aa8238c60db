"""The README's and the guides' commands that run on the bundled models, run as written:
the words the docs show, through bash, from the top of a checkout (slow; CI runs it).

Each runs in a scratch copy of the checkout (the scripts and entry points copied, the
models, configs and package linked), so commands that write beside themselves
(``benchmarks/results/``, ``results/``) leave the real checkout as it was. The other
commands parse in tests/docs/test_documented_commands.py, which also names the test that
runs each one's code path.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dspark_jax.testing import one_device_subprocess_env
from tests.docs.documented_commands import REPO, blocks, documented_commands

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A scratch checkout, and the environment the commands run in: ``python`` is this
    interpreter, one CPU device, a fresh cache (SPS profiles, compiled programs)."""
    root = tmp_path_factory.mktemp("checkout")
    for name in ("assets", "configs", "dspark_jax", "docs", "scripts"):
        (root / name).symlink_to(os.path.join(REPO, name))
    for name in ("serve.py", "train.py"):
        shutil.copy(os.path.join(REPO, name), root / name)
    shutil.copytree(
        os.path.join(REPO, "benchmarks"),
        root / "benchmarks",
        ignore=shutil.ignore_patterns("results", "__pycache__"),
    )
    (root / "benchmarks" / "results").mkdir()
    env = one_device_subprocess_env(root.parent / "jax_cache")
    # `python` is this interpreter's: its own bin directory first (a link to it elsewhere
    # would lose the virtual environment).
    env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env['PATH']}"
    env["XDG_CACHE_HOME"] = str(root.parent / "cache")
    env["PYTHONPATH"] = str(root)  # `benchmarks`' imports of their siblings
    return root, env


def bash(script: str, checkout, timeout: float) -> str:
    root, env = checkout
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, (
        f"exit {done.returncode} running:\n{script}\n--- stdout\n{done.stdout[-3000:]}\n"
        f"--- stderr\n{done.stderr[-3000:]}"
    )
    return done.stdout


def command(doc: str, text: str) -> str:
    """The command of ``doc`` whose words are ``text``, as a shell line."""
    found = [c for c in documented_commands() if c.doc == doc and c.text == text]
    assert found, f"{doc} no longer shows `{text}`"
    return shlex.join(found[0].argv)


def block_with(doc: str, needle: str, language: str = "bash") -> str:
    found = [body for _, body in blocks(doc, language) if needle in body]
    assert len(found) == 1, f"{doc}: {len(found)} {language} blocks contain {needle!r}"
    return found[0]


def test_evaluate_guide_top_to_bottom(checkout):
    doc = "docs/guides/evaluate.md"
    bash("\n".join(body for _, body in blocks(doc)), checkout, timeout=1800)
    results = checkout[0] / "results"
    acceptance = json.loads((results / "acceptance.json").read_text())
    assert acceptance["results"], "acceptance.json has no results"
    for fit in ("sts.json", "sts_draft_probability.json"):
        assert json.loads((results / fit).read_text())["temperatures"], fit
    assert list((results / "figs").glob("*.png")), "eval plot drew nothing"
    assert len((results / "out.jsonl").read_text().splitlines()) == 6


def test_demo_as_written(checkout):
    out = bash(command("README.md", "python serve.py --demo"), checkout, timeout=1200)
    assert command("docs/guides/serve.md", "python serve.py --demo") == "python serve.py --demo"
    assert "lossless check (greedy DSpark output == no speculation, token for token): passed" in out


def test_serve_guide_and_readme_requests_as_written(checkout):
    root, env = checkout
    serve = command("docs/guides/serve.md", "python serve.py")
    assert command("README.md", "python serve.py") == serve
    log_path = root.parent / "serve.log"  # a file: a pipe nobody reads would fill and stall
    with open(log_path, "w") as log_file:
        server = subprocess.Popen(
            ["bash", "-c", f"exec {serve}"], cwd=root, env=env,
            stdout=log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        # The guide's wait for /health, as written, watched: a server that exits fails the
        # test with its log instead of leaving the loop waiting.
        wait = subprocess.Popen(
            ["bash", "-c", block_with("docs/guides/serve.md", "until curl")], cwd=root, env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 900
        while wait.poll() is None and server.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        if wait.poll() is None:
            wait.kill()
            pytest.fail(f"serve.py did not answer /health (exit {server.poll()}):\n"
                        + log_path.read_text()[-3000:])  # fmt: skip
        replies = bash(block_with("docs/guides/serve.md", "curl -s "), checkout, timeout=300)
        # a completion, a chat completion, then a stream of chunks ending in [DONE]
        assert '"text_completion"' in replies and '"chat.completion"' in replies, replies
        assert replies.rstrip().endswith("data: [DONE]"), replies[-500:]
        readme = block_with("README.md", "curl -s").replace("python serve.py", "", 1)
        assert '"choices"' in bash(readme, checkout, timeout=300)
        client = block_with("docs/guides/serve.md", "from openai import OpenAI", "python")
        bash(f"python - <<'PYTHON'\n{client}PYTHON", checkout, timeout=300)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    assert server.returncode == 0, log_path.read_text()[-3000:]


def test_serve_guide_offline_jobs_as_written(checkout):
    llm = block_with("docs/guides/serve.md", "from dspark_jax.serve import LLM", "python")
    out = bash(f"python - <<'PYTHON'\n{llm}PYTHON", checkout, timeout=900)
    assert out.strip(), "the LLM example printed nothing"
    bash(block_with("docs/guides/serve.md", "printf"), checkout, timeout=900)
    assert len(open("/tmp/out.jsonl").read().splitlines()) == 2
    bash(command("docs/guides/serve.md", "python benchmarks/serving.py --quick"), checkout, 1200)
    assert (checkout[0] / "benchmarks" / "results" / "serving_quick.json").exists()


def test_plan_memory_quick_checks_as_written(checkout):
    doc = "docs/guides/plan-memory.md"
    bash(command(doc, "python benchmarks/roofline.py --quick"), checkout, timeout=900)
    assert list((checkout[0] / "benchmarks" / "results").glob("roofline_quick*"))
    text = "python benchmarks/train_roofline.py --case tiny_v5e4 --out /tmp/train_roofline"
    bash(command(doc, text), checkout, timeout=900)
