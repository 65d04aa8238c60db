"""The bundled target (assets/target) loads everywhere and matches its model card."""

import pathlib
import re

import numpy as np
import pytest

from dspark_jax.convert import load_hf
from dspark_jax.data import prepare_corpus
from dspark_jax.eval.lm import heldout_loss
from dspark_jax.tokenizer import Tokenizer

TARGET = pathlib.Path(__file__).resolve().parents[1] / "assets" / "target"


def _card_value(name: str) -> float:
    card = (TARGET / "README.md").read_text()
    match = re.search(rf"{name}\s*\|\s*([0-9.]+)", card)
    assert match, f"model card has no '{name}' row"
    return float(match.group(1))


def test_bundled_target_files_and_config():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md"):
        assert (TARGET / name).is_file(), name
    config, params = load_hf(str(TARGET))
    assert 5e6 <= config.num_params() <= 10e6
    assert config.max_position_embeddings >= 1024
    tok = Tokenizer(str(TARGET))
    assert tok.vocab_size <= config.vocab_size
    assert tok.mask_id is not None and tok.eos_id is not None


def test_bundled_target_loads_in_transformers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32)
    config, params = load_hf(str(TARGET))
    from dspark_jax.models.qwen3 import Qwen3

    tokens = np.arange(1, 33, dtype=np.int32)[None]
    ours = np.asarray(Qwen3(config).apply({"params": params}, tokens))
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=2e-3, rtol=2e-3)


def test_bundled_target_heldout_loss_matches_card(tmp_path):
    """Re-prepare the stdlib held-out split and recompute the card's held-out loss."""
    prepare_corpus("source_tree", None, str(tmp_path / "stdlib"))
    result = heldout_loss(str(TARGET), str(tmp_path / "stdlib"))
    expected = _card_value("Held-out loss")
    assert abs(result["heldout_loss"] - expected) <= 0.01 * expected, (result, expected)
