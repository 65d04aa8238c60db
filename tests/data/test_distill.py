"""Self-distillation data: prompt windows, regeneration, TFDS storage, resume, reader."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from dspark_jax.data import distill as D
from dspark_jax.data.corpus import HELDOUT, TRAIN, prepare_corpus
from dspark_jax.data.tokenizer_train import train_bpe_tokenizer
from dspark_jax.decode.autoregressive import generate
from dspark_jax.decode.mesh import decode_mesh
from dspark_jax.models.presets import PRESETS
from dspark_jax.models.qwen3 import Qwen3

N_FILES = 24
P, M, B = 16, 10, 4  # prompt_len, max_new_tokens, batch_size


def _write_tree(root: Path, n: int, lines_per_file) -> dict[str, str]:
    files = {}
    for i in range(n):
        body = "".join(
            f"def f_{i}_{j}(x):\n    y = x * {j} + {i}\n    return y - {j}\n\n"
            for j in range(lines_per_file(i))
        )
        files[f"pkg{i % 3}/mod_{i}.py"] = f'"""Module {i}."""\n\n' + body
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return files


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    # File 0 is too short for one window; the rest give several.
    files = _write_tree(root, N_FILES, lambda i: 0 if i == 0 else 2 + i % 5)
    corpus = tmp_path_factory.mktemp("corpus")
    prepare_corpus("source_tree", root, corpus)
    tok = train_bpe_tokenizer(files.values(), 300, out_path=corpus / "tokenizer.json")
    cfg = PRESETS["tiny"].replace(vocab_size=320)
    model = Qwen3(cfg)
    params = meta.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    params = jax.tree.map(np.asarray, params)
    return {"root": root, "files": files, "corpus": corpus, "tok": tok, "model": model,
            "params": params}  # fmt: skip


def _settings(**kw):
    base = dict(prompt_len=P, max_new_tokens=M, windows_per_doc=3, batch_size=B,
                temperature=0.0, seed=3, chunk_batches=2)  # fmt: skip
    return D.DistillSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def greedy(env, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill_greedy")
    s = _settings(max_prompts=22)  # 22 = 5 full batches + a padded one
    summary = D.distill(env["model"], env["params"], env["tok"], env["corpus"], out, s)
    return {"out": out, "settings": s, "summary": summary}


def _records(out, split):
    ds_dir = D.find_dataset_dir(out, D.DistillDataset.name)
    import tensorflow_datasets as tfds

    src = tfds.builder_from_directory(str(ds_dir)).as_data_source(split=split)
    return [src[i] for i in range(len(src))]


def _generate_reference(env, prompts, s, split):
    """What the AR sampler gives for these prompts, batch by batch, with the same seeds."""
    out = []
    for bi, start in enumerate(range(0, len(prompts), s.batch_size)):
        batch = [p.tokens for p in prompts[start : start + s.batch_size]]
        n = len(batch)
        batch += [batch[0]] * (s.batch_size - n)
        gen = generate(
            env["model"], env["params"], batch, s.max_new_tokens, temperature=s.temperature,
            seed=D.batch_seed(s.seed, split, bi), eos_id=env["tok"].eos_id,
            max_len=s.prompt_len + s.max_new_tokens,
        )  # fmt: skip
        out += gen.tokens[:n]
    return out


# -- prompts ----------------------------------------------------------------------------
def test_prompt_windows_start_at_line_boundaries_and_are_deterministic(env):
    tok = env["tok"]
    kw = dict(prompt_len=P, windows_per_doc=3, seed=5)
    a = D.make_prompts(env["corpus"], TRAIN, tok, **kw)
    assert a == D.make_prompts(env["corpus"], TRAIN, tok, **kw)
    assert a != D.make_prompts(env["corpus"], TRAIN, tok, **{**kw, "seed": 6})
    per_doc = {}
    for p in a:
        text = env["files"][p.source_path]
        assert len(p.tokens) == P
        assert p.window_start == 0 or text[p.window_start - 1] == "\n"
        # The prompt is the text from that line start, tokenised as a prompt would be.
        assert text[p.window_start :].startswith(tok.decode(p.tokens))
        per_doc.setdefault(p.source_path, []).append(p.window_start)
    assert "pkg0/mod_0.py" not in per_doc  # too short for a window
    assert all(len(v) == len(set(v)) <= 3 for v in per_doc.values())
    assert max(len(v) for v in per_doc.values()) == 3
    capped = D.make_prompts(env["corpus"], TRAIN, tok, **kw, max_prompts=7)
    assert capped == a[:7]


# -- generation and storage --------------------------------------------------------------
def test_greedy_records_equal_generate_output(env, greedy):
    s, out = greedy["settings"], greedy["out"]
    assert greedy["summary"]["records"][TRAIN] == 22
    for split in (TRAIN, HELDOUT):
        prompts = D.make_prompts(
            env["corpus"], split, env["tok"], prompt_len=P, windows_per_doc=3,
            max_prompts=22, seed=s.seed,
        )  # fmt: skip
        recs = _records(out, split)
        assert len(recs) == len(prompts)
        ref = _generate_reference(env, prompts, s, split)
        for rec, p, gen in zip(recs, prompts, ref):
            assert rec["tokens"].tolist() == list(p.tokens) + gen
            assert int(rec["prompt_len"]) == P
            assert rec["source_path"].decode() == p.source_path
            assert int(rec["window_start"]) == p.window_start
            # Loss mask: exactly the generated tokens.
            assert rec["loss_mask"].tolist() == [0] * P + [1] * len(gen)
    total = sum(len(r["tokens"]) - P for sp in (TRAIN, HELDOUT) for r in _records(out, sp))
    assert greedy["summary"]["generated_tokens"] == total
    assert not (Path(out) / D.WORK_DIRNAME).exists()


def test_sampled_records_use_per_batch_seeds(env, tmp_path):
    s = _settings(temperature=1.0, max_prompts=6, seed=11)
    D.distill(env["model"], env["params"], env["tok"], env["corpus"], tmp_path, s)
    prompts = D.make_prompts(env["corpus"], TRAIN, env["tok"], prompt_len=P,
                             windows_per_doc=3, max_prompts=6, seed=11)  # fmt: skip
    ref = _generate_reference(env, prompts, s, TRAIN)
    recs = _records(tmp_path, TRAIN)
    assert [r["tokens"][P:].tolist() for r in recs] == ref
    # Different batches draw with different seeds (not one stream repeated).
    assert D.batch_seed(11, TRAIN, 0) != D.batch_seed(11, TRAIN, 1)


def test_greedy_share_spreads_greedy_batches_over_every_prefix():
    assert [D.greedy_batch(0.25, i) for i in range(8)] == [False] * 3 + [True] + [False] * 3 + [
        True
    ]
    for share in (0.0, 0.1, 0.25, 1 / 3, 0.5, 1.0):
        for n in range(1, 60):
            assert sum(D.greedy_batch(share, i) for i in range(n)) == int(n * share)


def test_greedy_share_regenerates_those_train_batches_at_temperature_zero(env, greedy, tmp_path):
    """Train batches 1, 3, 5 (share 0.5) hold the greedy records (equal to a greedy
    distillation's, whatever their seed); the others and the whole held-out split are the
    temperature-1 samples with their own batch seeds, as without the share."""
    s = _settings(temperature=1.0, max_prompts=22, greedy_share=0.5)
    summary = D.distill(env["model"], env["params"], env["tok"], env["corpus"], tmp_path, s,
                        keep_work=True)  # fmt: skip
    assert summary["greedy_records"] == {TRAIN: 4 + 4 + 2, HELDOUT: 0}
    for split in (TRAIN, HELDOUT):
        prompts = D.make_prompts(env["corpus"], split, env["tok"], prompt_len=P,
                                 windows_per_doc=3, max_prompts=22, seed=s.seed)  # fmt: skip
        sampled = _generate_reference(env, prompts, s, split)
        argmax = [r["tokens"][P:].tolist() for r in _records(greedy["out"], split)]
        got = [r["tokens"][P:].tolist() for r in _records(tmp_path, split)]
        for i, gen in enumerate(got):
            is_greedy = split == TRAIN and (i // B) % 2 == 1
            assert gen == (argmax[i] if is_greedy else sampled[i]), (split, i)
    assert got != argmax  # the held-out split really was sampled
    manifest = D.read_metadata(D.find_dataset_dir(tmp_path, D.DistillDataset.name))["manifest"]
    assert manifest["greedy_share"] == 0.5
    # A resumed run counts the greedy records of the chunks it finds.
    import shutil

    shutil.rmtree(tmp_path / D.DistillDataset.name)
    for c in sorted((tmp_path / D.WORK_DIRNAME / TRAIN).glob("chunk-*.npz"))[1:]:
        c.unlink()
    held_chunks = len(list((tmp_path / D.WORK_DIRNAME / HELDOUT).glob("chunk-*.npz")))
    again = D.distill(env["model"], env["params"], env["tok"], env["corpus"], tmp_path, s)
    assert again["resumed_chunks"] == 1 + held_chunks
    assert again["greedy_records"] == summary["greedy_records"]
    # Without a share the manifest keeps the fields of datasets built before it existed.
    assert (
        "greedy_share"
        not in D.read_metadata(D.find_dataset_dir(greedy["out"], D.DistillDataset.name))["manifest"]
    )
    with pytest.raises(ValueError, match="greedy_share must be in"):
        _settings(greedy_share=1.5).validate()


def test_record_cap_reads_what_a_smaller_distill_writes(env, tmp_path):
    """``max_records = n`` (a multiple of the batch size) reads exactly the records
    ``max_prompts = n`` writes, sampled ones included: prompts and per-batch seeds do not
    depend on the cap, which is what makes one distillation serve a data-size curve."""
    small, large = tmp_path / "small", tmp_path / "large"
    for out, n in ((small, 2 * B), (large, 5 * B)):
        s = _settings(temperature=1.0, max_prompts=n, seed=5)
        D.distill(env["model"], env["params"], env["tok"], env["corpus"], out, s)

    def rows(out, **kw):
        it = D.make_distill_batches(out, TRAIN, P + M, B, seed=0, num_epochs=1,
                                    shuffle=False, **kw)  # fmt: skip
        return [r[:n].tolist() for b in it for r, n in zip(b["tokens"], b["length"]) if n]

    capped = rows(large, max_records=2 * B)
    assert capped == rows(small) and len(capped) == 2 * B
    assert capped != rows(large)[-2 * B :]  # the cap is a prefix, not any 2B records
    with pytest.raises(ValueError, match=r"max_records = 99: split 'train' .* holds 20"):
        rows(large, max_records=99)


def test_eos_is_kept_and_supervised(env, tmp_path):
    # A zero LM head makes every logit equal; greedy argmax then picks id 0, which is EOS.
    assert env["tok"].eos_id == 0
    params = jax.tree.map(lambda x: x, env["params"])
    params["lm_head"] = {"kernel": np.zeros_like(params["lm_head"]["kernel"])}
    s = _settings(max_prompts=5)
    summary = D.distill(env["model"], params, env["tok"], env["corpus"], tmp_path, s)
    recs = _records(tmp_path, TRAIN)
    assert len(recs) == 5 and summary["ended_with_eos"] >= 5
    for r in recs:
        assert r["tokens"][P:].tolist() == [0]
        assert r["loss_mask"].tolist() == [0] * P + [1]


def test_resume_skips_finished_chunks(env, greedy, tmp_path):
    s = greedy["settings"]
    args = (env["model"], env["params"], env["tok"], env["corpus"], tmp_path, s)
    D.distill(*args, keep_work=True)
    work = tmp_path / D.WORK_DIRNAME
    chunks = sorted((work / TRAIN).glob("chunk-*.npz"))
    assert len(chunks) == 3  # 6 batches / 2 per chunk
    # Simulate a run killed after the first chunk: drop the dataset and later chunks.
    import shutil

    shutil.rmtree(tmp_path / D.DistillDataset.name)
    for c in chunks[1:]:
        c.unlink()
    shutil.rmtree(work / HELDOUT)
    summary = D.distill(*args)
    assert summary["resumed_chunks"] == 1
    for split in (TRAIN, HELDOUT):
        assert [r["tokens"].tolist() for r in _records(tmp_path, split)] == [
            r["tokens"].tolist() for r in _records(greedy["out"], split)
        ]
    # Finished dataset: a rerun returns it; other settings are refused.
    assert D.distill(*args)["already_built"]
    with pytest.raises(ValueError, match="other settings"):
        D.distill(*args[:-1], _settings(max_prompts=22, seed=4))


def test_resume_with_other_settings_is_refused(env, tmp_path):
    work = tmp_path / D.WORK_DIRNAME
    work.mkdir()
    (work / "manifest.json").write_text(json.dumps({"seed": 99}))
    with pytest.raises(ValueError, match="cannot resume"):
        D.distill(env["model"], env["params"], env["tok"], env["corpus"], tmp_path, _settings())


# -- errors --------------------------------------------------------------------------------
def test_clear_errors(env, tmp_path):
    m, p, tok = env["model"], env["params"], env["tok"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        D.load_target(tmp_path / "nope")
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        D.load_target(tmp_path / "t")
    with pytest.raises(FileNotFoundError, match="no prepared dataset"):
        D.distill(m, p, tok, tmp_path / "no_corpus", tmp_path / "o1", _settings())
    with pytest.raises(ValueError, match="max_position_embeddings"):
        D.distill(m, p, tok, env["corpus"], tmp_path / "o2", _settings(max_new_tokens=300))
    with pytest.raises(ValueError, match="batch_size"):
        D.distill(m, p, tok, env["corpus"], tmp_path / "o3", _settings(batch_size=0))
    # A corpus whose documents are all shorter than one prompt.
    root = tmp_path / "short"
    root.mkdir()
    for i in range(4):
        (root / f"m{i}.py").write_text(f"x = {i}\n")
    prepare_corpus("source_tree", root, tmp_path / "short_corpus")
    with pytest.raises(ValueError, match="empty corpus split"):
        D.distill(m, p, tok, tmp_path / "short_corpus", tmp_path / "o4", _settings())


def test_cli_missing_target_exits_2(tmp_path, capsys):
    rc = D.main(["--target", str(tmp_path / "x"), "--corpus-dir", str(tmp_path),
                 "--out-dir", str(tmp_path / "o")])  # fmt: skip
    assert rc == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_end_to_end_with_hf_dir(env, tmp_path, capsys):
    from dspark_jax.convert import save_hf

    target = tmp_path / "target"
    save_hf(target, env["model"].config, env["params"], dtype="float32")
    (target / "tokenizer.json").write_bytes(Path(env["tok"].path).read_bytes())
    argv = ["--target", str(target), "--corpus-dir", str(env["corpus"]), "--out-dir",
            str(tmp_path / "o"), "--prompt-len", str(P), "--max-new-tokens", "6",
            "--max-prompts", "5", "--batch-size", "4", "--no-progress"]  # fmt: skip
    assert D.main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["records"][TRAIN] == 5
    assert summary["generated_tokens"] > 0 and summary["tokens_per_second"] > 0


# -- reader ----------------------------------------------------------------------------------
def test_reader_shapes_content_and_padding(greedy):
    out = greedy["out"]
    recs = _records(out, TRAIN)
    seq_len = P + 4  # shorter than the records: truncation
    it = D.make_distill_batches(out, TRAIN, seq_len, 5, seed=0, num_epochs=1, shuffle=False)
    batches = list(it)
    assert len(batches) == 5  # 22 records -> 4 full batches + one padded
    for b in batches:
        assert b["tokens"].shape == (5, seq_len) and b["loss_mask"].shape == (5, seq_len)
        assert b["length"].shape == (5,)
        assert all(v.dtype == np.int32 for v in b.values())
    rows = np.concatenate([b["tokens"] for b in batches])
    masks = np.concatenate([b["loss_mask"] for b in batches])
    lens = np.concatenate([b["length"] for b in batches])
    meta_path = Path(greedy["summary"]["dataset_dir"]) / "metadata.json"
    pad = json.loads(meta_path.read_text())["manifest"]["pad_id"]
    for i, r in enumerate(recs):
        n = min(len(r["tokens"]), seq_len)
        assert lens[i] == n
        assert rows[i, :n].tolist() == r["tokens"][:n].tolist()
        assert (rows[i, n:] == pad).all()
        assert masks[i].tolist() == [0] * P + [1] * (n - P) + [0] * (seq_len - n)
    assert (lens[22:] == 0).all() and (masks[22:] == 0).all() and (rows[22:] == pad).all()
    # Long seq_len: right padding, mask ends with the sequence.
    b = next(D.make_distill_batches(out, TRAIN, 64, 2, seed=0, shuffle=False))
    assert b["length"][0] == len(recs[0]["tokens"]) and b["loss_mask"][0, 40:].sum() == 0


def test_reader_determinism_sharding_and_state_restore(greedy):
    out = greedy["out"]
    kw = dict(seq_len=24, batch_size=3, seed=7)
    a = D.make_distill_batches(out, TRAIN, **kw)
    first = [next(a) for _ in range(12)]  # > 1 epoch (22 records): repeats forever
    b = D.make_distill_batches(out, TRAIN, **kw)
    for x, y in zip(first, [next(b) for _ in range(12)]):
        np.testing.assert_array_equal(x["tokens"], y["tokens"])
    c = D.make_distill_batches(out, TRAIN, **{**kw, "seed": 8})
    assert any((x["tokens"] != next(c)["tokens"]).any() for x in first)
    # Save state mid-stream, restore into a fresh iterator, continue identically.
    it = D.make_distill_batches(out, TRAIN, **kw)
    for _ in range(5):
        next(it)
    state = it.get_state()
    expect = [next(it) for _ in range(4)]
    fresh = D.make_distill_batches(out, TRAIN, **kw)
    fresh.set_state(state)
    for x in expect:
        y = next(fresh)
        for k in D.BATCH_KEYS:
            np.testing.assert_array_equal(x[k], y[k])
    # Strided host shards are disjoint and cover the split.
    seen = []
    for i in range(2):
        for bt in D.make_distill_batches(out, TRAIN, 64, 4, seed=0, shard_index=i,
                                         shard_count=2, num_epochs=1):  # fmt: skip
            seen += [tuple(r[:n]) for r, n in zip(bt["tokens"].tolist(), bt["length"]) if n]
    assert sorted(seen) == sorted(tuple(r["tokens"].tolist()) for r in _records(out, TRAIN))


def test_reader_errors(greedy, tmp_path):
    with pytest.raises(FileNotFoundError, match="no prepared dataset"):
        D.make_distill_batches(tmp_path, TRAIN, 16, 2, 0)
    with pytest.raises(ValueError, match="split 'dev'"):
        D.make_distill_batches(greedy["out"], "dev", 16, 2, 0)
    with pytest.raises(ValueError, match="seq_len"):
        D.make_distill_batches(greedy["out"], TRAIN, 1, 2, 0)


def test_greedy_distill_on_a_tensor_mesh_writes_the_same_records(env, greedy, tmp_path):
    """``--tensor 2``: the weights split over two devices, the same records (greedy)."""
    s = greedy["settings"]
    out = tmp_path / "tensor2"
    D.distill(
        env["model"], env["params"], env["tok"], env["corpus"], out, s,
        mesh=decode_mesh(tensor=2),
    )  # fmt: skip
    for split in (TRAIN, HELDOUT):
        want = [r["tokens"].tolist() for r in _records(greedy["out"], split)]
        assert [r["tokens"].tolist() for r in _records(out, split)] == want


def test_distill_on_two_processes_writes_what_one_process_writes(env, tmp_path):
    """``--tensor 8`` as two processes × 4 fake devices (``dspark_jax.distributed``) at
    T = 1: the records one process writes on the same mesh, written once, by process 0."""
    import subprocess
    import sys

    from dspark_jax.convert import save_hf
    from dspark_jax.testing import launch_processes, multiprocess_env

    s = _settings(max_prompts=10, temperature=1.0)
    one = tmp_path / "one"
    D.distill(env["model"], env["params"], env["tok"], env["corpus"], one, s,
              mesh=decode_mesh(tensor=8))  # fmt: skip
    target = tmp_path / "target"
    save_hf(target, env["model"].config, env["params"], dtype="float32")
    (target / "tokenizer.json").write_bytes(Path(env["tok"].path).read_bytes())
    two = tmp_path / "two"
    argv = [sys.executable, "-m", "dspark_jax.data.distill", "--target", str(target),
            "--corpus-dir", str(env["corpus"]), "--out-dir", str(two), "--prompt-len", str(P),
            "--max-new-tokens", str(M), "--windows-per-doc", "3", "--batch-size", str(B),
            "--temperature", "1.0", "--seed", "3", "--chunk-batches", "2",
            "--max-prompts", "10", "--no-progress", "--tensor", "8"]  # fmt: skip
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    repo = Path(__file__).resolve().parents[2]
    procs = launch_processes(argv, 2, port, multiprocess_env(4), cwd=repo,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    outs = [p.communicate(timeout=400) for p in procs]
    for i, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"process {i}:\n{err[-3000:]}"
    out0 = outs[0][0]  # gloo's connection lines come before and after on stdout
    summary, _ = json.JSONDecoder().raw_decode(out0[out0.index("{\n") :])
    assert summary["records"][TRAIN] == 10
    assert '"records"' not in outs[1][0]  # only process 0 wrote and reported the dataset
    for split in (TRAIN, HELDOUT):
        want = [r["tokens"].tolist() for r in _records(one, split)]
        assert [r["tokens"].tolist() for r in _records(two, split)] == want
