"""Corpus builders (TFDS/array_record), grain reading, packing and the packed pipeline."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json
import sys
from pathlib import Path

import grain
import numpy as np
import pytest

from dspark_jax.data import prepare as prepare_cli
from dspark_jax.data.corpus import (
    HELDOUT,
    TRAIN,
    _hash_bucket,
    assign_splits,
    make_text_dataset,
    prepare_corpus,
    read_metadata,
)
from dspark_jax.data.packing import PackedSequenceIterDataset, attention_mask_from_segments
from dspark_jax.data.pipeline import make_packed_batches
from dspark_jax.data.tokenizer_train import train_bpe_tokenizer

N_FILES = 40


def _make_tree(root: Path) -> dict[str, str]:
    """A few dozen small .py files in nested dirs, plus files that must be skipped."""
    files = {}
    for i in range(N_FILES):
        rel = f"pkg{i % 4}/sub{i % 3}/mod_{i}.py"
        body = "".join(
            f"def f_{i}_{j}(x):\n    return x * {j} + {i}  # é{j}\n\n" for j in range(3 + i % 7)
        )
        files[rel] = f'"""Module {i} — 模块 {i}."""\n\n' + body
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text, encoding="utf-8")
    (root / "site-packages/foo").mkdir(parents=True)
    (root / "site-packages/foo/skipped.py").write_text("x = 1\n")
    (root / "latin1.py").write_bytes("# caf\xe9\n".encode("latin-1"))  # not UTF-8
    (root / "empty.py").write_text("")
    (root / "notes.txt").write_text("not a .py file\n")
    return files


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    files = _make_tree(root)
    data_dir = tmp_path_factory.mktemp("data")
    counts = prepare_corpus("source_tree", root, data_dir)
    tok = train_bpe_tokenizer(files.values(), 300, out_path=data_dir / "tokenizer.json")
    return {"root": root, "files": files, "data_dir": data_dir, "counts": counts, "tok": tok}


def _all_records(data_dir, split, **kw):
    return list(make_text_dataset(data_dir, split, shuffle=False, **kw))


# -- corpus -----------------------------------------------------------------------------
def test_source_tree_corpus_contents_and_split(corpus):
    files, data_dir = corpus["files"], corpus["data_dir"]
    assert corpus["counts"][TRAIN] + corpus["counts"][HELDOUT] == N_FILES
    assert corpus["counts"][HELDOUT] >= 1
    got = {}
    for split in (TRAIN, HELDOUT):
        for r in _all_records(data_dir, split):
            assert r["path"] not in got
            got[r["path"]] = (split, r["text"])
    assert {p: t for p, (_, t) in got.items()} == files  # exact text, skips honoured
    expected = assign_splits(sorted(files), 2)
    assert sorted(p for p, (s, _) in got.items() if s == HELDOUT) == expected[HELDOUT]
    meta = read_metadata(next(Path(data_dir).glob("source_tree_corpus/*")))
    assert meta["skipped_non_utf8"] == 1 and meta["skipped_empty"] == 1
    assert sum(meta["num_chars"].values()) == sum(len(t) for t in files.values())
    assert "tensorflow" not in sys.modules  # TFDS built and read without TensorFlow


def test_split_is_deterministic_and_about_two_percent(corpus, tmp_path):
    counts = prepare_corpus("source_tree", corpus["root"], tmp_path)
    assert counts == corpus["counts"]
    for split in (TRAIN, HELDOUT):
        a = [r["path"] for r in _all_records(corpus["data_dir"], split)]
        b = [r["path"] for r in _all_records(tmp_path, split)]
        assert a == b
    keys = [f"lib/module_{i}.py" for i in range(5000)]
    held = assign_splits(keys, 2)[HELDOUT]
    assert 0.01 < len(held) / len(keys) < 0.03
    assert all(_hash_bucket(k) < 2 for k in held)
    # Adding files never moves existing ones between splits.
    held_more = set(assign_splits(keys + ["extra.py"], 2)[HELDOUT])
    assert set(held) <= held_more


def test_shards_disjoint_and_cover(corpus):
    data_dir = corpus["data_dir"]
    every = {r["path"] for r in _all_records(data_dir, TRAIN)}
    shards = [
        [
            r["path"]
            for r in make_text_dataset(data_dir, TRAIN, seed=3, shard_index=i, shard_count=3)
        ]
        for i in range(3)
    ]
    assert sum(len(s) for s in shards) == len(every)
    assert set().union(*shards) == every
    with pytest.raises(ValueError, match="shard_index"):
        make_text_dataset(data_dir, TRAIN, shard_index=3, shard_count=3)
    with pytest.raises(ValueError, match="split 'validation'"):
        make_text_dataset(data_dir, "validation")


def test_empty_and_mismatched_corpus_errors(corpus, tmp_path):
    empty = tmp_path / "empty_src"
    (empty / "a").mkdir(parents=True)
    (empty / "a" / "readme.txt").write_text("no python here")
    with pytest.raises(ValueError, match=f"empty corpus.*{empty}"):
        prepare_corpus("source_tree", empty, tmp_path / "d1")
    with pytest.raises(FileNotFoundError, match="missing_dir"):
        prepare_corpus("source_tree", tmp_path / "missing_dir", tmp_path / "d2")
    with pytest.raises(ValueError, match=f"no .jsonl files at {empty}"):
        prepare_corpus("jsonl", empty, tmp_path / "d3")
    # Reusing a data dir built from another source is refused.
    other = tmp_path / "other"
    _make_tree(other)
    with pytest.raises(ValueError, match="already holds a corpus built from"):
        prepare_corpus("source_tree", other, corpus["data_dir"])
    with pytest.raises(FileNotFoundError, match="no prepared dataset"):
        make_text_dataset(tmp_path / "nothing", TRAIN)


def test_jsonl_prompt_corpus(tmp_path, capfd):
    """Also: a local build says so, not TFDS's "Downloading and preparing dataset"."""
    src = tmp_path / "prompts"
    src.mkdir()
    rows = [{"turns": [f"Question {i}: what is {i} + {i}?", "and then?"]} for i in range(30)]
    rows[3] = {"turns": ["Write fizzbuzz."], "response": "for i in range(1, 16): ..."}
    rows[4] = {"turns": ["Say hi."], "output": "hi"}
    (src / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (src / "b.jsonl").write_text(json.dumps({"turns": ["Only one in b"]}) + "\n")
    counts = prepare_corpus("jsonl", src, tmp_path / "data")
    out, err = capfd.readouterr()
    assert "Downloading" not in out + err and "from local files into" in err
    assert sum(counts.values()) == 31
    recs = _all_records(tmp_path / "data", TRAIN) + _all_records(tmp_path / "data", HELDOUT)
    by_path = {r["path"]: r for r in recs}
    assert by_path["a.jsonl:4"]["response"].startswith("for i in range")
    assert by_path["a.jsonl:5"]["response"] == "hi"
    assert by_path["a.jsonl:1"]["text"] == by_path["a.jsonl:1"]["prompt"] == rows[0]["turns"][0]
    assert by_path["a.jsonl:1"]["turns"] == rows[0]["turns"]
    assert by_path["b.jsonl:1"]["response"] == ""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"question": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2.*keys present: \\['question'\\]"):
        prepare_corpus("jsonl", bad, tmp_path / "data_bad")


def test_real_eval_prompt_file(tmp_path):
    src = Path("/work/shared/eval_datasets/humaneval.jsonl")
    if not src.exists():
        pytest.skip("shared eval datasets not present")
    n_lines = sum(1 for line in src.read_text().splitlines() if line.strip())
    counts = prepare_corpus("jsonl", src, tmp_path)
    assert sum(counts.values()) == n_lines
    rec = _all_records(tmp_path, TRAIN)[0]
    assert "```python" in rec["prompt"]


def test_cli_prepare_and_tokenizer(corpus, tmp_path, capsys):
    rc = prepare_cli.main(
        ["--kind", "source_tree", "--source", str(corpus["root"]), "--data-dir", str(tmp_path),
         "--train-tokenizer", "--vocab-size", "300"]
    )  # fmt: skip
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["records"] == corpus["counts"]
    assert report["skipped_non_utf8"] == 1
    assert report["tokenizer"]["vocab_size"] <= 300 and report["tokenizer"]["chars_per_token"] > 1
    assert (tmp_path / "tokenizer.json").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    rc = prepare_cli.main(
        ["--kind", "source_tree", "--source", str(empty), "--data-dir", str(empty)]
    )
    assert rc == 2 and str(empty) in capsys.readouterr().err


# -- packing ----------------------------------------------------------------------------
EOS, PAD = 1000, 1001


def _pack(docs, seq_len):
    ds = grain.MapDataset.source([np.asarray(d, np.int32) for d in docs]).to_iter_dataset()
    return PackedSequenceIterDataset(ds, seq_len=seq_len, eos_id=EOS, pad_id=PAD)


def _expected_mask(segment_ids):
    """Block-diagonal causal mask built by walking the segments explicitly."""
    length = len(segment_ids)
    mask = np.zeros((length, length), bool)
    start = 0
    while start < length:
        if segment_ids[start] == 0:
            start += 1
            continue
        end = start
        while end < length and segment_ids[end] == segment_ids[start]:
            end += 1
        for q in range(start, end):
            mask[q, start : q + 1] = True
        start = end
    return mask


def test_packing_layout_exact():
    docs = [[1, 2, 3], [4, 5], [], [6, 7, 8, 9, 10, 11, 12], [13]]
    rows = list(_pack(docs, seq_len=8))
    toks = np.stack([r["tokens"] for r in rows])
    np.testing.assert_array_equal(
        toks,
        [
            [1, 2, 3, EOS, 4, 5, EOS, 6],
            [7, 8, 9, 10, 11, 12, EOS, 13],
            [EOS, PAD, PAD, PAD, PAD, PAD, PAD, PAD],
        ],
    )
    seg = np.stack([r["segment_ids"] for r in rows])
    np.testing.assert_array_equal(
        seg, [[1, 1, 1, 1, 2, 2, 2, 3], [1, 1, 1, 1, 1, 1, 1, 2], [1, 0, 0, 0, 0, 0, 0, 0]]
    )
    pos = np.stack([r["positions"] for r in rows])
    np.testing.assert_array_equal(
        pos, [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 6, 0], [0, 0, 0, 0, 0, 0, 0, 0]]
    )
    lm = np.stack([r["loss_mask"] for r in rows])
    np.testing.assert_array_equal(
        lm, [[1, 1, 1, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0, 0]]
    )
    tgt = np.stack([r["targets"] for r in rows])
    np.testing.assert_array_equal(tgt[0], [2, 3, EOS, PAD, 5, EOS, PAD, PAD])
    for r in rows:
        assert all(v.dtype == np.int32 and v.shape == (8,) for v in r.values())


def test_packing_never_crosses_documents():
    rng = np.random.default_rng(0)
    # Distinct token ranges per document, so any cross-document pair is detectable.
    docs = [list(range(100 * d, 100 * d + rng.integers(1, 40))) for d in range(1, 9)]
    rows = list(_pack(docs, seq_len=16))
    stream = np.concatenate([r["tokens"][r["segment_ids"] > 0] for r in rows])
    np.testing.assert_array_equal(stream, np.concatenate([d + [EOS] for d in docs]))
    for r in rows:
        seg, tok = r["segment_ids"], r["tokens"]
        mask = attention_mask_from_segments(seg)
        np.testing.assert_array_equal(mask, _expected_mask(seg))
        doc_of = np.where(tok == EOS, -1, tok // 100)
        for q, k in zip(*np.nonzero(mask)):
            assert k <= q
            assert doc_of[k] in (doc_of[q], -1) or doc_of[q] == -1  # EOS ends its own doc
            assert seg[k] == seg[q] != 0
        # Positions restart at 0 at each segment start and count up within it.
        starts = np.r_[True, seg[1:] != seg[:-1]]
        for s, e in zip(np.nonzero(starts)[0], list(np.nonzero(starts)[0][1:]) + [len(seg)]):
            if seg[s]:
                np.testing.assert_array_equal(r["positions"][s:e], np.arange(e - s))
        # Loss only where the next token is in the same segment, and targets match it.
        on = r["loss_mask"].astype(bool)
        assert not on[-1]
        np.testing.assert_array_equal(on[:-1], (seg[1:] == seg[:-1]) & (seg[:-1] != 0))
        np.testing.assert_array_equal(r["targets"][:-1][on[:-1]], tok[1:][on[:-1]])


def test_packing_state_restore():
    docs = [list(range(1, n)) for n in (5, 30, 2, 11, 17, 3, 40, 9)]
    it = iter(_pack(docs, seq_len=7))
    all_rows = []
    states = []
    for _ in range(6):
        states.append(json.loads(json.dumps(it.get_state())))  # must be JSON-serialisable
        all_rows.append(next(it))
    states.append(it.get_state())
    all_rows.extend(it)
    for k, st in enumerate(states):
        it2 = iter(_pack(docs, seq_len=7))
        it2.set_state(st)
        rest = list(it2)
        assert len(rest) == len(all_rows) - k
        for a, b in zip(rest, all_rows[k:]):
            for key in a:
                np.testing.assert_array_equal(a[key], b[key])


# -- full pipeline ----------------------------------------------------------------------
def _eq_batches(xs, ys):
    return len(xs) == len(ys) and all(np.array_equal(x[k], y[k]) for x, y in zip(xs, ys) for k in x)


def test_pipeline_shapes_determinism_and_restore(corpus):
    kw = dict(tokenizer=corpus["tok"], seq_len=64, batch_size=4)
    it = make_packed_batches(corpus["data_dir"], TRAIN, seed=7, **kw)
    first = [next(it) for _ in range(5)]
    for b in first:
        assert set(b) == {"tokens", "targets", "segment_ids", "positions", "loss_mask"}
        assert all(v.shape == (4, 64) and v.dtype == np.int32 for v in b.values())
    state = json.loads(json.dumps(it.get_state()))
    after = [next(it) for _ in range(25)]
    assert it.get_state()["parent"]["next_index"] > corpus["counts"][TRAIN]  # crossed an epoch

    same = make_packed_batches(corpus["data_dir"], TRAIN, seed=7, **kw)
    assert _eq_batches([next(same) for _ in range(5)], first)
    restored = make_packed_batches(corpus["data_dir"], TRAIN, seed=7, **kw)
    restored.set_state(state)
    assert _eq_batches([next(restored) for _ in range(25)], after)
    other = make_packed_batches(corpus["data_dir"], TRAIN, seed=8, **kw)
    assert not _eq_batches([next(other) for _ in range(5)], first)


def test_pipeline_finite_epoch_covers_data_once_per_shard(corpus):
    tok = corpus["tok"]
    texts = {r["text"] for r in _all_records(corpus["data_dir"], TRAIN)}
    want = sum(len(tok.encode(t)) + 1 for t in texts)  # +1: EOS per document
    seen_docs = []
    total = 0
    for shard in range(2):
        it = make_packed_batches(
            corpus["data_dir"], TRAIN, tok, seq_len=32, batch_size=3, seed=1,
            shard_index=shard, shard_count=2, num_epochs=1,
        )  # fmt: skip
        batches = list(it)
        assert all(b["tokens"].shape == (3, 32) for b in batches)
        for b in batches:  # padding (incl. rows padding the last batch) carries no loss
            assert (b["loss_mask"][b["segment_ids"] == 0] == 0).all()
            assert (b["tokens"][b["segment_ids"] == 0] == tok.pad_id).all()
        toks = np.concatenate([b["tokens"][b["segment_ids"] > 0] for b in batches])
        total += toks.size
        docs = tok.decode(toks).split("<|endoftext|>")
        assert docs[-1] == ""
        seen_docs.extend(docs[:-1])
    assert total == want
    assert sorted(seen_docs) == sorted(texts)  # shards are disjoint and cover the split
