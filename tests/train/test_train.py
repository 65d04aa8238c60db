"""Training loop, checkpoint/resume and export, on a tiny corpus built with the real pipeline."""

from __future__ import annotations

import os
import sys

import chex
import jax
import numpy as np
import pytest

from dspark_jax.config import ConfigError, load_config
from dspark_jax.testing import kill_and_resume, stdlib_corpus
from dspark_jax.train import read_metrics, train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "tiny", "target_tiny.py")
# Small, stable stdlib modules: a deterministic corpus of real Python code.
_STDLIB_FILES = ("abc", "bisect", "colorsys", "copy", "heapq", "keyword", "numbers",
                 "queue", "shlex", "string", "textwrap", "this", "fnmatch", "glob")  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return stdlib_corpus(tmp_path_factory.mktemp("corpus"), _STDLIB_FILES)


def _overrides(corpus, **kw):
    data_dir, tok = corpus
    out = [("data.data_dir", data_dir), ("data.tokenizer", tok)]
    out += [(k.replace("__", "."), str(v)) for k, v in kw.items()]
    return out


def _cfg(corpus, **kw):
    return load_config(TINY, _overrides(corpus, **kw))


def _losses(workdir):
    return {m["step"]: m["loss"] for m in read_metrics(workdir) if m["kind"] == "train"}


@pytest.fixture(scope="module")
def one_device_run(corpus, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("run1"))
    summary = train(_cfg(corpus), workdir, devices=jax.devices()[:1], progress=False)
    return workdir, summary


@pytest.mark.slow  # 54 s; the drafter's sharded training is tested in test_drafter_train
def test_loss_decreases_and_sharded_run_matches(corpus, one_device_run, tmp_path):
    workdir1, summary = one_device_run
    cfg = _cfg(corpus)
    losses1 = _losses(workdir1)
    assert sorted(losses1) == list(range(1, cfg.train.steps + 1))
    first = np.mean([losses1[s] for s in range(1, 6)])
    last = np.mean([losses1[s] for s in range(cfg.train.steps - 4, cfg.train.steps + 1)])
    assert last < first - 0.5, (first, last)
    evals = [m for m in read_metrics(workdir1) if m["kind"] == "eval"]
    assert [e["step"] for e in evals] == [20, 40]
    assert evals[-1]["heldout_loss"] < evals[0]["heldout_loss"]
    assert np.isclose(evals[-1]["heldout_perplexity"], np.exp(evals[-1]["heldout_loss"]))
    assert summary["tokens_per_s"] > 0

    # Same run on a 2x2x2 (data, fsdp, tensor) mesh of 8 fake devices.
    assert len(jax.devices()) == 8
    cfg8 = _cfg(corpus, mesh__data=2, mesh__fsdp=2, mesh__tensor=2)
    train(cfg8, str(tmp_path), progress=False)
    losses8 = _losses(str(tmp_path))
    chex.assert_trees_all_close(losses8, losses1, rtol=0, atol=2e-3)  # {step: loss}


def test_kill_and_resume_replays_the_same_losses(corpus, tmp_path):
    # One CPU device (sharded equivalence is tested above); the three processes share
    # compiled steps (same program, same binary).
    steps = 100
    run = kill_and_resume(REPO, TINY, _overrides(corpus), str(tmp_path), steps, 25)
    assert sorted(run["ref_losses"]) == list(range(1, steps + 1))
    assert run["killed_at"] < steps
    assert '"resumed": true' in run["stdout"]
    resumed, ref_losses = run["resumed_losses"], run["ref_losses"]
    assert sorted(resumed) == list(range(1, steps + 1))
    for s in range(1, steps + 1):
        assert resumed[s] == ref_losses[s], (s, resumed[s], ref_losses[s])


def test_resume_with_a_different_model_shape_fails_clearly(corpus, one_device_run):
    workdir, _ = one_device_run
    cfg = _cfg(corpus, model__hidden_size=32)
    with pytest.raises(ValueError) as e:
        train(cfg, workdir, devices=jax.devices()[:1], progress=False)
    msg = str(e.value)
    assert "does not match the configured model" in msg
    assert "params/embed_tokens/embedding" in msg
    assert "(320, 64)" in msg and "(320, 32)" in msg


def test_export_writes_a_loadable_hf_directory(corpus, one_device_run, tmp_path):
    from dspark_jax.convert import load_hf
    from dspark_jax.export import main as export_main
    from dspark_jax.export import restore_params

    workdir, _ = one_device_run
    out = str(tmp_path / "hf")
    assert export_main(["--workdir", workdir, "--out", out, "--dtype", "float32"]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    _, model_config, step, params, _ = restore_params(workdir)
    assert step == 40
    hf_config, hf_params = load_hf(out)
    assert hf_config.vocab_size == model_config.vocab_size == 320
    chex.assert_trees_all_equal(jax.device_get(params), jax.device_get(hf_params))


def test_init_from_starts_a_fresh_run_from_exported_weights(corpus, one_device_run, tmp_path):
    from dspark_jax.export import main as export_main

    workdir, _ = one_device_run
    source = str(tmp_path / "hf")
    assert export_main(["--workdir", workdir, "--out", source, "--dtype", "float32"]) == 0
    source_eval = [m for m in read_metrics(workdir) if m["kind"] == "eval"][-1]
    # One step whose learning rate is 0 (the warm-up starts at 0): the weights stay the
    # exported ones, so the held-out loss is the source run's final one.
    run = str(tmp_path / "warm")
    cfg = _cfg(corpus, train__init_from=source, train__steps=1, train__warmup_frac=0.5,
               train__eval_every=0)  # fmt: skip
    train(cfg, run, devices=jax.devices()[:1], progress=False)
    warm_eval = [m for m in read_metrics(run) if m["kind"] == "eval"][-1]
    assert warm_eval["step"] == 1
    np.testing.assert_allclose(warm_eval["heldout_loss"], source_eval["heldout_loss"], rtol=1e-6)
    # A fresh run's loss is far above it (ln 320 = 5.77 at the start).
    fresh = str(tmp_path / "fresh")
    train(_cfg(corpus, train__steps=1, train__warmup_frac=0.5, train__eval_every=0), fresh,
          devices=jax.devices()[:1], progress=False)  # fmt: skip
    fresh_eval = [m for m in read_metrics(fresh) if m["kind"] == "eval"][-1]
    assert fresh_eval["heldout_loss"] > warm_eval["heldout_loss"] + 1.0

    # Another architecture is refused by name, before any step; so is a missing directory.
    with pytest.raises(ConfigError, match="hidden_size: 64 there, 32 here"):
        train(_cfg(corpus, train__init_from=source, model__hidden_size=32),
              str(tmp_path / "other"), devices=jax.devices()[:1], progress=False)  # fmt: skip
    with pytest.raises(FileNotFoundError, match="train.init_from: directory .*nowhere"):
        train(_cfg(corpus, train__init_from=str(tmp_path / "nowhere")),
              str(tmp_path / "missing"), devices=jax.devices()[:1], progress=False)  # fmt: skip


def test_unknown_config_key(corpus, capsys):
    with pytest.raises(ConfigError, match="Unknown config key 'train.stepz'"):
        _cfg(corpus, train__stepz=3)
    sys.path.insert(0, REPO)
    import train as train_cli

    rc = train_cli.main(["--config", TINY, "--workdir", "/nonexistent", "--config.data.seqlen=3"])
    assert rc == 2
    assert "Unknown config key 'data.seqlen'" in capsys.readouterr().err


def test_help_lists_config_and_the_override_syntax(capsys):
    sys.path.insert(0, REPO)
    import train as train_cli

    with pytest.raises(SystemExit) as e:
        train_cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--config FILE" in out and "--config.KEY.SUB=VALUE" in out
    assert "--config.target.dir=" in out and "--config.data.data_dir=" in out
    assert "--drafter" not in out  # train.py has no such flag


def test_seq_len_above_max_positions(corpus, tmp_path):
    cfg = _cfg(corpus, data__seq_len=512)  # tiny preset: 256 positions
    with pytest.raises(ValueError, match="seq_len = 512 exceeds .* max_position_embeddings = 256"):
        train(cfg, str(tmp_path), progress=False)


def test_batch_not_divisible_by_data_parallel_degree(corpus, tmp_path):
    cfg = _cfg(corpus, data__batch_size=6)  # 8 devices on the data axis
    with pytest.raises(ValueError, match="batch_size = 6 is not divisible by the data-parallel"):
        train(cfg, str(tmp_path), progress=False)


def test_missing_data_dir_and_tokenizer(corpus, tmp_path):
    data_dir, tok = corpus
    cfg = _cfg(corpus, data__data_dir=str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="Data directory not found"):
        train(cfg, str(tmp_path / "w1"), progress=False)
    cfg = _cfg(corpus, data__tokenizer=str(tmp_path / "nope.json"))
    with pytest.raises(FileNotFoundError, match="Tokenizer not found"):
        train(cfg, str(tmp_path / "w2"), progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    cfg = _cfg(corpus, data__data_dir=str(empty))
    with pytest.raises(FileNotFoundError, match="no prepared dataset"):
        train(cfg, str(tmp_path / "w3"), progress=False)


def test_empty_corpus(tmp_path):
    from dspark_jax.data import prepare_corpus

    src = tmp_path / "src"
    src.mkdir()
    (src / "notes.txt").write_text("no python here")
    with pytest.raises(ValueError, match="empty corpus"):
        prepare_corpus("source_tree", str(src), str(tmp_path / "data"))
