"""A drafter run whose rows cannot reach past the distilled prompts is refused, naming
``data.seq_len`` and the prompt length, instead of training on nothing (loss 0,
``heldout_label_positions`` 0): only the generated tokens after a prompt are supervised.

The data are distilled for real (``python -m dspark_jax.data.distill``'s entry point) from a
tiny random Qwen3 checkpoint, so the check reads the manifest that distillation writes.
"""

from __future__ import annotations

import os
import shutil
import sysconfig

import pytest

from dspark_jax.config import load_config
from dspark_jax.testing import tiny_hf_qwen3
from dspark_jax.train import train
from dspark_jax.train.trainer import make_task

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "recipes", "drafter_dspark_my_qwen3.py")
PROMPT_LEN, NEW_TOKENS = 16, 4
# Qwen3 defines no <|pad|>: the tokenizer pads with EOS and says so, as it should.
pytestmark = pytest.mark.filterwarnings("ignore:.*defines no '<\\|pad\\|>'")


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    from dspark_jax.data import prepare_corpus
    from dspark_jax.data.distill import main as distill_main

    root = tmp_path_factory.mktemp("seq_len")
    model = tiny_hf_qwen3(root / "model", writer="save_hf")["path"]
    src = root / "src"
    src.mkdir()
    for name in ("textwrap", "shlex", "glob", "fnmatch"):
        shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name + ".py"), src)
    prepare_corpus("source_tree", str(src), str(root / "corpus"), heldout_percent=50)
    out = str(root / "distill")
    argv = ["--target", model, "--corpus-dir", str(root / "corpus"), "--out-dir", out,
            "--prompt-len", str(PROMPT_LEN), "--max-new-tokens", str(NEW_TOKENS),
            "--max-prompts", "4", "--batch-size", "4", "--no-progress"]  # fmt: skip
    with pytest.warns(UserWarning, match="no '<\\|pad\\|>'"):  # Qwen3 has none: EOS pads
        assert distill_main(argv) == 0
    return model, out


def _config(model, data, seq_len):
    small = [("drafter.num_layers", "1"), ("drafter.gamma", "2"), ("drafter.markov_rank", "8"),
             ("drafter.anchors_per_seq", "2"), ("drafter.eval_anchors_per_seq", "2"),
             ("data.batch_size", "2"), ("train.steps", "1")]  # fmt: skip
    base = [("target.dir", model), ("data.data_dir", data), ("data.seq_len", str(seq_len))]
    return load_config(CONFIG, base + small)


@pytest.mark.parametrize("seq_len", [PROMPT_LEN - 4, PROMPT_LEN, PROMPT_LEN + 1])
def test_seq_len_that_ends_inside_the_prompts_is_refused(distilled, tmp_path, seq_len):
    model, data = distilled
    message = (
        rf"data.seq_len = {seq_len} is too short for the distilled data in .*: its prompts are "
        rf"{PROMPT_LEN} tokens \(--prompt-len\) .* would train on nothing \(loss 0\)\. Set "
        rf"--config.data.seq_len to at least {PROMPT_LEN + 2}; {PROMPT_LEN + NEW_TOKENS} "
        "keeps every generated token"
    )
    with pytest.raises(ValueError, match=message):
        make_task(_config(model, data, seq_len)).check()
    with pytest.raises(ValueError, match=message):  # train.py refuses before compiling
        train(_config(model, data, seq_len), str(tmp_path / "run"), progress=False)
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_seq_len_past_the_prompts_is_accepted(distilled):
    model, data = distilled
    make_task(_config(model, data, PROMPT_LEN + 2)).check()
    make_task(_config(model, data, PROMPT_LEN + NEW_TOKENS)).check()
