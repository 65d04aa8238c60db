"""Evaluation harness end to end on tiny random models: prompts, jitted fixed-block runs,
results file, diagrams, and the command line."""

import contextlib
import io
import json

import jax
import numpy as np
import pytest

from dspark_jax.convert import param_shapes, save_hf
from dspark_jax.data.tokenizer_train import train_bpe_tokenizer
from dspark_jax.eval import calibration as cal
from dspark_jax.eval import metrics as M
from dspark_jax.eval.__main__ import main
from dspark_jax.eval.prompts import format_prompt, load_prompts, split_prompts
from dspark_jax.models.drafter_config import DrafterConfig
from dspark_jax.models.drafter_io import save_drafter
from dspark_jax.models.drafters import init_drafter_params, make_drafter
from dspark_jax.models.presets import PRESETS

GAMMA = 4
MAX_NEW = 16
HUMANEVAL_TURN = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    '```python\ndef add(a, b):\n    """Return a + b.\n    >>> add(1, 2)\n    3\n    """\n\n```'
)
QUESTIONS = [
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "A train travels 60 miles per hour for 2 hours. How far does it go?\nPlease reason.",
    "What is 7 times 8?",
    "Sara reads 10 pages a day. How many pages does she read in a week?",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_prompt_formats():
    assert format_prompt(HUMANEVAL_TURN, "humaneval") == (
        'def add(a, b):\n    """Return a + b.\n    >>> add(1, 2)\n    3\n    """\n'
    )
    mbpp = format_prompt("Write a function to find the volume of a prism.", "mbpp")
    assert mbpp == '"""Write a function to find the volume of a prism."""\n\n\ndef'
    gsm = format_prompt("Two plus two?\nPlease reason step by step.", "gsm8k")
    assert gsm == "# Two plus two?\n# Please reason step by step.\n# Answer:\n"
    # Instruction sets that ask for code get the stub even outside mbpp.
    assert format_prompt("Write a python function that adds.", "other").endswith("\ndef")
    assert format_prompt('Say """hi""" \\ ok', "mbpp", style="docstring") == (
        '"""Say \\"\\"\\"hi\\"\\"\\" \\\\ ok"""\n\n\ndef'
    )
    assert format_prompt("as is", "x", style="raw") == "as is"
    with pytest.raises(ValueError, match="fenced code block"):
        format_prompt("no code here", "x", style="code")
    with pytest.raises(ValueError, match="unknown prompt style"):
        format_prompt("x", "x", style="chat")


def test_plain_text_prompts_are_left_as_they_are(tmp_path):
    """auto renders a benchmark's instruction turns, never plain text: a "prompt" string
    or a turn that already reads as code stays as it is, unless a style is asked for."""
    code = "def fibonacci(n):\n    a, b = 0, 1\n"
    for text in (code, "import os\n\n", "# a comment\nx = 1\n", '"""Doc."""\n', "@dec\n"):
        assert format_prompt(text, "anything") == text
    assert format_prompt(code, "x", style="comment").startswith("# def fibonacci")
    f = tmp_path / "mine.jsonl"
    plain = "Once upon a time, in a small town,"
    f.write_text(json.dumps({"prompt": plain}) + "\n" + json.dumps({"turns": [code]}) + "\n")
    assert [p.formatted for p in load_prompts(f)] == [plain, code]
    assert load_prompts(f, style="comment")[0].formatted == f"# {plain}\n# Answer:\n"
    # Instruction turns are still rendered.
    assert format_prompt("Two plus two?", "gsm8k") == "# Two plus two?\n# Answer:\n"


def test_load_prompts_and_errors(tmp_path):
    f = tmp_path / "mbpp.jsonl"
    f.write_text(
        "\n".join(json.dumps({"turns": [f"Write a function number {i}.", "2nd"]}) for i in range(5))
    )
    ps = load_prompts(f, limit=3)
    assert [p.index for p in ps] == [0, 1, 2] and ps[0].set_name == "mbpp"
    assert ps[1].formatted.startswith('"""Write a function number 1.')
    fit, held = split_prompts(load_prompts(f), 0.6)
    assert len(fit) == 3 and len(held) == 2
    with pytest.raises(FileNotFoundError, match="prompt file not found"):
        load_prompts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: invalid JSON"):
        load_prompts(bad)
    bad.write_text('{"question": "no turns"}\n')
    with pytest.raises(ValueError, match="'turns'"):
        load_prompts(bad)


# -- tiny models on disk ------------------------------------------------------------------


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    target_dir = root / "target"
    texts = [f"def f_{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(300)] + QUESTIONS
    tok = train_bpe_tokenizer(texts, 300, out_path=target_dir / "tokenizer.json")
    cfg = PRESETS["tiny"].replace(vocab_size=300, hidden_size=32, intermediate_size=64, head_dim=8)
    rng = np.random.default_rng(0)
    params = {}
    for path, shape in param_shapes(cfg).items():
        v = rng.standard_normal(shape).astype(np.float32) * 0.1
        if path[-1] == "scale":
            v += 1.0
        node = params
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    save_hf(target_dir, cfg, params, dtype="float32")
    (root / "humaneval.jsonl").write_text(
        "\n".join(
            json.dumps({"turns": [HUMANEVAL_TURN.replace("add", f"add{i}")]}) for i in range(4)
        )
    )
    (root / "gsm8k.jsonl").write_text("\n".join(json.dumps({"turns": [q]}) for q in QUESTIONS))
    drafter_cfgs = {
        "dspark": DrafterConfig(
            kind="dspark", gamma=GAMMA, num_layers=1, mask_token_id=tok.mask_id, markov_rank=8
        ),
        "dflash": DrafterConfig(
            kind="dflash", gamma=GAMMA, num_layers=1, mask_token_id=tok.mask_id
        ),
    }
    return {"root": root, "target": target_dir, "config": cfg, "drafters": drafter_cfgs}


def _save_drafter(workspace, name, seed):
    cfg = workspace["drafters"][name]
    d = make_drafter(cfg, workspace["config"])
    params = init_drafter_params(d, jax.random.key(seed))
    path = workspace["root"] / name
    save_drafter(path, cfg, workspace["config"], params)
    return path


@pytest.fixture(scope="module")
def cli_run(workspace, tmp_path_factory):
    """calibrate (DSpark) -> acceptance (DSpark + DFlash, two prompt sets) via the CLI."""
    out_dir = tmp_path_factory.mktemp("cli")
    root = workspace["root"]
    dspark, dflash = _save_drafter(workspace, "dspark", 0), _save_drafter(workspace, "dflash", 1)
    # T = 1: random models accept a fair share of sampled drafts, so labels have both classes.
    common = [
        "--target",
        str(workspace["target"]),
        "--max-new-tokens",
        str(MAX_NEW),
        "--slots",
        "3",
        "--max-prompt-tokens",
        "16",
    ]
    cal_argv = [
            "calibrate",
            *common,
            "--drafter",
            str(dspark),
            "--temperature",
            "1",
            "--prompts",
            str(root / "gsm8k.jsonl"),
            "--split-fraction",
            "0.5",
            "--out",
            str(dspark / "sts.json"),
            "--min-fit-rounds",
            "0",  # a tiny run: a handful of rounds
    ]  # fmt: skip
    # This tiny random drafter's fit is worse than none at some held-out positions: the
    # first run refuses to write, naming them; --force writes it anyway.
    refused = io.StringIO()
    with contextlib.redirect_stderr(refused):
        refused_rc = main(cal_argv)
    refused_written = (dspark / "sts.json").exists()
    forced = io.StringIO()
    with contextlib.redirect_stdout(forced):
        cal_rc = main([*cal_argv, "--force"])
    # The draft-probability estimate of the head-less DFlash drafter: refused from too few
    # rounds (nothing written), then written where serving reads it.
    dp_argv = [
        "calibrate", *common, "--drafter", str(dflash), "--temperature", "1",
        "--prompts", str(root / "gsm8k.jsonl"), "--survival-estimator", "draft-probability",
        "--out", str(dflash),
    ]  # fmt: skip
    few = io.StringIO()
    with contextlib.redirect_stderr(few):
        few_rc = main([*dp_argv, "--min-fit-rounds", "100000"])
    few_written = (dflash / "sts_draft_probability.json").exists()
    dp_rc = main([*dp_argv, "--min-fit-rounds", "0", "--force", "--mode", "isotonic"])
    results = out_dir / "results.json"
    acc_rc = main(
        [
            "acceptance",
            *common,
            "--drafter",
            str(dspark),
            "--drafter",
            str(dflash),
            "--prompts",
            str(root / "humaneval.jsonl"),
            "--prompts",
            str(root / "gsm8k.jsonl"),
            "--temperature",
            "1",
            "--out",
            str(results),
        ]
    )
    return {
        "refused": (refused_rc, refused_written, refused.getvalue()),
        "forced_out": forced.getvalue(),
        "cal_rc": cal_rc,
        "acc_rc": acc_rc,
        "draft_probability": (few_rc, few_written, few.getvalue(), dp_rc),
        "dflash": dflash,
        "dspark": dspark,
        "results": results,
        "out_dir": out_dir,
    }


@pytest.mark.slow  # 80 s; the refusal itself is tested in test_calibration
def test_cli_calibrate_refuses_a_fit_that_makes_a_position_worse(cli_run):
    rc, written, err = cli_run["refused"]
    assert rc == 2 and not written
    line = next(ln for ln in err.splitlines() if ln.startswith("error: "))
    assert "calibration makes drafter dspark worse at position(s) k = " in line
    assert "was not written" in line and "--force" in line
    out = cli_run["forced_out"]
    assert "warning: calibration makes drafter dspark worse at position(s) k = " in out
    sts = json.loads((cli_run["dspark"] / "sts.json").read_text())
    worse = sts["data"]["worse_heldout_positions"]
    assert worse and all(f"k = {k} (" in line for k in worse)
    for row in sts["heldout_metrics"]:
        assert (row["ece_after"] > row["ece_before"]) == (row["position"] in worse)


def test_cli_calibrates_the_draft_probability_of_a_headless_drafter(cli_run):
    """calibrate --survival-estimator draft-probability on DFlash: a fit from too few rounds
    is refused as for the head (nothing written); the fit lands in
    sts_draft_probability.json, which acceptance then applies as that drafter's STS."""
    few_rc, few_written, err, rc = cli_run["draft_probability"]
    assert few_rc == 2 and not few_written
    assert "decode rounds to fit" in err and "nothing was written" in err
    assert rc == 0
    payload = json.loads((cli_run["dflash"] / "sts_draft_probability.json").read_text())
    assert payload["estimator"] == "draft_probability"
    assert payload["data"]["survival_estimator"] == "draft_probability"
    assert len(payload["temperatures"]) == GAMMA
    # An isotonic fit (--mode isotonic): a step map per position that had labels.
    assert payload["mode"] == "isotonic" and len(payload["knots"]) == GAMMA
    assert payload["knots"][0]["edges"] and payload["temperatures"] == [1.0] * GAMMA
    assert not (cli_run["dflash"] / "sts.json").exists()
    results = json.loads(cli_run["results"].read_text())["results"]
    dflash = [e for e in results if e["drafter"] == "dflash"]
    assert dflash and all(e["survival_estimator"] == "draft_probability" for e in dflash)
    assert all(e["sts_applied_offline"] and e["calibration"]["sts"] for e in dflash)
    meta = json.loads(cli_run["results"].read_text())["config"]["drafters"]
    assert next(d for d in meta if d["label"] == "dflash")["sts_knots"] is not None


def test_cli_calibrate_writes_sts(cli_run):
    assert cli_run["cal_rc"] == 0
    ddir = cli_run["dspark"]
    sts = json.loads((ddir / "sts.json").read_text())
    assert len(sts["temperatures"]) == GAMMA and all(t > 0 for t in sts["temperatures"])
    assert sts["data"]["fit_prompts"] == ["gsm8k[0]", "gsm8k[1]"]
    assert sts["data"]["limit"] is None and sts["mode"] == "temperature"
    assert sts["biases"] == [0.0] * GAMMA
    assert sts["data"]["heldout_prompts"] == ["gsm8k[2]", "gsm8k[3]"]
    assert len(sts["heldout_metrics"]) == GAMMA
    np.testing.assert_allclose(cal.load_sts(ddir).temperatures, sts["temperatures"], rtol=1e-6)
    # Refit from the saved arrays: same temperatures; position 1 ECE cannot get worse
    # (T = 1 is on the grid).
    data = np.load(ddir / "sts_data.npz")
    res = cal.fit_sts(data["fit_logits"], data["fit_accepted"], data["fit_verified"])
    np.testing.assert_allclose(res.temperatures, sts["temperatures"], rtol=1e-5)
    assert res.ece_after[0] <= res.ece_before[0] + 1e-9


def test_cli_acceptance_results(cli_run, workspace):
    assert cli_run["acc_rc"] == 0
    data = json.loads(cli_run["results"].read_text())  # strict JSON: NaN became null
    entries = data["results"]
    arrays = np.load(cli_run["results"].with_suffix(".rounds.npz"))
    cfg = data["config"]
    assert cfg["jax_version"] == jax.__version__ and cfg["scheduler"] == "fixed"
    assert cfg["args"]["max_new_tokens"] == MAX_NEW
    assert [d["config"]["kind"] for d in cfg["drafters"]] == ["dspark", "dflash"]
    from dspark_jax.convert.loading import load_target

    # summarize.py matches results to the bundled models by this fingerprint
    assert cfg["target"]["weights"] == load_target(str(workspace["target"])).fingerprint
    assert [(e["drafter"], e["prompt_set"]) for e in entries] == [
        ("dspark", "humaneval"),
        ("dspark", "gsm8k"),
        ("dflash", "humaneval"),
        ("dflash", "gsm8k"),
    ]
    for i, e in enumerate(entries):
        a, v = arrays[f"{i}/accepted"], arrays[f"{i}/verified"]
        assert e["rounds"] == a.size == sum(e["rounds_per_prompt"])
        assert 1.0 <= e["tau"] <= GAMMA + 1
        assert e["tau"] == pytest.approx(M.mean_tau(a))
        per_prompt = np.array(e["tau_per_prompt"]) * np.array(e["rounds_per_prompt"])
        assert per_prompt.sum() / e["rounds"] == pytest.approx(e["tau"])
        assert sum(e["accepted_histogram"]) == e["rounds"]
        # Fixed block: every round verifies all γ drafts except a request's last rounds.
        assert np.all(v <= GAMMA) and np.mean(v == GAMMA) > 0.5
        assert e["generated_tokens"] <= MAX_NEW * e["num_prompts"]
        ca = np.array([np.nan if x is None else x for x in e["conditional_acceptance"]])
        assert np.all((ca[~np.isnan(ca)] >= 0) & (ca[~np.isnan(ca)] <= 1))
        assert set(e["tau_ratio_to"]) == ({"dspark", "dflash"} - {e["drafter"]})
    # Every drafter's survivals are scored: DSpark's confidence head, DFlash's draft
    # probability (with its sts_draft_probability.json); raw and STS from the same logits.
    assert [e["survival_estimator"] for e in entries] == ["confidence_head"] * 2 + [
        "draft_probability"
    ] * 2
    assert entries[2]["calibration"]["sts"] is not None and "2/confidence_logits" in arrays
    calib = entries[0]["calibration"]
    assert entries[0]["sts_applied_offline"]
    z, a, v = (arrays[f"0/{k}"] for k in ("confidence_logits", "accepted", "verified"))
    labels, observed = M.prefix_labels(a, GAMMA, v)
    assert 0 < labels[observed].mean() < 1
    assert sum(calib["raw"]["reliability"]["count"]) == observed.sum()
    assert [p["n"] for p in calib["raw"]["per_position"]] == observed.sum(0).tolist()
    sts = cal.load_sts(cli_run["dspark"])
    temps, biases = sts.temperatures, sts.biases
    np.testing.assert_allclose(calib["sts"]["temperatures"], temps, rtol=1e-6)
    np.testing.assert_allclose(calib["sts"]["biases"], biases, rtol=1e-6)
    a_sts = cal.survival_from_logits(z, temps, biases)
    m = observed[:, 1]
    assert calib["sts"]["per_position"][1]["ece"] == pytest.approx(
        M.ece(a_sts[m, 1], labels[m, 1]), abs=1e-6
    )


def test_cli_plot(cli_run, capsys):
    fig_dir = cli_run["out_dir"] / "figs"
    assert main(["plot", "--results", str(cli_run["results"]), "--out-dir", str(fig_dir)]) == 0
    names = sorted(p.name for p in fig_dir.iterdir())
    assert names == [
        "position_acceptance.png",
        "reliability_dflash_gsm8k_T1.png",
        "reliability_dflash_humaneval_T1.png",
        "reliability_dspark_gsm8k_T1.png",
        "reliability_dspark_humaneval_T1.png",
        "threshold_dflash_gsm8k_T1.png",
        "threshold_dflash_humaneval_T1.png",
        "threshold_dspark_gsm8k_T1.png",
        "threshold_dspark_humaneval_T1.png",
    ]
    for n in names:
        assert (fig_dir / n).read_bytes()[:8] == PNG_MAGIC
    assert "position_acceptance.png" in capsys.readouterr().out


def test_cli_errors(workspace, cli_run, tmp_path, capsys):
    prompts = str(workspace["root"] / "gsm8k.jsonl")
    target, out = str(workspace["target"]), str(tmp_path / "r.json")

    def acceptance(target, drafter, *extra):
        return ["acceptance", "--target", target, "--drafter", drafter, "--prompts", prompts,
                "--out", out, *extra]  # fmt: skip

    cases = [
        (acceptance(str(tmp_path / "none"), "x"), "does not exist"),
        (acceptance(target, "x", "--slots", "0"), "--slots"),
        (["plot", "--results", str(tmp_path / "missing.json"), "--out-dir", str(tmp_path)],
         "results file not found"),
        (acceptance(target, str(tmp_path / "nodrafter")), "does not exist"),
        (["calibrate", "--target", target, "--drafter", str(workspace["root"] / "dflash"),
          "--prompts", prompts, "--survival-estimator", "confidence-head"],
         "no confidence head"),
    ]  # fmt: skip
    for argv, expected in cases:
        rc = main(argv)
        assert rc == 2 and expected in capsys.readouterr().err, argv


def test_cli_calibrate_never_replaces_a_file_silently(cli_run, workspace, capsys):
    """An existing --out (here the drafter's sts.json) is refused before any decoding."""
    path = cli_run["dspark"] / "sts.json"
    before = path.read_bytes()
    argv = ["calibrate", "--target", str(workspace["target"]), "--drafter"]
    argv += [str(cli_run["dspark"]), "--prompts", str(workspace["root"] / "gsm8k.jsonl")]
    assert main(argv + ["--out", str(path)]) == 2
    err = capsys.readouterr().err
    assert "already exists; pass --overwrite" in err and "Traceback" not in err
    # A directory means its sts.json; the label arrays beside it are guarded too.
    assert main(argv + ["--out", str(cli_run["dspark"])]) == 2
    assert path.read_bytes() == before


def test_calibrate_refuses_too_few_rounds():
    from dspark_jax.eval.__main__ import MIN_FIT_ROUNDS, check_fit_rounds

    check_fit_rounds(MIN_FIT_ROUNDS, MIN_FIT_ROUNDS)
    with pytest.raises(ValueError, match="only 31 decode rounds.*nothing was written"):
        check_fit_rounds(31, MIN_FIT_ROUNDS)


def test_every_entry_point_names_a_drafter_given_as_target(tmp_path, capsys):
    """One check in the shared loader (convert.loading.load_target): eval, distill,
    generate and serve each say the directory is a drafter's, and where it belongs."""
    import pathlib
    import sys

    from dspark_jax.data import distill
    from dspark_jax.generate import main as generate_main

    repo = pathlib.Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(repo))
    import serve

    drafter = serve.DEFAULT_DRAFTER
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f():"}) + "\n")
    runs = {
        "eval": lambda: main(["acceptance", "--target", drafter, "--drafter", drafter,
                              "--prompts", str(prompts), "--out", str(tmp_path / "r.json")]),
        "generate": lambda: generate_main(["--target", drafter, "--prompts", str(prompts),
                                           "--out", str(tmp_path / "g.jsonl")]),
        "distill": lambda: distill.main(["--target", drafter, "--corpus-dir", str(tmp_path),
                                         "--out-dir", str(tmp_path / "d")]),
        "serve": lambda: serve.main(["--target", drafter]),
    }  # fmt: skip
    for name, run in runs.items():
        assert run() == 2, name
        err = capsys.readouterr().err
        assert f"error: --target {drafter} is a drafter directory" in err, (name, err)
        hint = "give it where a drafter goes" if name == "distill" else "pass it as --drafter"
        assert hint in err and "Traceback" not in err, (name, err)


def test_cli_acceptance_on_a_tensor_mesh_equals_one_device(workspace, tmp_path):
    """Greedy acceptance with ``--tensor 2`` records the same rounds as on one device."""
    cfg = workspace["drafters"]["dspark"]
    d = make_drafter(cfg, workspace["config"])
    path = tmp_path / "dspark"  # not the module's drafter directory, which others calibrate
    save_drafter(path, cfg, workspace["config"], init_drafter_params(d, jax.random.key(0)))
    arrays = {}
    for tensor in ("1", "2"):
        out = tmp_path / f"tensor{tensor}.json"
        argv = ["acceptance", "--target", str(workspace["target"]), "--drafter", str(path)]
        argv += ["--prompts", str(workspace["root"] / "humaneval.jsonl"), "--temperature", "0"]
        argv += ["--max-new-tokens", "12", "--slots", "2", "--max-prompt-tokens", "16"]
        argv += ["--no-progress", "--tensor", tensor, "--out", str(out)]
        assert main(argv) == 0
        assert json.loads(out.read_text())["config"]["args"]["tensor"] == int(tensor)
        arrays[tensor] = np.load(out.with_suffix(".rounds.npz"))
    for key in ("0/accepted", "0/verified"):
        np.testing.assert_array_equal(arrays["1"][key], arrays["2"][key])
