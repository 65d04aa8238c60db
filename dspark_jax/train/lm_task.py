"""Next-token language-model training of the Qwen3 target on packed corpus batches.

Loss: cross-entropy of ``tokens[t+1]`` given ``tokens[<=t]`` *within a segment* (packing
never predicts across a document boundary), averaged over valid targets (``loss_mask``),
computed in float32 whatever the compute dtype.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dspark_jax.config import model_config_from
from dspark_jax.models.qwen3 import Qwen3, Qwen3Config
from dspark_jax.train.trainer import Task, fixed_eval_batches


def next_token_targets(batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``(targets, mask)``: the batch's own ``targets`` when present, else shifted tokens
    kept only where the next token is in the same (non-padding) segment."""
    mask = batch["loss_mask"].astype(jnp.float32)
    if "targets" in batch:
        return batch["targets"], mask
    tokens, seg = batch["tokens"], batch["segment_ids"]
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    same = jnp.concatenate([(seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] != 0),
                            jnp.zeros_like(seg[:, :1], bool)], axis=1)  # fmt: skip
    return targets, mask * same


def lm_loss_sums(logits: jax.Array, targets: jax.Array, mask: jax.Array):
    """Summed float32 cross-entropy, number of valid targets, and correct top-1 count."""
    logits = logits.astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    return jnp.sum(ce * mask), jnp.sum(mask), jnp.sum(correct * mask)


class LMTask(Task):
    """``task = "lm"``: train the whole Qwen3 model (nothing frozen)."""

    name = "lm"

    def __init__(self, cfg):
        super().__init__(cfg)
        self._tokenizer = None
        self._model_config = None

    # -- config / data checks ------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from dspark_jax.tokenizer import Tokenizer

            path = self.cfg.data.tokenizer
            if not path or not os.path.exists(path):
                raise FileNotFoundError(
                    f"Tokenizer not found: data.tokenizer = {path!r}. Build one with "
                    "`python -m dspark_jax.data.prepare ... --train-tokenizer` or set "
                    "--config.data.tokenizer=PATH."
                )
            self._tokenizer = Tokenizer(path)
        return self._tokenizer

    def model_config(self) -> Qwen3Config:
        if self._model_config is None:
            base = model_config_from(self.cfg.model)
            tok = self.tokenizer
            vocab = self.cfg.model.get("vocab_size")
            if vocab is None:  # "match the tokenizer"
                vocab = tok.vocab_size
            if tok.vocab_size > vocab:
                raise ValueError(
                    f"The tokenizer {tok.path} has {tok.vocab_size} ids but model.vocab_size is "
                    f"{vocab}; set --config.model.vocab_size to at least {tok.vocab_size}."
                )
            self._model_config = base.replace(
                vocab_size=int(vocab),
                eos_token_id=tok.eos_id,
                # Precision policy: fp32 master params, compute in train.compute_dtype.
                dtype=self.cfg.train.compute_dtype,
                param_dtype="float32",
            )
        return self._model_config

    def check(self) -> None:
        data = self.cfg.data
        if not data.data_dir or not os.path.isdir(data.data_dir):
            raise FileNotFoundError(
                f"Data directory not found: data.data_dir = {data.data_dir!r}. Prepare a corpus "
                "with `python -m dspark_jax.data.prepare --kind source_tree --data-dir DIR ...`."
            )
        mc = self.model_config()  # also loads the tokenizer
        if data.seq_len > mc.max_position_embeddings:
            raise ValueError(
                f"data.seq_len = {data.seq_len} exceeds the model's max_position_embeddings = "
                f"{mc.max_position_embeddings}; lower --config.data.seq_len."
            )
        from dspark_jax.data.corpus import TRAIN, make_text_dataset

        n = len(make_text_dataset(data.data_dir, TRAIN, shuffle=False))
        if n == 0:
            raise ValueError(
                f"empty corpus: the '{TRAIN}' split of {data.data_dir} has no documents"
            )

    # -- params ------------------------------------------------------------------------
    def module(self) -> Qwen3:
        return Qwen3(self.model_config())

    def init_params(self, rng: jax.Array) -> Any:
        seq = min(8, self.cfg.data.seq_len)
        tokens = jnp.zeros((1, seq), jnp.int32)
        return self.module().init(rng, tokens)["params"]

    def warm_start_params(self, directory: str) -> Any:
        """The weights of the model in ``directory`` (``train.init_from``: a Hugging Face
        Qwen3 directory such as an exported target) as float32 master parameters. Its
        architecture must be this run's, field by field (precision aside)."""
        from dspark_jax.config import ConfigError
        from dspark_jax.convert import load_hf

        if not os.path.isdir(directory):
            raise FileNotFoundError(f"train.init_from: directory {directory!r} does not exist")
        if not os.path.isfile(os.path.join(directory, "config.json")):
            raise FileNotFoundError(
                f"train.init_from: {directory!r} has no config.json (a Hugging Face model "
                "directory, e.g. `python -m dspark_jax.export` output, is expected)"
            )
        loaded_config, params = load_hf(directory, dtype="float32")
        ours = self.model_config()
        # Precision, memory and kernel choices and the informational token ids are not
        # the architecture.
        ignore = {"dtype", "param_dtype", "remat", "attention", "scan_layers",
                  "bos_token_id", "eos_token_id"}  # fmt: skip
        differ = [
            f"{f}: {getattr(loaded_config, f)!r} there, {getattr(ours, f)!r} here"
            for f in Qwen3Config.field_names()
            if f not in ignore and getattr(loaded_config, f) != getattr(ours, f)
        ]
        if differ:
            raise ConfigError(
                f"train.init_from: the model in {directory} is not this run's architecture ("
                + "; ".join(differ)
                + "); set the model section to match it"
            )
        return params

    # -- losses ------------------------------------------------------------------------
    def _sums(self, params, batch):
        logits = self.module().apply(
            {"params": params}, batch["tokens"], batch["positions"], batch["segment_ids"]
        )
        targets, mask = next_token_targets(batch)
        return lm_loss_sums(logits, targets, mask)

    def loss_fn(self, params, frozen, batch, rng):
        del frozen, rng  # nothing frozen, no dropout
        ce_sum, count, correct = self._sums(params, batch)
        denom = jnp.maximum(count, 1.0)
        loss = ce_sum / denom
        return loss, {"accuracy": correct / denom, "targets": count}

    def eval_sums(self, params, frozen, batch):
        del frozen
        ce_sum, count, correct = self._sums(params, batch)
        return {"ce_sum": ce_sum, "count": count, "correct": correct}

    def summarize_eval(self, sums: dict[str, float]) -> dict[str, float]:
        import math

        count = max(sums["count"], 1.0)
        loss = sums["ce_sum"] / count
        return {
            "heldout_loss": loss,
            "heldout_perplexity": math.exp(min(loss, 50.0)),
            "heldout_accuracy": sums["correct"] / count,
            "heldout_targets": int(sums["count"]),
        }

    # -- data --------------------------------------------------------------------------
    def train_iterator(self, batch_size: int, shard_index: int, shard_count: int):
        from dspark_jax.data.corpus import TRAIN
        from dspark_jax.data.pipeline import make_packed_batches

        d = self.cfg.data
        return make_packed_batches(
            d.data_dir, TRAIN, self.tokenizer, d.seq_len, batch_size, d.seed,
            shard_index=shard_index, shard_count=shard_count, num_epochs=None,
            shuffle=d.shuffle,
        )  # fmt: skip

    def eval_batches(self, batch_size: int, num_batches: int, shard_index: int, shard_count: int):
        """The first ``num_batches`` batches of one unshuffled pass over the held-out split
        (fewer if it is shorter): the same tokens at every evaluation."""
        from dspark_jax.data.corpus import HELDOUT
        from dspark_jax.data.pipeline import make_packed_batches

        d = self.cfg.data
        it = make_packed_batches(
            d.data_dir, HELDOUT, self.tokenizer, d.seq_len, batch_size, 0,
            shard_index=shard_index, shard_count=shard_count, num_epochs=1, shuffle=False,
        )  # fmt: skip
        return fixed_eval_batches(
            it, num_batches, f"empty corpus: the '{HELDOUT}' split of {d.data_dir} has no tokens"
        )
