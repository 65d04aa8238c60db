"""Every ``python`` command the README and ``docs/guides/`` show parses with that entry
point's own parser, as written (placeholders such as ``$MODEL`` filled in), and every
repository file it names exists. ``train.py`` commands also load their config with their
overrides, so a renamed config key fails here.

What parsing cannot show (that the command then runs) is shown in two places: the guides
that run on the bundled models run as written in tests/docs/test_guides_run.py (slow; CI
runs it), and the walkthrough's block is scripts/byo_qwen3.sh, run end to end by
tests/scripts/test_byo_qwen3.py. The commands left (a real Qwen3 checkpoint, a TPU slice,
a GPU, hours of compute) are each listed in HOW_CHECKED with the test that runs their
code path on tiny models, so a new command in a guide must be placed here too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import runpy
import sys

import pytest

from tests.docs.documented_commands import REPO, Command, documented_commands
from tests.scripts.test_byo_qwen3 import script_steps

# The walkthrough's block is the script itself (its own test compares them).
COMMANDS = documented_commands(skip=(script_steps().strip(),))
PYTHON_COMMANDS = [c for c in COMMANDS if c.is_python_entry_point]

# What a reader puts in place of a variable the docs leave to them.
PLACEHOLDERS = {"MODEL": "/path/to/Qwen3-8B", "RANK": "0"}
REPO_PATH = re.compile(r"^(configs|assets|scripts|benchmarks)/[\w./-]+$")


class _Parsed(Exception):
    """Raised by parse_args once the command line has parsed: the command stops there."""


@contextlib.contextmanager
def _stop_after_parsing():
    parse_args = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(parse_args(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_then_stop
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = parse_args


def _expand(word: str, command: Command) -> str:
    word = re.sub(r"\$\((.*?)\)", "SUBSTITUTED", word)  # "$(cat key.txt)"

    def value(m):
        name = m.group(1) or m.group(2)
        assert name in PLACEHOLDERS, (
            f"{command.id}: ${name} has no placeholder value; add one to PLACEHOLDERS"
        )
        return PLACEHOLDERS[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, word)


def parse(command: Command) -> argparse.Namespace:
    """Run the command's entry point up to its parse_args; returns the parsed namespace.
    A parser error fails with argparse's own message."""
    argv = [_expand(w, command) for w in command.argv[1:]]
    if argv[0] == "-m":
        # Import and call main(argv): runpy would execute the module a second time, and a
        # module that registers itself (a TFDS builder) refuses that.
        module, args = argv[1], argv[2:]
        entry = importlib.import_module(module)
        if not hasattr(entry, "main"):  # a package: python -m runs its __main__
            entry = importlib.import_module(module + ".__main__")
        run = lambda: entry.main(args)  # noqa: E731
    else:
        path, args = os.path.join(REPO, argv[0]), argv[1:]
        assert os.path.isfile(path), f"{command.id}: no {argv[0]}"
        run = lambda: runpy.run_path(path, run_name="__main__")  # noqa: E731
    old_argv, old_path, stderr = sys.argv, list(sys.path), io.StringIO()
    sys.argv = [argv[0] if argv[0] != "-m" else module, *args]
    try:
        with _stop_after_parsing(), contextlib.redirect_stderr(stderr):
            run()
    except _Parsed as parsed:
        return parsed.args[0]
    except SystemExit as exit_:
        pytest.fail(f"{command.id}: `{command.text}` does not parse (exit {exit_.code}):\n"
                    f"{stderr.getvalue()}")  # fmt: skip
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    pytest.fail(f"{command.id}: `{command.text}` ran to the end without parsing arguments")


@pytest.mark.parametrize("command", PYTHON_COMMANDS, ids=lambda c: c.id)
def test_documented_command_parses(command, monkeypatch):
    monkeypatch.chdir(REPO)
    words = [_expand(w, command) for w in command.argv]
    for word in words:
        path = word.partition("=")[2] if word.startswith("--") else word
        if REPO_PATH.match(path) and not path.startswith("benchmarks/results"):
            assert os.path.exists(os.path.join(REPO, path)), f"{command.id}: no {path}"
    parse(command)
    if command.argv[1] == "train.py":
        # train.py's --config and --config.KEY=VALUE are its own syntax: load the config.
        import dspark_jax.train.trainer  # noqa: F401  (registers the choices the loader checks)
        from dspark_jax.config import load_config, split_config_args

        spec, overrides, _ = split_config_args(words[2:])
        load_config(spec, overrides)


def test_documented_shell_scripts_exist_and_parse():
    import subprocess

    scripts = [w for c in COMMANDS for w in c.argv if w.startswith("scripts/")]
    assert scripts, "the docs name no script? the walkthrough's command was not found"
    for script in sorted(set(scripts)):
        path = os.path.join(REPO, script)
        assert os.path.isfile(path), f"no {script}"
        done = subprocess.run(["bash", "-n", path], capture_output=True, text=True)
        assert done.returncode == 0, f"{script}: {done.stderr}"


# Commands tests/docs/test_guides_run.py runs as written: (doc, the command's text).
RUN_AS_WRITTEN_DOCS = ("docs/guides/evaluate.md",)  # every command, top to bottom
RUN_AS_WRITTEN = {
    ("README.md", "python serve.py --demo"),
    ("README.md", "python serve.py"),
    ("docs/guides/serve.md", "python serve.py --demo"),
    ("docs/guides/serve.md", "python serve.py"),
    ("docs/guides/serve.md", "python benchmarks/serving.py --quick"),
    ("docs/guides/plan-memory.md", "python benchmarks/roofline.py --quick"),
    ("docs/guides/plan-memory.md",
     "python benchmarks/train_roofline.py --case tiny_v5e4 --out /tmp/train_roofline"),
}  # fmt: skip
SERVE_GUIDE_GENERATE = re.compile(r"^python -m dspark_jax\.generate .*--prompts /tmp/prompts")

# Every other command, by what it needs that a 2-core CI machine does not have, and the
# test that runs its code path on tiny models. The first pattern that matches applies.
HOW_CHECKED = [
    (
        r"dspark_jax\.convert\.deepspec",
        "DeepSpec's released checkpoint: tests/convert/test_deepspec_import.py imports one it "
        "builds with DeepSpec's own PyTorch modules",
    ),
    (
        r"/ckpt/|/path/to|path/to/|drafters/my_dspark|\$MODEL|gs://|/shared/wd",
        "your checkpoint and data: the same steps on a tiny random Qwen3 in "
        "tests/scripts/test_byo_qwen3.py; --distributed / --tensor / --data meshes in "
        "tests/train/test_multihost.py, tests/engine/test_multihost_decoding.py, "
        "tests/serve/test_serve_mesh.py",
    ),
    (
        r"--aot-topology|--tpu v5|--topology v5p",
        "XLA:TPU for a named slice (libtpu, minutes per 8B compile): tests/aot/test_aot_tpu.py, "
        "tests/perf/test_roofline.py on small models",
    ),
    (
        r"--aot-devices|benchmarks/aot_memory\.py$",
        "an 8B compile on 8-64 fake CPU devices (minutes, GBs): tests/aot/test_aot.py runs the "
        "same path on tiny configs",
    ),
    (
        r"verify_cost\.py .*--modelled-chip",
        "times a round on a GPU: scripts/device_gpu_check.sh runs it on a device",
    ),
    (
        r"roofline\.py --render|serving_sim\.py|train_budget\.py|train_roofline\.py --case 8b",
        "rewrites committed results from committed inputs: tests/perf/test_serving_sim.py, "
        "tests/perf/test_roofline.py, tests/perf/test_train_cost.py, "
        "tests/perf/test_train_roofline.py",
    ),
    (
        r"benchmarks/serving\.py --target|benchmarks/soak\.py",
        "a load benchmark at 1-64 clients (long on 2 cores): `--quick` runs as written, "
        "tests/serve/test_server.py",
    ),
    (
        r"^python serve\.py --",
        "a server with one more flag than `python serve.py` (run as written): each flag in "
        "tests/serve/test_serve_cli.py, tests/serve/test_server_access.py, "
        "tests/serve/test_engine.py",
    ),
    (
        r"^python -m dspark_jax\.eval (acceptance|calibrate) .*--prompts prompts\.jsonl",
        "your prompts file: the same commands on the guide's prompts in evaluate.md, run as "
        "written",
    ),
    (
        r"configs/bundled/target_pycode_v2\.py|--train-tokenizer|workdirs/target_pycode_v2",
        "trains the bundled target from scratch (long on 2 cores): tests/train/test_train.py, "
        "tests/data/test_data.py on tiny configs",
    ),
]


def how_checked(command: Command) -> str:
    if command.doc in RUN_AS_WRITTEN_DOCS or (command.doc, command.text) in RUN_AS_WRITTEN:
        return "run as written: tests/docs/test_guides_run.py"
    if command.doc == "docs/guides/serve.md" and SERVE_GUIDE_GENERATE.match(command.text):
        return "run as written: tests/docs/test_guides_run.py"
    for pattern, why in HOW_CHECKED:
        if re.search(pattern, command.text):
            return why
    return ""


@pytest.mark.parametrize("command", PYTHON_COMMANDS, ids=lambda c: c.id)
def test_every_documented_command_is_run_or_says_what_runs_its_path(command):
    assert how_checked(command), (
        f"{command.id}: `{command.text}` is neither run as written by "
        "tests/docs/test_guides_run.py nor placed in HOW_CHECKED (what it needs, and the "
        "test that runs its code path)"
    )
