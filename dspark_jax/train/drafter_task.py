"""Drafter training (DSpark, DFlash, EAGLE-3, MTP-1) in the shared loop (DESIGN §4).

``task = "drafter"``. Only the drafter is trainable; the target (a Hugging Face Qwen3
directory, ``target.dir``) is loaded once, sharded by its logical axis names and passed to
the step as a frozen input. Inside the jitted step:

1. The target runs over the batch (``Qwen3.hidden_states``) and returns the tap states
   (context features ``[B, T, m·d]``; MTP-1 uses the final hidden state), under
   ``stop_gradient``.
2. DSpark/DFlash: ``drafter.anchors_per_seq`` anchors per sequence are sampled with the
   step's RNG (``anchors.sample_anchors``; exact on resume, new every step) and their
   γ-token blocks are packed densely (``anchors.pack_blocks``). The target LM head runs
   only at the ``B·N·γ`` label positions (never over ``[B, T, V]``) to give ``p_t``.
   EAGLE-3 / MTP-1 train on every eligible position (their forward covers every position
   anyway; EAGLE-3 needs ``p_t`` at every position for its soft labels).
3. Losses from :mod:`dspark_jax.train.drafter_losses` (all at temperature 1).

Held-out metrics (every eval, ``metrics.jsonl``): on fixed anchors (a constant key, so
every eval and every drafter kind of one data set sees the same blocks), the teacher-forced
acceptance ``Σ_v min(p_t, p_d)`` per draft position k = 1..γ, its mean, a teacher-forced
accepted length ``τ_tf = 1 + Σ_k Π_{i≤k} α_i`` over blocks whose γ labels are all
supervised, and for a confidence head the BCE and ECE (20 equal-width bins) of
``c_k = σ(z_k)`` against the *soft* target ``c*_k = 1 − ½‖p_d − p_t‖₁``. The soft target is
the exact conditional acceptance probability under T = 1 lossless verification, i.e. the
expectation of the Bernoulli accept label given the prefix; using it removes the label
sampling noise that biases a Bernoulli-label ECE upwards on small held-out sets, and it is
the quantity the head is trained to predict.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dspark_jax import sharding as shd
from dspark_jax.config import ConfigError
from dspark_jax.models.drafter_config import (
    DrafterConfig,
    drafter_kind,
)
from dspark_jax.models.fingerprint import weights_fingerprint
from dspark_jax.models.qwen3 import Qwen3, Qwen3Config
from dspark_jax.train import anchors as A
from dspark_jax.train import drafter_losses as L
from dspark_jax.train.drafter_schema import loss_alphas
from dspark_jax.train.trainer import Task, fixed_eval_batches, register_task

# Held-out anchors come from this constant key (not the training RNG): identical blocks at
# every evaluation and for every drafter kind evaluated on the same data.
EVAL_ANCHOR_SEED = 1234


# ----------------------------------------------------------------------------------------
# The task
# ----------------------------------------------------------------------------------------
class DrafterTask(Task):
    """``task = "drafter"``: train a drafter against a frozen Qwen3 target."""

    name = "drafter"

    def __init__(self, cfg):
        super().__init__(cfg)
        self._target_config: Qwen3Config | None = None
        self._tokenizer = None
        self._drafter_config: DrafterConfig | None = None
        self._head_names = None  # logical axis names of the sequential head's params
        self._target_fingerprint: str | None = None  # set when the target's weights load
        self._data_target_fingerprint: str | None = None  # the distilled data's target

    # -- configs -------------------------------------------------------------------------
    @property
    def target_dir(self) -> str:
        return self.cfg.target.dir

    def _read_target_config(self) -> Qwen3Config:
        if self._target_config is None:
            from dspark_jax.convert import read_hf_config

            d = self.target_dir
            if not d or not os.path.isdir(d):
                raise FileNotFoundError(
                    f"Target directory not found: target.dir = {d!r}. Point it at a Hugging "
                    "Face Qwen3 directory (config.json, model.safetensors, tokenizer.json), "
                    "e.g. one written by `python -m dspark_jax.export`."
                )
            from dspark_jax.models.drafter_io import drafter_dir_error, is_drafter_dir

            if is_drafter_dir(d):  # train.py has no --drafter: say which key to fix
                raise drafter_dir_error(d, "--config.target.dir", None)
            self._target_config = read_hf_config(d)
        return self._target_config

    def model_config(self) -> Qwen3Config:
        """The target's config as the drafter sees it: compute in ``train.compute_dtype``,
        drafter params float32 (master weights), ``drafter.remat`` for the draft layers."""
        return self._read_target_config().replace(
            dtype=self.cfg.train.compute_dtype,
            param_dtype="float32",
            remat=self.cfg.drafter.get("remat", "none"),  # absent in older run configs
        )

    def frozen_config(self) -> Qwen3Config:
        """The frozen target: stored in ``target.dtype``, computed in ``train.compute_dtype``."""
        return self._read_target_config().replace(
            dtype=self.cfg.train.compute_dtype, param_dtype=self.cfg.target.dtype
        )

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from dspark_jax.tokenizer import Tokenizer

            path = self.cfg.data.tokenizer or os.path.join(self.target_dir, "tokenizer.json")
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"Tokenizer not found: {path!r} (data.tokenizer, default "
                    "<target.dir>/tokenizer.json)"
                )
            needs_mask = drafter_kind(self.cfg.drafter.kind).mask_token
            self._tokenizer = Tokenizer(
                path, mask_token=self.cfg.drafter.mask_token if needs_mask else None
            )
        return self._tokenizer

    @property
    def drafter_config(self) -> DrafterConfig:
        """The resolved :class:`DrafterConfig` (taps, layers, head filled in)."""
        if self._drafter_config is None:
            d = self.cfg.drafter
            try:
                mask_id = self.tokenizer.mask_id if drafter_kind(d.kind).mask_token else None
                dc = DrafterConfig.from_section(d, mask_id)
                self._drafter_config = dc.resolve(self.model_config())
            except ValueError as e:
                raise ConfigError(f"drafter section: {e}") from None
        return self._drafter_config

    def module(self):
        from dspark_jax.models.drafters import make_drafter

        return make_drafter(self.drafter_config, self.model_config())

    def check(self) -> None:
        cfg, d = self.cfg, self.cfg.drafter
        tcfg = self.model_config()
        dc = self.drafter_config  # validates kind/taps/mask against the target
        tok = self.tokenizer
        if tok.vocab_size > tcfg.vocab_size:
            raise ValueError(
                f"The tokenizer {tok.path} has {tok.vocab_size} ids but the target's vocab_size "
                f"is {tcfg.vocab_size}: wrong tokenizer for this target?"
            )
        seq = cfg.data.seq_len
        if seq > tcfg.max_position_embeddings:
            raise ValueError(
                f"data.seq_len = {seq} exceeds the target's max_position_embeddings = "
                f"{tcfg.max_position_embeddings}; lower --config.data.seq_len."
            )
        for key in ("anchors_per_seq", "eval_anchors_per_seq"):
            if d[key] > seq:
                raise ValueError(f"drafter.{key} = {d[key]} exceeds data.seq_len = {seq}")
        if cfg.data.batch_size % d.pack_sequences:
            raise ValueError(
                f"data.batch_size = {cfg.data.batch_size} is not divisible by "
                f"drafter.pack_sequences = {d.pack_sequences}"
            )
        _, _, a_conf = loss_alphas(cfg)
        if a_conf > 0 and not dc.has_confidence:
            raise ValueError(
                f"loss.alpha_conf = {a_conf} but drafter kind {dc.kind!r} has no confidence "
                "head; set --config.loss.alpha_conf=0 or --config.drafter.confidence=True"
            )
        self._check_data()

    def _check_data(self) -> None:
        from dspark_jax.data.corpus import read_metadata
        from dspark_jax.data.distill import DistillDataset, find_dataset_dir

        data_dir = self.cfg.data.data_dir
        try:
            ds_dir = find_dataset_dir(data_dir, DistillDataset.name)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"Distillation data not found: data.data_dir = {data_dir!r} holds no "
                f"{DistillDataset.name}. Build it with `python -m dspark_jax.data.distill "
                "--target TARGET_DIR --corpus-dir CORPUS --out-dir DIR`."
            ) from None
        manifest = read_metadata(ds_dir).get("manifest", {})
        self._data_target_fingerprint = manifest.get("target_fingerprint")
        prompt_len, new = manifest.get("prompt_len"), manifest.get("max_new_tokens")
        seq = self.cfg.data.seq_len
        if isinstance(prompt_len, int) and seq < prompt_len + 2:
            # Rows are cut to seq_len and only generated tokens are supervised (an anchor
            # and the token after it must both be generated): every row would end inside
            # its prompt, or one token after it, and the run would train on nothing.
            full = f"; {prompt_len + new} keeps every generated token" if new else ""
            raise ValueError(
                f"data.seq_len = {seq} is too short for the distilled data in {ds_dir}: its "
                f"prompts are {prompt_len} tokens (--prompt-len) and only the generated "
                "tokens after them are supervised, so every row would end before them and "
                f"training would train on nothing (loss 0). Set --config.data.seq_len to at "
                f"least {prompt_len + 2}{full}."
            )
        sha = manifest.get("tokenizer_sha1")
        if sha is not None:
            have = hashlib.sha1(self.tokenizer.path.read_bytes()).hexdigest()
            if have != sha:
                raise ValueError(
                    f"{ds_dir} was generated with another tokenizer than {self.tokenizer.path} "
                    "(sha1 mismatch): distill the data with this target"
                )
        vocab = manifest.get("target_config", {}).get("vocab_size")
        if vocab is not None and vocab != self.model_config().vocab_size:
            raise ValueError(
                f"{ds_dir} was generated by a target with vocab_size {vocab}, but target.dir "
                f"has vocab_size {self.model_config().vocab_size}"
            )

    def checkpoint_meta(self) -> dict[str, Any]:
        meta = super().checkpoint_meta()
        meta["drafter_config"] = self.drafter_config.to_dict()
        if self._target_fingerprint is not None:  # the export records it in the drafter
            meta["target_fingerprint"] = self._target_fingerprint
        return meta

    def check_resume(self, meta: dict[str, Any]) -> None:
        saved = meta.get("target_fingerprint")
        if saved is not None and self._target_fingerprint not in (None, saved):
            raise ValueError(
                f"target.dir = {self.target_dir!r} holds other weights than this run started "
                f"with (target fingerprint {self._target_fingerprint}, the checkpoint's "
                f"{saved}): point target.dir at the original target or use a new workdir"
            )

    def _check_target_weights(self, params) -> None:
        """Record the target's fingerprint; refuse data distilled from another target."""
        self._target_fingerprint = weights_fingerprint(params)
        data_fp = self._data_target_fingerprint
        if data_fp is not None and data_fp != self._target_fingerprint:
            raise ValueError(
                f"data.data_dir = {self.cfg.data.data_dir!r} was distilled from another target "
                f"(target fingerprint {data_fp}; target.dir = {self.target_dir!r} has "
                f"{self._target_fingerprint}): distill the data with this target"
            )

    # -- params --------------------------------------------------------------------------
    def init_params(self, rng: jax.Array) -> Any:
        from dspark_jax.models.drafters import init_drafter_params

        return init_drafter_params(self.module(), rng)

    def warm_start_params(self, directory: str) -> Any:
        """The weights of the drafter directory ``directory`` (``train.init_from``: written
        by ``dspark_jax.export`` or converted from DeepSpec), to fine-tune it, e.g. on
        another target of the same shapes or on new data. Its target shapes and kind must
        be this run's; the loop then checks every parameter's shape."""
        from dspark_jax.models.drafter_io import load_drafter

        module, params = load_drafter(directory, self.model_config())
        theirs, ours = module.config.kind, self.drafter_config.kind
        if theirs != ours:
            raise ConfigError(
                f"train.init_from: {directory} holds a {theirs!r} drafter but drafter.kind "
                f"is {ours!r}"
            )
        return params

    def frozen_params(self, mesh):
        """The target's parameters from ``target.dir``, sharded by their logical names."""
        from dspark_jax import sharding as shd
        from dspark_jax.convert import load_hf

        fcfg = self.frozen_config()
        _, params = load_hf(self.target_dir, dtype=self.cfg.target.dtype)
        self._check_target_weights(params)
        boxed = jax.eval_shape(
            lambda: Qwen3(fcfg).init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))["params"]
        )
        shardings = shd.param_shardings(boxed, mesh)
        want = jax.tree.structure(shardings)
        if jax.tree.structure(params) != want:
            raise ValueError(
                f"The parameters in {self.target_dir} do not match its config.json "
                f"(tree {jax.tree.structure(params)} vs {want})"
            )

        return shd.place_host_tree(params, shardings), shardings

    # -- forward pieces ------------------------------------------------------------------
    def _target(self):
        return Qwen3(self.frozen_config())

    def _target_features(self, frozen, tokens):
        """``(context features [B, T, F], final hidden [B, T, d])`` under stop_gradient."""
        dc = self.drafter_config
        taps = tuple(dc.taps) if dc.uses_taps else None
        h, tap_states = self._target().apply(
            {"params": frozen}, tokens, None, None, taps, method="hidden_states"
        )
        h = jax.lax.stop_gradient(h)
        if taps is None:
            return h, h
        m, b, t, d = tap_states.shape
        feats = jnp.transpose(tap_states, (1, 2, 0, 3)).reshape(b, t, m * d)
        return jax.lax.stop_gradient(feats), h

    def _lm_head(self, frozen):
        """The frozen LM head as a callable ``h [..., d] -> float32 logits [..., V]``.

        Two layouts, chosen per call from the (global) number of rows:

        * **vocab-parallel**, when there are fewer rows than vocabulary entries (the label
          positions of a step: B·N·γ rows): the weight is resharded so its *vocabulary*
          axis is split over the batch axes (an all-to-all of the local shard, no copy of
          the whole matrix), the rows are all-gathered (``rows × d``, small), and each
          device computes the logits of every row for its slice of the vocabulary; the
          caller's batch constraint then moves them back to row-split (an all-to-all of
          the logits). Gathering the whole ``[d, V]`` weight on every device instead (the
          FSDP default) was the largest buffer of the 8B step: 2 × 1.24 GB per chip on
          XLA:TPU (``benchmarks/results/gathered_lm_head_baseline/``). A tensor axis, when
          the vocabulary divides over it too, keeps its share of the split.
        * **weight-gathered** otherwise (EAGLE-3's every-position logits, where the rows
          outnumber the weight): the weight is all-gathered over the batch axes and each
          device multiplies its own rows. Left to itself, the partitioner may instead
          contract the split ``d`` axis and all-reduce a global-batch ``[rows, V]``
          float32 partial product on every device.
        """
        target, vocab = self._target(), self.model_config().vocab_size
        tied = "lm_head" not in frozen
        weight = frozen["embed_tokens"]["embedding"] if tied else frozen["lm_head"]["kernel"]
        names = ("vocab", "embed") if tied else ("embed", "vocab")
        mesh = jax.sharding.get_abstract_mesh()
        split = () if mesh.empty else shd.batch_axes_dividing(vocab)
        if split and mesh.shape.get("tensor", 1) > 1:
            if vocab % (math.prod(mesh.shape[a] for a in split) * mesh.shape["tensor"]) == 0:
                split = split + ("tensor",)

        def with_weight(w):
            if tied:
                return dict(frozen, embed_tokens={"embedding": w})
            return dict(frozen, lm_head={"kernel": w})

        def head(h):
            rows = math.prod(h.shape[:-1])
            if not split or rows >= vocab:
                w = shd.gather_batch_axes(weight, names)
                return target.apply(
                    {"params": with_weight(w)}, h, method="logits_from_hidden"
                )  # fmt: skip
            P = jax.sharding.PartitionSpec
            w = jax.lax.with_sharding_constraint(weight, P(split, None) if tied else P(None, split))
            h = jax.lax.with_sharding_constraint(h, P())
            logits = target.apply({"params": with_weight(w)}, h, method="logits_from_hidden")
            return jax.lax.with_sharding_constraint(logits, P(*([None] * (logits.ndim - 1)), split))

        return head

    def _embed(self, frozen):
        table = frozen["embed_tokens"]["embedding"]
        dt = self.model_config().compute_dtype
        return lambda ids: jnp.take(table, ids, axis=0).astype(dt)

    def _target_logits_at_labels(self, frozen, h, packed: A.PackedBlocks):
        """Target logits for each block label (LM head at ``a+k-1``, k = 1..γ): ``[N, γ, V]``.
        Only ``B·N·γ`` rows go through the LM head, never ``[B, T, V]``.

        The blocks are sequence-major (``pack_blocks``), so the rows are gathered per
        sequence (``[B, N·γ]`` positions of its own row): the gather stays local to the
        batch shard that holds the sequence, and the ``[N, γ, V]`` logits are split over
        the batch axes like the batch itself."""
        b, t = h.shape[:2]
        n, g = packed.labels.shape
        pos = jnp.minimum(packed.label_pos - 1, t - 1).reshape(b, (n // b) * g)
        rows = jnp.take_along_axis(h, pos[..., None], axis=1).reshape(n, g, h.shape[-1])
        rows = shd.batch_constraint(rows)
        return shd.batch_constraint(jax.lax.stop_gradient(self._lm_head(frozen)(rows)))

    def _gather_head_factors(self, params):
        """``params`` with the sequential head's factors (Markov W1 ``[V, r]``, W2
        ``[r, V]``; their ``rank`` axis is split over fsdp) all-gathered for the forward.

        Left split, the partitioner contracts W2's split rank axis and all-reduces a
        global-batch ``[B·N·γ, V]`` float32 bias on every device; gathered, each device
        applies the whole (small: ``2·V·r``) factors to its own blocks."""
        if "markov_head" not in params or jax.sharding.get_abstract_mesh().empty:
            return params
        if self._head_names is None:
            from dspark_jax.models.drafters import init_drafter_params

            boxed = jax.eval_shape(lambda k: init_drafter_params(self.module(), k),
                                   jax.random.key(0))  # fmt: skip
            self._head_names = shd.logical_names_of(boxed)["markov_head"]
        head = jax.tree.map(shd.gather_batch_axes, params["markov_head"], self._head_names)
        return dict(params, markov_head=head)

    def _block_forward(self, params, frozen, feats, ctx_valid, packed: A.PackedBlocks):
        """DSpark/DFlash packed forward, vmapped over groups of ``pack_sequences`` sequences.

        Sharding: the group axis is the batch axis. When the mesh's batch axes (data × fsdp)
        divide the number of groups, the inputs are split over them and the vmap carries
        ``spmd_axis_name``, so every logical constraint inside (the backbone's per-layer
        ``ACT_AXES``, the MLP's) also pins the group axis; inside a group
        ``activation_batch`` is then left unsplit (a mesh axis shards one dimension only).
        Otherwise (no mesh, or groups the batch axes do not divide) the inner
        ``activation_batch`` constraint splits each group's blocks as before. Without the
        group constraint the weights' fsdp-split ``embed`` axis propagated into the
        activations and XLA kept the whole global batch of drafter activations and
        ``[B·N·γ, V]`` logits on every device (benchmarks/aot_memory.md).
        """
        b, t, f = feats.shape
        p = self.cfg.drafter.pack_sequences
        g = b // p
        grouped = A.group_blocks(packed, b, g)
        module, embed, lm_head = self.module(), self._embed(frozen), self._lm_head(frozen)
        params = self._gather_head_factors(params)
        axes = shd.batch_axes_dividing(g)

        def one(fe, va, bt, bs, ap):
            with nn.logical_axis_rules(shd.rules_without(axes)):
                return module.apply(
                    {"params": params}, fe, va, bt, bs, ap, embed, None, True,
                    method="train_forward",
                )  # fmt: skip

        ins = (
            feats.reshape(g, p, t, f),
            ctx_valid.reshape(g, p, t),
            grouped.block_tokens,
            grouped.block_seq,
            grouped.anchor_pos,
        )
        ins = tuple(shd.batch_constraint(x, axes) for x in ins)
        # The LM head runs outside the vmap (``lm_head=None`` inside): its vocab-parallel
        # layout needs the rows of every group on every device, which the group axis's
        # batch split inside the vmap would forbid.
        part, conf, h = jax.vmap(one, spmd_axis_name=axes or None)(*ins)
        n = packed.block_seq.shape[0]
        h = shd.batch_constraint(h.reshape((n,) + h.shape[2:]))
        logits = shd.batch_constraint(lm_head(h))
        if part is not None:  # the sequential head's bias (DSpark), row-split like h
            logits = logits + shd.batch_constraint(part.reshape((n,) + part.shape[2:]))
        conf = None if conf is None else shd.batch_constraint(conf.reshape(n, -1))
        return logits, conf

    def _sequence_forward(self, params, frozen, feats, tokens, valid):
        """EAGLE-3 ``[γ, B, T, V]`` / MTP-1 ``[1, B, T, V]`` logits at every position."""
        module = self.module()
        out = module.apply(
            {"params": params},
            feats,
            tokens,
            valid,
            self._embed(frozen),
            self._lm_head(frozen),
            method="train_forward",
        )
        return out[None] if self.drafter_config.single_token else out

    @staticmethod
    def _shift_left(x, n):
        pad = jnp.zeros((x.shape[0], n) + x.shape[2:], x.dtype)
        return jnp.concatenate([x[:, n:], pad], axis=1)[:, : x.shape[1]]

    def _sequence_loss(self, params, frozen, feats, h, batch, packed, anchor_pos, anchor_valid):
        """EAGLE-3 / MTP-1 loss. Returns ``(loss, terms, block logits [N, G, V], count)``
        with the drafter's logits for the blocks of ``packed`` (state ``a-1``, step i
        predicts ``a+1+i``).

        ``drafter.sequence_positions = "all"``: every position t whose anchor ``t+1`` is
        eligible (EAGLE-3's usual training-time test). ``"anchors"``: only the states
        ``a-1`` of the sampled anchors, with the target LM head applied only there (a
        sparse LM-head callable), so EAGLE-3 sees the same labels per step as DSpark and
        does not pay ``γ·B·T·V`` LM-head work on CPU.
        """
        dc, tokens, loss_mask = self.drafter_config, batch["tokens"], batch["loss_mask"]
        b, t = tokens.shape
        valid = jnp.arange(t)[None, :] < batch["length"][:, None]
        rows = jnp.arange(b)[:, None]
        sel = jnp.where(anchor_valid, anchor_pos - 1, 0)  # [B, N] state that drafts block
        head = self._lm_head(frozen)
        sparse = self.cfg.drafter.sequence_positions == "anchors"

        def sparse_head(hn):  # [B, T, d] -> [B, T, V], nonzero only at the anchor states
            lg = head(hn[rows, sel])
            return jnp.zeros(hn.shape[:-1] + lg.shape[-1:], lg.dtype).at[rows, sel].set(lg)

        module = self.module()
        out = module.apply(
            {"params": params}, feats, tokens, valid, self._embed(frozen),
            sparse_head if sparse else head, method="train_forward",
        )  # fmt: skip
        out = out[None] if dc.single_token else out  # [G, B, T, V]
        g = out.shape[0]
        blocks = jnp.transpose(out[:, rows, sel], (1, 2, 0, 3)).reshape(-1, g, out.shape[-1])
        if sparse:
            tgt = self._target_logits_at_labels(frozen, h, packed)
            mask = packed.label_valid
            if dc.single_token:
                loss, terms = L.mtp_loss(blocks[:, 0], packed.labels[:, 0], mask[:, 0])
            else:
                loss, terms = L.eagle3_block_loss(
                    blocks, tgt, mask, step_weight=float(self.cfg.loss.eagle3_step_weight)
                )
            return loss, terms, blocks, jnp.sum(mask[:, 0])
        elig = self._shift_left(A.eligible_anchors(loss_mask), 1)  # anchor t+1 eligible
        if dc.single_token:
            loss, terms = L.mtp_loss(out[0], self._shift_left(tokens, 2), elig)
        else:
            sup = loss_mask.astype(bool)
            mask = jnp.stack([elig & self._shift_left(sup, 2 + i) for i in range(dc.gamma)])
            next_logits = jax.lax.stop_gradient(head(h))
            loss, terms = L.eagle3_loss(
                out, next_logits, mask, step_weight=float(self.cfg.loss.eagle3_step_weight)
            )
        return loss, terms, blocks, jnp.sum(elig)

    # -- losses --------------------------------------------------------------------------
    def _block_loss(self, params, frozen, feats, h, batch, packed):
        a_ce, a_tv, a_conf = loss_alphas(self.cfg)
        t = batch["tokens"].shape[1]
        ctx_valid = jnp.arange(t)[None, :] < batch["length"][:, None]
        logits, conf = self._block_forward(params, frozen, feats, ctx_valid, packed)
        tgt = self._target_logits_at_labels(frozen, h, packed)
        loss, terms = L.dspark_loss(
            logits, conf, tgt, packed.labels, packed.label_valid,
            decay=float(self.cfg.loss.decay), alpha_ce=a_ce, alpha_tv=a_tv, alpha_conf=a_conf,
        )  # fmt: skip
        return loss, terms, (logits, conf, tgt)

    def loss_fn(self, params, frozen, batch, rng):
        feats, h = self._target_features(frozen, batch["tokens"])
        if self.drafter_config.parallel_block:
            n = self.cfg.drafter.anchors_per_seq
            anchor_pos, anchor_valid = A.sample_anchors(rng, batch["loss_mask"], n)
            packed = A.pack_blocks(
                batch["tokens"], batch["loss_mask"], anchor_pos, anchor_valid,
                self.drafter_config.gamma,
            )  # fmt: skip
            loss, terms, _ = self._block_loss(params, frozen, feats, h, batch, packed)
            count = jnp.sum(packed.label_valid)
        else:
            n = self.cfg.drafter.anchors_per_seq
            anchor_pos, anchor_valid = A.sample_anchors(rng, batch["loss_mask"], n)
            packed = A.pack_blocks(
                batch["tokens"], batch["loss_mask"], anchor_pos, anchor_valid,
                self.drafter_config.draft_len,
            )  # fmt: skip
            loss, terms, _, count = self._sequence_loss(
                params, frozen, feats, h, batch, packed, anchor_pos, anchor_valid
            )
        return loss, dict(terms, label_positions=count.astype(jnp.float32))

    # -- held-out metrics ----------------------------------------------------------------
    def eval_sums(self, params, frozen, batch):
        dc = self.drafter_config
        g = dc.draft_len
        tokens, loss_mask = batch["tokens"], batch["loss_mask"]
        feats, h = self._target_features(frozen, tokens)
        anchor_pos, anchor_valid = A.sample_anchors(
            jax.random.PRNGKey(EVAL_ANCHOR_SEED), loss_mask, self.cfg.drafter.eval_anchors_per_seq
        )
        packed = A.pack_blocks(tokens, loss_mask, anchor_pos, anchor_valid, g)
        conf = None
        if dc.parallel_block:
            loss, _, (logits, conf, tgt) = self._block_loss(params, frozen, feats, h, batch, packed)
            loss_count = jnp.sum(packed.label_valid)
        else:
            # Step i at state a-1 predicts a+1+i: the same blocks as DSpark's.
            loss, _, logits, loss_count = self._sequence_loss(
                params, frozen, feats, h, batch, packed, anchor_pos, anchor_valid
            )
            tgt = self._target_logits_at_labels(frozen, h, packed)
        mask = packed.label_valid.astype(jnp.float32)
        acc = L.acceptance(logits, tgt)  # [N, γ]
        sums = {"loss_sum": loss * loss_count, "loss_count": loss_count.astype(jnp.float32)}
        for k in range(g):
            sums[f"acc_sum_{k + 1}"] = jnp.sum(acc[:, k] * mask[:, k])
            sums[f"acc_count_{k + 1}"] = jnp.sum(mask[:, k])
        full = jnp.all(packed.label_valid, axis=1).astype(jnp.float32)
        prefix = jnp.cumprod(acc, axis=1).sum(axis=1)
        sums["tau_sum"] = jnp.sum(prefix * full)
        sums["tau_blocks"] = jnp.sum(full)
        if conf is not None:
            c_star = jnp.clip(acc, 0.0, 1.0)  # = clamp(1 - ½‖p_d - p_t‖₁, 0, 1)
            sums["conf_bce_sum"] = jnp.sum(L.bce_with_logits(conf, c_star) * mask)
            cnt, sc, st = L.ece_bin_sums(jax.nn.sigmoid(conf), c_star, mask)
            for i in range(L.ECE_BINS):
                sums[f"ece_n_{i:02d}"] = cnt[i]
                sums[f"ece_c_{i:02d}"] = sc[i]
                sums[f"ece_t_{i:02d}"] = st[i]
        return sums

    def summarize_eval(self, sums: dict[str, float]) -> dict[str, float]:
        g = self.drafter_config.draft_len
        out = {"heldout_loss": sums["loss_sum"] / max(sums["loss_count"], 1.0)}
        tot, cnt = 0.0, 0.0
        for k in range(1, g + 1):
            s, n = sums[f"acc_sum_{k}"], sums[f"acc_count_{k}"]
            out[f"heldout_accept_k{k}"] = s / n if n else math.nan
            tot, cnt = tot + s, cnt + n
        out["heldout_accept_mean"] = tot / cnt if cnt else math.nan
        out["heldout_tau_tf"] = (
            1.0 + sums["tau_sum"] / sums["tau_blocks"] if sums["tau_blocks"] else math.nan
        )
        out["heldout_label_positions"] = int(cnt)
        if "conf_bce_sum" in sums:
            out["heldout_conf_bce"] = sums["conf_bce_sum"] / cnt if cnt else math.nan
            bins = range(L.ECE_BINS)
            out["heldout_conf_ece"] = L.ece_from_sums(
                [sums[f"ece_n_{i:02d}"] for i in bins],
                [sums[f"ece_c_{i:02d}"] for i in bins],
                [sums[f"ece_t_{i:02d}"] for i in bins],
            )
        return out

    # -- data ----------------------------------------------------------------------------
    def train_iterator(self, batch_size: int, shard_index: int, shard_count: int):
        from dspark_jax.data.corpus import TRAIN
        from dspark_jax.data.distill import make_distill_batches

        d = self.cfg.data
        return make_distill_batches(
            d.data_dir, TRAIN, d.seq_len, batch_size, d.seed, shard_index, shard_count,
            num_epochs=None, shuffle=d.shuffle, max_records=d.max_train_records or None,
        )  # fmt: skip

    def eval_batches(self, batch_size: int, num_batches: int, shard_index: int, shard_count: int):
        """The first ``num_batches`` batches of one unshuffled held-out pass (the same every
        eval), padded with fully masked batches so all hosts run the same count."""
        from dspark_jax.data.corpus import HELDOUT
        from dspark_jax.data.distill import make_distill_batches

        d = self.cfg.data
        it = make_distill_batches(
            d.data_dir, HELDOUT, d.seq_len, batch_size, 0, shard_index, shard_count,
            num_epochs=1, shuffle=False,
        )  # fmt: skip
        return fixed_eval_batches(
            it, num_batches, f"empty data: the '{HELDOUT}' split of {d.data_dir} has no records"
        )


register_task("drafter", "dspark_jax.train.drafter_task:DrafterTask")


__all__ = ["DrafterTask"]
