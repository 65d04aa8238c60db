"""End-to-end tests of ``python -m dspark_jax.generate`` on a tiny random target + drafter."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from dspark_jax.convert import save_hf
from dspark_jax.data.tokenizer_train import train_bpe_tokenizer
from dspark_jax.decode.autoregressive import generate as ar_generate
from dspark_jax.generate import main, read_prompts
from dspark_jax.models.drafter_io import load_drafter, save_drafter
from dspark_jax.models.drafters import DrafterConfig, init_drafter_params, make_drafter
from dspark_jax.models.presets import PRESETS
from dspark_jax.models.qwen3 import Qwen3
from dspark_jax.tokenizer import Tokenizer

CODE = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "import os\nprint(os.getcwd())\n",
] * 5
PROMPTS = ["def add(a, b):\n", "for i in range", "class Point:\n    def"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    target_dir, drafter_dir = root / "target", root / "drafter"
    os.makedirs(target_dir)
    tok = train_bpe_tokenizer(CODE, vocab_size=300, out_path=target_dir, min_frequency=1)
    cfg = PRESETS["tiny"].replace(
        vocab_size=tok.vocab_size, num_hidden_layers=2, max_position_embeddings=128
    )
    target = Qwen3(cfg)
    tp = nn.unbox(target.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    save_hf(target_dir, cfg, tp, dtype="float32")
    dcfg = DrafterConfig(kind="dspark", gamma=3, num_layers=1, markov_rank=8, mask_token_id=2)
    drafter = make_drafter(dcfg, cfg)
    save_drafter(drafter_dir, dcfg, cfg, init_drafter_params(drafter, jax.random.key(1)))
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"turns": [p], "category": "code"}) + "\n")
    return dict(
        root=root,
        target=str(target_dir),
        drafter=str(drafter_dir),
        prompts=str(prompts),
        cfg=cfg,
        params=tp,
        tok=tok,
    )


def _argv(d, out, *flags, drafter=True):
    """``--target/--drafter/--prompts/--out`` of the ``model_dirs`` fixture, then ``flags``."""
    head = ["--target", d["target"]] + (["--drafter", d["drafter"]] if drafter else [])
    return head + ["--prompts", d["prompts"], "--out", str(out), *flags]


def _read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_greedy_cli_matches_autoregressive(model_dirs, capsys):
    d = model_dirs
    out = str(d["root"] / "fixed.jsonl")
    flags = ["--max-new-tokens", "12", "--slots", "2", "--max-len", "64", "--prompt-style", "raw"]
    rc = main(_argv(d, out, *flags))
    assert rc == 0
    printed = capsys.readouterr().out
    assert "tau=" in printed and "tokens/s=" in printed
    lines = _read(out)
    assert [x["prompt_index"] for x in lines] == [0, 1, 2]
    tok = Tokenizer(d["target"])
    ids = [tok.encode(p) for p in PROMPTS]
    ref = ar_generate(Qwen3(d["cfg"]), d["params"], ids, 12, max_len=64, eos_id=tok.eos_id)
    for line, want, reason in zip(lines, ref.tokens, ref.finish_reasons):
        assert line["tokens"] == want
        assert line["finish_reason"] == reason
        assert line["text"] == tok.decode(want, skip_special_tokens=True)
        assert line["rounds"] == len(line["accepted_per_round"]) >= 1
        assert all(
            0 <= a <= v <= 3 for a, v in zip(line["accepted_per_round"], line["verified_per_round"])
        )


@pytest.mark.slow  # 41 s; the SPS cache is tested in test_engine
def test_prefix_sampling_cli_profiles_sps_and_reuses_cache(model_dirs, monkeypatch):
    """SPS is profiled into the per-user cache ($XDG_CACHE_HOME), not beside --out."""
    d = model_dirs
    monkeypatch.setenv("XDG_CACHE_HOME", str(d["root"] / "xdg"))
    out = str(d["root"] / "prefix.jsonl")
    flags = "--max-new-tokens 6 --slots 2 --max-len 64 --scheduler prefix --temperature 1.0 "
    flags += "--top-k 20 --top-p 0.9 --num-samples 2 --limit 2 --seed 3"
    args = _argv(d, out, *flags.split())
    assert main(args) == 0
    lines = _read(out)
    assert [(x["prompt_index"], x["sample_index"]) for x in lines] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    for x in lines:
        assert len(x["tokens"]) <= 6 and x["finish_reason"] in ("eos", "length")
        if x["finish_reason"] == "length":
            assert len(x["tokens"]) == 6
    assert not (d["root"] / "sps_cache.json").exists()
    cache = json.load(open(d["root"] / "xdg" / "dspark_jax" / "sps.json"))
    assert len(cache) == 1
    (entry,) = cache.values()
    assert len(entry["buckets"]) >= 2 and all(s > 0 for s in entry["sps"])


def test_no_drafter_runs_plain_decoding(model_dirs, capsys):
    """Also: more --slots than prompts verifies only as many slots as there are requests."""
    d = model_dirs
    out = str(d["root"] / "plain.jsonl")
    flags = ["--max-new-tokens", "5", "--slots", "8", "--max-len", "64"]
    assert main(_argv(d, out, *flags, drafter=False)) == 0
    assert "slots=3," in capsys.readouterr().out  # 3 prompts, 8 slots asked for
    lines = _read(out)
    assert all(set(x["accepted_per_round"]) <= {0} for x in lines)


def test_prompt_style_is_shared_with_eval(tmp_path):
    """generate renders first turns like eval: a fenced block is extracted unless raw."""
    f = tmp_path / "he.jsonl"
    turn = "Complete this:\n```python\ndef f(x):\n    return x\n```\n"
    f.write_text(json.dumps({"turns": [turn]}) + "\n")
    assert read_prompts(str(f)) == ["def f(x):\n    return x\n"]
    assert read_prompts(str(f), style="raw") == [turn]


def test_cli_errors_name_the_problem(model_dirs, tmp_path, capsys):
    d = model_dirs
    base = ["--prompts", d["prompts"], "--out", str(tmp_path / "o.jsonl")]

    def err(argv):
        assert main(argv) == 2
        return capsys.readouterr().err

    assert "does not exist" in err(["--target", str(tmp_path / "nope")] + base)
    msg = err(["--target", d["target"], "--drafter", str(tmp_path / "nodrafter")] + base)
    assert "Drafter directory" in msg and "does not exist" in msg
    # A drafter trained for another vocabulary: both values are named.
    other = d["cfg"].replace(vocab_size=d["cfg"].vocab_size + 8)
    dcfg = DrafterConfig(kind="dspark", gamma=3, num_layers=1, markov_rank=8, mask_token_id=2)
    bad = tmp_path / "bad_drafter"
    save_drafter(
        bad, dcfg, other, init_drafter_params(make_drafter(dcfg, other), jax.random.key(0))
    )
    msg = err(["--target", d["target"], "--drafter", str(bad)] + base)
    assert "vocab_size" in msg and str(other.vocab_size) in msg and str(d["cfg"].vocab_size) in msg
    msg = err(["--target", d["target"], "--drafter", d["drafter"], "--max-len", "4"] + base)
    assert "does not fit the cache" in msg and "prompt 0" in msg
    # Confidence-based schedulers need a DSpark drafter; without a drafter they are refused.
    assert "needs --drafter" in err(["--target", d["target"], "--scheduler", "prefix"] + base)
    assert "--gamma" in err(
        ["--target", d["target"], "--drafter", d["drafter"], "--gamma", "9"] + base
    )
    bad_prompts = tmp_path / "p.jsonl"
    bad_prompts.write_text('{"text": "x"}\n')
    msg = err(["--target", d["target"], "--prompts", str(bad_prompts)] + base[2:])
    assert "turns" in msg and ":1" in msg


def test_drafter_round_trip(model_dirs):
    d = model_dirs
    module, params = load_drafter(d["drafter"], d["cfg"])
    assert module.config.gamma == 3 and module.config.kind == "dspark"
    leaves = jax.tree_util.tree_leaves(params)
    assert leaves and all(leaf.dtype == jnp.float32 for leaf in leaves)


@pytest.mark.slow
def test_module_entry_point(model_dirs, tmp_path):
    d = model_dirs
    out = tmp_path / "m.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "dspark_jax.generate"]
        + _argv(d, out, "--max-new-tokens", "4", "--max-len", "64", "--scheduler", "topk"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(_read(out)) == len(PROMPTS)


@pytest.mark.slow  # 45 s; eval's CLI runs a tensor mesh in the default suite
def test_greedy_cli_on_a_tensor_mesh_matches_one_device(model_dirs):
    """``--tensor 2``: the target is read straight onto 2 devices and the drafter placed
    by the same rules; the greedy tokens are autoregressive decoding's on one device."""
    d = model_dirs
    out = str(d["root"] / "tensor2.jsonl")
    flags = ["--max-new-tokens", "10", "--slots", "2", "--max-len", "64", "--prompt-style", "raw"]
    assert main(_argv(d, out, *flags, "--tensor", "2")) == 0
    tok = Tokenizer(d["target"])
    ids = [tok.encode(p) for p in PROMPTS]
    ref = ar_generate(Qwen3(d["cfg"]), d["params"], ids, 10, max_len=64, eos_id=tok.eos_id)
    assert [x["tokens"] for x in _read(out)] == ref.tokens


def test_data_replicas_need_a_slot_count_they_divide(model_dirs, capsys):
    """Each data replica owns R/N slots: a count N does not divide is one error line that
    names both, exit 2, before any model is compiled."""
    d = model_dirs
    rc = main(_argv(d, str(d["root"] / "data2.jsonl"), "--data", "2"))
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "--data 2 needs a slot count it divides" in err and "got 3 slots" in err
