"""Tokenizer wrapper, BPE training round trip, special tokens, incremental decoding."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from dspark_jax.data.tokenizer_train import train_bpe_tokenizer
from dspark_jax.tokenizer import IncrementalDecoder, Tokenizer

CODE = '''\
import os


class Greeter:
    """Says hello — in several scripts: 你好, こんにちは, привет 👋🏽."""

    def __init__(self, name: str = "wörld") -> None:
\tself.name = name  # a tab-indented line
        if name:
            print(f"hello {name!r}")\r
        return None
'''

TRAIN_TEXTS = [
    CODE,
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "x = {'key': [1, 2, 3]}\nwhile x:\n    x.popitem()\n",
] * 20


@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe_tokenizer(TRAIN_TEXTS, vocab_size=400, out_path=out)


def test_trained_tokenizer_round_trips_code(small_tok):
    samples = [
        CODE,
        "    \n\t\t  mixed   whitespace\n\n\n",
        "emoji 🧑‍💻 and CJK 漢字 and combining e\u0301",
        "",
        "<not special> ünïcödé\x00\x7f",
    ]
    for s in samples:
        ids = small_tok.encode(s)
        assert small_tok.decode(ids) == s
        assert all(0 <= i < small_tok.vocab_size for i in ids)
    # Learned merges actually compress the training text.
    assert len(small_tok.encode(CODE)) < len(CODE.encode("utf-8"))


def test_special_tokens_and_loading(small_tok, tmp_path):
    assert (small_tok.eos_id, small_tok.pad_id, small_tok.mask_id) == (0, 1, 2)
    assert small_tok.vocab_size <= 400
    assert set(small_tok.special_tokens) == {"<|endoftext|>", "<|pad|>", "<|mask|>"}
    # Special tokens written in text are parsed as the single special id.
    assert small_tok.encode("a<|endoftext|>")[-1] == small_tok.eos_id
    # A directory holding tokenizer.json loads too.
    same = Tokenizer(small_tok.path.parent)
    assert same.encode(CODE) == small_tok.encode(CODE)
    with pytest.raises(FileNotFoundError, match="Tokenizer file not found"):
        Tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)  # directory without a tokenizer.json


def _qwen_like_file(path):
    """A byte-level tokenizer.json whose specials are Qwen3's (no pad, no mask)."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(list(pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(path))
    return path


def test_missing_special_tokens_raise_clear_errors(tmp_path):
    path = _qwen_like_file(tmp_path / "tokenizer.json")
    # EOS falls back to <|im_end|>; pad falls back to EOS loudly, not silently.
    with pytest.warns(UserWarning, match="<\\|pad\\|>"):
        tok = Tokenizer(path)
    assert tok.eos_token == "<|im_end|>" and tok.pad_id == tok.eos_id
    assert not tok.has_mask
    with pytest.raises(ValueError) as e:
        _ = tok.mask_id
    msg = str(e.value)
    assert "<|mask|>" in msg and "<|im_start|>" in msg and "<|im_end|>" in msg
    # Explicitly requested names must exist.
    with pytest.raises(ValueError, match="mask token '<\\|MASK\\|>'.*<\\|im_end\\|>"):
        Tokenizer(path, pad_token="<|im_start|>", mask_token="<|MASK|>")
    with pytest.raises(ValueError, match="EOS token '<\\|eot\\|>'"):
        Tokenizer(path, eos_token="<|eot|>")
    ok = Tokenizer(path, pad_token="<|im_start|>", mask_token="<|im_start|>")
    assert ok.mask_id == ok.pad_id == ok.token_to_id("<|im_start|>")


def test_training_rejects_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        train_bpe_tokenizer(["abc"], vocab_size=100, out_path=tmp_path / "t.json")
    with pytest.raises(ValueError, match="no texts"):
        train_bpe_tokenizer([], vocab_size=300, out_path=tmp_path / "t.json")


def test_incremental_decoder_never_splits_utf8(small_tok):
    text = "print('héllo 世界 🐍🧑‍💻 ok')\n# 日本語のコメント 🎉\n"
    ids = small_tok.encode(text)
    # The test is only meaningful if some token boundary falls inside a character.
    assert any("\ufffd" in small_tok.decode(ids[:k]) for k in range(1, len(ids)))
    dec = IncrementalDecoder(small_tok)
    chunks = [dec.add(i) for i in ids]
    chunks.append(dec.flush())
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == text
    # Emission is incremental (not everything at the end).
    assert sum(1 for c in chunks if c) > len(text) // 8


def test_incremental_decoder_flush_and_specials(small_tok):
    snake = small_tok.encode("🐍")
    assert len(snake) > 1  # 4 UTF-8 bytes, no merge learned for it
    dec = IncrementalDecoder(small_tok)
    assert [dec.add(i) for i in snake[:-1]] == [""] * (len(snake) - 1)
    assert dec.flush() == "\ufffd"  # a genuinely incomplete char surfaces only on flush
    dec = IncrementalDecoder(small_tok)
    out = "".join(dec.add(i) for i in small_tok.encode("ab") + [small_tok.eos_id])
    assert out + dec.flush() == "ab"  # EOS skipped by default
