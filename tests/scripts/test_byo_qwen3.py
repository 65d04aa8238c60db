"""The "bring your own Qwen3" walkthrough, run end to end: ``scripts/byo_qwen3.sh`` with
``SMALL=1`` on a tiny random Qwen3 made by ``scripts/make_tiny_qwen3.py`` (with
``transformers`` where torch is installed, else with ``convert.save_hf``): corpus,
self-distillation with the checkpoint's own tokenizer, training with
``configs/recipes/drafter_dspark_my_qwen3.py``, export, calibration, evaluation, serving and one
chat request. And the guide (docs/guides/train-drafter.md) shows the script's steps as they
are, so neither can change without the other.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest

from dspark_jax.testing import free_port, one_device_subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "byo_qwen3.sh")
GUIDE = os.path.join(REPO, "docs", "guides", "train-drafter.md")
BEGIN, END = "# ---- STEPS", "# ---- end of STEPS ----"
GUIDE_MARK = "<!-- the STEPS of scripts/byo_qwen3.sh (tests/scripts/test_byo_qwen3.py) -->"


def script_steps() -> str:
    """The script's STEPS section as the guide shows it: without the marker lines and the
    ``step "..."`` progress lines."""
    text = open(SCRIPT).read()
    body = text[text.index(BEGIN) : text.index(END)].splitlines()[1:]
    return "\n".join(line for line in body if not line.startswith("step ")).strip() + "\n"


def guide_steps() -> str:
    text = open(GUIDE).read()
    assert GUIDE_MARK in text, f"{GUIDE} lost the marker {GUIDE_MARK!r}"
    m = re.match(r"\s*```bash\n(.*?)```", text[text.index(GUIDE_MARK) + len(GUIDE_MARK) :], re.S)
    assert m, f"no ```bash block right after {GUIDE_MARK!r} in {GUIDE}"
    return m.group(1)


def test_guide_shows_the_script_steps():
    assert guide_steps() == script_steps(), (
        f"{GUIDE}'s block after {GUIDE_MARK!r} must be the STEPS section of {SCRIPT} "
        "(without its `step` lines); it should read:\n" + script_steps()
    )


def test_guide_settings_table_has_the_script_values():
    """The guide's table of SMALL=1 / full-size values says what the script sets."""
    script, guide = open(SCRIPT).read(), open(GUIDE).read()
    pairs = [("PROMPT_LEN", "NEW_TOKENS"), ("MAX_PROMPTS", "DISTILL_BATCH"),
             ("EVAL_TOKENS", "EVAL_SLOTS")]  # fmt: skip
    for a, b in pairs:
        values = re.findall(rf"\b{a}=(\d+) {b}=(\d+)", script)
        assert len(values) == 2, (a, b, values)  # SMALL=1, then full size
        (small_a, small_b), (full_a, full_b) = values
        row = f"| `{a}`, `{b}` | {small_a}, {small_b} | {full_a}, {full_b} |"
        assert row in guide, f"{GUIDE} should have the row {row!r}"


@pytest.mark.slow  # the whole guide end to end (137 s)
def test_walkthrough_end_to_end_on_a_tiny_random_qwen3(tmp_path):
    env = one_device_subprocess_env(tmp_path / "jax_cache")
    # `python` in the script is this interpreter (CI: the leg's virtual environment).
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    model, work = tmp_path / "my_qwen3", tmp_path / "work"
    made = subprocess.run(
        [sys.executable, "scripts/make_tiny_qwen3.py", str(model)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-4000:]
    info = json.loads(made.stdout.strip().splitlines()[-1])
    have_torch = importlib.util.find_spec("torch") is not None
    assert info["writer"] == ("transformers" if have_torch else "save_hf")

    env.update(MODEL=str(model), WORK=str(work), SMALL="1", PORT=str(free_port()))
    start = time.monotonic()
    run = subprocess.run(
        ["bash", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    seconds = time.monotonic() - start
    log = run.stdout[-6000:] + "\n--- stderr ---\n" + run.stderr[-6000:]
    assert run.returncode == 0, log
    print(f"byo_qwen3.sh SMALL=1 took {seconds:.0f} s")

    # Every step left its output, and training saw supervised tokens.
    steps = re.findall(r"^== (\d)\. ", run.stdout, re.M)
    assert steps == list("1234567"), log
    evals = [json.loads(line) for line in open(work / "run" / "metrics.jsonl")]
    evals = [m for m in evals if "heldout_label_positions" in m]
    assert evals and evals[-1]["heldout_label_positions"] > 0
    drafter = json.load(open(work / "drafter" / "drafter_config.json"))["drafter"]
    assert drafter["kind"] == "dspark" and drafter["gamma"] == 2
    assert os.path.isfile(work / "drafter" / "sts.json")
    results = json.load(open(work / "acceptance.json"))["results"]
    assert sorted(r["temperature"] for r in results) == [0.0, 1.0]
    assert all(r["num_prompts"] == 4 and r["tau"] >= 1.0 for r in results)
    chat = json.load(open(work / "chat.json"))
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] > 0
    assert "chat reply: " in run.stdout
